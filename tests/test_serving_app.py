"""The HTTP layer on its own: chat rendering with the Gemma 4 template, thinking split into
`reasoning_content`, streamed deltas per canvas. A scripted scheduler plays the model's outputs
(real token ids of a Gemma-like tokenizer, decoded as the real scheduler decodes them)."""

import json
import threading
import types

import pytest
from fastapi.testclient import TestClient

from dgemma_jax.io.chat import render_chat
from dgemma_jax.io.tokenizer import load_tokenizer
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.serving import text as text_lib
from dgemma_jax.serving.metrics import Metrics
from dgemma_jax.serving.output import SeqEvent
from dgemma_jax.serving.server import create_app
from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

L = 8


class ScriptedScheduler:
    """Answers every choice with `script` (text), one canvas of L token ids per event."""

    def __init__(self, tok, script):
        self.tokenizer, self.script, self.requests = tok, script, []
        self.default_sampler = SamplerConfig(canvas_length=L, max_denoising_steps=16, eos_ids=(1, 106))
        self.engine = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=tok.vocab_size),
                                            sampler=self.default_sampler.replace(max_denoising_steps=64))
        self.canvas_length, self.context, self.error, self.max_queue = L, 4096, None, 256
        self.metrics = Metrics(self.status)

    def default_max_tokens(self, prompt_len, limit):
        return limit

    def submit(self, req):
        self.requests.append(req)
        ids = self.tokenizer.encode(self.script)

        def play():
            for i in range(req.n):
                for c in range(0, len(ids), L):
                    text, hit = text_lib.cut_at_stop(self.tokenizer.decode(ids[:c + L], skip_special=not req.keep_special),
                                                     req.stop)
                    done = hit or c + L >= len(ids)
                    req.on_event(SeqEvent(i, text, min(c + L, len(ids)), 2 * (c // L + 1), c // L + 1,
                                          "stop" if done else None))
                    if done:
                        break

        threading.Thread(target=play).start()
        return req

    def submit_many(self, reqs):
        return [self.submit(r) for r in reqs]

    def status(self):
        return {"slots": 1, "busy_slots": 0, "queued": 0, "worker_alive": True, "stopping": False}

    def close(self):
        pass

    def pending(self):
        return 0

    def stop(self):
        pass


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma_like")
    gemma_like_tokenizer_json(d / "tokenizer.json")
    return load_tokenizer(d)


def _client(sched):
    return TestClient(create_app(sched, "tiny-gemma"))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6*7?"},
            {"role": "assistant", "content": "<|channel>thought\nold thoughts<channel|>Earlier answer."},
            {"role": "user", "content": "And 7*6?"}]


@pytest.mark.parametrize("thinking", [False, True])
def test_chat_prompt_is_the_gemma4_template_of_the_history_without_thinking(tok, thinking):
    sched = ScriptedScheduler(tok, "42<turn|>")
    body = {"messages": MESSAGES, "seed": 1}
    if thinking:
        body["chat_template_kwargs"] = {"enable_thinking": True}
    r = _client(sched).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    history = MESSAGES[:2] + [{"role": "assistant", "content": "Earlier answer."}] + MESSAGES[3:]
    want = tok.encode(render_chat(history, add_generation_prompt=True, enable_thinking=thinking))
    assert list(sched.requests[0].prompt_ids) == want
    assert r.json()["usage"]["prompt_tokens"] == len(want)
    assert "old thoughts" not in tok.decode(want)            # earlier thinking is never fed back


def test_thinking_comes_back_as_reasoning_content(tok):
    script = "<|channel>thought\nsix sevens are forty-two<channel|>It is 42.<turn|>"
    r = _client(ScriptedScheduler(tok, script)).post("/v1/chat/completions", json={
        "messages": MESSAGES[1:2], "chat_template_kwargs": {"enable_thinking": True}})
    msg = r.json()["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "It is 42.", "reasoning_content": "six sevens are forty-two"}
    r = _client(ScriptedScheduler(tok, "It is 42.<turn|>")).post("/v1/chat/completions",
                                                                  json={"messages": MESSAGES[1:2]})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is 42."}


def test_streamed_reasoning_then_content_add_up_to_the_whole_answer(tok):
    script = "<|channel>thought\nsix sevens are forty-two, surely<channel|>It is 42, as always.<turn|>"
    with _client(ScriptedScheduler(tok, script)).stream("POST", "/v1/chat/completions", json={
            "messages": MESSAGES[1:2], "stream": True, "n": 2,
            "chat_template_kwargs": {"enable_thinking": True}}) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    for i in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"][0]["index"] == i]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "six sevens are forty-two, surely"
        assert "".join(d.get("content", "") for d in deltas) == "It is 42, as always."
        assert len(deltas) >= 4                                # several canvases, streamed as they land
        first_content = next(k for k, d in enumerate(deltas) if d.get("content"))
        assert not any(d.get("reasoning_content") for d in deltas[first_content + 1:])   # the thought ends first
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_stop_string_split_across_canvases_is_never_streamed(tok):
    script = "alpha beta gam STOP delta<turn|>"   # one token per byte: "S" ends canvas 2, "TOP" opens canvas 3
    with _client(ScriptedScheduler(tok, script)).stream("POST", "/v1/completions", json={
            "prompt": "x", "stream": True, "stop": "STOP"}) as r:
        pieces = [json.loads(ln[6:])["choices"][0]["text"] for ln in r.iter_lines() if ln.startswith("data: {")]
    assert "".join(pieces) == "alpha beta gam "       # the "S" held back at canvas 2 was never sent
