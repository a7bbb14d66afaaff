"""`dgemma serve` as users meet it: a real server process on 127.0.0.1 with the bundled model,
driven by the official `openai` client (and raw HTTP for what a client library would not send)."""

import concurrent.futures as cf
import json
import threading
import time

import httpx
import openai
import pytest

from tests.helpers.serve import ServerProcess, module_server

MODEL = "dgemma-tiny-digits"


def _sorted(prompt: str) -> str:
    return "".join(sorted(prompt[1:-1]))


PROMPTS = ["s9350814272=", "s31415926535=", "s8877665544332211=", "s705182936=", "s5550123498761=",
           "s2718281828459=", "s90807060504=", "s123456789="]


server = module_server("--slots", "8", "--max-queue", "40", "--max-steps", "1024")


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    assert h["status"] == "ok" and h["slots"] == 8 and h["busy_slots"] == 0 and h["context"] == 256
    assert h["memory"]["slot_tick"]["argument_size_in_bytes"] > 0   # compiled at startup, memory reported


def test_completions_sort_digits_and_count_usage(client):
    for i, p in enumerate(PROMPTS[:4]):
        r = client.completions.create(model=MODEL, prompt=p, seed=i, max_tokens=32)
        assert r.choices[0].text == _sorted(p) and r.choices[0].finish_reason == "stop"
        u = r.usage
        assert u.prompt_tokens == len(p) + 1                          # BOS + characters
        assert u.completion_tokens == len(_sorted(p)) + 1             # the digits and the EOS
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        extra = u.model_extra
        assert extra["denoising_steps"] >= extra["canvases"] >= -(-u.completion_tokens // 8)
        assert extra["tokens_per_forward"] == pytest.approx(u.completion_tokens / extra["denoising_steps"], abs=1e-3)


def test_chat_streaming_equals_non_streaming(client):
    msg = [{"role": "user", "content": PROMPTS[2]}]
    full = client.chat.completions.create(model=MODEL, messages=msg, seed=3)
    assert full.choices[0].message.content == _sorted(PROMPTS[2])
    assert full.choices[0].message.role == "assistant" and full.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=msg, seed=3, stream=True,
                                                  stream_options={"include_usage": True}))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(pieces) == full.choices[0].message.content
    assert len(pieces) >= 2                             # one chunk per committed canvas (17 tokens: 3 canvases)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_completion_streaming_and_stop_strings(client):
    text = "".join(c.choices[0].text for c in client.completions.create(model=MODEL, prompt=PROMPTS[0], seed=1,
                                                                        stream=True))
    assert text == _sorted(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], seed=1, stop=["45"])
    assert r.choices[0].text == "01223" and r.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], seed=1, stop="45", stream=True))
    assert "".join(c.choices[0].text for c in streamed) == "01223"


def test_n_choices_and_prompt_lists(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], n=3, seed=9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.message.content == _sorted(PROMPTS[1]) for c in r.choices)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, seed=4)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [_sorted(PROMPTS[0])] * 2 + [_sorted(PROMPTS[1])] * 2


def test_max_tokens_and_sampler_knobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], seed=2, max_tokens=8)
    assert r.choices[0].finish_reason == "length" and r.choices[0].text == _sorted(PROMPTS[2])[:8]
    assert r.usage.completion_tokens == 8
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], seed=2,
                                  extra_body={"max_denoising_steps": 2, "t_max": 0.9, "t_min": 0.3})
    assert r.usage.model_extra["denoising_steps"] <= 2 * r.usage.model_extra["canvases"]


def test_a_request_alone_equals_it_among_three_others(client):
    """Same seed, alone or batched with three other prompts of other lengths: the same tokens."""
    def ask(p, seed):
        r = client.completions.create(model=MODEL, prompt=p, seed=seed, max_tokens=24)
        return r.choices[0].text, r.usage.model_extra["denoising_steps"]

    alone = ask(PROMPTS[4], 77)
    with cf.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(ask, p, 5 + i) for i, p in enumerate((PROMPTS[2], PROMPTS[5], PROMPTS[7]))]
        again = pool.submit(ask, PROMPTS[4], 77)
        assert again.result() == alone
        assert [o.result()[0] for o in others] == [_sorted(p) for p in (PROMPTS[2], PROMPTS[5], PROMPTS[7])]


def test_load_64_requests_from_16_clients_equal_one_at_a_time(server, client):
    """Bounded load over loopback: every request completes once, with the tokens it gets alone."""
    jobs = [(PROMPTS[i % len(PROMPTS)], 1000 + i) for i in range(64)]

    def ask(job):
        r = client.completions.create(model=MODEL, prompt=job[0], seed=job[1], max_tokens=24)
        return r.id, r.choices[0].text, r.usage.model_extra["denoising_steps"]

    serial = [ask(j) for j in jobs]
    with cf.ThreadPoolExecutor(16) as pool:
        loaded = list(pool.map(ask, jobs))
    assert len({r[0] for r in serial + loaded}) == 128                     # none duplicated
    assert [r[1:] for r in loaded] == [r[1:] for r in serial]              # none lost or changed
    assert sum(r[1] == _sorted(j[0]) for r, j in zip(loaded, jobs)) >= 63
    h = server.health()
    assert h["busy_slots"] == 0 and h["queued"] == 0


