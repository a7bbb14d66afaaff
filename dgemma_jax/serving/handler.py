"""Request handling for the server's routes: a request's prompts and checks, its submission to the
scheduler, and the OpenAI response or event stream built from its choices' events. Errors are
`APIError`s, which the app turns into OpenAI error bodies."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import secrets
import time
import uuid
from typing import Sequence

from fastapi import Request as HTTPRequest
import numpy as np
from fastapi.responses import StreamingResponse

from dgemma_jax.io.prompts import chat_prompt, message_text
from dgemma_jax.serving import images as images_lib
from dgemma_jax.serving import text as text_lib
from dgemma_jax.serving.output import SeqEvent
from dgemma_jax.serving.scheduler import QueueFull, Request, Scheduler, ShuttingDown, Starting
from dgemma_jax.serving.schema import ChatRequest, CompletionRequest

DEFAULT_MAX_TOKENS = 256   # when a request names no max_tokens (capped to what fits, like `dgemma generate`)
DISCONNECT_POLL_S = 0.1
STARTING_RETRY_AFTER_S = 5  # Retry-After of a request that arrives while the programs compile
QUEUE_RETRY_AFTER_S = 1     # Retry-After of a request that finds the queue full
HEAD_CHARS_PER_TOKEN = 8    # a text longer than this many characters per token of context: its head is tokenized first


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param
        self.headers = headers


def _deliver(loop, queue: asyncio.Queue, prompt: int, ev: SeqEvent) -> None:
    """Hand a scheduler event to the request's handler on the event loop (from the worker thread)."""
    try:
        loop.call_soon_threadsafe(queue.put_nowait, (prompt, ev))
    except RuntimeError:  # the event loop is closed: the server exited (a second signal), nobody waits for it
        pass


