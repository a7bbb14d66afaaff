"""Mixture of experts: the Gemma 4 router and pluggable dropless dispatch strategies.

Router: r = rms_normalize(h) * router_scale * D^-1/2; p = softmax(r Wr) over ALL experts in float32;
top-k of p; renormalise the k weights to sum 1; multiply by per_expert_scale[expert].
Each expert: down_e(gelu_tanh(z G_e) * (z U_e)), z = the pre-MoE-normed input.

Dispatch strategies (all dropless, all equal to the dense oracle):
* "dense"    every token through every expert, weighted by the (mostly zero) combine weights.
             The oracle; also fine for tiny expert counts.
* "ragged"   sort token-expert pairs by expert and run `lax.ragged_dot` grouped matmuls
             (the TPU/GPU path).
* "capacity" scatter pairs into per-expert buffers of `capacity` rows and run one batched matmul;
             if any expert overflows its buffer the step falls back to a dropless path under
             `lax.cond` ("dense" on CPU, "ragged" elsewhere), so nothing is ever dropped. Fast on CPU.
* "auto"     "capacity" on CPU, "ragged" elsewhere.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.layers import gelu_tanh, ones_param, param, rms_normalize
from dgemma_jax.parallel.context import constrain


def route(h: jax.Array, w_router: jax.Array, router_scale: jax.Array, expert_scale: jax.Array, top_k: int,
          eps: float):
    """h: [N, D] un-normed residual -> (weights [N, k] float32, experts [N, k] int32)."""
    d = h.shape[-1]
    r = rms_normalize(h, eps) * router_scale.astype(jnp.float32) * (d ** -0.5)
    logits = jnp.einsum("nd,de->ne", r, w_router.astype(jnp.float32), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    w = w * expert_scale.astype(jnp.float32)[idx]
    return w, idx.astype(jnp.int32)


def _expert_ffn_dense(z, gate_up, down):
    """All experts on all tokens: z [N, D] -> [N, E, D]."""
    h = constrain(jnp.einsum("nd,edcf->necf", z, gate_up), (None, "experts", None, "expert_mlp"))
    h = gelu_tanh(h[..., 0, :]) * h[..., 1, :]
    return jnp.einsum("nef,efd->ned", h, down)


def dispatch_dense(z, weights, experts, gate_up, down):
    n, e = z.shape[0], gate_up.shape[0]
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)
    y = _expert_ffn_dense(z, gate_up, down)
    return jnp.einsum("ned,ne->nd", y, combine.astype(y.dtype))


def _sorted_pairs(experts, num_experts):
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, sizes


def dispatch_ragged(z, weights, experts, gate_up, down):
    n, k = experts.shape
    e, d, _, f = gate_up.shape
    order, sizes = _sorted_pairs(experts, e)
    token = order // k
    xs = z[token]
    h = jax.lax.ragged_dot(xs, gate_up.reshape(e, d, 2 * f), sizes)
    h = gelu_tanh(h[:, :f]) * h[:, f:]
    y = jax.lax.ragged_dot(h, down, sizes)
    y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros((n, d), y.dtype).at[token].add(y)


def capacity_for(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    cap = int(math.ceil(factor * num_tokens * top_k / num_experts))
    cap = max(8, -(-cap // 8) * 8)
    return min(cap, num_tokens)


def dispatch_capacity(z, weights, experts, gate_up, down, capacity: int):
    n, k = experts.shape
    e, d, _, f = gate_up.shape
    flat = experts.reshape(-1)
    # rank of each (token, choice) pair inside its expert, in token order
    onehot = jax.nn.one_hot(flat, e, dtype=jnp.int32)
    rank = (jnp.cumsum(onehot, axis=0) - onehot)[jnp.arange(n * k), flat]
    fits = rank < capacity

    def buffered(_):
        slot = jnp.where(fits, rank, capacity)
        token = jnp.arange(n * k) // k
        buf = jnp.zeros((e, capacity, d), z.dtype).at[flat, slot].set(z[token], mode="drop")
        buf = constrain(buf, ("experts", None, "embed"))
        h = jnp.einsum("ecd,edgf->ecgf", buf, gate_up)
        h = gelu_tanh(h[..., 0, :]) * h[..., 1, :]
        y = constrain(jnp.einsum("ecf,efd->ecd", h, down), ("experts", None, "embed"))
        out = y.at[flat, slot].get(mode="fill", fill_value=0)  # [n*k, d]
        out = out * weights.reshape(-1)[:, None].astype(out.dtype)
        return out.reshape(n, k, d).sum(1)

    def fallback(_):  # an expert overflowed: run a dropless path for this step
        if target_backend() == "cpu":  # ragged_dot is slow on CPU; all-experts is ~2x faster
            return dispatch_dense(z, weights, experts, gate_up, down)
        return dispatch_ragged(z, weights, experts, gate_up, down)

    return jax.lax.cond(jnp.all(fits), buffered, fallback, None)


_TARGET_BACKEND: list[str] = []


def target_backend() -> str:
    """The platform programs are being built for: the default backend, unless an AOT compile for
    another platform (e.g. TPU from a CPU machine) set it with `compiling_for`."""
    return _TARGET_BACKEND[-1] if _TARGET_BACKEND else jax.default_backend()


class compiling_for:
    """Context manager: trace MoE dispatch choices for `platform` (used by AOT compilation)."""

    def __init__(self, platform: str):
        self.platform = platform

    def __enter__(self):
        _TARGET_BACKEND.append(self.platform)

    def __exit__(self, *exc):
        _TARGET_BACKEND.pop()


def resolve_dispatch(name: str) -> str:
    if name != "auto":
        return name
    return "capacity" if target_backend() == "cpu" else "ragged"


class MoE(nn.Module):
    """Router + experts. `__call__(h, z)`: h [B, T, D] routes, z [B, T, D] is processed."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, h: jax.Array, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        w_router = param(self, "router", (d, e), ("embed", "experts_router"), cfg)
        router_scale = ones_param(self, "router_scale", (d,), ("norm",), cfg)
        expert_scale = ones_param(self, "expert_scale", (e,), ("experts_router",), cfg)
        gate_up = param(self, "gate_up", (e, d, 2, f), ("experts", "embed", None, "expert_mlp"), cfg)
        down = param(self, "down", (e, f, d), ("experts", "expert_mlp", "embed"), cfg)

        shape = z.shape
        hf = h.reshape(-1, d)
        zf = z.reshape(-1, d)
        with jax.named_scope("router"):
            weights, experts = route(hf, w_router, router_scale, expert_scale, cfg.top_k, cfg.rms_norm_eps)
        gate_up, down = gate_up.astype(z.dtype), down.astype(z.dtype)
        strategy = resolve_dispatch(cfg.moe_dispatch)
        with jax.named_scope(f"experts_{strategy}"):
            if strategy == "dense":
                y = dispatch_dense(zf, weights, experts, gate_up, down)
            elif strategy == "ragged":
                y = dispatch_ragged(zf, weights, experts, gate_up, down)
            else:
                cap = capacity_for(zf.shape[0], cfg.top_k, e, cfg.moe_capacity_factor)
                y = dispatch_capacity(zf, weights, experts, gate_up, down, cap)
        return y.reshape(shape).astype(z.dtype)
