"""The HTTP server: OpenAI's chat/completions API over a `Scheduler` (FastAPI + uvicorn, SSE).

    app = create_app(scheduler, model_name="dgemma-tiny-digits")
    uvicorn.run(app, host="127.0.0.1", port=8000)          # or `dgemma serve`

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics
(Prometheus, `serving/metrics.py`). With an API key every route but /health and /metrics needs
`Authorization: Bearer <key>` (401). Client mistakes get OpenAI-style errors (`{"error": {"message",
"type", "code", "param"}}`): a bad body or a request that cannot fit (a slot or the whole queue) is
400, a body over the size limit 413, a body slower than its timeout 408, an unknown model or route
404, a wrong method 405, a full queue 429 with Retry-After, a draining server 503. A streamed
response sends one SSE chunk per committed canvas and `data: [DONE]`; a client that goes away frees
its slots at the next canvas boundary.

A request's body is read whole (up to `max_body_bytes`) before the app sees it, and prompts are
tokenized off the event loop, so one large request does not stall the others or `/health`. On
SIGTERM the server answers 503 to new requests and to those whose body is still arriving, and waits
for the generations in flight (up to `drain_seconds`; requests still running then get a 503 or
their stream ends) while /health says "draining"; then it stops listening. A second SIGTERM/SIGINT
exits at once. A connection's headers must arrive within `header_timeout` (`_TimedH11`), a body
within `body_timeout`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Sequence

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from dgemma_jax.io.images import settings_for as image_settings_for, soft_token_count
from dgemma_jax.io.prompts import message_text
from dgemma_jax.serving import images as images_lib
from dgemma_jax.serving.handler import DEFAULT_MAX_TOKENS, APIError, RequestHandler
from dgemma_jax.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from dgemma_jax.serving.scheduler import Scheduler
from dgemma_jax.serving.schema import ChatRequest, CompletionRequest
from dgemma_jax.serving.structured import StructuredRunner

DRAIN_BODY_GRACE_S = 1.0    # while draining, how long a request that just began may take to send its body
HEADER_TIMEOUT_S = 10.0     # a connection's request line and headers must arrive within this (dgemma serve --header-timeout)
BODY_TIMEOUT_S = 30.0       # and its body within this once the headers are in (--body-timeout)
BODY_BYTES_PER_TOKEN = 64   # the default body limit per token of context (JSON-escaped text, token id lists)
BODY_ENVELOPE_BYTES = 2 ** 16   # and for the rest of the JSON (fields, message wrappers)
TEXT_WORKERS = 2            # threads that tokenize prompts and build chat prompts (off the event loop)
IMAGE_WORKERS = 1           # the thread that decodes and resizes images (apart from the text ones)


def default_max_body_bytes(context: int, vision: bool = False) -> int:
    """The default request body limit: 64 bytes per token of a slot's context plus 64 KiB for the
    JSON around it, plus one image's data URL (`images.MAX_IMAGE_BYTES` in base64) for a checkpoint
    with a vision tower."""
    text = BODY_BYTES_PER_TOKEN * int(context) + BODY_ENVELOPE_BYTES
    return text + (images_lib.MAX_IMAGE_BYTES * 4 // 3 + 4 if vision else 0)


def _error(status: int, message: str, kind: str, code: str | None = None, param: str | None = None,
           headers: dict[str, str] | None = None):
    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}},
                        status_code=status, headers=headers)


def _json_kind(value) -> str:
    """A JSON value in words for an error message: `the string "8"`, `true`, `an array`."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, str):
        return f"the string {json.dumps(value[:40])}"
    if isinstance(value, (list, tuple)):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"the number {value!r}"


class _Drain:
    """Whether the server drains, and the requests whose body is still arriving (`_BodyGate`)."""

    def __init__(self):
        self.draining = False
        self.forced = False    # a second signal: the app's lifespan ends without waiting for the scheduler
        self.reading: set[asyncio.Future] = set()

    def __call__(self) -> None:
        """Stop waiting for bodies: every request still sending one gets a 503 (call on the event loop's thread)."""
        self.draining = True
        for f in list(self.reading):
            if not f.done():
                f.set_result(None)


OPEN_ROUTES = ("/health", "/metrics")   # answered without the API key (probes, scrapers)


