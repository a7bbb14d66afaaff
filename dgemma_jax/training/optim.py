"""Optimizer: the published SFT recipe by default (spec §4.5).

    clip_by_global_norm(1.0) -> AdamW(b1 0.95, b2 0.99, eps 1e-8, weight decay 1e-4)
    lr: linear warmup peak/(w+1) -> peak over w steps (the first update is not at lr 0), cosine decay
        -> end (1.5e-5) at total_steps

Frozen parameters (`freeze` regexes over the "/"-joined path, e.g. the router) get no update and no
optimizer state (optax.multi_transform with set_to_zero).
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import optax

from dgemma_jax.training.lora import path_str


def lr_schedule(peak: float, end: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """lr of update s (s = 0 is the first): peak * (s + 1) / (w + 1) for s < w warmup steps, so the
    first update is already above 0, then cosine from peak at s = w to end at s = total_steps."""
    w = max(0, min(int(warmup_steps), int(total_steps) - 1))
    cosine = optax.cosine_decay_schedule(init_value=peak, decay_steps=max(int(total_steps) - w, 1),
                                         alpha=end / peak if peak else 0.0)
    if w == 0:
        return cosine
    warmup = optax.linear_schedule(init_value=peak / (w + 1), end_value=peak, transition_steps=w)
    return optax.join_schedules([warmup, cosine], [w])


def make_optimizer(*, peak_lr: float = 1.5e-4, end_lr: float = 1.5e-5, warmup_steps: int = 100,
                   total_steps: int = 2000, b1: float = 0.95, b2: float = 0.99, eps: float = 1e-8,
                   weight_decay: float = 1e-4, clip_norm: float = 1.0, decay_matrices_only: bool = False,
                   freeze: Sequence[str] = ()) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule). `freeze`: regexes of parameter paths that must not change."""
    sched = lr_schedule(peak_lr, end_lr, warmup_steps, total_steps)
    mask = (lambda p: jax.tree_util.tree_map(lambda x: x.ndim >= 2, p)) if decay_matrices_only else None
    parts = []
    if clip_norm and clip_norm > 0:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=mask))
    opt = optax.chain(*parts)
    if freeze:
        pats = [re.compile(p) for p in freeze]

        def labels(params):
            return jax.tree_util.tree_map_with_path(
                lambda path, _: "frozen" if any(pt.search(path_str(path)) for pt in pats) else "train", params)

        opt = optax.multi_transform({"train": opt, "frozen": optax.set_to_zero()}, labels)
    return opt, sched
