"""Structured output from the CLI (`dgemma generate --json-schema FILE / --regex`) and the server
(`response_format` through the official `openai` client), on a random-weight Hugging Face-format
checkpoint with a real subword tokenizer (tests/helpers/subword_tokenizer.py): noise answers, valid by
the constraint alone. Slow tier (a server process and CLI runs)."""

import concurrent.futures
import dataclasses
import json
import re

import httpx
import jsonschema
import openai
import pytest

from dgemma_jax import ModelConfig, init_params, save_hf
from tests.helpers.serve import ServerProcess
from tests.helpers.subword_tokenizer import subword_tokenizer_json
from tests.test_cli import _one_line_error as error_line, dgemma
from tests.test_structured import SCHEMAS

CFG = dataclasses.replace(ModelConfig.preset("tiny-2layer"), vocab_size=400)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured_ckpt")
    save_hf(init_params(CFG, 1), CFG, path, canvas_length=16, generation_config={
        "max_denoising_steps": 4, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
        "confidence_threshold": 0.005, "sampler_config": {"entropy_bound": 0.1}, "eos_token_id": [1],
        "pad_token_id": 0})
    subword_tokenizer_json(path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = ServerProcess("--checkpoint", str(checkpoint), "--slots", "3", "--max-steps", "4",
                        "--served-model-name", "noise")
    yield srv
    srv.stop()


def test_cli_json_schema_and_regex(checkpoint, tmp_path):
    schema = SCHEMAS["nested_required_optional"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    for seed in ("0", "1"):
        r = dgemma("generate", "--checkpoint", str(checkpoint), "--prompt", "A person:", "--json-schema", str(f),
                   "--max-new-tokens", "96", "--seed", seed)
        assert r.returncode == 0, r.stderr[-2000:]
        jsonschema.validate(json.loads(r.stdout), schema)
        assert "finish_reason stop" in r.stderr
    r = dgemma("generate", "--checkpoint", str(checkpoint), "--prompt", "code:", "--regex", "[0-9]{3}-[a-z]{2,4}",
               "--max-new-tokens", "32", "--quiet")
    assert r.returncode == 0 and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", r.stdout.strip()), r.stderr[-2000:]
    r = dgemma("generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--regex", "[a-")
    assert "--regex: the regex cannot be compiled by llguidance" in error_line(r) and "unclosed" in error_line(r)
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "strin"}')
    r = dgemma("generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--json-schema", str(bad))
    assert "Invalid type: strin" in error_line(r)
    r = dgemma("generate", "--checkpoint", str(checkpoint), "--prompt", "x", "--json-schema", str(f), "--regex", "a")
    assert "not both" in error_line(r)


def test_openai_client_response_format(server):
    client = server.client(timeout=120)
    for name in ("arrays_enums", "numbers", "array_of_objects"):
        schema = SCHEMAS[name]
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        r = client.chat.completions.create(model="noise", messages=[{"role": "user", "content": "JSON:"}],
                                           response_format=rf, seed=3, max_tokens=96, n=2)
        assert len(r.choices) == 2
        for c in r.choices:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.message.content), schema)
        again = client.chat.completions.create(model="noise", messages=[{"role": "user", "content": "JSON:"}],
                                               response_format=rf, seed=3, max_tokens=96, n=2)
        assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    r = client.completions.create(model="noise", prompt=["one", "two"], seed=1, max_tokens=96,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert len(r.choices) == 2 and all(isinstance(json.loads(c.text), dict) for c in r.choices)
    assert r.usage.completion_tokens > 0
    plain = client.completions.create(model="noise", prompt="one", seed=1, max_tokens=16,
                                      extra_body={"response_format": {"type": "text"}})
    assert plain.choices[0].finish_reason in ("stop", "length")   # {"type": "text"}: no constraint


def test_bad_response_format_is_a_400_naming_the_problem(server):
    client = server.client(timeout=60)
    msgs = [{"role": "user", "content": "x"}]
    cases = [
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "strin"}}}, "Invalid type: strin"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {"type": "string"}}}},
         "Unimplemented keys"),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "("}}},
         "unclosed group"),
        ({"type": "json_schema", "json_schema": {"name": "s"}}, '"json_schema": {"name": ..., "schema"'),
        ({"type": "yaml"}, 'must be "json_object" or "json_schema"'),
    ]
    for rf, problem in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="noise", messages=msgs, response_format=rf)
        err = e.value.body
        assert problem in err["message"] and err["param"] == "response_format", err
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "stream": True,
                                                         "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "stream" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "response_format": "json"})
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"]


def test_a_structured_answer_is_the_same_alone_and_in_a_shared_batch(server):
    # structured requests run in the slots beside the others (Request.grammar): the same request gives
    # the same answer alone and while a plain request and another structured one share the batch
    client = server.client(timeout=180)
    msgs = [{"role": "user", "content": "JSON:"}]

    def structured(name, seed):
        rf = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
        r = client.chat.completions.create(model="noise", messages=msgs, response_format=rf, seed=seed, max_tokens=64)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[name])
        return r.choices[0].message.content, r.choices[0].finish_reason

    alone = structured("numbers", 5)
    # a long plain request (never confident: every canvas takes the 4 steps), in its slot before the others come
    plain = client.completions.create(model="noise", prompt="one two", seed=2, max_tokens=160, stream=True,
                                      extra_body={"confidence_threshold": 0.0,
                                                  "stream_options": {"include_provisional": True}})
    chunks = iter(plain)
    next(chunks)   # its first preview: it holds a slot and has taken a denoising step
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(structured, "arrays_enums", 9)
        shared = pool.submit(structured, "numbers", 5)
        assert shared.result() == alone
        other.result()
    rest = [c for c in chunks if c.choices]
    assert rest and rest[-1].choices[0].finish_reason in ("stop", "length")
