"""Static configuration of the DiffusionGemma entropy-bound sampler.

`SamplerConfig` is a frozen, hashable dataclass, so it can be passed to
`jax.jit` as a static argument. Every sequence field is stored as a tuple.

Defaults are the released `google/diffusiongemma-26B-A4B-it` sampler settings
(spec section 3.1): 48 denoising steps, linear temperature 0.8 -> 0.4,
entropy bound 0.1, stop when the argmax canvas is stable for one step and the
mean entropy is below 0.005, EOS ids (1, 106, 50), pad id 0.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping

from dgemma_jax.sampling.rules import DEFAULT_ACCEPT, DEFAULT_STOP, AcceptRule, StopRule

__all__ = ["SamplerConfig"]


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `True` as a step count is always a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# The step budget's upper bound: the temperature schedule is a host-computed float32 table of one entry
# per step baked into the program (bit-exact with HF's), 256 KiB at this bound.
MAX_DENOISING_STEPS = 1 << 16


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """Knobs of the entropy-bound denoising sampler.

    Attributes:
      canvas_length: number of tokens denoised in parallel per canvas (L).
      max_denoising_steps: step budget per canvas (N). Step i (0-based) uses
        temperature t_min + (t_max - t_min) * (N - i) / N.
      t_max: temperature of the first step.
      t_min: lower end of the schedule (never reached: the last step uses
        t_min + (t_max - t_min) / N).
      entropy_bound: a position of sorted rank k is accepted when the sum of the
        entropies ranked strictly below it is <= entropy_bound.
      confidence_threshold: a row is confident when its mean entropy is
        strictly below this value.
      stability_threshold: a row is stable when its argmax canvas equals each
        of the previous `stability_threshold` argmax canvases.
      eos_ids: ids that end a sequence; the canvas is truncated after the
        first of them. May be empty (no truncation).
      pad_id: id written after the first EOS and into finished rows.
      accept: which sampled positions a step keeps (`rules.AcceptRule`; default `rules.EntropyBound()`).
      stop: which rows a step finishes besides those that spent their step budget (`rules.StopRule`;
        default `rules.StableAndConfident()`). Both are hashable callables of a `rules.StepView`;
        they read the per-row thresholds from it, so the numbers above stay the settings.
    """

    canvas_length: int = 256
    max_denoising_steps: int = 48
    t_max: float = 0.8
    t_min: float = 0.4
    entropy_bound: float = 0.1
    confidence_threshold: float = 0.005
    stability_threshold: int = 1
    eos_ids: tuple[int, ...] = (1, 106, 50)
    pad_id: int = 0
    accept: AcceptRule = DEFAULT_ACCEPT
    stop: StopRule = DEFAULT_STOP

    def __post_init__(self) -> None:
        def fail(field: str, value: Any, allowed: str) -> None:
            raise ValueError(f"SamplerConfig.{field} must be {allowed}, got {value!r}")

        def set_(field: str, value: Any) -> None:
            object.__setattr__(self, field, value)

        # Integer fields with a lower bound.
        for field, minimum in (
            ("canvas_length", 1),
            ("max_denoising_steps", 1),
            ("stability_threshold", 1),
            ("pad_id", 0),
        ):
            value = getattr(self, field)
            if not _is_int(value) or value < minimum:
                fail(field, value, f"an integer >= {minimum}")
            set_(field, int(value))

        if self.max_denoising_steps > MAX_DENOISING_STEPS:
            fail("max_denoising_steps", self.max_denoising_steps,
                 f"at most {MAX_DENOISING_STEPS} (the compiled loop keeps a float32 temperature per step; "
                 "a canvas stops early once stable and confident, so a large finite budget is enough)")

        # Real-valued fields: coerce to Python float, reject NaN/inf.
        for field in ("t_max", "t_min", "entropy_bound", "confidence_threshold"):
            value = getattr(self, field)
            if not _is_real(value) or not math.isfinite(float(value)):
                fail(field, value, "a finite real number")
            set_(field, float(value))

        if not self.t_min > 0.0:
            fail("t_min", self.t_min, "> 0 (and < t_max)")
        if not self.t_min < self.t_max:
            fail(
                "t_max",
                self.t_max,
                f"strictly greater than t_min={self.t_min!r} (0 < t_min < t_max)",
            )
        if not self.entropy_bound > 0.0:
            fail("entropy_bound", self.entropy_bound, "> 0")
        if not self.confidence_threshold >= 0.0:
            fail("confidence_threshold", self.confidence_threshold, ">= 0")

        eos = self.eos_ids
        if _is_int(eos):
            eos = (eos,)
        if isinstance(eos, (str, bytes)) or not isinstance(eos, (tuple, list)):
            fail("eos_ids", self.eos_ids, "a tuple (or list) of non-negative integers")
        for token in eos:
            if not _is_int(token) or token < 0:
                fail("eos_ids", self.eos_ids, "a tuple (or list) of non-negative integers")
        set_("eos_ids", tuple(int(t) for t in eos))

        for field in ("accept", "stop"):
            rule = getattr(self, field)
            if not callable(rule):
                fail(field, rule, "a callable of a rules.StepView (see dgemma_jax.sampling.rules)")
            try:
                hash(rule)
            except TypeError:
                fail(field, rule, "hashable (a frozen dataclass): the sampler is a static argument of the programs")

    @property
    def history_length(self) -> int:
        """Rows of the argmax history the loop carries: min(stability_threshold, max_denoising_steps).

        Step i (0-based) has seen only i earlier argmax canvases, so a threshold of S >= N steps can
        never be met; N slots (never all filled) then decide exactly as S would. Without the cap a
        "never stop early" threshold such as 10**6 would carry a [B, 10**6, L] buffer through the loop.
        """
        return min(self.stability_threshold, self.max_denoising_steps)

    def replace(self, **changes: Any) -> "SamplerConfig":
        """Returns a copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    def settings(self) -> dict[str, Any]:
        """The numeric settings as a JSON-able dict (`SamplerConfig(**settings)` gives this config back).

        The rules are code, not settings: a config with other than the default accept / stop rules
        is a ValueError here (store the settings and pass your rules again with `replace`)."""
        if self.accept != DEFAULT_ACCEPT or self.stop != DEFAULT_STOP:
            raise ValueError("this SamplerConfig has its own accept or stop rule, which cannot be stored as settings; "
                             "store sampler.replace(accept=rules.DEFAULT_ACCEPT, stop=rules.DEFAULT_STOP) and pass "
                             "your rules again with replace(...) after loading")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("accept", "stop")}

    @classmethod
    def for_model(cls, config: Any, **overrides: Any) -> "SamplerConfig":
        """The released sampler settings for a model: its canvas length, EOS ids and pad id.

        The one place a default sampler is derived from a `ModelConfig` (the engine, the CLI, the
        server and the AOT reports all call this); `overrides` replace any field.
        """
        kw = dict(canvas_length=config.canvas_length, eos_ids=tuple(config.eos_ids), pad_id=config.pad_id)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf_generation_config(
        cls, generation_config: Mapping[str, Any], **overrides: Any
    ) -> "SamplerConfig":
        """Builds a config from a Hugging Face `generation_config.json` dict.

        Reads `max_denoising_steps`, `t_min`, `t_max`, `stability_threshold`,
        `confidence_threshold`, `sampler_config.entropy_bound`, `eos_token_id`
        (int or list) and `pad_token_id`. Keys that are absent or null keep the
        released defaults; unknown keys are ignored. `canvas_length` is a model
        config field, not a generation one: pass it in `overrides` if needed.
        `overrides` are applied last.
        """
        gc = dict(generation_config)
        kw: dict[str, Any] = {}
        for hf_key, field in (
            ("max_denoising_steps", "max_denoising_steps"),
            ("t_min", "t_min"),
            ("t_max", "t_max"),
            ("stability_threshold", "stability_threshold"),
            ("confidence_threshold", "confidence_threshold"),
            ("pad_token_id", "pad_id"),
        ):
            if gc.get(hf_key) is not None:
                kw[field] = gc[hf_key]

        sampler_cfg = gc.get("sampler_config")
        if sampler_cfg is not None:
            if isinstance(sampler_cfg, Mapping):
                bound = sampler_cfg.get("entropy_bound")
            else:  # an EntropyBoundSamplerConfig-like object
                bound = getattr(sampler_cfg, "entropy_bound", None)
            if bound is not None:
                kw["entropy_bound"] = bound

        eos = gc.get("eos_token_id")
        if eos is not None:
            kw["eos_ids"] = (eos,) if _is_int(eos) else tuple(eos)

        kw.update(overrides)
        return cls(**kw)
