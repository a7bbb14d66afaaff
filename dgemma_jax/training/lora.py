"""LoRA adapters on chosen linear groups, applied UNMERGED: y = x W + (alpha / r) (x A) B.

Training never folds the adapters into the base: the model reads the frozen base kernels in their
own dtype and adds the low-rank term computed from the float32 adapters (`model.layers.project`,
and per expert in every MoE dispatch path), so an update too small for the base dtype (in bf16 any
delta under half an ulp of W) still changes the output, and no dense [in, out] delta is ever built.
`forward_adapters` lays the adapters out for the model's "lora" variable collection; `merge` folds
them in (W + (alpha / r) A @ B, in W's dtype) only for export and inference.

Every linear weight of the model is an einsum kernel with logical axis names (see
`dgemma_jax.model.logical_axes`). A kernel is viewed as a (batch of) matrix [in, out]:

* axes named "experts" are batch axes (one adapter per expert);
* if the last axis is "embed" the kernel writes the residual stream: out = that axis, in = the rest
  (attention o [N, H, D], MLP down [F, D], expert down [E, F, D]);
* otherwise in = the first non-batch axis, out = the rest (q [D, N, H], k/v [D, K, H],
  gate_up [D, 2, F], expert gate_up [E, D, 2F]).

A: [*batch, in, r] (random, std 1/sqrt(in)), B: [*batch, r, out] (zeros), so a fresh adapter is
exactly the base model. Groups (regular expressions over the "/"-joined parameter path):
"""

from __future__ import annotations

import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import logical_axes

LORA_GROUPS: dict[str, str] = {
    "attention": r"(^|/)attn/(q|k|v|o)$",
    "mlp": r"(^|/)dense_mlp/(gate_up|down)$",
    "experts": r"(^|/)moe/(gate_up|down)$",
    "self_conditioning": r"(^|/)sc_mlp/(gate_up|down)$",
}
__doc__ += "\n" + "\n".join(f"    {k:18s} {v}" for k, v in LORA_GROUPS.items()) + "\n"

# every MoE parameter except the expert kernels: the router projection, its input scale and the
# per-expert output scale (transformers' router.proj / router.scale / router.per_expert_scale) and
# anything added to the routing later; `freeze_router` freezes all of them (spec: router frozen in SFT)
ROUTER_PATTERN = r"(^|/)moe/(?!(gate_up|down)$)[^/]+$"
# the vision tower and its projection (a checkpoint with `vision`): the trainer is text-only, so they stay as loaded
VISION_PATTERN = r"^(vision_tower|embed_vision)/"


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _spec_names(spec) -> tuple:
    return tuple(spec) if spec is not None else ()


def target_paths(config: ModelConfig, groups: Sequence[str]) -> dict[str, tuple]:
    """{path: logical axes} of the kernels the chosen groups adapt."""
    unknown = [g for g in groups if g not in LORA_GROUPS]
    if unknown:
        raise ValueError(f"unknown LoRA group(s) {unknown}; choose from {sorted(LORA_GROUPS)}")
    pats = [re.compile(LORA_GROUPS[g]) for g in groups]
    axes = logical_axes(config)
    flat = jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
    out = {}
    for path, spec in flat:
        p = path_str(path)
        if any(pt.search(p) for pt in pats):
            out[p] = _spec_names(spec)
    if not out:
        raise ValueError(f"LoRA groups {list(groups)} match no parameter of this model")
    return out


def split_axes(names: tuple) -> tuple[list[int], list[int], list[int]]:
    """(batch axes, in axes, out axes) of a kernel from its logical axis names."""
    batch = [i for i, n in enumerate(names) if n == "experts"]
    rest = [i for i in range(len(names)) if i not in batch]
    if names[rest[-1]] == "embed":
        return batch, rest[:-1], rest[-1:]
    return batch, rest[:1], rest[1:]


def _get(tree, path: str):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def _set(tree: dict, path: str, value) -> None:
    keys = path.split("/")
    for k in keys[:-1]:
        tree = tree.setdefault(k, {})
    tree[keys[-1]] = value


