"""Each sampler setting is declared once (`sampling/settings.py`) and every other form derives from it:
the `SamplerConfig` fields, the per-row knobs (`RowKnobs` / `StepView`), the server's request fields,
the CLI flags and what a server's requests must share."""

import argparse
import ast
import dataclasses
import os

import pytest

from dgemma_jax.sampling import settings as S
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import RowKnobs
from dgemma_jax.sampling.rules import StepView

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the files that derive a form of the settings (issue 47: six places in five files before)
DERIVED = ("dgemma_jax/sampling/config.py", "dgemma_jax/sampling/loop.py", "dgemma_jax/sampling/rules.py",
           "dgemma_jax/serving/schema.py", "dgemma_jax/cli_run.py", "dgemma_jax/serving/scheduler.py")

# a setting declared once, as a new rule's author would: it must reach every form without another edit
MARGIN = S.Setting("demo_margin", float, 0.25, "a demo rule's margin", owner="a demo rule", per_row=True,
                   knob="margin", minimum=0.0, flag="demo-margin", http=True, hf_key="demo_margin")


def _names():
    names = set()
    for s in S.SETTINGS:
        names |= {s.name, s.knob} - {None}
    return names


def test_the_derived_forms_are_the_declared_settings():
    fields = [f.name for f in dataclasses.fields(SamplerConfig)]
    assert fields == [s.name for s in S.SETTINGS] + ["accept", "stop"]
    assert {f.name: f.default for f in dataclasses.fields(SamplerConfig)
            if f.name not in ("accept", "stop")} == {s.name: s.default for s in S.SETTINGS}
    knobs = [s.knob for s in S.SETTINGS if s.knob]
    assert [f.name for f in dataclasses.fields(RowKnobs)] == ["temperatures", *knobs]
    assert [f.name for f in dataclasses.fields(StepView)][5:] == knobs
    from dgemma_jax.serving.schema import ChatRequest, CompletionRequest

    sampler_like = {n for n in ChatRequest.model_fields if n in {s.name for s in S.SETTINGS}}   # OpenAI's stop is not ours
    assert sampler_like == {s.name for s in S.SETTINGS if s.http}
    assert set(CompletionRequest.model_fields) >= sampler_like
    from dgemma_jax.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    for command in ("generate", "chat"):
        flags = {o for a in sub.choices[command]._actions for o in a.option_strings}
        assert {f"--{s.flag}" for s in S.SETTINGS if s.flag} <= flags, command


def test_no_setting_is_declared_a_second_time():
    # a class-level field, a pydantic field or a CLI flag naming a setting anywhere in the derived files
    # means it was declared there by hand (e.g. a new field added only to SamplerConfig or RowKnobs)
    names, flags = _names(), {f"--{s.flag}" for s in S.SETTINGS if s.flag}
    found = []
    for rel in DERIVED:
        tree = ast.parse(open(os.path.join(ROOT, rel)).read())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id in names:
                    found.append(f"{rel}: {cls.name}.{stmt.target.id}")
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            if getattr(call.func, "attr", None) == "add_argument" and call.args \
                    and isinstance(call.args[0], ast.Constant) and call.args[0].value in flags:
                found.append(f"{rel}: add_argument({call.args[0].value!r})")
    assert not found, f"declare these in sampling/settings.py only: {found}"


def test_a_field_added_by_hand_is_caught():
    # the guard above is not vacuous: a SamplerConfig with a hand-written extra field differs from SETTINGS
    @dataclasses.dataclass(frozen=True)
    class Extra(SamplerConfig):
        demo_margin: float = 0.25

    assert [f.name for f in dataclasses.fields(Extra)] != [s.name for s in Extra.SETTINGS] + ["accept", "stop"]


def test_a_setting_declared_once_reaches_every_form():
    settings = S.SETTINGS + (MARGIN,)

    @dataclasses.dataclass(frozen=True)
    @S.with_fields_of(settings)
    class Sampler(SamplerConfig):
        pass

    # SamplerConfig: a field with its default, checked and coerced
    assert Sampler().demo_margin == 0.25 and Sampler(demo_margin=1).demo_margin == 1.0
    with pytest.raises(ValueError, match=r"SamplerConfig\.demo_margin must be >= 0, got -1"):
        Sampler(demo_margin=-1.0)
    assert Sampler(demo_margin=0.5).settings()["demo_margin"] == 0.5
    assert Sampler.from_hf_generation_config({"demo_margin": 0.75}).demo_margin == 0.75
    # the row knobs (RowKnobs columns and StepView fields)
    assert S.knob_fields(settings)[-1] == "margin"
    values = S.knob_values([Sampler(demo_margin=0.5), Sampler()], settings)
    assert values["margin"].tolist() == [0.5, 0.25] and str(values["margin"].dtype) == "float32"
    # the HTTP request schema, and what a request's body changes
    from dgemma_jax.serving.schema import sampler_fields_model

    model = sampler_fields_model(settings)
    assert "demo_margin" in model.model_json_schema()["properties"]
    body = model(demo_margin=0.5)
    assert S.request_changes(body, settings) == {"demo_margin": 0.5}
    # the CLI: a flag with the setting's help and range
    parser = argparse.ArgumentParser()
    S.add_flags(parser, settings)
    assert "--demo-margin" in parser.format_help() and "a demo rule's margin" in parser.format_help()
    assert S.changes_from_args(parser.parse_args(["--demo-margin", "0.5"]), settings) == {"demo_margin": 0.5}
    with pytest.raises(SystemExit):
        parser.parse_args(["--demo-margin", "-1"])
    # a per-row setting: a request may set it; it is not one the batch shares
    assert "demo_margin" not in S.batch_wide(settings)


def test_settings_round_trip_and_released_defaults():
    cfg = SamplerConfig()
    assert cfg.settings() == {s.name: s.default for s in S.SETTINGS}
    assert SamplerConfig(**cfg.settings()) == cfg
    assert S.batch_wide() == ("canvas_length", "stability_threshold", "eos_ids", "pad_id")
