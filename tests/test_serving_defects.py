"""The defects a load and fault run found in `dgemma serve` (issue 32, point 6), each pinned by a test
that failed on the server before the fix: a large prompt froze every client, a half-sent request kept
SIGTERM from finishing, a request that could never fit the queue got a retryable 429, lenient types
and unclear 400s, and no bundled model could take an image over HTTP.

The request checks run in-process on an unstarted scheduler of the bundled model (nothing compiles:
every answer here comes before a slot); the rest drive real `dgemma serve` processes."""

import base64
import os
import socket
import threading
import time

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.io.images import prompt_with_images
from dgemma_jax.serving.scheduler import Request, Scheduler
from dgemma_jax.serving.handler import QUEUE_RETRY_AFTER_S
from dgemma_jax.serving.server import create_app, default_max_body_bytes
from tests.helpers.serve import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "dgemma-tiny-digits"
PROMPT = {"model": MODEL, "prompt": "s9350814272=", "seed": 0, "max_tokens": 16}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "s9350814272="}]}


@pytest.fixture(scope="module")
def idle():
    """(scheduler, client): a scheduler that never starts (queue limit 4), behind the app."""
    cfg, params, sampler, tok = load_bundled()
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=64, max_queue=4)
    return sch, TestClient(create_app(sch, MODEL))


def _error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"}, err
    return err


# ------------------------------------------------------------------ the queue
def test_a_request_that_can_never_fit_the_queue_is_a_400_naming_the_limit(idle):
    sch, client = idle
    err = _error(client.post("/v1/completions", json={**PROMPT, "n": 5}), 400)
    assert "5 sequences" in err["message"] and "--max-queue" in err["message"] and err["param"] == "n"
    err = _error(client.post("/v1/completions", json={**PROMPT, "prompt": ["s12=", "s34=", "s56="], "n": 2}), 400)
    assert "6 sequences (3 prompt(s) x n=2)" in err["message"]
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "n": 5}), 400)
    assert "queue holds (4" in err["message"]
    assert sch.status()["queued"] == 0


def test_a_full_queue_is_a_429_with_retry_after_and_takes_none_of_the_request(idle):
    sch, client = idle
    held = [sch.submit(Request(sch.tokenizer.encode("s12=", add_bos=True), 8, sch.default_sampler, i, lambda ev: None))
            for i in range(2)]
    try:
        # 3 prompts fit the queue's limit of 4 but not its 2 free places: none of them is queued
        r = client.post("/v1/completions", json={**PROMPT, "prompt": ["s12=", "s34=", "s56="]})
        err = _error(r, 429)
        assert r.headers["retry-after"] == str(QUEUE_RETRY_AFTER_S)
        assert err["code"] == "queue_full" and "adds 3" in err["message"]
        assert sch.status()["queued"] == 2
    finally:
        for h in held:
            h.cancelled.set()
        with sch._cond:
            sch.plan.queue.clear()


# ------------------------------------------------------------------ strict bodies
@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", "8", 'max_tokens: Input should be a valid integer; got the string "8"'),
    ("max_tokens", True, "max_tokens: Input should be a valid integer; got true"),
    ("seed", "7", 'seed: Input should be a valid integer; got the string "7"'),
    ("stream", "yes", 'stream: Input should be a valid boolean; got the string "yes"'),
    ("n", 2.0, "n: Input should be a valid integer"),
])
def test_lenient_types_are_refused_naming_the_field(idle, field, value, words):
    err = _error(idle[1].post("/v1/completions", json={**PROMPT, field: value}), 400)
    assert err["message"].startswith(words) and err["param"] == field, err


def test_unknown_keys_and_untyped_parts_in_a_message_are_refused(idle):
    client = idle[1]
    msg = {"role": "user", "content": "s1=", "colour": "red"}
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "messages": [msg]}), 400)
    assert err["message"] == "messages.0.colour: unknown field 'colour': this server does not support it"
    err = _error(client.post("/v1/chat/completions",
                             json={**CHAT, "messages": [{"role": "user", "content": [{"text": "s1="}]}]}), 400)
    assert 'content[0] has no "type"' in err["message"] and err["param"] == "messages.0"
    part = {"type": "text", "text": "s1=", "bold": True}
    err = _error(client.post("/v1/chat/completions",
                             json={**CHAT, "messages": [{"role": "user", "content": [part]}]}), 400)
    assert "unknown field(s) ['bold'] in a text part" in err["message"]
    part = {"type": "audio", "audio": "..."}
    err = _error(client.post("/v1/chat/completions",
                             json={**CHAT, "messages": [{"role": "user", "content": [part]}]}), 400)
    assert "content[0].type 'audio'" in err["message"]


