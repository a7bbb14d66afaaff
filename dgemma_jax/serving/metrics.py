"""The server's Prometheus metrics (`GET /metrics`), each server in its own `CollectorRegistry`.

Names follow vLLM's where the meaning is the same (so its dashboards fit); the rest are `dgemma:`.
Counted per sequence (one choice of one prompt: a request with n=2 finishes two), except
`vllm:prompt_tokens_total` (each prompt once, as `usage.prompt_tokens`):

    vllm:num_requests_running        gauge      sequences in a slot (busy slots)
    vllm:num_requests_waiting        gauge      sequences in the queue
    dgemma:slots                     gauge      the server's slots
    vllm:kv_cache_usage_perc         gauge      busy slots / slots (a slot is one cache row)
    vllm:request_success_total       counter    finished sequences, by finished_reason (stop, length, abort)
    vllm:prompt_tokens_total         counter    prompt tokens of the accepted prompts
    vllm:generation_tokens_total     counter    generated tokens (usage.completion_tokens)
    vllm:prefix_cache_queries_total  counter    prompt tokens looked up in a slot's cache at admission
    vllm:prefix_cache_hits_total     counter    of those, found there (usage...cached_tokens)
    dgemma:denoising_steps_total     counter    denoiser passes (usage.denoising_steps)
    dgemma:canvases_total            counter    canvases settled
    vllm:num_preemptions_total       counter    sequences preempted (their cache row moved to the host)
    vllm:time_to_first_token_seconds histogram  submission -> a sequence's first committed canvas
    vllm:e2e_request_latency_seconds histogram  submission -> a sequence's end
    vllm:request_queue_time_seconds  histogram  submission -> its slot
    dgemma:http_responses_total      counter    HTTP responses, by route and status code
    dgemma:requests_rejected_total   counter    refused requests (4xx/5xx before a slot), by reason
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: from a few ms (the tiny model on a CPU) to minutes (long answers of the 26B under load)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                   160.0, 320.0, 640.0)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class _Live:
    """Gauges read from the scheduler when scraped."""

    def __init__(self, status):
        self.status = status

    def collect(self):
        st = self.status()
        for name, doc, value in (
                ("vllm:num_requests_running", "Sequences in a slot (busy slots).", st["busy_slots"]),
                ("vllm:num_requests_waiting", "Sequences waiting in the queue.", st["queued"]),
                ("dgemma:slots", "The server's slots (sequences denoised together).", st["slots"]),
                ("vllm:kv_cache_usage_perc", "Busy slots over slots (a slot is one cache row).",
                 st["busy_slots"] / max(st["slots"], 1))):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    """One server's metrics. `status`: a callable returning the scheduler's `status()` (read on scrape)."""

    def __init__(self, status):
        self.registry = r = CollectorRegistry()
        r.register(_Live(status))
        self.success = Counter("vllm:request_success", "Finished sequences by finish reason.",
                               ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted prompts.", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in a slot's cache.",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in a slot's cache (reused).",
                                   registry=r)
        self.steps = Counter("dgemma:denoising_steps", "Denoiser passes of settled canvases.", registry=r)
        self.canvases = Counter("dgemma:canvases", "Canvases settled.", registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Sequences preempted (their cache row kept on the host).",
                                   registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Submission to a sequence's first committed "
                              "canvas.", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Submission to a sequence's end.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Submission to a sequence's slot.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.responses = Counter("dgemma:http_responses", "HTTP responses by route and status code.",
                                 ["route", "status"], registry=r)
        self.rejected = Counter("dgemma:requests_rejected", "Requests refused before a slot, by reason.",
                                ["reason"], registry=r)
        for reason in FINISHED_REASONS.values():   # present (at 0) before the first request
            self.success.labels(reason)

    def finished(self, reason: str) -> None:
        self.success.labels(FINISHED_REASONS.get(reason, reason)).inc()

    def response(self, path: str, status: int) -> None:
        self.responses.labels(path if path in ROUTES else "other", str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
