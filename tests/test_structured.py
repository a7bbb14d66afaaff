"""Structured output (engine/grammar.py, engine/structured.py, the library's json_schema= / regex= /
response_format=) on a random-weight model with a real subword tokenizer (a byte-level BPE trained on
JSON and English, tests/helpers/subword_tokenizer.py): its answers are noise, so whatever validity they
have comes from the constraint alone."""

import dataclasses
import json
import re

import jsonschema
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine.grammar import compile_grammar, schema_of_response_format
from dgemma_jax.errors import DgemmaWarning
from dgemma_jax.io.tokenizer import load_tokenizer
from dgemma_jax.pipeline import DiffusionGemma
from dgemma_jax.sampling import SamplerConfig
from tests.helpers.subword_tokenizer import subword_tokenizer_json

CFG = dataclasses.replace(ModelConfig.preset("tiny-2layer"), vocab_size=400)   # the BPE's 400 tokens
BUDGET = 96

SCHEMAS = {
    "nested_required_optional": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                        "properties": {"city": {"type": "string", "maxLength": 8},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "arrays_enums": {
        "type": "object", "additionalProperties": False, "required": ["tags", "status"],
        "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                                "maxItems": 3},
                       "status": {"enum": ["active", "inactive", 3, None]}}},
    "numbers": {
        "type": "object", "additionalProperties": False, "required": ["score", "count", "ok"],
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                       "count": {"type": "integer", "minimum": -5, "maximum": 500},
                       "ok": {"type": "boolean"}}},
    "pattern_strings": {
        "type": "object", "additionalProperties": False, "required": ["id", "date"],
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]-[0-9]{2}$"},
                       "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                       "note": {"type": ["string", "null"], "maxLength": 6}}},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                  "properties": {"sku": {"type": "string", "maxLength": 5},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
}
REGEXES = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no|maybe)", r"#[0-9a-f]{6}", r"[A-Z][a-z]{1,6} [0-9]{1,2}"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    subword_tokenizer_json(path)
    return load_tokenizer(str(path))


@pytest.fixture(scope="module")
def model(tokenizer):
    sampler = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))
    return DiffusionGemma(CFG, init_params(CFG, 0), tokenizer, sampler)


