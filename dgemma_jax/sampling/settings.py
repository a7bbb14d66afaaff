"""The sampler's settings, each declared once; every other form of a setting is derived from `SETTINGS`.

A setting is a field of `SamplerConfig`. One that varies per request (`per_row`) is also a field of
the server's request body (`http`), and one a rule reads inside the step (`knob`) is a [B] column of
`loop.RowKnobs` and a field of `rules.StepView` under that name; one with a `flag` is a
`dgemma generate / chat` flag. The derived forms:

    SamplerConfig fields, defaults and checks   sampling/config.py    (`sampler_fields`, `Setting.check`)
    RowKnobs columns / StepView fields          sampling/loop.py, rules.py (`knob_fields`, `knob_values`)
    the HTTP request's sampler fields           serving/schema.py     (`http_fields`, `request_changes`)
    the CLI's sampler flags                     cli_run.py            (`add_flags`, `changes_from_args`)
    what a server's requests must share         serving/scheduler.py  (`batch_wide`)
    generation_config.json keys                 `SamplerConfig.from_hf_generation_config` (`hf_key`)

To add a setting that varies per request: append a `Setting` here (its name, type, default, range,
help, flag, knob name and the rule that reads it) and read `view.<knob>` in that rule
(`sampling/rules.py`). Nothing else names it; `tests/test_sampler_settings.py` fails if a setting
is declared anywhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
from typing import Any, Callable, Mapping

import numpy as np

__all__ = ["Setting", "SETTINGS", "MAX_DENOISING_STEPS"]

# The step budget's upper bound: the temperature schedule is a host-computed float32 table of one entry
# per step baked into the program (bit-exact with HF's), 256 KiB at this bound.
MAX_DENOISING_STEPS = 1 << 16

IDS = "ids"   # the kind of a setting that is a tuple of non-negative token ids


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `True` as a step count is always a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One sampler setting, declared once.

    name: the `SamplerConfig` field (and the HTTP request field). kind: int, float or `IDS`.
    default: the released sampler's value. help: one line for the CLI and the HTTP schema.
    owner: what reads it (a rule of `sampling/rules.py`, the temperature schedule, the loop).
    per_row: a request may set it for its own row of a server's batch (else it is batch-wide: a
    shape, or read once for the whole batch). knob: the name of its [B] column in `loop.RowKnobs`
    and its field of `rules.StepView` (None: the step does not read it per row, or reads it through
    the temperature table). minimum / above: the lower bound (strict when `above`); maximum: the
    upper bound with `maximum_why`. relation: a check against the other settings (a config ->
    an error text or None). flag: the CLI flag (without dashes) or None. http: a request body field.
    hf_key: its key in a Hugging Face generation_config.json ("a.b": key b of the mapping a)."""

    name: str
    kind: Any
    default: Any
    help: str
    owner: str
    per_row: bool = False
    knob: str | None = None
    minimum: float | None = None
    above: bool = False
    bound_text: str | None = None
    maximum: int | None = None
    maximum_why: str = ""
    relation: Callable[[Any], str | None] | None = None
    flag: str | None = None
    http: bool = False
    hf_key: str | None = None

    def _fail(self, value: Any, allowed: str) -> None:
        raise ValueError(f"SamplerConfig.{self.name} must be {allowed}, got {value!r}")

    def _bound(self) -> str:
        if self.bound_text is not None:
            return self.bound_text
        if self.kind is int:   # an integer >= m is one > m - 1 (the CLI's "must be > 0")
            return f"> {self.minimum - 1:g}"
        return f"{'>' if self.above else '>='} {self.minimum:g}"

    def _problem(self, value: Any) -> tuple[Any, str | None]:
        """(value coerced, None) or (value, what is allowed)."""
        if self.kind is IDS:
            ids = (value,) if _is_int(value) else value
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)) \
                    or not all(_is_int(t) and t >= 0 for t in ids):
                return value, "a tuple (or list) of non-negative integers"
            return tuple(int(t) for t in ids), None
        if self.kind is int:
            if not _is_int(value):
                return value, "an integer" + (f" >= {self.minimum:g}" if self.minimum is not None else "")
            value = int(value)
        else:
            if not _is_real(value) or not math.isfinite(float(value)):
                return value, "a finite real number"
            value = float(value)
        if self.minimum is not None and not (value > self.minimum if self.above else value >= self.minimum):
            return value, (f"an integer >= {self.minimum:g}" if self.kind is int else self._bound())
        if self.maximum is not None and value > self.maximum:
            return value, f"at most {self.maximum} ({self.maximum_why})"
        return value, None

    def check(self, value: Any) -> Any:
        """`value` coerced to this setting's type, or ValueError naming the setting and the value."""
        coerced, problem = self._problem(value)
        if problem is not None:
            self._fail(value, problem)
        return coerced

    def parse(self, text: str) -> Any:
        """A CLI flag's value: this setting's type and range (argparse.ArgumentTypeError otherwise)."""
        kind = int if self.kind is int else float
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        value, problem = self._problem(value)
        if problem is not None:
            low = self.minimum is not None and not (value > self.minimum if self.above else value >= self.minimum)
            raise argparse.ArgumentTypeError(f"must be {self._bound() if low else problem}, got {text!r}")
        return value

    @property
    def knob_dtype(self):
        return np.int32 if self.kind is int else np.float32


