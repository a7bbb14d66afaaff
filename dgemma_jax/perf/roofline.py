"""What a denoise step MUST do, per chip: the useful FLOPs and the bytes that must move.

These are the yardsticks the compiler's `cost_analysis` is held against (performance issue,
target 3): a compiled step should count at most ~1.25x the useful FLOPs (no all-experts dense
compute, no recomputation) and ~1.25x the required bytes (each chip's weight shard read once plus
its KV-cache reads).

Useful FLOPs of one denoising step over B x L canvas tokens (whole mesh; divide by chips):
* every dense projection (attention q/k/v/o, dense MLP, router, self-conditioning MLP): 2 x tokens x size;
* experts: 2 x tokens x top_k x (one expert's gate_up + down);
* attention: 4 x tokens x heads x head_dim x keys read (the ring cache + L on sliding layers,
  `model.cache.ring_size`; the whole cache + L on global layers, as the kernels read them);
* head: logits and the self-conditioning soft embedding, 2 x 2 x tokens x V x D.
`denoise_step_flops_by_part` splits that count by part (the CPU benchmarks' tables);
`causal_pass_flops` counts a causal pass (prefill, commit, a 1-token decode) the same way, with the
attention pairs its causal mask keeps. tests/test_perf_flops.py holds both against the matrix
products of the traced model.

Required bytes per chip: the chip's shard of every parameter, plus its shard of the cache slots
the step must read (window - 1 slots of K and V on sliding layers, of their ring; all slots on global
layers).
"""

from __future__ import annotations

import functools
import math
import re

import jax

from dgemma_jax.config import SLIDING, ModelConfig
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.cache import SLOT_AXIS, ring_size
from dgemma_jax.model.layers import itemsize

# the parameter each matrix product multiplies by, by report part ("experts_topk": every expert's
# kernel, of which a token uses top_k / num_experts; "embedding": the head's V x D, used twice by a step)
_PARTS = (("qkvo_proj", r"^blocks_\d+/attn/[qkvo]$"), ("dense_mlp", r"^blocks_\d+/dense_mlp/(gate_up|down)$"),
          ("router", r"^blocks_\d+/moe/router$"), ("experts_topk", r"^blocks_\d+/moe/(gate_up|down)$"),
          ("sc_mlp", r"^sc_mlp/(gate_up|down)$"), ("embedding", r"^embedding$"))
# the denoise step's parts: the trunk's (everything before the final norm), then the head's
TRUNK_PARTS = ("qkvo_proj", "attention", "dense_mlp", "experts_topk", "router", "sc_mlp")
HEAD_PARTS = ("head_logits", "sc_soft_embedding")
# a causal pass (prefill, commit, a 1-token decode) runs the layers only, and the head where asked
CAUSAL_PARTS = ("qkvo_proj", "attention", "dense_mlp", "experts_topk", "router", "head_logits")


def _path(p) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in p)


@functools.lru_cache(maxsize=16)
def _token_macs(config: ModelConfig) -> dict[str, int]:
    """Multiply-accumulates per token of every weight product, by part (from the parameter shapes, traced
    once per config; read-only)."""
    out = {part: 0 for part, _ in _PARTS}
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]:
        name = _path(path)
        part = next((part for part, pattern in _PARTS if re.match(pattern, name)), None)
        if part == "experts_topk":
            out[part] += math.prod(leaf.shape) * config.top_k // config.num_experts
        elif part is not None:
            out[part] += math.prod(leaf.shape)
    return out


def _attention_macs(config: ModelConfig, layer: int, keys: int) -> int:
    """QK^T and PV of one layer over `keys` query-key pairs, all heads."""
    return 2 * config.num_heads * config.layer_head_dim(layer) * keys