def init_lora(config: ModelConfig, params, rng: jax.Array, rank: int, groups: Sequence[str],
              dtype=jnp.float32) -> dict:
    """Adapter tree mirroring the params tree: {..path..: {"a": A, "b": B}} for every target kernel."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    lora: dict = {}
    targets = target_paths(config, groups)
    for i, (p, names) in enumerate(sorted(targets.items())):
        w = _get(params, p)
        batch, ins, outs = split_axes(names)
        bshape = [w.shape[j] for j in batch]
        n_in = int(np.prod([w.shape[j] for j in ins]))
        n_out = int(np.prod([w.shape[j] for j in outs]))
        a = jax.random.normal(jax.random.fold_in(rng, i), (*bshape, n_in, rank), dtype) / math.sqrt(n_in)
        b = jnp.zeros((*bshape, rank, n_out), dtype)
        _set(lora, p, {"a": a, "b": b})
    return lora


def _lora_leaves(lora) -> dict[str, dict]:
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict) and set(node) == {"a", "b"} and not isinstance(node["a"], dict):
            out[prefix] = node
            return
        for k, v in node.items():
            walk(v, f"{prefix}/{k}" if prefix else k)

    walk(lora, "")
    return out


def delta(config: ModelConfig, path: str, w_shape: tuple, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The dense update (alpha/r) A @ B laid out like the kernel at `path`."""
    names = target_paths_cache(config)[path]
    batch, ins, outs = split_axes(names)
    d = jnp.einsum("...ir,...ro->...io", a, b) * scale          # [*batch, in, out]
    shape_bio = [w_shape[j] for j in batch] + [w_shape[j] for j in ins] + [w_shape[j] for j in outs]
    d = d.reshape(shape_bio)
    perm = batch + ins + outs                                    # axis order of d in terms of w's axes
    return jnp.transpose(d, np.argsort(perm))


_AXES_CACHE: dict = {}


def target_paths_cache(config: ModelConfig) -> dict[str, tuple]:
    if config not in _AXES_CACHE:
        axes = logical_axes(config)
        flat = jax.tree_util.tree_flatten_with_path(
            axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]
        _AXES_CACHE[config] = {path_str(p): _spec_names(s) for p, s in flat}
    return _AXES_CACHE[config]


def forward_adapters(config: ModelConfig, params, lora, alpha: float, rank: int) -> dict:
    """The "lora" variable collection the model runs with: {path: {"a", "b"}} with A reshaped to
    [*batch, *in axes, r] and B to [*batch, r, *out axes] of the kernel at `path`, and B multiplied
    by alpha / rank (a rank-sized product, not a dense delta). Traceable; gradients reach A and B.

        model.apply({"params": params, "lora": forward_adapters(...)}, ...)
    """
    scale = alpha / rank
    axes = target_paths_cache(config)
    out: dict = {}
    for p, ab in _lora_leaves(lora).items():
        if p not in axes:
            raise ValueError(f"LoRA adapter {p!r} names no kernel of this model")
        w_shape = _get(params, p).shape
        batch, ins, outs = split_axes(axes[p])
        if batch + ins + outs != list(range(len(w_shape))):
            raise ValueError(f"kernel {p!r} axes {axes[p]} are not ordered batch, in, out; the unmerged "
                             "LoRA projection needs that order")
        bshape = tuple(w_shape[j] for j in batch)
        a = ab["a"].reshape(*bshape, *(w_shape[j] for j in ins), ab["a"].shape[-1])
        b = (ab["b"] * jnp.asarray(scale, ab["b"].dtype)).reshape(*bshape, ab["b"].shape[-2],
                                                                   *(w_shape[j] for j in outs))
        _set(out, p, {"a": a, "b": b})
    return out


def merge(config: ModelConfig, params, lora, alpha: float, rank: int):
    """Base params with every adapter folded in: W + (alpha / rank) * A @ B (in W's dtype).

    For export and inference only: training runs the adapters unmerged (`forward_adapters`),
    because casting the merged kernel back to a bf16 base rounds small adapter updates away.
    """
    scale = alpha / rank
    leaves = _lora_leaves(lora)

    def fold(path, w):
        p = path_str(path)
        if p not in leaves:
            return w
        ab = leaves[p]
        return (w.astype(jnp.float32) + delta(config, p, w.shape, ab["a"], ab["b"], scale)).astype(w.dtype)

    return jax.tree_util.tree_map_with_path(fold, params)


def count(tree) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
