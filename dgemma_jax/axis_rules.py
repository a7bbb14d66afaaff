"""Logical axis names -> mesh axes: the ONE place where the model meets the mesh.

Parameters carry logical axis names (see `dgemma_jax.model.layers.param`); the KV cache and the
activations use the names below. A rule set maps each logical name to a mesh axis (or a tuple of
mesh axes, or None = replicated). A dimension whose size is not divisible by its mesh axes is
replicated instead (e.g. 2 global KV heads over a tensor axis of 4), so one rule set serves every
config.

Mesh axes: `data` (batch), `fsdp` (parameters sharded for training, also batch), `tensor`
(heads / MLP hidden), `expert` (experts).

A rule set is checked when it is built (`rules_for`, `check_rules`) and again against the mesh it
is used with (`Shardings`, `Runtime`): a logical name the model does not use or a mesh axis that
does not exist is an error naming it, never a silently replicated dimension. Besides the built-in
sets (`RULE_SETS`) a rule set can come from a JSON file or a mapping (an ml_collections entry):
{"batch": ["data", "fsdp"], "experts": "expert", "embed": null, ...}; docs/tpu.md has the format.
"""

from __future__ import annotations

import json
import os
from typing import Mapping, Sequence

import numpy as np
from jax.sharding import Mesh, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")

# Logical names used outside the parameters.
CACHE_AXES = ("batch", "kv_heads", "cache_seq", "head_dim")   # model/cache.py: [B, K, S, H]
ACTIVATION_AXES = ("batch", "seq", "embed")

# Every logical axis name the model's parameters, KV cache and activations carry, and what it labels
# (docs/tpu.md tabulates these; tests/test_sharding.py checks the set against the model's own names).
LOGICAL_AXES: dict[str, str] = {
    "batch": "rows of a batch: activations, the KV cache, the engine's inputs",
    "seq": "token positions of the activations",
    "embed": "the model width (hidden size): every text-model kernel, the embedding table, the activations",
    "vocab": "vocabulary rows of the embedding table (tied with the output head)",
    "heads": "query heads of the attention kernels (q, o)",
    "kv_heads": "key/value heads of the attention kernels (k, v) and of the KV cache",
    "head_dim": "the width of one attention head (q/k/v/o kernels, q/k norms, KV cache; text and vision)",
    "cache_seq": "the KV cache's token slots",
    "mlp": "hidden units of the dense MLP (and of the self-conditioning MLP)",
    "experts": "the experts of the MoE kernels and of the MoE's dispatch buffers",
    "experts_router": "the router's per-expert outputs (router kernel, per-expert scale)",
    "expert_gate_up": "one expert's gate and up hidden units (2 x the expert's hidden size)",
    "expert_mlp": "one expert's hidden units (down projection)",
    "norm": "the width of the text model's RMSNorm scales",
    "layers": "the stacked layer-group axis of a scanned model (`--layers scan`); always replicated",
    "vision_embed": "the vision tower's width (its kernels, norms, position table, projection)",
    "vision_heads": "the vision tower's query heads",
    "vision_kv_heads": "the vision tower's key/value heads",
    "vision_mlp": "the vision tower's MLP hidden units",
}
# stacked by `model.layout`, whose shardings keep it whole: a rule may not split it
UNSPLIT_AXES = ("layers",)

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

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]

RULE_SETS: dict[str, Rules] = {
    # Single-user latency: weights resident and split, only activations move.
    "latency": (("batch", "data"),) + _MODEL_SPLIT + (("embed", None), ("vision_embed", None)),
    # Batch serving: rows over data/fsdp, model split as for latency.
    "serving": (("batch", ("data", "fsdp")),) + _MODEL_SPLIT + (("embed", None), ("vision_embed", None)),
    # Batch serving at many slots: rows over every mesh axis, only the experts and the vocabulary
    # split. Attention, the dense MLP and the norms run on each chip's own rows with whole (replicated)
    # weights; the MoE and the sampling head gather the rows of each group and hand each chip its
    # rows' sums back (`model.moe.expert_parallel`, `sampling.fused.head_sample_stats_split`): per
    # layer one all-gather and one reduce-scatter of the rows instead of all-reducing the
    # attention's and the MoE's partial sums.
    "throughput": (("batch", MESH_AXES), ("experts", ("expert", "tensor")), ("vocab", ("tensor", "expert")))
    + tuple((name, None) for name in ("heads", "kv_heads", "mlp", "vision_heads", "vision_kv_heads",
                                      "vision_mlp", "embed", "vision_embed")),
    # Training: FSDP (parameters split along `embed` over fsdp, batch over data+fsdp),
    # optionally combined with tensor and expert parallelism.
    "training": (("batch", ("data", "fsdp")),) + _MODEL_SPLIT + (("embed", "fsdp"), ("vision_embed", "fsdp")),
}


