"""What a denoise step MUST do, per chip: the useful FLOPs and the bytes that must move.

These are the yardsticks the compiler's `cost_analysis` is held against (performance issue,
target 3): a compiled step should count at most ~1.25x the useful FLOPs (no all-experts dense
compute, no recomputation) and ~1.25x the required bytes (each chip's weight shard read once plus
its KV-cache reads).

Useful FLOPs of one denoising step over B x L canvas tokens (whole mesh; divide by chips):
* every dense projection (attention q/k/v/o, dense MLP, router, self-conditioning MLP): 2 x tokens x size;
* experts: 2 x tokens x top_k x (one expert's gate_up + down);
* attention: 4 x tokens x heads x head_dim x keys read (window - 1 + L on sliding layers, the
  whole cache + L on global layers, as the kernels read them);
* head: logits and the self-conditioning soft embedding, 2 x 2 x tokens x V x D.

Required bytes per chip: the chip's shard of every parameter, plus its shard of the cache slots
the step reads (window - 1 slots of K and V on sliding layers, all slots on global layers).
"""

from __future__ import annotations

import math

import jax

from dgemma_jax.config import SLIDING, ModelConfig
from dgemma_jax.model.api import param_shapes

_MATMULS = ("attn/q", "attn/k", "attn/v", "attn/o", "dense_mlp/gate_up", "dense_mlp/down", "moe/router",
            "sc_mlp/gate_up", "sc_mlp/down")


def _path(p) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in p)


def denoise_step_flops(config: ModelConfig, batch: int, context: int) -> float:
    """Useful FLOPs of one denoising step (all chips together) at a cache of `context` slots."""
    tokens = batch * config.canvas_length
    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]:
        name = _path(path)
        size = math.prod(leaf.shape)
        if any(name.endswith(m) for m in _MATMULS):
            total += 2.0 * tokens * size
        elif name.endswith("moe/gate_up") or name.endswith("moe/down"):
            total += 2.0 * tokens * size * config.top_k / config.num_experts
        elif name == "embedding":
            total += 2.0 * 2.0 * tokens * size
    for i in range(config.num_layers):
        keys = _keys_read(config, i, context) + config.canvas_length
        total += 4.0 * tokens * config.num_heads * config.layer_head_dim(i) * keys
    return total


def _keys_read(config: ModelConfig, layer: int, context: int) -> int:
    """Cache slots a denoising step reads on `layer` (see `Attention.denoise`)."""
    if config.layer_types[layer] == SLIDING and config.sliding_window - 1 < context:
        return config.sliding_window - 1
    return context


def denoise_step_bytes_per_chip(config: ModelConfig, shardings, batch: int, context: int) -> dict[str, float]:
    """{"params", "cache", "total"}: bytes one chip must read for one step (its shards)."""
    def shard_bytes(leaf, sharding):
        return math.prod(sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize

    params = sum(jax.tree.leaves(jax.tree.map(shard_bytes, param_shapes(config), shardings.params)))
    shapes, cshard = shardings.cache_shape(batch, context), shardings.cache(batch, context)
    cache = 0.0
    for i in range(config.num_layers):
        frac = _keys_read(config, i, context) / context
        for leaf, sh in ((shapes.keys[i], cshard.keys[i]), (shapes.values[i], cshard.values[i])):
            cache += frac * shard_bytes(leaf, sh)
    return {"params": float(params), "cache": float(cache), "total": float(params + cache)}