def _t_max_above_t_min(config) -> str | None:
    if not config.t_min < config.t_max:
        return f"strictly greater than t_min={config.t_min!r} (0 < t_min < t_max)"
    return None


DEFAULT_HELP = " (default: the checkpoint's sampler)"

SETTINGS: tuple[Setting, ...] = (
    Setting("canvas_length", int, 256, "tokens per canvas (default: the one the model was trained with)",
            owner="the canvas's shape", minimum=1, flag="canvas-length", http=True),
    Setting("max_denoising_steps", int, 48,
            "max denoising steps per canvas (default: the checkpoint's sampler, 16 for the bundled model, 48 for "
            "the released one)", owner="the loop's step budget (`loop.denoise_step`) and the temperature schedule",
            per_row=True, knob="max_steps", minimum=1, maximum=MAX_DENOISING_STEPS,
            maximum_why="the compiled loop keeps a float32 temperature per step; a canvas stops early once stable "
                        "and confident, so a large finite budget is enough",
            flag="steps", http=True, hf_key="max_denoising_steps"),
    Setting("t_max", float, 0.8, "sampling temperature at the first step" + DEFAULT_HELP,
            owner="the temperature schedule (`ops.temperature_table`)", per_row=True, minimum=0.0, above=True,
            relation=_t_max_above_t_min, flag="t-max", http=True, hf_key="t_max"),
    Setting("t_min", float, 0.4, "sampling temperature at the last step" + DEFAULT_HELP,
            owner="the temperature schedule (`ops.temperature_table`)", per_row=True, minimum=0.0, above=True,
            bound_text="> 0 (and < t_max)", flag="t-min", http=True, hf_key="t_min"),
    Setting("entropy_bound", float, 0.1,
            "the sampler's entropy bound for keeping positions each step" + DEFAULT_HELP,
            owner="rules.EntropyBound", per_row=True, knob="entropy_bound", minimum=0.0, above=True,
            flag="entropy-bound", http=True, hf_key="sampler_config.entropy_bound"),
    Setting("confidence_threshold", float, 0.005,
            "a canvas is confident when its mean entropy is below this" + DEFAULT_HELP,
            owner="rules.StableAndConfident", per_row=True, knob="confidence", minimum=0.0,
            flag="confidence", http=True, hf_key="confidence_threshold"),
    Setting("stability_threshold", int, 1,
            "a canvas is stable when its argmax equals its last N argmax canvases" + DEFAULT_HELP,
            owner="rules.StableAndConfident (the history's length, a shape)", minimum=1, flag="stability",
            hf_key="stability_threshold"),
    Setting("eos_ids", IDS, (1, 106, 50), "ids that end a sequence", owner="finish_canvas (EOS truncation)",
            hf_key="eos_token_id"),
    Setting("pad_id", int, 0, "id written after the first EOS and into finished rows",
            owner="finish_canvas", minimum=0, hf_key="pad_token_id"),
)


# ---------------------------------------------------------------------------------------- derived forms
def by_name(settings=SETTINGS) -> dict[str, Setting]:
    return {s.name: s for s in settings}


def sampler_fields(settings=SETTINGS) -> list[tuple[str, Any, Any]]:
    """(name, annotation, default) of `SamplerConfig`'s setting fields, in declaration order."""
    kinds = {int: int, float: float, IDS: tuple[int, ...]}
    return [(s.name, kinds[s.kind], s.default) for s in settings]