class RequestHandler:
    """Request handling for the routes: a request's prompts (tokenized off the event loop by the
    routes), its checks (model, size, sampler settings), its submission to the scheduler, and the
    OpenAI response or event stream built from the choices' events (`serving.output.SeqEvent`)."""

    def __init__(self, scheduler: Scheduler, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 allowed_image_dirs: Sequence[str] = (), max_soft_tokens: int | None = None):
        self.scheduler, self.model_name = scheduler, model_name
        # the base model's name, then the LoRA adapters' (dgemma serve --lora NAME=PATH): a request's model picks one
        self.models = {model_name: 0, **{n: i + 1 for i, n in enumerate(getattr(scheduler, "adapter_names", ()))}}
        self.tok, self.cfg = scheduler.tokenizer, scheduler.engine.config
        self.default_max_tokens, self.max_soft_tokens = default_max_tokens, max_soft_tokens
        self.allowed_image_dirs = allowed_image_dirs
        # infill (`suffix`) runs outside the slots, one request at a time (`infill`)
        self.infill_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dgemma-infill")

    def check_prompt_length(self, n: int, param: str) -> None:
        """400 at once for a prompt that leaves no room for a canvas (before the other prompts are tokenized)."""
        l, ctx = self.scheduler.canvas_length, self.scheduler.context
        if n + l > ctx:
            raise APIError(400, f"the prompt is {n} tokens; with one canvas of {l} it exceeds this server's context "
                                f"of {ctx} tokens per request: shorten the prompt", param=param)

    def check_text_head(self, text: str, param: str) -> None:
        """Bounded work for a long text: when it has more than `HEAD_CHARS_PER_TOKEN` characters per token
        of context, its head of that many characters is tokenized first, and a head that alone could
        never fit is the 400 (the rest is never tokenized)."""
        ctx, head = self.scheduler.context, HEAD_CHARS_PER_TOKEN * self.scheduler.context
        if len(text) <= head:
            return
        try:
            n = len(self.tok.encode(text[:head]))
        except ValueError:
            return   # the whole text's tokenization names the problem
        if n - 4 + self.scheduler.canvas_length > ctx:   # 4: tokens a cut may split or merge
            raise APIError(400, f"the prompt is more than {n - 4} tokens (its first {head} of {len(text)} characters "
                                f"alone); with one canvas of {self.scheduler.canvas_length} it exceeds this server's "
                                f"context of {ctx} tokens per request: shorten the prompt", param=param)

    def completion_ids(self, body: CompletionRequest) -> list[list[int]]:
        """The prompts' ids, each checked against the context as soon as it is tokenized (off the event loop)."""
        out = []
        for item in body.prompts():
            ids = self.prompt_ids(item)
            self.check_prompt_length(len(ids), "prompt")
            out.append(ids)
        return out

    def check_size(self, body, n_prompts: int) -> None:
        """400 for a request whose sequences could never all wait in the queue (before any work on it)."""
        total = n_prompts * body.n
        if total > self.scheduler.max_queue:
            raise APIError(400, f"this request asks for {total} sequences ({n_prompts} prompt(s) x n={body.n}), more "
                                f"than this server's queue holds ({self.scheduler.max_queue}, dgemma serve --max-queue): "
                                "send fewer prompts or a smaller n, or split the request", code="too_many_sequences",
                           param="n")

    def prompt_ids(self, item) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise APIError(400, "the prompt is empty", param="prompt")
            self.check_text_head(item, "prompt")
            try:
                return self.tok.encode(item, add_bos=True)
            except ValueError as e:
                raise APIError(400, f"the prompt cannot be tokenized: {e}", param="prompt") from None
        bad = [t for t in item if not 0 <= t < self.cfg.vocab_size]
        if bad or not item:
            raise APIError(400, f"token ids must be in [0, {self.cfg.vocab_size}); got {bad[:5] or 'an empty list'}",
                           param="prompt")
        return list(item)

    def chat_ids(self, body: ChatRequest):
        """(prompt ids, ImageBatch or None) of a chat request (`io.prompts.chat_prompt`, after this server's
        own checks: the model takes images, a template-less model gets one user message, image paths
        only from the allowed directories)."""
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        self.check_text_head("".join(message_text(m) for m in messages), "messages")
        with_images = images_lib.has_image_parts(messages)
        if with_images and self.cfg.vision is None:
            raise APIError(400, f"{self.model_name} is a text-only checkpoint (no vision tower): it cannot take images; "
                                "drop the image parts", param="messages")
        if not self.tok.has_chat_template:
            users = [m for m in messages if m["role"] == "user"]
            if len(messages) != 1 or len(users) != 1:
                raise APIError(400, f"{self.model_name} has no chat template (a character-level model): send exactly one "
                                    "user message, whose text is the prompt (and its images)", param="messages")
            if not with_images:
                return self.prompt_ids(message_text(users[0])), None
        try:
            if with_images:
                messages = images_lib.resolve_image_parts(messages, self.allowed_image_dirs)
                first = messages[0]
                if self.tok.has_chat_template and first["role"] in ("system", "developer") and isinstance(
                        first.get("content"), list) and any(
                        isinstance(p, dict) and p.get("type") == "image" for p in first["content"]):
                    raise ValueError("messages[0]: the chat template shows no images of a leading system message; "
                                     "put the image in a user message")
            return chat_prompt(self.cfg, self.tok, messages, thinking=body.thinking, max_soft_tokens=self.max_soft_tokens)
        except (TypeError, ValueError) as e:
            raise APIError(400, str(e), param="messages") from None
        except Exception as e:  # noqa: BLE001 - a decoder's own exception: still the client's image
            if not with_images:
                raise
            raise APIError(400, f"the image could not be read ({type(e).__name__}: {e})", param="messages") from None

    def check_model(self, body) -> int:
        """The index of the adapter the request's model names (0: the base model; no model: the base)."""
        if body.model is None:
            return 0
        if body.model not in self.models:
            names = ", ".join(repr(m) for m in self.models)
            raise APIError(404, f"the model {body.model!r} does not exist here; this server serves {names}",
                           code="model_not_found", param="model")
        return self.models[body.model]

    def sampler_for(self, body):
        if body.canvas_length is not None and body.canvas_length != self.scheduler.canvas_length:
            raise APIError(400, f"canvas_length={body.canvas_length}: this server runs canvases of "
                                f"{self.scheduler.canvas_length} tokens (the checkpoint's)", param="canvas_length")
        budget = self.scheduler.engine.sampler.max_denoising_steps
        if body.max_denoising_steps is not None and body.max_denoising_steps > budget:
            raise APIError(400, f"max_denoising_steps={body.max_denoising_steps} exceeds this server's budget of "
                                f"{budget} (dgemma serve --max-steps)", param="max_denoising_steps")
        try:
            return self.scheduler.default_sampler.replace(**body.sampler_changes())
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def submit_all(self, body, prompts: list[list[int]], queue: asyncio.Queue, chat: bool, images=None,
                   adapter: int = 0, grammar=None) -> list[Request]:
        loop = asyncio.get_running_loop()
        sampler = self.sampler_for(body)
        try:
            budget = body.token_budget()
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens") from None
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        reqs = []
        for p, ids in enumerate(prompts):
            n_tok = budget if budget is not None else self.scheduler.default_max_tokens(len(ids), self.default_max_tokens)
            previews = bool(body.stream and body.stream_options and body.stream_options.include_provisional)
            reqs.append(Request(ids, n_tok, sampler, seed, n=body.n, stop=body.stops, provisional=previews,
                                priority=body.priority, adapter=adapter, grammar=grammar,
                                keep_special=chat and self.tok.has_chat_template, images=images,
                                on_event=functools.partial(_deliver, loop, queue, p)))
        try:
            self.scheduler.submit_many(reqs)   # all of the request's sequences or none
        except BaseException as e:
            if isinstance(e, QueueFull):
                raise APIError(429, str(e), "rate_limit_error", "queue_full",
                               headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)}) from None
            if isinstance(e, Starting):
                raise APIError(503, str(e), "server_error", "starting",
                               headers={"Retry-After": str(STARTING_RETRY_AFTER_S)}) from None
            if isinstance(e, ShuttingDown):
                raise APIError(503, str(e), "server_error", "shutting_down") from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param="messages" if images is not None else "max_tokens") from None
            raise
        return reqs

    async def infill(self, body: CompletionRequest, prompts: list[list[int]], grammar=None) -> dict:
        """A completion with OpenAI's `suffix`: each prompt's text is the middle between the prompt and
        the suffix, by the library's `Engine.infill` with the request's sampler and seed (the suffix
        pinned on the canvas right after each candidate middle length, then EOS; the candidate the
        model's causal pass finds most likely is kept; docs/api.md). It runs outside the slots, one
        request at a time in a thread of its own, so the same request gives the library's middle."""
        self.check_model(body)
        for param, bad, why in (("stream", body.stream, "the middle's length is chosen after every candidate is "
                                 "generated, so nothing can be streamed before the end"),
                                ("n", body.n > 1, "infill gives one middle per prompt"),
                                ("stop", bool(body.stops), "the suffix ends the middle"),
                                ("response_format", grammar is not None, "a constrained middle between a "
                                 "prefix and a suffix is not supported; send one or the other")):
            if bad:
                raise APIError(400, f"{param} cannot go with suffix: {why}", param=param)
        sampler = self.sampler_for(body)
        if self.scheduler._started_at is not None and not self.scheduler.ready.is_set():
            raise APIError(503, f"the server is still compiling its programs ({self.scheduler.runner.progress()}); "
                                "retry shortly", "server_error", "starting",
                           headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        budget = body.max_tokens if body.max_tokens is not None else self.scheduler.canvas_length
        job = functools.partial(self._infill, prompts, body.suffix, sampler, seed, budget)
        try:
            middles, steps = await asyncio.get_running_loop().run_in_executor(self.infill_pool, job)
        except ValueError as e:
            raise APIError(400, str(e), param="suffix" if "suffix" in str(e) else "max_tokens") from None
        choices = [{"index": i, "text": self.tok.decode(m, skip_special=True), "finish_reason": "stop",
                    "logprobs": None} for i, m in enumerate(middles)]
        prompt, completion = sum(len(p) for p in prompts), sum(len(m) for m in middles)
        self.scheduler.metrics.prompt_tokens.inc(prompt)
        self.scheduler.metrics.generation_tokens.inc(completion)
        return {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                          "denoising_steps": int(np.sum(steps))}}

    def _infill(self, prompts, suffix: str, sampler, seed: int, budget: int):
        """(middles' ids, denoiser passes of each chosen candidate); ValueError naming a bad input."""
        ids = self.tok.encode(suffix) if suffix else []
        if not ids:
            raise ValueError("suffix is empty (it has no tokens): send the text that follows the completion, or "
                             "leave suffix out")
        for p in prompts:   # the prompt, the middle's budget, the suffix and its EOS within a slot's context
            self.scheduler.check_fits(len(p), budget + len(ids) + 1)
        width = max(len(p) for p in prompts)
        tokens = np.full((len(prompts), width), self.cfg.pad_id, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        engine = self.scheduler.engine.with_sampler(sampler)
        out = engine.infill(tokens, np.asarray([len(p) for p in prompts], np.int32), suffixes=[ids] * len(prompts),
                            rng=seed, max_new_tokens=budget)
        return out.middles, out.steps

    def usage(self, prompts, finals: dict, n: int) -> dict:
        completion = sum(ev.token_count for ev in finals.values())
        steps = sum(ev.steps for ev in finals.values())
        prompt = sum(len(p) for p in prompts)
        # a prompt's tokens found in its slot's cache (prefix reuse), the least over its n choices
        per_prompt: dict[int, int] = {}
        for i, ev in finals.items():
            p = i // n
            per_prompt[p] = min(per_prompt.get(p, ev.cached_tokens), ev.cached_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(per_prompt.values())},
                "denoising_steps": steps, "canvases": sum(ev.canvases for ev in finals.values()),
                "tokens_per_forward": round(completion / steps, 4) if steps else 0.0,
                # scheduler ticks from a choice's admission to its end (the most over the choices)
                "ticks": max((ev.tick - ev.admitted_tick + 1 for ev in finals.values()), default=0),
                "tick_range": [min((ev.admitted_tick for ev in finals.values()), default=0),
                               max((ev.tick for ev in finals.values()), default=0)]}

    async def watch_disconnect(self, http: HTTPRequest, reqs: list[Request]):
        while True:
            if await http.is_disconnected():
                for r in reqs:
                    r.cancelled.set()
                return
            await asyncio.sleep(DISCONNECT_POLL_S)

    async def run(self, http: HTTPRequest, body, prompts: list[list[int]], chat: bool, images=None, grammar=None):
        """A request's response: its sequences through the scheduler's slots (structured ones too, with
        their `grammar`: serving/structured.py), streamed or whole."""
        adapter = self.check_model(body)
        model = body.model or self.model_name
        queue: asyncio.Queue = asyncio.Queue()
        reqs = self.submit_all(body, prompts, queue, chat, images, adapter, grammar)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        n_total = len(prompts) * body.n
        stamp = int(time.time())
        if body.stream:
            return StreamingResponse(self.stream(http, body, prompts, reqs, queue, rid, stamp, n_total, chat, model),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals: dict[int, SeqEvent] = {}
        watcher = asyncio.create_task(self.watch_disconnect(http, reqs))
        try:
            while len(finals) < n_total:
                p, ev = await queue.get()
                if ev.finish_reason is not None:
                    finals[p * body.n + ev.index] = ev
        finally:  # also when this task is cancelled (the drain time ran out): its slots are freed
            watcher.cancel()
            if len(finals) < n_total:
                for r in reqs:
                    r.cancelled.set()
        if any(ev.finish_reason == "error" for ev in finals.values()):
            raise APIError(500, f"the server's worker failed: {self.scheduler.error}", "server_error")
        choices = []
        for i in sorted(finals):
            ev = finals[i]
            if chat:
                reasoning, content = text_lib.split_reasoning(ev.text, body.thinking)
                msg = {"role": "assistant", "content": content}
                if reasoning is not None:
                    msg["reasoning_content"] = reasoning
                choices.append({"index": i, "message": msg, "finish_reason": ev.finish_reason, "logprobs": None})
            else:
                choices.append({"index": i, "text": ev.text, "finish_reason": ev.finish_reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": stamp,
                "model": model, "choices": choices, "usage": self.usage(prompts, finals, body.n)}

    async def stream(self, http, body, prompts, reqs, queue, rid, stamp, n_total, chat, model):
        kind = "chat.completion.chunk" if chat else "text_completion"
        sent: dict[int, list[str]] = {}   # choice -> [reasoning sent, content sent]
        finals: dict[int, SeqEvent] = {}

        def chunk(choices, **extra):
            return "data: " + json.dumps({"id": rid, "object": kind, "created": stamp, "model": model,
                                          "choices": choices, **extra}) + "\n\n"

        watcher = asyncio.create_task(self.watch_disconnect(http, reqs))
        try:
            if chat:
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                             for i in range(n_total)])
            while len(finals) < n_total:
                p, ev = await queue.get()
                i = p * body.n + ev.index
                done = ev.finish_reason is not None
                if ev.finish_reason == "error":
                    yield "data: " + json.dumps({"error": {"message": f"the server's worker failed: {self.scheduler.error}",
                                                           "type": "server_error", "code": None}}) + "\n\n"
                    return
                text = ev.text if done else text_lib.stream_safe(ev.text, body.stops)
                prev = sent.setdefault(i, ["", ""])
                if ev.provisional is not None:   # a preview of the canvas in flight: nothing committed
                    if chat:
                        yield chunk([{"index": i, "delta": {"provisional": ev.provisional}, "finish_reason": None}])
                    else:
                        yield chunk([{"index": i, "text": "", "provisional": ev.provisional, "finish_reason": None,
                                      "logprobs": None}])
                    continue
                if chat:
                    reasoning, content = text_lib.split_reasoning(text, body.thinking)
                    delta = {}
                    if reasoning and text_lib.delta(prev[0], reasoning):
                        delta["reasoning_content"] = text_lib.delta(prev[0], reasoning)
                        prev[0] = reasoning
                    if text_lib.delta(prev[1], content):
                        delta["content"] = text_lib.delta(prev[1], content)
                        prev[1] = content
                    piece = {"index": i, "delta": delta, "finish_reason": ev.finish_reason}
                else:
                    d = text_lib.delta(prev[1], text)
                    prev[1] += d
                    piece = {"index": i, "text": d, "finish_reason": ev.finish_reason, "logprobs": None}
                if done:
                    finals[i] = ev
                if done or piece.get("delta") or piece.get("text"):
                    yield chunk([piece])
            if body.stream_options and body.stream_options.include_usage:
                yield chunk([], usage=self.usage(prompts, finals, body.n))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the response task is cancelled) or the stream ended
            watcher.cancel()
            if len(finals) < n_total:
                for r in reqs:
                    r.cancelled.set()
