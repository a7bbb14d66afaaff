"""What an operator needs of `dgemma serve` (issue 45): Prometheus metrics that count what was
served, an API key, header and body timeouts, bounded inputs, and errors in OpenAI's shape. One
server for the module (the bundled model, an API key, short timeouts), driven through the `openai`
client, httpx and raw sockets."""

import json
import threading
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.serving.output import OutputProcessor
from dgemma_jax.serving.schema import MAX_STOP_CHARS, MAX_STOPS
from dgemma_jax.serving.planner import Choice
from dgemma_jax.serving.scheduler import Request
from tests.helpers.serve import ServerProcess, free_port

MODEL = "dgemma-tiny-digits"
KEY = "sk-test-45"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--slots", "2", "--api-key", KEY, "--header-timeout", "1", "--body-timeout", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _scrape(server) -> dict:
    """{(sample name, frozenset(labels)): value} of /metrics (no key needed)."""
    r = httpx.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _get(m, name, **labels):
    return m.get((name, frozenset(labels.items())), 0.0)


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}, err
    return err


# ------------------------------------------------------------------ metrics
def test_metrics_counters_move_by_the_requests_usage(server, client):
    before = _scrape(server)
    outs = [client.completions.create(model=MODEL, prompt="s9350814272=", seed=1, max_tokens=16),
            client.completions.create(model=MODEL, prompt="s705182936=", seed=2, max_tokens=8, n=2),
            client.chat.completions.create(model=MODEL, seed=3, messages=[{"role": "user", "content": "s8812="}])]
    # a follow-up that begins with the first prompt: its cached tokens count as prefix-cache hits
    outs.append(client.completions.create(model=MODEL, prompt="s9350814272=" + outs[0].choices[0].text + "s1=",
                                          seed=4, max_tokens=8))
    with pytest.raises(openai.BadRequestError):   # refused before a slot: a rejection, no tokens
        client.completions.create(model=MODEL, prompt="s1=", stop=["x"] * (MAX_STOPS + 1))
    after = _scrape(server)

    def moved(name, **labels):
        return _get(after, name, **labels) - _get(before, name, **labels)

    seqs = sum(len(o.choices) for o in outs)   # 5 sequences
    reasons = [c.finish_reason for o in outs for c in o.choices]
    assert moved("vllm:request_success_total", finished_reason="stop") == reasons.count("stop")
    assert moved("vllm:request_success_total", finished_reason="length") == reasons.count("length")
    assert moved("vllm:request_success_total", finished_reason="abort") == 0
    assert moved("vllm:prompt_tokens_total") == sum(o.usage.prompt_tokens for o in outs)
    assert moved("vllm:generation_tokens_total") == sum(o.usage.completion_tokens for o in outs)
    assert moved("dgemma:denoising_steps_total") == sum(o.usage.model_extra["denoising_steps"] for o in outs)
    assert moved("dgemma:canvases_total") == sum(o.usage.model_extra["canvases"] for o in outs)
    hits = sum(o.usage.prompt_tokens_details.cached_tokens for o in outs)
    assert outs[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert moved("vllm:prefix_cache_hits_total") >= hits > 0
    # every sequence's prompt is looked up once: the n=2 request's prompt twice
    assert moved("vllm:prefix_cache_queries_total") == sum(o.usage.prompt_tokens for o in outs) + \
        outs[1].usage.prompt_tokens
    for h in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
              "vllm:request_queue_time_seconds"):
        assert moved(h + "_count") == seqs, h
        assert moved(h + "_sum") > 0
        assert moved(h + "_bucket", le="+Inf") == seqs
    assert moved("dgemma:http_responses_total", route="/v1/completions", status="200") == 3
    assert moved("dgemma:http_responses_total", route="/v1/chat/completions", status="200") == 1
    assert moved("dgemma:http_responses_total", route="/v1/completions", status="400") == 1
    assert moved("dgemma:requests_rejected_total", reason="value_error") == 1   # the error body's code
    assert _get(after, "vllm:num_requests_running") == 0 and _get(after, "vllm:num_requests_waiting") == 0
    assert _get(after, "dgemma:slots") == 2


# ------------------------------------------------------------------ auth
def test_the_api_key_guards_every_route_but_health_and_metrics(server, client):
    before = _scrape(server)
    anon = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as e:
        anon.completions.create(model=MODEL, prompt="s12=", max_tokens=8)
    assert e.value.status_code == 401 and "invalid API key" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        anon.models.list()
    err = _error(httpx.get(server.url + "/v1/models", timeout=10), 401)
    assert err["code"] == "invalid_api_key" and "Authorization: Bearer" in err["message"]
    assert client.models.list().data[0].id == MODEL
    assert client.completions.create(model=MODEL, prompt="s21=", seed=0, max_tokens=8).choices[0].text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):   # off by default (--enable-api-docs)
        _error(httpx.get(server.url + path, headers=AUTH, timeout=10), 404)
    assert _get(_scrape(server), "dgemma:requests_rejected_total", reason="invalid_api_key") - \
        _get(before, "dgemma:requests_rejected_total", reason="invalid_api_key") == 3


