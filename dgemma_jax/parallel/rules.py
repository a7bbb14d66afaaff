"""Logical axis names -> mesh axes: the ONE place where the model meets the mesh.

Parameters carry logical axis names (see `dgemma_jax.model.layers.param`); the KV cache and the
activations use the names below. A rule set maps each logical name to a mesh axis (or a tuple of
mesh axes, or None = replicated). A dimension whose size is not divisible by its mesh axes is
replicated instead (e.g. 2 global KV heads over a tensor axis of 4), so one rule set serves every
config.

Mesh axes: `data` (batch), `fsdp` (parameters sharded for training, also batch), `tensor`
(heads / MLP hidden), `expert` (experts).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical names used outside the parameters.
CACHE_AXES = ("batch", "cache_seq", "kv_heads", "head_dim")
ACTIVATION_AXES = ("batch", "seq", "embed")

# How the model itself is split (shared by every rule set): whole experts over `expert` (then
# `tensor`); attention heads, dense-MLP hidden units and the vocabulary over `tensor` (then
# `expert`). Every model axis splits every layer, so on an expert-parallel mesh the non-expert
# weights and their work are split too instead of being replicated on every expert shard, and on a
# tensor-parallel mesh the experts are spread instead of replicated. Experts are never cut inside
# (their hidden units stay together: the grouped-matmul kernels need them whole).
_MODEL_SPLIT = (
    ("experts", ("expert", "tensor")),
    ("heads", ("tensor", "expert")),
    ("kv_heads", ("tensor", "expert")),
    ("mlp", ("tensor", "expert")),
    ("vocab", ("tensor", "expert")),
    # the vision tower (model/vision.py): heads and MLP units split like the text model's; its width stays whole
    ("vision_heads", ("tensor", "expert")),
    ("vision_kv_heads", ("tensor", "expert")),
    ("vision_mlp", ("tensor", "expert")),
)

RULE_SETS: dict[str, tuple[tuple[str, str | tuple[str, ...] | None], ...]] = {
    # Single-user latency: weights resident and split, only activations move.
    "latency": (("batch", "data"),) + _MODEL_SPLIT + (("embed", None), ("vision_embed", None)),
    # Batch serving: rows over data/fsdp, model split as for latency.
    "serving": (("batch", ("data", "fsdp")),) + _MODEL_SPLIT + (("embed", None), ("vision_embed", None)),
    # Training: FSDP (parameters split along `embed` over fsdp, batch over data+fsdp),
    # optionally combined with tensor and expert parallelism.
    "training": (("batch", ("data", "fsdp")),) + _MODEL_SPLIT + (("embed", "fsdp"), ("vision_embed", "fsdp")),
}


def rules_for(name: str):
    if name not in RULE_SETS:
        raise ValueError(f"unknown sharding rule set {name!r}; choose one of {', '.join(RULE_SETS)}")
    return RULE_SETS[name]


def _axis_size(mesh: Mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return int(np.prod([mesh.shape[a] for a in axes]))


def spec_for(shape: Sequence[int], logical: Sequence[str | None], rules, mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array of `shape` with logical axis names, under `rules` on `mesh`.

    Mesh axes that are absent from the mesh, of size 1, already used by an earlier dimension, or
    that do not divide the dimension are dropped (that dimension is then replicated on them).
    """
    table = dict(rules)
    used: set[str] = set()
    out = []
    for size, name in zip(shape, logical):
        target = table.get(name) if name is not None else None
        if target is None:
            out.append(None)
            continue
        axes = (target,) if isinstance(target, str) else tuple(target)
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        while axes and size % _axis_size(mesh, axes):
            axes = axes[:-1]
        if not axes:
            out.append(None)
            continue
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)