def rules_for(value, mesh: Mesh | None = None) -> Rules:
    """A checked rule set from a built-in name (`RULE_SETS`: "latency", "serving", "throughput",
    "training"), a JSON rules file (path), a mapping {logical name: mesh axis | [mesh axes] | None}
    (e.g. an ml_collections entry) or a sequence of (logical name, target) pairs. Mesh axes are
    checked against `MESH_AXES` and the axes of `mesh` when given (`check_rules`)."""
    if isinstance(value, str):
        if value in RULE_SETS:
            return check_rules(RULE_SETS[value], mesh) if mesh is not None else RULE_SETS[value]
        if os.path.isfile(value):
            return load_rules(value, mesh)
        if value.lower().endswith(".json") or os.sep in value:
            raise ValueError(f"rules file {value!r} does not exist; give a JSON rules file (docs/tpu.md) or one of "
                             f"{', '.join(RULE_SETS)}")
        raise ValueError(f"unknown sharding rule set {value!r}{_hint(value, RULE_SETS)}; choose one of "
                         f"{', '.join(RULE_SETS)}, or give a JSON rules file (docs/tpu.md)")
    return check_rules(value, mesh)


def load_rules(path: str, mesh: Mesh | None = None) -> Rules:
    """The rule set of a JSON file: an object mapping logical names to a mesh axis, a list of mesh axes
    or null (replicated), checked like any rule set."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"rules file {path!r} is not valid JSON: {e}") from None
    except OSError as e:
        raise ValueError(f"rules file {path!r} cannot be read: {e.strerror or e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"rules file {path!r} must hold a JSON object mapping logical axis names to a mesh axis, "
                         f"a list of mesh axes or null; it holds a {type(data).__name__}")
    return check_rules(data, mesh, where=f"rules file {path!r}")


def check_rules(rules, mesh: Mesh | None = None, where: str = "sharding rules") -> Rules:
    """`rules` (pairs or a mapping) as a normalized, hashable rule set, or a ValueError naming the first
    unknown logical axis or mesh axis. The mesh axes allowed are `MESH_AXES` and, with `mesh`, its
    axis names (a `MESH_AXES` name the mesh lacks counts as size 1, as in `spec_for`)."""
    if isinstance(rules, Mapping) or hasattr(rules, "to_dict"):  # dict, ml_collections ConfigDict
        pairs = list((rules.to_dict() if hasattr(rules, "to_dict") else rules).items())
    elif isinstance(rules, str):
        raise ValueError(f"{where}: expected a rule set, got the string {rules!r} (rules_for({rules!r}) reads a "
                         "built-in set's name or a rules file)")
    elif not isinstance(rules, Sequence):
        raise ValueError(f"{where}: expected a mapping of logical axis names to mesh axes or (name, target) "
                         f"pairs; got {type(rules).__name__}")
    else:
        pairs = list(rules)
    mesh_axes = tuple(MESH_AXES) + tuple(a for a in (mesh.axis_names if mesh is not None else ()) if a not in MESH_AXES)
    out, seen = [], set()
    for pair in pairs:
        if isinstance(pair, (str, bytes)) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"{where}: each rule is a (logical axis, mesh axes) pair; got {pair!r}")
        name, target = pair
        if name not in LOGICAL_AXES:
            raise ValueError(f"{where}: unknown logical axis {name!r}{_hint(name, LOGICAL_AXES)}; the logical axes "
                             f"are {', '.join(LOGICAL_AXES)}")
        if name in seen:
            raise ValueError(f"{where}: logical axis {name!r} has two rules; keep one")
        seen.add(name)
        if target is None or (not isinstance(target, str) and isinstance(target, Sequence) and not target):
            out.append((name, None))
            continue
        axes = (target,) if isinstance(target, str) else target
        if not isinstance(axes, Sequence) or not all(isinstance(a, str) for a in axes):
            raise ValueError(f"{where}: the rule for {name!r} must be a mesh axis, a list of mesh axes or null "
                             f"(replicated); got {target!r}")
        for a in axes:
            if a not in mesh_axes:
                raise ValueError(f"{where}: the rule for {name!r} names unknown mesh axis {a!r}{_hint(a, mesh_axes)}; "
                                 f"the mesh axes are {', '.join(mesh_axes)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"{where}: the rule for {name!r} names a mesh axis twice: {list(axes)}")
        if name in UNSPLIT_AXES:
            raise ValueError(f"{where}: logical axis {name!r} is always replicated (the stacked layers keep it "
                             "whole); map it to null or leave it out")
        out.append((name, axes[0] if isinstance(target, str) else tuple(axes)))
    return tuple(out)


def _hint(name, choices) -> str:
    import difflib  # deferred: only an error needs it

    near = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


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


def axes_of(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names) as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def entry_of(axes: tuple):
    """The PartitionSpec entry splitting over `axes`: None, one name, or the tuple."""
    if not axes:
        return None
    return axes if len(axes) != 1 else axes[0]