def denoise_step_flops_by_part(config: ModelConfig, batch: int, context: int, canvas: int | None = None) -> dict:
    """Useful FLOPs (2 x multiply-accumulates, all rows) of one denoising step over a canvas of `canvas`
    tokens (default the config's) after `context` cached ones, by part (`TRUNK_PARTS`, `HEAD_PARTS`),
    with "trunk" and "total" (integers)."""
    canvas = config.canvas_length if canvas is None else canvas
    macs = _token_macs(config)
    acc = {part: canvas * macs[part] for part in ("qkvo_proj", "dense_mlp", "experts_topk", "router", "sc_mlp")}
    acc["attention"] = sum(_attention_macs(config, i, canvas * (_keys_read(config, i, context) + canvas))
                           for i in range(config.num_layers))
    acc["head_logits"] = acc["sc_soft_embedding"] = canvas * macs["embedding"]
    out = {part: 2 * batch * acc[part] for part in TRUNK_PARTS + HEAD_PARTS}
    out["trunk"] = sum(out[k] for k in TRUNK_PARTS)
    out["total"] = out["trunk"] + sum(out[k] for k in HEAD_PARTS)
    return out


def denoise_step_flops(config: ModelConfig, batch: int, context: int) -> float:
    """Useful FLOPs of one denoising step (all chips together) at a cache of `context` slots."""
    return float(denoise_step_flops_by_part(config, batch, context)["total"])


def causal_pass_flops(config: ModelConfig, batch: int, context: int, new: int, head_tokens: int = 0) -> dict:
    """Useful FLOPs of a causal pass (prefill, commit, a 1-token decode) of `new` tokens per row after
    `context` committed ones, plus the head's logits on `head_tokens` of them, by part (`CAUSAL_PARTS`)
    with "total". Attention counts the pairs the causal mask keeps: a token at position p sees
    p + 1 keys on global layers and min(window, p + 1) on sliding ones (useful work, not the blocks an
    implementation may compute and mask)."""
    macs = _token_macs(config)
    acc = {part: new * macs[part] for part in ("qkvo_proj", "dense_mlp", "experts_topk", "router")}
    acc["attention"] = 0
    for i in range(config.num_layers):
        seen = range(context + 1, context + new + 1)
        keys = sum(seen) if config.layer_types[i] != SLIDING else sum(min(config.sliding_window, s) for s in seen)
        acc["attention"] += _attention_macs(config, i, keys)
    acc["head_logits"] = head_tokens * macs["embedding"]
    out = {part: 2 * batch * acc[part] for part in CAUSAL_PARTS}
    out["total"] = sum(out.values())
    return out


def _keys_read(config: ModelConfig, layer: int, context: int) -> int:
    """Cache slots a denoising step reads on `layer` (see `Attention.denoise`): a sliding layer's
    whole ring (`model.cache.ring_size`), a global layer's every slot."""
    if config.layer_types[layer] == SLIDING:
        return ring_size(config, context)
    return context


def denoise_step_bytes_per_chip(config: ModelConfig, shardings, batch: int, context: int,
                                params=None) -> dict[str, float]:
    """{"params", "cache", "total"}: bytes one chip must read for one step (its shards). params: the
    parameter tree (arrays or ShapeDtypeStructs; default the float `param_shapes`), e.g. with int8
    kernels, placed per `shardings.for_params`."""
    def shard_bytes(leaf, sharding):
        return math.prod(sharding.shard_shape(leaf.shape)) * itemsize(leaf.dtype)

    tree = param_shapes(config) if params is None else params
    placement = shardings.params if params is None else shardings.for_params(tree)
    params = sum(jax.tree.leaves(jax.tree.map(shard_bytes, tree, placement)))
    shapes, cshard = shardings.cache_shape(batch, context), shardings.cache(batch, context)
    cache = 0.0
    for i in range(config.num_layers):
        slots = shapes.keys[i].shape[SLOT_AXIS]   # a sliding layer's ring, a global layer's context
        frac = min(config.sliding_window - 1, slots) / slots if config.layer_types[i] == SLIDING else 1.0
        for leaf, sh in ((shapes.keys[i], cshard.keys[i]), (shapes.values[i], cshard.values[i])):
            cache += frac * shard_bytes(leaf, sh)
    return {"params": float(params), "cache": float(cache), "total": float(params + cache)}


def tree_bytes(tree) -> int:
    """Bytes a tree of arrays or ShapeDtypeStructs holds (all shards together)."""
    return int(sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(tree)))