def _check_schema(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("regex, problem", [("(", "unclosed group"), ("[a-", "unclosed character class"),
                                            ("(?<=a)b", "look-around")])
def test_a_bad_regex_is_one_line_naming_the_problem(tokenizer, regex, problem):
    with pytest.raises(ValueError) as e:
        compile_grammar(tokenizer, CFG.vocab_size, (1,), regex=regex)
    assert problem in str(e.value) and "regex" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("schema, problem", [
    ({"type": "strin"}, "Invalid type: strin"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum (5) is greater than maximum (2)"),
    ({"not": {"type": "string"}}, 'Unimplemented keys: ["not"]'),          # valid JSON schema, not supported
    ({"type": "string", "pattern": "(?<=a)b"}, "look-around"),
    ({"properties": {"a": {"$ref": "#/defs/missing"}}}, "/defs/missing"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_a_schema_that_cannot_be_compiled_is_refused_naming_the_problem(tokenizer, schema, problem):
    with pytest.raises(ValueError) as e:
        compile_grammar(tokenizer, CFG.vocab_size, (1,), json_schema=schema)
    assert problem in str(e.value) and "\n" not in str(e.value)


def test_response_format_and_argument_errors(tokenizer):
    assert schema_of_response_format({"type": "json_object"}) == (None, True)
    schema = SCHEMAS["numbers"]
    assert schema_of_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}) \
        == (schema, False)
    for bad, what in [({"type": "xml"}, "json_object"), ({"type": "json_schema"}, '"json_schema"'), ([], "object")]:
        with pytest.raises(ValueError, match=what):
            schema_of_response_format(bad)
    with pytest.raises(ValueError, match="exactly one"):
        compile_grammar(tokenizer, CFG.vocab_size, (1,), regex="a", json_object=True)
    with pytest.raises(ValueError, match="EOS"):
        compile_grammar(tokenizer, CFG.vocab_size, (), regex="a")


# ---------------------------------------------------------------------------------------- answers
# (slow: the first compiles the model's programs, ~15 s on 2 cores; each after it takes < 10 s)


@pytest.mark.slow
def test_the_library_refuses_two_constraints(model):
    with pytest.raises(ValueError, match="one of json_schema, regex or response_format"):
        model.generate("x", json_schema=SCHEMAS["numbers"], regex="a")


@pytest.mark.slow
def test_a_schema_and_a_regex_hold_on_noise(model):
    """One schema and one regex, two seeds each."""
    schema = SCHEMAS["nested_required_optional"]
    for seed in (0, 1):
        _check_schema(model.generate("Describe a person:", seed=seed, json_schema=schema, max_new_tokens=BUDGET),
                      schema)
        assert re.fullmatch(REGEXES[0], model.generate("code:", seed=seed, regex=REGEXES[0], max_new_tokens=32))


@pytest.mark.slow
@pytest.mark.parametrize("decoder", ["prefix", "dingo"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_answer_validates_across_seeds(model, name, decoder):
    """Each schema, 16 seeds over two prompts, under each constraint decoder ("dingo": the DP over the
    DFA of the schema's regex): every answer that ends ("stop") parses and validates; one that the
    budget cut ("length": a noise model may write digits without end in an unbounded number) is a
    valid prefix, and such answers are rare."""
    schema = SCHEMAS[name]
    grammar = model.grammar(json_schema=schema)
    tokens, lengths = model.encode_batch(["A record:", "JSON please"] * 8)
    out = model.engine.generate_structured(tokens, lengths, grammars=grammar, rng=list(range(16)),
                                           max_new_tokens=BUDGET, constraint_decoder=decoder)
    assert out.decoders == [decoder] * 16
    for ids, reason in zip(out.tokens, out.finish_reasons):
        if reason == "stop":
            _check_schema(model.tokenizer.decode(ids, skip_special=True), schema)
        else:
            assert reason == "length" and len(ids) == BUDGET and grammar.matcher().validate_tokens(ids) == BUDGET
    assert out.finish_reasons.count("stop") >= 14, out.finish_reasons


@pytest.mark.slow
def test_every_regex_answer_matches_across_seeds(model):
    for regex in REGEXES:
        for seeds in ([0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]):
            texts = model.generate(["a", "b c", "d e f", "g"], seed=seeds, regex=regex, max_new_tokens=32)
            for text in texts:
                assert re.fullmatch(regex, text), (regex, text)


@pytest.mark.slow
def test_dingo_answers_match_across_seeds(model):
    """constraint_decoder="dingo" (the DP over positions x the regex's DFA states): every regex, 16 seeds,
    every answer ends and matches; "any JSON object" has no DFA and keeps the prefix walk."""
    tokens, lengths = model.encode_batch(["a", "b c", "d e f", "g"] * 4)
    for regex in REGEXES:
        out = model.engine.generate_structured(tokens, lengths, grammars=model.grammar(regex=regex), rng=list(range(16)),
                                               max_new_tokens=32, constraint_decoder="dingo")
        assert out.decoders == ["dingo"] * 16 and out.finish_reasons == ["stop"] * 16
        for ids in out.tokens:
            assert re.fullmatch(regex, model.tokenizer.decode(ids, skip_special=True)), (regex, ids)
    text = model.generate("x", seed=1, regex=REGEXES[3], max_new_tokens=32, constraint_decoder="dingo")
    assert re.fullmatch(REGEXES[3], text)
    out = model.engine.generate_structured(tokens[:1, :lengths[0]], None, rng=0, max_new_tokens=BUDGET,
                                           grammars=model.grammar(response_format={"type": "json_object"}),
                                           constraint_decoder="dingo")
    assert out.decoders == ["prefix"]
    with pytest.raises(ValueError, match="constraint_decoder must be one of"):
        model.engine.generate_structured(tokens, lengths, grammars=model.grammar(regex="a"), constraint_decoder="x")


@pytest.mark.slow
def test_fixed_text_is_pinned_without_a_denoising_pass(model):
    """A literal regex is the grammar's forced text: pinned whole before any step (no pass at all); a
    schema's braces and keys are forced tokens too."""
    tokens, lengths = model.encode_batch(["x", "y"])
    out = model.engine.generate_structured(tokens, lengths, grammars=model.grammar(regex="Hello, world!"), rng=[0, 1],
                                           max_new_tokens=32)
    assert out.steps.sum() == 0 and out.finish_reasons == ["stop"] * 2
    assert [model.tokenizer.decode(t) for t in out.tokens] == ["Hello, world!"] * 2
    assert (out.forced == [len(t) for t in out.tokens]).all() and (out.repairs == 0).all()
    out = model.engine.generate_structured(tokens, lengths, grammars=model.grammar(json_schema=SCHEMAS["numbers"]),
                                           rng=[0, 1], max_new_tokens=BUDGET)
    assert (out.forced >= 3).all()      # '{"score":', '"count":', '"ok":' at least


@pytest.mark.slow
def test_json_object_response_format(model):
    """{"type": "json_object"}: any object (its strings unbounded, so a noise answer may run out of budget:
    then "length" and a valid prefix); {"type": "json_schema"}: the schema."""
    grammar = model.grammar(response_format={"type": "json_object"})
    tokens, lengths = model.encode_batch(["Anything:"] * 4)
    out = model.engine.generate_structured(tokens, lengths, grammars=grammar, rng=[3, 4, 5, 6], max_new_tokens=BUDGET)
    for ids, reason in zip(out.tokens, out.finish_reasons):
        if reason == "stop":
            assert isinstance(json.loads(model.tokenizer.decode(ids, skip_special=True)), dict)
        else:
            assert grammar.matcher().validate_tokens(ids) == len(ids) == BUDGET
    assert "stop" in out.finish_reasons
    schema = SCHEMAS["arrays_enums"]
    text = model.generate("x", seed=4, response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                                              "schema": schema}},
                          max_new_tokens=BUDGET)
    _check_schema(text, schema)


@pytest.mark.slow
def test_the_budget_running_out_is_finish_reason_length_with_a_valid_prefix(model, tokenizer):
    """A schema whose shortest answer is longer than the budget: "length", and the text is a valid prefix."""
    schema = {"type": "object", "required": ["a"], "additionalProperties": False,
              "properties": {"a": {"type": "string", "pattern": "^[0-9]{60}$"}}}
    grammar = model.grammar(json_schema=schema)
    tokens, lengths = model.encode_batch(["x"])
    out = model.engine.generate_structured(tokens, lengths, grammars=grammar, rng=0, max_new_tokens=16)
    assert out.finish_reasons == ["length"] and len(out.tokens[0]) == 16
    assert grammar.matcher().validate_tokens(out.tokens[0]) == 16     # every token a valid continuation
    with pytest.warns(DgemmaWarning, match="reached max_new_tokens=16 before the JSON schema was complete"):
        text = model.generate("x", seed=0, json_schema=schema, max_new_tokens=16)
    assert text.startswith('{"a":"')


@pytest.mark.slow
def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_batch(model):
    schema = SCHEMAS["array_of_objects"]
    grammar = model.grammar(json_schema=schema)
    tokens, lengths = model.encode_batch(["first prompt", "a second, longer prompt", "3"])
    batch = model.engine.generate_structured(tokens, lengths, grammars=grammar, rng=[5, 6, 7], max_new_tokens=BUDGET)
    for i, seed in enumerate((5, 6, 7)):
        alone = model.engine.generate_structured(tokens[i:i + 1, :lengths[i]], None, grammars=grammar, rng=seed,
                                                 max_new_tokens=BUDGET)
        assert alone.tokens[0] == batch.tokens[i] and alone.finish_reasons[0] == batch.finish_reasons[i]
    assert len({tuple(t) for t in batch.tokens}) > 1     # the seeds and prompts do matter
