"""What a result says beyond its tokens: a budget cut short, rows that met NaN/Inf logits."""

from __future__ import annotations

import warnings

import jax
import numpy as np

from dgemma_jax.engine.drivers import CanvasEvent
from dgemma_jax.engine.inputs import DEFAULT_NEW_TOKENS
from dgemma_jax.errors import DgemmaWarning, NonFiniteLogits


def warn_if_cut_short(config, max_new: int, finished, context: int, cache_length: int | None = None) -> None:
    """Warn (DgemmaWarning) when the default budget was capped by the room left after the prompt and
    a row used all of it without an end of sequence: its text is cut short, not finished."""
    if max_new >= DEFAULT_NEW_TOKENS or bool(np.all(np.asarray(finished))):
        return
    room = f"the model's {config.max_position_embeddings} positions"
    if cache_length is not None and cache_length < config.max_position_embeddings:
        room = f"the {cache_length}-token context"
    warnings.warn(f"the output was cut short at {max_new} new tokens (of {DEFAULT_NEW_TOKENS} by default) without "
                  f"an end of sequence: a {context}-token prompt leaves no room for more in {room}; "
                  "shorten the prompt", DgemmaWarning, stacklevel=3)


NONFINITE_CHOICES = ("warn", "raise", "ignore")


def report_nonfinite(flags, action: str = "warn") -> None:
    """Act on a result's per-row `nonfinite` flags ([B] bool; see `sampling.loop.nonfinite_rows`):
    "warn" (a DgemmaWarning), "raise" (`NonFiniteLogits`) or "ignore"; nothing when no row met one."""
    if action not in NONFINITE_CHOICES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_CHOICES}; got {action!r}")
    if action == "ignore" or isinstance(flags, jax.core.Tracer):  # traced: the flags are the caller's to read
        return
    rows = np.flatnonzero(np.asarray(flags))
    if len(rows) == 0:
        return
    msg = (f"the model produced NaN/Inf logits for row(s) {rows.tolist()[:8]}: its weights or activations are not "
           "finite, so the tokens are not its answer; check the checkpoint (loading names a non-finite tensor) and "
           "the dtype (float16/bfloat16 overflow)")
    if action == "raise":
        raise NonFiniteLogits(msg)
    warnings.warn(msg, DgemmaWarning, stacklevel=3)


def reporting(events, action: str):
    """The streaming drivers' events, each `CanvasEvent`'s nonfinite flags reported as they come."""
    for ev in events:
        if isinstance(ev, CanvasEvent) and ev.nonfinite is not None:
            report_nonfinite(ev.nonfinite, action)
        yield ev
