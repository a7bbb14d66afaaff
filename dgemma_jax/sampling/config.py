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
from typing import Any, Mapping

from dgemma_jax.sampling import settings as settings_lib
from dgemma_jax.sampling.rules import DEFAULT_ACCEPT, DEFAULT_STOP, AcceptRule, StopRule

__all__ = ["SamplerConfig", "MAX_DENOISING_STEPS"]

MAX_DENOISING_STEPS = settings_lib.MAX_DENOISING_STEPS


@dataclasses.dataclass(frozen=True)
@settings_lib.with_fields_of(settings_lib.SETTINGS)
class SamplerConfig:
    """Knobs of the entropy-bound denoising sampler.

    Its settings are declared once, in `sampling/settings.py` (`SETTINGS`: name, type, default,
    range, help, which rule reads it); this class, `loop.RowKnobs`, `rules.StepView`, the server's
    request fields and the CLI flags are all derived from that list. The released ones:

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

    Besides the settings, two fields hold code:
      accept: which sampled positions a step keeps (`rules.AcceptRule`; default `rules.EntropyBound()`).
      stop: which rows a step finishes besides those that spent their step budget (`rules.StopRule`;
        default `rules.StableAndConfident()`). Both are hashable callables of a `rules.StepView`;
        they read the per-row thresholds from it, so the numbers above stay the settings.
    """

    accept: AcceptRule = DEFAULT_ACCEPT
    stop: StopRule = DEFAULT_STOP

    def __post_init__(self) -> None:
        for name, value in settings_lib.check_all(self, type(self).SETTINGS).items():
            object.__setattr__(self, name, value)
        for field in ("accept", "stop"):
            rule = getattr(self, field)
            if not callable(rule):
                raise ValueError(f"SamplerConfig.{field} must be a callable of a rules.StepView (see "
                                 f"dgemma_jax.sampling.rules), got {rule!r}")
            try:
                hash(rule)
            except TypeError:
                raise ValueError(f"SamplerConfig.{field} must be hashable (a frozen dataclass): the sampler is a "
                                 f"static argument of the programs, got {rule!r}") from None

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
        return {s.name: getattr(self, s.name) for s in self.SETTINGS}

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

        Reads each setting's `hf_key` (sampling/settings.py): `max_denoising_steps`, `t_min`,
        `t_max`, `stability_threshold`, `confidence_threshold`, `sampler_config.entropy_bound`,
        `eos_token_id` (int or list) and `pad_token_id`. Keys that are absent or null keep the
        released defaults; unknown keys are ignored. `canvas_length` is a model
        config field, not a generation one: pass it in `overrides` if needed.
        `overrides` are applied last.
        """
        kw = settings_lib.from_hf(dict(generation_config), cls.SETTINGS)
        kw.update(overrides)
        return cls(**kw)
