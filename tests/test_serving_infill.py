"""`suffix` on /v1/completions (OpenAI's field; issue 47): the answer is the middle between the prompt
and the suffix, by the library's `Engine.infill` (the suffix pinned on the canvas after the middle).
Through the official `openai` client, in-process on an unstarted scheduler of the bundled model
(infill runs outside the slots, so nothing but its own programs compiles)."""

import openai
import pytest
from fastapi.testclient import TestClient

import dgemma_jax as dg
from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.serving.scheduler import Scheduler
from dgemma_jax.serving.server import create_app

MODEL = "dgemma-tiny-digits"
# prefix | middle | suffix of the sorted digits, the prefix ending on a canvas boundary (tests/test_infill.py)
CASES = [("s6596842182=", 0, 7), ("s4716497287=", 8, 9)]


@pytest.fixture(scope="module")
def client():
    cfg, params, sampler, tok = load_bundled()
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=64, max_queue=4)
    http = TestClient(create_app(sch, MODEL))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_suffix_gives_the_middle_the_library_gives_and_the_suffix_once_at_the_end(client):
    model = dg.DiffusionGemma.from_pretrained()
    for p, i, j in CASES:
        answer = "".join(sorted(p[1:-1]))
        prompt, suffix = p + answer[:i], answer[j:]
        r = client.completions.create(model=MODEL, prompt=prompt, suffix=suffix, seed=0, max_tokens=8)
        middle = r.choices[0].text
        assert middle == answer[i:j], (p, middle)
        assert (prompt + middle + suffix).endswith(suffix) and suffix not in middle
        assert middle == model.generate(prompt, suffix=suffix, max_new_tokens=8, seed=0)
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.completion_tokens == len(middle) and r.usage.model_extra["denoising_steps"] > 0


def test_suffix_refuses_what_it_cannot_honour_by_name(client):
    ask = dict(model=MODEL, prompt="s12=", seed=0, max_tokens=8)
    for extra, param in ((dict(suffix=""), "suffix"), (dict(suffix="9", n=2), "n"),
                         (dict(suffix="9", stop=["x"]), "stop"), (dict(suffix="9", max_tokens=200), "max_tokens"),
                         (dict(suffix="9", extra_body=dict(response_format={"type": "json_object"})),
                          "response_format")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**ask, **extra})
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="stream cannot go with suffix"):
        client.completions.create(**ask, suffix="9", stream=True)
