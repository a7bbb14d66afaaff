"""The step-level engine as users meet it (issue 32): fairness between fast and slow requests, a long
prompt admitted without stalling the others, prefix reuse with `cached_tokens`, and per-step
previews, through the official `openai` client against a real server with the bundled model."""

import concurrent.futures as cf
import time

import pytest

from tests.helpers.serve import module_server

MODEL = "dgemma-tiny-digits"
SLOW = dict(max_denoising_steps=48, confidence_threshold=0.0)   # never confident: every canvas runs 48 steps


def _sorted(prompt: str) -> str:
    return "".join(sorted(prompt[1:-1]))


server = module_server("--slots", "4", "--max-steps", "64", "--prefill-chunk", "16")


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


def _complete(client, prompt, seed, max_tokens=16, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, seed=seed, max_tokens=max_tokens, extra_body=extra)


def _wait_busy(server, n, timeout=60):
    deadline = time.monotonic() + timeout
    while server.health()["busy_slots"] < n:
        assert time.monotonic() < deadline, "the slow requests never took their slots"
        time.sleep(0.05)


def test_a_fast_request_is_not_held_back_by_slow_ones(server, client):
    """Fairness: a request whose canvases settle in a few steps, beside three that run 48 steps a canvas,
    takes the same number of ticks as alone (within 1.5x); a whole-canvas round would hold it for
    every slow canvas."""
    alone = _complete(client, "s705182936=", seed=4)
    assert alone.choices[0].text == _sorted("s705182936=")
    ticks_alone = alone.usage.model_extra["ticks"]
    assert ticks_alone <= 3 * alone.usage.model_extra["canvases"] + 2
    with cf.ThreadPoolExecutor(3) as pool:
        slow = [pool.submit(_complete, client, p, 10 + i, 24, **SLOW)
                for i, p in enumerate(["s31415926535=", "s8877665544332211=", "s2718281828459="])]
        _wait_busy(server, 3)
        fast = _complete(client, "s705182936=", seed=4)
        slow = [f.result() for f in slow]
    assert fast.choices[0].text == alone.choices[0].text
    ticks = fast.usage.model_extra["ticks"]
    assert ticks <= 1.5 * ticks_alone, (ticks, ticks_alone)
    first, last = fast.usage.model_extra["tick_range"]
    for s in slow:   # the slow ones really ran beside it, for far longer
        assert s.usage.model_extra["denoising_steps"] == 48 * s.usage.model_extra["canvases"]
        s_first, s_last = s.usage.model_extra["tick_range"]
        assert s_first <= first and last < s_last


def test_a_long_prompt_admitted_meanwhile_stalls_no_other_slot(server, client):
    """Admission: a 200-token prompt goes in 16 tokens a tick while two requests decode; each of those
    (a prompt of one chunk) still makes one denoising step on every tick it holds its slot."""
    long_prompt = "s" + "9876543210" * 19 + "="
    forced = dict(max_denoising_steps=64, confidence_threshold=0.0)   # 2 canvases x 64 steps each
    with cf.ThreadPoolExecutor(2) as pool:
        decoding = [pool.submit(_complete, client, p, 20 + i, 16, **forced)
                    for i, p in enumerate(["s31415926535=", "s705182936="])]
        _wait_busy(server, 2)
        long = _complete(client, long_prompt, seed=1, max_tokens=8)
        decoding = [f.result() for f in decoding]
    assert long.usage.prompt_tokens == len(long_prompt) + 1
    # its chunks: what its slot did not hold already (a reused beginning, here "<bos>s" at most)
    chunks = -(-(long.usage.prompt_tokens - long.usage.prompt_tokens_details.cached_tokens) // 16)
    assert chunks >= 12
    l_first, _ = long.usage.model_extra["tick_range"]
    for d in decoding:
        extra = d.usage.model_extra
        first, last = extra["tick_range"]
        assert first < l_first and l_first + chunks <= last, (first, last, l_first)   # decoding all through it
        assert extra["ticks"] == extra["denoising_steps"] == 128    # and a step on every one of its ticks
    assert long.usage.model_extra["ticks"] == chunks + long.usage.model_extra["denoising_steps"] - 1


def test_previews_come_every_step_and_the_committed_text_is_unchanged(client):
    msg = [{"role": "user", "content": "s8877665544332211="}]
    full = client.chat.completions.create(model=MODEL, messages=msg, seed=6)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msg, seed=6, stream=True,
                                                  stream_options={"include_usage": True, "include_provisional": True}))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    previews = [c.choices[0].delta.model_extra.get("provisional") for c in chunks if c.choices]
    previews = [p for p in previews if p is not None]
    assert content == full.choices[0].message.content == _sorted("s8877665544332211=")
    steps = chunks[-1].usage.model_extra["denoising_steps"]
    assert steps == full.usage.model_extra["denoising_steps"] and len(previews) >= steps
    assert any(p for p in previews)
    plain = list(client.chat.completions.create(model=MODEL, messages=msg, seed=6, stream=True))
    assert not any(c.choices[0].delta.model_extra.get("provisional") is not None for c in plain if c.choices)
    streamed = list(client.completions.create(model=MODEL, prompt="s705182936=", seed=2, stream=True,
                                              stream_options={"include_provisional": True}))
    assert "".join(c.choices[0].text for c in streamed) == _sorted("s705182936=")
    assert sum(c.choices[0].model_extra.get("provisional") is not None for c in streamed) >= 2


plain_server = module_server("--slots", "2", "--max-steps", "64", "--no-prefix-reuse")


def test_a_second_turn_reuses_the_first_from_the_cache(client, plain_server):
    """Prefix reuse: the second turn (the first turn's prompt and answer, then a new question) finds them
    in its slot (`cached_tokens`) and answers exactly as a server that prefills everything. The bundled
    model has no chat template, so the turns go as completions: its vocabulary cannot spell the EOS
    that ended the answer, so the match stops one token short of prompt + completion tokens (with the
    EOS in the prompt it covers all of them: tests/test_serving_slots.py)."""
    plain = plain_server.client(timeout=300)
    first = _complete(client, "s9350814272=", seed=3)
    answer = first.choices[0].text
    assert answer == _sorted("s9350814272=")
    turn2 = "s9350814272=" + answer + "s31415926535="
    second = _complete(client, turn2, seed=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens + first.usage.completion_tokens - 1, (cached, first.usage)
    without = _complete(plain, turn2, seed=8)
    assert without.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].text == without.choices[0].text
    assert second.usage.model_extra["denoising_steps"] == without.usage.model_extra["denoising_steps"]