# ------------------------------------------------------------------ errors in OpenAI's shape
def test_unknown_routes_methods_and_bad_utf8_are_openai_errors(server):
    err = _error(httpx.get(server.url + "/v2/nothing", headers=AUTH, timeout=10), 404)
    assert err["code"] == "not_found" and "/v1/chat/completions" in err["message"]
    err = _error(httpx.get(server.url + "/v1/completions", headers=AUTH, timeout=10), 405)
    assert err["code"] == "method_not_allowed" and "GET" in err["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "s1\xff\xfe="}', timeout=10,
                   headers={**AUTH, "content-type": "application/json"})
    err = _error(r, 400)
    assert err["code"] == "invalid_utf8" and "UTF-8" in err["message"]


def test_stop_lists_are_bounded_and_stream_options_need_stream(server):
    def post(**body):
        return httpx.post(server.url + "/v1/completions", json={"prompt": "s12=", "max_tokens": 8, **body},
                          headers=AUTH, timeout=30)

    err = _error(post(stop=["9"] * (MAX_STOPS + 1)), 400)
    assert f"stop has {MAX_STOPS + 1} strings" in err["message"] and f"at most {MAX_STOPS}" in err["message"]
    err = _error(post(stop="9" * (MAX_STOP_CHARS + 1)), 400)
    assert f"at most {MAX_STOP_CHARS}" in err["message"]
    assert post(stop=["9"] * MAX_STOPS).status_code == 200
    err = _error(post(stream_options={"include_usage": True}), 400)
    assert "stream_options needs" in err["message"]
    err = _error(post(stream=False, stream_options={"include_usage": True}), 400)


def test_a_chat_prompt_too_long_for_the_context_blames_the_messages(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "s" + "1" * 300 + "="}])
    body = e.value.body
    assert body["param"] == "messages" and "shorten the prompt" in body["message"], body


# ------------------------------------------------------------------ previews and stop strings
def test_a_preview_never_shows_text_past_a_stop_string():
    cfg, _, sampler, tok = load_bundled()
    proc = OutputProcessor(tok, sampler.pad_id, sampler.eos_ids)
    req = Request(tok.encode("s9350814272=", add_bos=True), 16, sampler, 0, lambda ev: None, stop=("3",),
                  provisional=True)
    choice = Choice(req, 0, None, 2)
    choice.tokens = list(tok.encode("01"))
    ev = proc.event(choice, None, 0, preview=tok.encode("223457"))
    assert ev.text == "01" and ev.provisional == "22"     # not "223457": the answer would stop before the 3
    req.stop = ("13",)                                     # a stop that begins in the committed text
    choice.tokens = list(tok.encode("01"))
    assert proc.event(choice, None, 0, preview=tok.encode("3457")).provisional == ""


def test_streamed_previews_stop_where_the_answer_stops(server, client):
    chunks = list(client.completions.create(model=MODEL, prompt="s9350814272=", seed=1, stop=["3"], stream=True,
                                            stream_options={"include_provisional": True}))
    text = "".join(c.choices[0].text for c in chunks)
    previews = [c.choices[0].model_extra.get("provisional") for c in chunks]
    previews = [p for p in previews if p]
    assert text == "0122" and previews
    assert all("3" not in p for p in previews), previews