def test_wrong_content_type_empty_body_and_a_non_object_get_clear_400s(idle):
    client = idle[1]
    err = _error(client.post("/v1/completions", content=b'{"prompt": "s1="}', headers={"content-type": "text/plain"}),
                 400)
    assert "content-type is 'text/plain'" in err["message"] and "application/json" in err["message"]
    err = _error(client.post("/v1/completions", content=b"", headers={"content-type": "application/json"}), 400)
    assert err["message"].startswith("the request body is empty") and err["code"] == "empty_body"
    err = _error(client.post("/v1/chat/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400)
    assert err["message"].startswith("the body must be a JSON object") and "got an array" in err["message"]


def test_the_body_limit_follows_the_context_and_an_oversized_body_is_a_413(idle):
    # no 1 MiB floor (issue 45): 64 bytes a token of context and 64 KiB for the JSON around it
    assert default_max_body_bytes(64) == 64 * 64 + 2 ** 16 and default_max_body_bytes(2 ** 16) == 64 * 2 ** 16 + 2 ** 16
    assert default_max_body_bytes(64, vision=True) > 32 * 2 ** 20     # one image's data URL fits
    r = idle[1].post("/v1/completions", json={**PROMPT, "prompt": "s" + "1" * 2 ** 17 + "="})
    err = _error(r, 413)
    assert f"limit of {64 * 64 + 2 ** 16} bytes" in err["message"] and "--max-body-bytes" in err["message"]


def test_a_long_prompt_is_refused_from_its_head_without_tokenizing_the_rest(idle, monkeypatch):
    """A text of more than 8 characters per token of context: only its head is tokenized before the 400
    (issue 45: 1 MB prompts were tokenized whole before the length check)."""
    sch, client = idle
    seen = []
    encode = sch.tokenizer.encode
    monkeypatch.setattr(sch.tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    r = client.post("/v1/completions", json={**PROMPT, "prompt": "s" + "1" * 60000 + "="})
    err = _error(r, 400)
    assert "its first 512 of 60002 characters" in err["message"] and err["param"] == "prompt"
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "1" * 60000}]})
    assert "its first 512 of 60000 characters" in _error(r, 400)["message"]
    assert seen and max(seen) == 512, seen


# ------------------------------------------------------------------ real servers
def _half_request(port: int) -> socket.socket:
    """A socket that sent a request's headers and half its body."""
    body = b'{"model": "dgemma-tiny-digits", "prompt": "s9350814272=", "max_tokens": 16}'
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n" % len(body) + body[:len(body) // 2])
    return s


def _read_response(s: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            part = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not part:
            break
        out += part
    return out


def _long_request(srv, box):
    """A request that runs ~20 s on one slot (16 choices one after the other, each never confident: 1024
    steps a canvas, ~1 s); its outcome goes into box."""
    cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        box["result"] = cl.completions.create(model=MODEL, prompt="s9350814272=", seed=0, n=16, extra_body={
            "max_denoising_steps": 1024, "confidence_threshold": 0.0})
    except Exception as e:  # noqa: BLE001 - what the client saw is the result
        box["result"] = e


def _wait_busy(srv, box):
    deadline = time.monotonic() + 60
    while srv.health()["busy_slots"] < 1:
        assert time.monotonic() < deadline and "result" not in box, box
        time.sleep(0.05)


def test_a_large_prompt_does_not_stall_health_and_sigterm_ignores_a_half_sent_request():
    """A 4 MB prompt (the body limit raised to let it in) is tokenized off the event loop: /health
    answers within 1.5 s throughout (before, it waited for the whole tokenization: seconds). Then a client that sent half a
    request does not keep SIGTERM from finishing: its request gets 503, the server exits 0."""
    srv = ServerProcess("--slots", "1", "--max-body-bytes", str(32 * 2 ** 20))
    try:
        box = {}

        def big():
            box["r"] = httpx.post(srv.url + "/v1/completions", timeout=120,
                                  json={**PROMPT, "prompt": "s" + "1" * 4 * 2 ** 20 + "="})

        t = threading.Thread(target=big)
        t.start()
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=30).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
        t.join()
        assert box["r"].status_code == 400 and "exceeds this server's context" in box["r"].text
        assert worst < 1.5, f"/health took {worst:.2f} s while the large prompt was tokenized"

        half = _half_request(srv.port)
        time.sleep(0.3)
        srv.terminate()
        assert srv.proc.wait(20) == 0
        answer = _read_response(half)
        assert answer.startswith(b"HTTP/1.1 503") and b"stopped waiting for this request's body" in answer, answer
    finally:
        srv.stop()
    assert "Traceback" not in srv.log() and "CancelledError" not in srv.log()