def _post(server, body, raw=None):
    return httpx.post(server.url + "/v1/completions", content=raw, json=None if raw else body, timeout=30,
                      headers={"content-type": "application/json"})


def test_client_mistakes_get_clear_4xx_errors(server, client):
    r = _post(server, None, raw=b'{"prompt": "s1=", ')
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = _post(server, {"prompt": "s1=", "frequency_penaltyy": 1})
    assert r.status_code == 400 and "frequency_penaltyy" in r.json()["error"]["message"]
    r = _post(server, {"prompt": "s1=", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="context of 256 tokens"):
        client.completions.create(model=MODEL, prompt="s" + "1" * 300 + "=")
    with pytest.raises(openai.BadRequestError, match="at most"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="not in the vocabulary"):
        client.completions.create(model=MODEL, prompt="hello")
    with pytest.raises(openai.BadRequestError, match="t_max"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0.2)
    with pytest.raises(openai.BadRequestError, match="canvases of 8"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"canvas_length": 16})
    with pytest.raises(openai.BadRequestError, match="budget of 1024"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], extra_body={"max_denoising_steps": 1025})
    with pytest.raises(openai.BadRequestError, match="one\\s+user message"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be nice"},
                                                              {"role": "user", "content": PROMPTS[0]}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPTS[0])
    with pytest.raises(openai.BadRequestError, match="more than this server's queue holds \\(40"):
        client.completions.create(model=MODEL, prompt=PROMPTS[0], n=41)   # can never fit: not a retryable 429
    # nothing leaked: the server is idle and answers again
    assert server.health()["busy_slots"] == 0
    assert client.completions.create(model=MODEL, prompt=PROMPTS[3], seed=0).choices[0].text == _sorted(PROMPTS[3])


def test_clients_that_disconnect_mid_stream_free_their_slots(server, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[2]}], "stream": True,
            "max_denoising_steps": 1024, "confidence_threshold": 0.0}   # never confident: 1024 steps a canvas
    before = server.health()["stats"]

    def open_and_drop(i):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "seed": i}, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    return json.loads(line[6:])["id"]   # leave after the first chunk

    with cf.ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(open_and_drop, range(16)))
    assert len(set(ids)) == 16
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = server.health()
        if h["busy_slots"] == 0 and h["queued"] == 0:
            break
        time.sleep(0.2)
    assert h["busy_slots"] == 0 and h["queued"] == 0, h
    cancelled = h["stats"].get("finished_cancelled", 0) - before.get("finished_cancelled", 0)
    # every one was cancelled: a queued one before it ran, a running one after its canvas in flight
    # (their answers need 3 canvases; run to the end they would have taken 48)
    assert cancelled == 16, h["stats"]
    assert h["stats"].get("slot_canvases", 0) - before.get("slot_canvases", 0) <= 16
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], seed=0)
    assert r.choices[0].message.content == _sorted(PROMPTS[0])


def test_sigterm_drains_open_requests_then_exits_cleanly():
    srv = ServerProcess("--slots", "2", "--max-steps", "64")
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        started = threading.Barrier(7)

        def ask(i):
            started.wait()
            r = cl.completions.create(model=MODEL, prompt=PROMPTS[i], seed=i, max_tokens=24,
                                      extra_body={"max_denoising_steps": 64, "confidence_threshold": 0.0})
            return r.choices[0].text

        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(ask, i) for i in range(6)]
            started.wait()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:    # all 6 accepted: 2 running, 4 queued
                h = srv.health()
                if h["busy_slots"] + h["queued"] + h["stats"].get("finished_stop", 0) >= 6:
                    break
                time.sleep(0.05)
            assert h["busy_slots"] >= 1, h        # SIGTERM lands while requests are in flight
            srv.terminate()
            texts = [f.result(timeout=120) for f in futs]
        assert texts == [_sorted(PROMPTS[i]) for i in range(6)]
        assert srv.proc.wait(60) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(srv.url + "/health", timeout=2)
    finally:
        srv.stop()


def test_an_int8_server_sorts_digits_and_reports_less_memory(server):
    """`dgemma serve --quantize int8`: the bundled model's kernels quantized on load still sort digits
    (its held-out accuracy with int8 weights: benchmarks/results/quant_quality.json)."""
    srv = ServerProcess("--slots", "2", "--quantize", "int8")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for i, p in enumerate(PROMPTS[:4]):
            r = c.completions.create(model=MODEL, prompt=p, seed=i, max_tokens=32)
            assert r.choices[0].text == _sorted(p), (p, r.choices[0].text)
        float_args = server.health()["memory"]["slot_tick"]["argument_size_in_bytes"]
        int8_args = srv.health()["memory"]["slot_tick"]["argument_size_in_bytes"]
        assert int8_args < float_args  # fewer slots and one byte per kernel weight
    finally:
        srv.stop()
    assert "Traceback" not in srv.log()