# ------------------------------------------------------------------ slow clients
def _closed_after(s: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closed `s` (reading whatever it sent), at most `limit`."""
    t0, got = time.monotonic(), b""
    s.settimeout(limit)
    try:
        while True:
            part = s.recv(65536)
            if not part:
                break
            got += part
    except (socket.timeout, ConnectionResetError):
        pass
    return time.monotonic() - t0, got


def test_partial_headers_a_silent_connection_and_a_partial_body_are_cut_off(server):
    silent = socket.create_connection(("127.0.0.1", server.port))
    partial = socket.create_connection(("127.0.0.1", server.port))
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n")
    took, got = _closed_after(partial, 10)
    assert took < 3 and got == b"", (took, got)       # --header-timeout 1
    took, got = _closed_after(silent, 10)
    assert took < 3 and got == b""
    body = json.dumps({"prompt": "s12=", "max_tokens": 8}).encode()
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\nauthorization: "
                 b"Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body[:5])
    took, got = _closed_after(slow, 10)
    assert took < 4 and got.startswith(b"HTTP/1.1 408") and b"--body-timeout" in got, (took, got)
    # a keep-alive connection that finished a request and then dawdles over the next one's headers
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    time.sleep(0.3)
    s.sendall(b"GET /health HTTP/1.1\r\nHo")
    took, got = _closed_after(s, 10)
    assert took < 3 and got.startswith(b"HTTP/1.1 200") and got.count(b"HTTP/1.1") == 1, (took, got)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------ the command line
def test_a_bad_or_busy_port_is_one_line_and_exit_2():
    p = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "serve", "--port", "99999"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "a port is 0-65535, got 99999" in p.stderr and "listening" not in p.stderr
    port = free_port()
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        p = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "serve", "--port", str(port)],
                           capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if "dgemma" in ln]
    assert p.returncode == 2, p.stderr
    assert lines == [f"dgemma: error: cannot listen on 127.0.0.1:{port} (Address already in use): pick another "
                     "--port (or stop what holds it) or --host"], p.stderr
    assert "Traceback" not in p.stderr


# ------------------------------------------------------------------ large images
def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def test_twelve_huge_images_keep_a_text_request_fast_and_memory_bounded(tmp_path):
    """12 concurrent chats with a 9400x9400 PNG (under Pillow's pixel limit, a few hundred KB encoded) to the
    bundled vision model: they decode in threads of their own within the decoded-pixel budget (one at a
    time at the default 100 M pixels), so a text request beside them answers within 1 s (or 10x its time alone on
    a loaded machine) and the server's
    memory grows by less than 1.5 GB (before: 6 such images took it from 1.2 to 6.9 GB, a text chat waited
    20 s behind 12)."""
    from PIL import Image

    big = tmp_path / "big.png"
    Image.new("RGB", (9400, 9400), (200, 30, 30)).save(big)
    srv = ServerProcess("--checkpoint", "bundled:dgemma-tiny-vision-digits", "--slots", "2",
                        "--allowed-image-dir", str(tmp_path))
    try:
        cl = srv.client()
        text = [{"role": "user", "content": "sort the digits"}]
        results, worst = [], 0.0

        def image_chat():
            try:
                results.append(cl.chat.completions.create(
                    model="dgemma-tiny-vision-digits", max_tokens=8, seed=0, messages=[{"role": "user", "content": [
                        {"type": "image_url", "image_url": {"url": f"file://{big}"}},
                        {"type": "text", "text": "sort the digits in the image"}]}]).choices[0].finish_reason)
            except Exception as e:  # noqa: BLE001 - what the client saw is the result
                results.append(e)

        # warm up: the text programs, and the image prefill program (compiled on first use, which stalls
        # every slot once: not what this measures)
        cl.chat.completions.create(model="dgemma-tiny-vision-digits", messages=text, max_tokens=8, seed=0)
        image_chat()
        assert results == ["stop"] or results == ["length"], results
        results.clear()
        alone = []   # the text chat's time with nothing beside it: the bound below scales with the machine's load
        for _ in range(5):
            t0 = time.monotonic()
            cl.chat.completions.create(model="dgemma-tiny-vision-digits", messages=text, max_tokens=8, seed=0)
            alone.append(time.monotonic() - t0)
        bound = max(1.0, 10 * sorted(alone)[2])
        base = _rss(srv.proc.pid)
        peak = base
        threads = [threading.Thread(target=image_chat) for _ in range(12)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            r = cl.chat.completions.create(model="dgemma-tiny-vision-digits", messages=text, max_tokens=8, seed=0)
            worst = max(worst, time.monotonic() - t0)
            assert r.choices[0].finish_reason in ("stop", "length")
            peak = max(peak, _rss(srv.proc.pid))
            time.sleep(0.1)
        assert len(results) == 12 and all(r in ("stop", "length") for r in results), results
        assert worst < bound, f"a text chat took {worst:.2f} s beside 12 huge images ({sorted(alone)[2]:.2f} s alone)"
        assert peak - base < 1.5 * 2 ** 30, f"the server grew by {(peak - base) / 2 ** 30:.2f} GB"
        # four such images take at least 4 x 66 prompt tokens, more than the context (256): a 400 from their
        # headers, before any of them is decoded (each decode takes seconds)
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError, match="at least 264 tokens"):
            cl.chat.completions.create(model="dgemma-tiny-vision-digits", max_tokens=8, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{big}"}}] * 4}])
        assert time.monotonic() - t0 < 1.5
    finally:
        srv.stop()