def knob_settings(settings=SETTINGS) -> tuple[Setting, ...]:
    """The settings a step reads per row: `RowKnobs` columns and `StepView` fields."""
    return tuple(s for s in settings if s.knob is not None)


def knob_fields(settings=SETTINGS) -> list[str]:
    return [s.knob for s in knob_settings(settings)]


def knob_values(samplers, settings=SETTINGS) -> dict[str, np.ndarray]:
    """{knob: [B] values}, one per sampler (row)."""
    return {s.knob: np.asarray([getattr(x, s.name) for x in samplers], s.knob_dtype) for s in knob_settings(settings)}


def batch_wide(settings=SETTINGS) -> tuple[str, ...]:
    """The settings every row of one batch shares (a request cannot set its own)."""
    return tuple(s.name for s in settings if not s.per_row)


def check_all(config, settings=SETTINGS) -> dict[str, Any]:
    """{name: coerced value} of `config`'s settings, or ValueError naming the first bad one."""
    values = {s.name: s.check(getattr(config, s.name)) for s in settings}
    view = _Values(values)
    for s in settings:
        if s.relation is not None:
            problem = s.relation(view)
            if problem:
                s._fail(values[s.name], problem)
    return values


class _Values:
    def __init__(self, values):
        self.__dict__.update(values)


def from_hf(generation_config: Mapping[str, Any], settings=SETTINGS) -> dict[str, Any]:
    """The settings a Hugging Face generation_config.json dict gives (absent or null keys left out)."""
    out = {}
    for s in settings:
        if s.hf_key is None:
            continue
        value: Any = generation_config
        for part in s.hf_key.split("."):
            if value is None:
                break
            value = value.get(part) if isinstance(value, Mapping) else getattr(value, part, None)
        if value is not None:
            out[s.name] = value
    return out


def http_fields(settings=SETTINGS) -> dict[str, tuple[Any, Any]]:
    """pydantic field definitions {name: (annotation, FieldInfo)} of the request body's sampler fields.

    Integers are range-checked by the schema; every value is checked again by `SamplerConfig`, whose
    message a bad one gets as a 400."""
    from pydantic import Field  # deferred: the web stack, only for the server's schema

    out = {}
    for s in settings:
        if not s.http:
            continue
        kind = int if s.kind is int else float
        bounds = {"ge": s.minimum} if kind is int and s.minimum is not None else {}
        out[s.name] = (kind | None, Field(None, description=s.help, **bounds))
    return out


def request_changes(body, settings=SETTINGS) -> dict[str, Any]:
    """The per-row settings a request body sets (not None)."""
    return {s.name: getattr(body, s.name) for s in settings
            if s.http and s.per_row and getattr(body, s.name, None) is not None}


def add_flags(parser, settings=SETTINGS) -> None:
    """The CLI flags of the settings that have one (dest: the flag with underscores)."""
    for s in settings:
        if s.flag is not None:
            parser.add_argument(f"--{s.flag}", type=s.parse, dest=s.flag.replace("-", "_"), help=s.help)


def changes_from_args(args, settings=SETTINGS) -> dict[str, Any]:
    """The settings the CLI flags set (not None)."""
    out = {}
    for s in settings:
        if s.flag is not None:
            value = getattr(args, s.flag.replace("-", "_"), None)
            if value is not None:
                out[s.name] = value
    return out


def with_fields(cls, fields, *, first: bool):
    """`cls` with `fields` [(name, annotation[, default])] added to its annotations (before or after
    its own), for a dataclass decorator applied next."""
    own = dict(cls.__dict__.get("__annotations__", {}))
    new = {}
    for field in fields:
        name, annotation = field[0], field[1]
        new[name] = annotation
        if len(field) > 2:
            setattr(cls, name, field[2])
    cls.__annotations__ = {**new, **own} if first else {**own, **new}
    return cls


def with_fields_of(settings=SETTINGS):
    """A class decorator (under `dataclasses.dataclass`): the settings as the class's first fields,
    with their defaults, and `cls.SETTINGS` the list its checks and conversions read."""
    def add(cls):
        cls = with_fields(cls, sampler_fields(settings), first=True)
        cls.SETTINGS = tuple(settings)
        return cls
    return add