class _Guard:
    """The outermost ASGI layer: the API key (`Authorization: Bearer KEY` on every route but
    `OPEN_ROUTES`; 401 in OpenAI's error shape before the body is read) and the metrics of every
    response (`dgemma:http_responses_total` by route and status; an error's code, or its type,
    counts in `dgemma:requests_rejected_total`)."""

    def __init__(self, app, api_key: str | None, metrics):
        self.app, self.metrics = app, metrics
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        state = {"status": None, "error": None}

        async def counted(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                self.metrics.response(path, message["status"])
            elif message["type"] == "http.response.body" and state["status"] and state["status"] >= 400 \
                    and state["error"] is None:
                state["error"] = _error_code(message.get("body", b""))
                self.metrics.rejected.labels(state["error"]).inc()
            await send(message)

        if self.api_key is not None and path not in OPEN_ROUTES:
            sent = b""
            for k, v in scope.get("headers", ()):
                if k.lower() == b"authorization":
                    sent = v
            scheme, _, token = sent.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                what = "no API key" if not sent else "an invalid API key"
                return await _BodyGate._answer(
                    counted, 401, f"{what}: this server needs its API key as the header Authorization: Bearer "
                    "<key> (the openai client's api_key)", "invalid_request_error", "invalid_api_key", close=True,
                    extra=[(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, counted)


def _error_code(body: bytes) -> str:
    """An error body's code (else its type) for the rejection metric."""
    try:
        err = json.loads(body)["error"]
        return str(err.get("code") or err.get("type") or "unknown")
    except Exception:  # noqa: BLE001 - not an OpenAI error body
        return "unknown"


class _BodyGate:
    """ASGI middleware in front of the app: reads each request's whole body first.

    A body over `max_body_bytes` gets 413 (by its Content-Length before any of it is read, or once
    it grows past the limit), a POST whose body is empty or not JSON by its content-type a 400, and
    a body still arriving when the server drains (`drain()`, a `_Drain`) a 503, so a half-sent request never
    holds up a shutdown. The app then reads the body from memory. A request cancelled while the
    server drains (the drain time ran out) ends with a 503, or its stream ends, instead of a
    CancelledError traceback in the log."""

    DISCARD_BYTES = 16 * 2 ** 20   # an oversized body is read and dropped up to this much, so the client sees the 413

    def __init__(self, app, max_body_bytes: int, drain: _Drain, body_timeout: float = BODY_TIMEOUT_S):
        self.app, self.max_body_bytes, self.drain = app, int(max_body_bytes), drain
        self.body_timeout = float(body_timeout)

    @staticmethod
    async def _answer(send, status: int, message: str, kind: str, code: str | None, close: bool = False,
                      extra: list | None = None):
        body = json.dumps({"error": {"message": message, "type": kind, "code": code, "param": None}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        headers += extra or []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _too_large(self, send, size: str):
        return self._answer(send, 413, f"the request body ({size}) is more than this server's limit of "
                            f"{self.max_body_bytes} bytes: send a shorter prompt, or start the server with a larger "
                            "--max-body-bytes", "invalid_request_error", "body_too_large", close=True)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            if int(declared) <= self.DISCARD_BYTES:
                await self._read(receive, keep=False)
            return await self._too_large(send, f"{int(declared)} bytes")
        body = await self._read(receive, keep=True)
        if body is None:   # the client left
            return
        if isinstance(body, str):
            if body == "slow":
                return await self._answer(send, 408, f"the request body did not arrive within {self.body_timeout:g} s "
                                          "(dgemma serve --body-timeout)", "invalid_request_error", "request_timeout",
                                          close=True)
            if body == "draining":
                return await self._answer(send, 503, "the server is shutting down and stopped waiting for this "
                                          "request's body; send it to another server or retry after the restart",
                                          "server_error", "shutting_down", close=True)
            return await self._too_large(send, "sent in chunks")
        if scope["method"] == "POST":
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as e:
                return await self._answer(send, 400, f"the body is not valid UTF-8 (byte {e.start}: {e.reason}): send "
                                          "the JSON encoded as UTF-8", "invalid_request_error", "invalid_utf8")
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind and kind != "application/json" and not kind.endswith("+json"):
                return await self._answer(send, 400, f"the body's content-type is {kind!r}: send the request as JSON "
                                          "with content-type: application/json", "invalid_request_error",
                                          "unsupported_content_type")
            if not body.strip():
                return await self._answer(send, 400, "the request body is empty: send a JSON object (e.g. "
                                          "{\"prompt\": \"...\"} or {\"messages\": [...]})", "invalid_request_error",
                                          "empty_body")
        await self._run(scope, body, receive, send)

    async def _read(self, receive, keep: bool):
        """The whole body (bytes); None when the client left; "draining" when the server drains first;
        "large" when it passes the limit (the rest is read and dropped, up to DISCARD_BYTES); "slow"
        when it takes longer than `body_timeout`."""
        loop = asyncio.get_running_loop()
        stop = loop.create_future()
        deadline = loop.time() + self.body_timeout
        if self.drain.draining:   # a request that began as the drain did
            deadline = min(deadline, loop.time() + DRAIN_BODY_GRACE_S)
        self.drain.reading.add(stop)
        body, size = bytearray(), 0
        try:
            while True:
                get = asyncio.ensure_future(receive())
                await asyncio.wait({get, stop}, timeout=max(deadline - loop.time(), 0),
                                   return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    return "draining" if self.drain.draining else "slow"
                message = get.result()
                if message["type"] == "http.disconnect":
                    return None
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    keep = False
                    if size > self.DISCARD_BYTES:
                        return "large"
                if keep:
                    body += chunk
                if not message.get("more_body", False):
                    return bytes(body) if size <= self.max_body_bytes else "large"
        finally:
            self.drain.reading.discard(stop)

    async def _run(self, scope, body: bytes, receive, send):
        replayed, sent = False, {"started": False, "done": False}

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def tracked(message):
            if message["type"] == "http.response.start":
                sent["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                sent["done"] = True
            await send(message)

        try:
            await self.app(scope, replay, tracked)
        except asyncio.CancelledError:
            if not self.drain.draining:
                raise
            # the drain time (--drain-seconds) ran out while this request ran: tell its client
            if not sent["started"]:
                await self._answer(send, 503, "the server shut down before this request finished (its drain time, "
                                   "--drain-seconds, ran out); retry it", "server_error", "shutting_down", close=True)
            elif not sent["done"]:
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def create_app(scheduler: Scheduler, model_name: str, *, default_max_tokens: int = DEFAULT_MAX_TOKENS,
               allowed_image_dirs: Sequence[str] = (), max_soft_tokens: int | None = None,
               max_body_bytes: int | None = None, api_key: str | None = None, api_docs: bool = False,
               body_timeout: float = BODY_TIMEOUT_S, decode_pixels: int = images_lib.DECODE_PIXELS) -> FastAPI:
    """The ASGI app serving `scheduler` under `model_name`. Its lifespan stops the scheduler (after
    uvicorn has drained the open requests). allowed_image_dirs: directories whose files chat image
    parts may name (default none: data URLs only); max_soft_tokens: each image's soft-token budget
    (default: the checkpoint's image processor's, `dgemma_jax.io.images.settings_for`);
    max_body_bytes: the largest request body (default `default_max_body_bytes`), larger ones get 413.
    api_key: every route but /health and /metrics needs `Authorization: Bearer <api_key>` (401 without);
    api_docs: serve /docs, /redoc and /openapi.json (default off); body_timeout: seconds a body may
    take to arrive (408 after); decode_pixels: the image pixels decoded at once across requests.
    `app.state.drain()` makes requests whose body is still arriving answer 503 (`serve` calls it on SIGTERM)."""
    cfg = scheduler.engine.config
    created = int(time.time())
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(scheduler.context, getattr(cfg, "vision", None) is not None)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if not app.state.drain.forced:
            await asyncio.get_running_loop().run_in_executor(None, scheduler.stop)
        for pool in app.state.pools:
            pool.shutdown(wait=False, cancel_futures=True)

    docs = {} if api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="dgemma_jax", lifespan=lifespan, **docs)
    app.state.drain = _Drain()
    app.add_middleware(_BodyGate, max_body_bytes=max_body_bytes, drain=app.state.drain, body_timeout=body_timeout)
    app.add_middleware(_Guard, api_key=api_key, metrics=scheduler.metrics)   # outermost: before any body is read

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        if e.status_code == 404:
            msg, code = (f"no route {request.url.path!r}: this server answers POST /v1/chat/completions, POST "
                         "/v1/completions, GET /v1/models, GET /health and GET /metrics"), "not_found"
        elif e.status_code == 405:
            msg, code = f"{request.method} is not allowed on {request.url.path}", "method_not_allowed"
        else:
            msg, code = str(e.detail), None
        return _error(e.status_code, msg, "invalid_request_error", code, headers=getattr(e, "headers", None))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error(e.status, e.message, e.kind, e.code, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        msg = str(first.get("msg", "invalid request body")).removeprefix("Value error, ")
        kind = first.get("type", "")
        if kind == "json_invalid":
            where = ""
            msg = f"the body is not valid JSON ({first.get('ctx', {}).get('error', msg)})"
        elif kind == "extra_forbidden":
            msg = f"unknown field {str(first['loc'][-1])!r}: this server does not support it"
        elif kind == "model_attributes_type" and not where:
            msg = ("the body must be a JSON object ({\"prompt\": ...} or {\"messages\": [...]}); got "
                   + _json_kind(first.get("input")))
        elif kind.endswith("_type") and "input" in first:   # strict types: "8" is not 8, true is not 1
            msg = f"{msg.rstrip('.')}; got {_json_kind(first['input'])}"
        return _error(400, f"{where}: {msg}" if where else msg, "invalid_request_error", first.get("type"), where or None)

    handler = RequestHandler(scheduler, model_name, default_max_tokens=default_max_tokens,
                             allowed_image_dirs=allowed_image_dirs, max_soft_tokens=max_soft_tokens)
    # prompts and images in pools of their own: many large images never hold up a text request
    text_pool = concurrent.futures.ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="dgemma-text")
    image_pool = concurrent.futures.ThreadPoolExecutor(IMAGE_WORKERS, thread_name_prefix="dgemma-images")
    budget = images_lib.PixelBudget(decode_pixels)
    structured = StructuredRunner(handler)   # response_format (serving/structured.py)
    app.state.pools = (text_pool, image_pool)

    def image_pixels(body: ChatRequest) -> int:
        """The pixels the request's images decode to (from their headers), after a 400 when its text
        and images could never fit the context (the least its prompt can be: its text's tokens and
        each image's soft tokens and two markers)."""
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            found = images_lib.sizes(images_lib.resolve_image_parts(messages, allowed_image_dirs))
            settings = image_settings_for(cfg, max_soft_tokens)
        except ValueError:   # chat_ids answers the 400
            return 0
        text = handler.tok.encode("".join(message_text(m) for m in messages))
        least = len(text) + sum(soft_token_count(h, w, settings) + 2 for h, w in found)
        if least + scheduler.canvas_length > scheduler.context:
            raise APIError(400, f"the prompt is at least {least} tokens ({len(text)} of text, {len(found)} image(s)); "
                                f"with one canvas of {scheduler.canvas_length} it exceeds this server's context of "
                                f"{scheduler.context} tokens per request: send fewer or smaller images or less text",
                           param="messages")
        return sum(h * w for h, w in found)

    # ------------------------------------------------------------------ routes
    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        handler.check_model(body)
        handler.check_size(body, 1)
        loop = asyncio.get_running_loop()
        grammar = await loop.run_in_executor(text_pool, structured.grammar, body)
        if images_lib.has_image_parts([m.model_dump(include={"content"}) for m in body.messages]) \
                and getattr(cfg, "vision", None) is not None:
            handler.sampler_for(body)   # the cheap checks first
            # decoding and resizing takes a while and memory: its own threads, within the pixel budget
            # (the images' sizes read from their headers first)
            n_pixels = await loop.run_in_executor(image_pool, image_pixels, body)
            async with budget.hold(n_pixels):
                ids, images = await loop.run_in_executor(image_pool, handler.chat_ids, body)
        else:
            ids, images = await loop.run_in_executor(text_pool, handler.chat_ids, body)
        handler.check_prompt_length(len(ids), "messages")   # the prompt, not max_tokens, is what does not fit
        if grammar is not None and images is not None:
            raise APIError(400, "response_format cannot be combined with images on this server", param="response_format")
        return await handler.run(http, body, [ids], chat=True, images=images, grammar=grammar)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        handler.check_model(body)
        handler.check_size(body, len(body.prompts()))
        # off the event loop: a long prompt takes a while to tokenize, and /health and the streams wait for none
        grammar = await asyncio.get_running_loop().run_in_executor(text_pool, structured.grammar, body)
        prompts = await asyncio.get_running_loop().run_in_executor(text_pool, handler.completion_ids, body)
        if body.suffix is not None:
            return await handler.infill(body, prompts, grammar)
        return await handler.run(http, body, prompts, chat=False, grammar=grammar)

    @app.get("/v1/models")
    async def models():
        # the base model, then each LoRA adapter (dgemma serve --lora), with the model it adapts as its parent
        return {"object": "list", "data": [{"id": m, "object": "model", "created": created, "owned_by": "dgemma_jax",
                                            "max_model_len": scheduler.context,
                                            **({"root": model_name, "parent": model_name} if m != model_name else {})}
                                           for m in handler.models]}

    @app.get("/metrics")
    async def metrics():
        return Response(scheduler.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/health")
    async def health():
        st = scheduler.status()
        ok = st["worker_alive"] and not st["stopping"]
        if ok:
            status = "ok"
        elif st["stopping"]:
            status = "draining"
        elif not st.get("ready", True) and scheduler.error is None:
            status = "starting"
        else:
            status = "failed"
        return JSONResponse({"status": status, "model": model_name, **st}, status_code=200 if ok else 503)

    return app


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a header timeout: a connection whose request line and headers are
    not all in `header_timeout` seconds after it opened (or after its last response) is closed
    (uvicorn itself waits for them forever; its keep-alive timeout ends at the first byte)."""

    header_timeout = HEADER_TIMEOUT_S

    def _arm(self) -> None:
        armed = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late, armed)

    def _headers_late(self, armed) -> None:
        if self.cycle is armed and not self.transport.is_closing():   # no new request began since
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:
                pass
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._header_timer.cancel()
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc) -> None:
        self._header_timer.cancel()
        super().connection_lost(exc)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (not yet listening): OSError when it cannot be (the port in use,
    an address this machine does not have), so that `dgemma serve` says so before loading a model."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(scheduler: Scheduler, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          drain_seconds: float | None = None, log_level: str = "info", sock: socket.socket | None = None,
          on_listening: Callable[[], None] | None = None, header_timeout: float = HEADER_TIMEOUT_S,
          **app_kwargs: Any) -> bool:
    """Run the app with uvicorn until SIGINT/SIGTERM, on `sock` (from `bind_socket`) or host:port;
    `on_listening()` is called once it accepts connections. On the signal, new requests get 503 while
    the generations in flight finish (up to `drain_seconds`) and /health answers 503 "draining";
    requests whose body is still arriving get 503; then the server stops listening and the scheduler
    stops. A second signal exits at once. Returns False when the drain was cut short (a second
    signal, or `drain_seconds` ran out with generations still running)."""
    class _Server(uvicorn.Server):
        cut = False

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises SIGTERM/SIGINT once its graceful shutdown is done, so a server that
            # drained every request would still end "killed by signal"; a clean drain exits 0 here
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

        def handle_exit(self, sig, frame):
            if self.should_exit:   # a second SIGTERM or SIGINT: stop waiting for anything
                self.force_exit = True
                self.left_behind = scheduler.status()   # what it cuts short (freed at once after this)
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and on_listening is not None:
                on_listening()

        async def shutdown(self, sockets=None):
            app.state.drain()      # a half-sent request gets 503 and holds nothing up
            scheduler.close()      # new requests get 503; /health says "draining"
            loop = asyncio.get_running_loop()
            deadline = None if drain_seconds is None else loop.time() + drain_seconds
            # still listening while the generations in flight finish, so /health reports the drain
            while not self.force_exit and scheduler.pending() and scheduler.ready.is_set() \
                    and scheduler.error is None:
                if deadline is not None and loop.time() >= deadline:
                    self.cut = True
                    break
                await asyncio.sleep(0.05)
            if deadline is not None:   # what is left of the drain time for the responses to go out
                self.config.timeout_graceful_shutdown = max(deadline - loop.time(), 0.05)
            await super().shutdown(sockets)
            if self.force_exit:    # uvicorn leaves the lifespan hanging then (a traceback at exit): end it
                app.state.drain.forced = True
                await self.lifespan.shutdown()

    app = create_app(scheduler, model_name, **app_kwargs)
    protocol = type("_TimedH11", (_TimedH11,), {"header_timeout": float(header_timeout)})
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                            timeout_graceful_shutdown=drain_seconds)
    server = _Server(config)
    server.run(sockets=[sock] if sock is not None else None)
    if server.force_exit:
        st = getattr(server, "left_behind", None) or scheduler.status()
        print(f"dgemma serve: a second signal: exiting without waiting for {st['busy_slots']} running and "
              f"{st['queued']} queued sequence(s)", file=sys.stderr, flush=True)
        scheduler.stop(timeout=10)   # the cancelled requests' choices end at their next canvas
    elif server.cut:
        print(f"dgemma serve: the drain time (--drain-seconds {drain_seconds:g}) ran out: the requests still "
              "running were ended with 503", file=sys.stderr, flush=True)
    return not (server.force_exit or server.cut)
