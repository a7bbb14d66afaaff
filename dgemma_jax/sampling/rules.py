"""Accept and stop rules: small frozen objects a denoising step calls, pluggable through `SamplerConfig`.

After its model pass a step hands the rules one `StepView` (the step's argmax and entropies, the
argmax history, and each row's settings from `loop.RowKnobs`):
* `SamplerConfig.accept(view)` -> bool [B, L]: which sampled positions stay (the rest are re-noised);
* `SamplerConfig.stop(view)` -> bool [B]: which rows' canvases are finished after this step; a row
  that has made its step budget (`max_denoising_steps`, per row) is finished whatever the rule says.

The released sampler is `EntropyBound()` and `StableAndConfident()` (HF's EntropyBoundSampler and
StableAndConfidentStoppingCriteria). A rule of your own is
any hashable callable with that signature (a frozen dataclass, as here): it is part of the static
sampler, so a program is compiled per rule. Per-row settings (a server's requests each with their own
thresholds) reach a rule through the view's knobs, never through the rule itself.

    @dataclasses.dataclass(frozen=True)
    class LeadingEos:                     # stop a row whose canvas begins with end-of-sequence
        def __call__(self, view): return view.argmax[:, 0] == 1
    sampler = SamplerConfig(stop=AnyOf((StableAndConfident(), LeadingEos())))
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Protocol

import jax

from dgemma_jax.sampling import ops
from dgemma_jax.sampling.settings import knob_fields, with_fields


@dataclasses.dataclass(frozen=True)
@functools.partial(with_fields, fields=[(k, jax.Array) for k in knob_fields()], first=False)
class StepView:
    """What a rule sees of one denoising step (every array traced).

    step: [] or [B] int32 steps made, this one included; argmax: [B, L] the step's argmax canvas (held
    positions at their tokens); history: [B, S, L] the previous S argmax canvases (-1 before any);
    entropy: [B, L] the tempered entropy per position; mean_entropy: [B] over the free positions;
    then one [B] field per per-row setting with a knob (`sampling/settings.py`; today entropy_bound,
    confidence, max_steps): each row's settings (`loop.RowKnobs.columns`)."""

    step: jax.Array
    argmax: jax.Array
    history: jax.Array
    entropy: jax.Array
    mean_entropy: jax.Array


class AcceptRule(Protocol):
    def __call__(self, view: StepView) -> jax.Array:
        """bool [B, L]: the positions whose samples are kept."""


class StopRule(Protocol):
    def __call__(self, view: StepView) -> jax.Array:
        """bool [B]: the rows whose canvas ends with this step."""


@dataclasses.dataclass(frozen=True)
class EntropyBound:
    """Keep the lowest-entropy positions while the entropies ranked below stay within the row's bound
    (`ops.entropy_bound_accept`, HF's EntropyBoundSampler)."""

    def __call__(self, view: StepView) -> jax.Array:
        return ops.entropy_bound_accept(view.entropy, view.entropy_bound[:, None])


@dataclasses.dataclass(frozen=True)
class StableAndConfident:
    """Stop a row whose argmax equals its last S argmax canvases and whose mean entropy is below its
    confidence threshold (`ops.stop_decision`, HF's StableAndConfidentStoppingCriteria)."""

    def __call__(self, view: StepView) -> jax.Array:
        return ops.stop_decision(view.argmax, view.history, view.mean_entropy, view.confidence)


@dataclasses.dataclass(frozen=True)
class AnyOf:
    """Stop a row when any of `rules` stops it."""

    rules: tuple

    def __post_init__(self):
        if not self.rules or not all(callable(r) for r in self.rules):
            raise ValueError(f"AnyOf takes a non-empty tuple of stop rules (callables); got {self.rules!r}")
        object.__setattr__(self, "rules", tuple(self.rules))

    def __call__(self, view: StepView) -> jax.Array:
        return functools.reduce(operator.or_, (rule(view) for rule in self.rules))


DEFAULT_ACCEPT = EntropyBound()
DEFAULT_STOP = StableAndConfident()