def test_a_second_sigterm_exits_at_once_and_an_oversized_body_gets_413_over_a_socket():
    srv = ServerProcess("--slots", "1", "--max-steps", "1024")   # no --drain-seconds: drain until they finish
    try:
        limit = default_max_body_bytes(256)   # the bundled model's context
        for extra in ({}, {"transfer-encoding": "chunked"}):   # by its content-length, or as it arrives
            body = b'{"prompt": "' + b"1" * (limit + 10) + b'"}'
            content = body if not extra else iter([body[i:i + 65536] for i in range(0, len(body), 65536)])
            r = httpx.post(srv.url + "/v1/completions", content=content, timeout=30,
                           headers={"content-type": "application/json", **extra})
            assert r.status_code == 413 and f"limit of {limit} bytes" in r.json()["error"]["message"], r.text
        box = {}
        t = threading.Thread(target=_long_request, args=(srv, box))
        t.start()
        _wait_busy(srv, box)
        srv.terminate()
        time.sleep(2.0)
        assert srv.proc.poll() is None          # draining: the generation is still running
        t0 = time.monotonic()
        srv.terminate()
        assert srv.proc.wait(20) == 1
        assert time.monotonic() - t0 < 15
        t.join(60)
        assert isinstance(box["result"], Exception)   # its client learns it was cut short
    finally:
        srv.stop()
    assert "a second signal: exiting without waiting for 1 running" in srv.log()
    assert "Traceback" not in srv.log() and "CancelledError" not in srv.log()


def test_drain_seconds_ends_a_running_request_with_503_and_no_traceback():
    srv = ServerProcess("--slots", "1", "--max-steps", "1024", "--drain-seconds", "3")
    try:
        box = {}
        t = threading.Thread(target=_long_request, args=(srv, box))
        t.start()
        _wait_busy(srv, box)
        half = _half_request(srv.port)
        time.sleep(0.3)
        t0 = time.monotonic()
        srv.terminate()
        assert _read_response(half).startswith(b"HTTP/1.1 503")   # at once, not after the drain time
        assert time.monotonic() - t0 < 2.5
        # while it drains the server still answers /health (503 "draining") and refuses new requests
        r = httpx.get(srv.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "draining" and r.json()["busy_slots"] == 1
        r = httpx.post(srv.url + "/v1/completions", json=PROMPT, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
        assert srv.proc.wait(30) == 1      # the drain time cut a request short: not a clean exit
        t.join(60)
        assert isinstance(box["result"], openai.InternalServerError) and box["result"].status_code == 503
        assert "drain time" in str(box["result"])
    finally:
        srv.stop()
    assert "Traceback" not in srv.log() and "CancelledError" not in srv.log()
    assert "the drain time (--drain-seconds 3) ran out" in srv.log()


# ------------------------------------------------------------------ images
def test_the_bundled_vision_model_takes_an_image_over_http():
    """`dgemma serve --checkpoint bundled:dgemma-tiny-vision-digits` (no chat template): a user message
    with an image part and the instruction is answered as `DiffusionGemma.chat` answers it, and the
    server's image checks answer 400s."""
    srv = ServerProcess("--checkpoint", "bundled:dgemma-tiny-vision-digits", "--slots", "1")
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        digits = os.path.join(ROOT, "examples", "digits.png")
        with open(digits, "rb") as f:
            url = "data:image/png;base64," + base64.b64encode(f.read()).decode()

        def ask(parts):
            return cl.chat.completions.create(model="dgemma-tiny-vision-digits", seed=0, max_tokens=8,
                                              messages=[{"role": "user", "content": parts}])

        image = {"type": "image_url", "image_url": {"url": url}}
        r = ask([image, {"type": "text", "text": "sort the digits in the image"}])
        assert r.choices[0].message.content == "0159"
        cfg, _, _, tok = load_bundled("dgemma-tiny-vision-digits")
        ids, _, _ = prompt_with_images(cfg, tok, "sort the digits in the image", [digits])
        assert r.usage.prompt_tokens == ids.shape[1]       # the library's prompt: BOS, the image, the text
        r = ask([image, {"type": "text", "text": "read the digits in the image"}])
        assert sorted(r.choices[0].message.content) == list("0159")
        with pytest.raises(openai.BadRequestError, match="media type is 'text/plain'"):
            ask([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}},
                 {"type": "text", "text": "sort the digits in the image"}])
        with pytest.raises(openai.BadRequestError, match="reads no local image files"):
            ask([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
                 {"type": "text", "text": "sort the digits in the image"}])
        with pytest.raises(openai.BadRequestError, match="not an image Pillow can read"):
            ask([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
                 {"type": "text", "text": "sort the digits in the image"}])
        assert srv.health()["busy_slots"] == 0
    finally:
        srv.stop()


def test_a_lower_priority_value_is_admitted_first_and_equal_ones_in_arrival_order(idle):
    """vLLM's `priority` (issue 45): the free slot goes to the waiting sequence with the lowest value."""
    sch, client = idle
    ids = sch.tokenizer.encode("s12=", add_bos=True)
    reqs = [Request(ids, 8, sch.default_sampler, i, lambda ev: None, priority=p) for i, p in enumerate((0, 3, -2, 0))]
    try:
        sch.submit_many(reqs)
        order = []
        for _ in reqs:
            sch._admit()
            order.append(sch.plan.busy[0].request.seed)
            sch.plan.busy[0] = None
        assert order == [2, 0, 3, 1]
    finally:
        with sch._cond:
            sch.plan.queue.clear()
            sch.plan.busy = [None] * sch.slots
    err = _error(client.post("/v1/completions", json={**PROMPT, "priority": "high"}), 400)
    assert err["param"] == "priority"
