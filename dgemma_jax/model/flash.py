"""The denoiser's attention, canvas and KV cache under one softmax, as ONE fused TPU kernel (Pallas).

Written in XLA, attention materialises a [queries, keys] float32 score tile per key block, and the
TPU compiler keeps it in HBM: on v5p-8 the 26B step's global layers then write and re-read ~0.5 GB
of scores per layer at a 32k cache, more than their K/V. This kernel keeps every score tile, the
running softmax max and sum and the float32 accumulator in on-chip memory: a denoiser layer's
attention reads q, the canvas's K/V and the cache's K/V once and writes its output, nothing else.

`denoise_attention` folds each KV head's G query heads into the query rows ([T G, H] queries
against that head's keys), so every query block sees each K/V block once, read straight from the
cache's [B, K, S, H] layout (model/cache.py; no copy into another order). The kernel's key axis
walks the canvas's own keys first (every canvas query sees all of them: the denoiser is
bidirectional) and then the cache's, whose visible slots come as a per-slot mask (query-independent:
the denoiser's global layers and its "block" sliding window). Because the canvas comes first every
row has seen keys before any cache block, so masked slots weigh exactly zero, and one softmax spans
both key sets: no log-sum-exp statistics leave the chip to be merged in XLA. (jax's flash-attention
kernel, used before, took only the cache: it returned its max and sum, each broadcast over 128
lanes in float32, and the canvas's own [T, T] scores were XLA's: ~0.8 GB a step at 32 slots on a
v6e-8, projected. Splash attention, before that, also returned its accumulator.)

Off TPU the same kernel runs in Pallas's interpreter (tests compare it with the XLA path on
CPU). Gradients come from the XLA formulation (a `custom_vjp`), so LoRA training through the
kernel is exact. On a mesh the kernel runs per head shard (`head_parallel`). The compiler sees the
kernel as one opaque call; `denoise_attention` tells the runtime's observer its FLOPs (`kernel_flops`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dgemma_jax.axis_rules import CACHE_AXES, axes_of
from dgemma_jax.runtime import Runtime

_NEG = -1e30
_LANES = 128
_BLOCK = 512   # the most query rows, or keys, one grid step holds


def _block(n: int) -> int | None:
    """Rows or keys a grid step holds: all n when n < 128, else the largest multiple of 128 dividing
    n up to `_BLOCK` (None: n cannot be tiled)."""
    if n < _LANES:
        return n if n % 8 == 0 else None
    for c in range(min(n, _BLOCK) // _LANES * _LANES, 0, -_LANES):
        if n % c == 0:
            return c
    return None


def supported(rows: int, canvas: int, keys: int, head_dim: int) -> bool:
    """Shapes the kernel takes: at least 128 query rows (T x G) in whole tiles, cache slots and head_dim
    in whole 128-lane tiles (a narrower head would leave lanes idle and make the TPU compiler relay the
    cache out: small configs keep XLA), canvas keys in whole 128-lane tiles or fewer than 128."""
    return (rows >= _LANES and _block(rows) is not None and _block(canvas) is not None
            and keys % _LANES == 0 and head_dim % _LANES == 0)


def _lanes(x, n: int):
    """A lane-replicated [rows, 128] statistic spread over n columns."""
    return jnp.tile(x, (1, n // _LANES)) if n >= _LANES else x[:, :n]


def _kernel(q_ref, kc_ref, vc_ref, k_ref, v_ref, valid_ref, o_ref, m_ref, l_ref, acc_ref, *, canvas_blocks):
    from jax.experimental import pallas as pl  # (deferred: Mosaic machinery only the kernel path needs)

    j = pl.program_id(3)

    @pl.when(j == 0)
    def _start():
        m_ref[...] = jnp.full(m_ref.shape, _NEG, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def keys(k, v, visible):
        s = jax.lax.dot_general(q_ref[0, 0], k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)      # [rows, keys]
        if visible is not None:   # the canvas came first: a masked slot's exp is exactly 0
            s = jnp.where(visible, s, _NEG)
        m_prev = m_ref[...]
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))   # [rows, 128]
        p = jnp.exp(s - _lanes(m_next, s.shape[1]))
        scale = jnp.exp(m_prev - m_next)
        l_ref[...] = scale * l_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        m_ref[...] = m_next
        acc_ref[...] = acc_ref[...] * _lanes(scale, acc_ref.shape[1]) + jax.lax.dot(
            p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    @pl.when(j < canvas_blocks)
    def _canvas():
        keys(kc_ref[0, 0], vc_ref[0, 0], None)

    @pl.when(j >= canvas_blocks)
    def _cache():
        keys(k_ref[0, 0], v_ref[0, 0], valid_ref[0, :1, :] > 0)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[0, 0] = (acc_ref[...] / _lanes(l_ref[...], acc_ref.shape[1])).astype(o_ref.dtype)


def _kernel_call(q, k, v, cache_k, cache_v, valid, interpret):
    # deferred: the Pallas TPU machinery only the kernel path needs
    from jax.experimental import pallas as pl  # (deferred, as above)
    from jax.experimental.pallas import tpu as pltpu  # (deferred, as above)

    b, t, n, h = q.shape
    kh, s = cache_k.shape[1], cache_k.shape[2]
    g = n // kh
    rows = t * g
    # [B, K, T G, H] queries: row t * G + j is query t of the head's j-th query head
    qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, rows, h)
    # the mask on 8 sublanes (one TPU tile's rows), as the kernel reads it
    vis = jnp.broadcast_to(valid.astype(jnp.int32)[:, None, :], (b, 8, s))
    bq, bc, bs = _block(rows), _block(t), _block(s)
    nc = t // bc
    grid = (b, kh, rows // bq, nc + s // bs)
    spec = pl.BlockSpec
    call = pl.pallas_call(
        functools.partial(_kernel, canvas_blocks=nc),
        grid=grid,
        in_specs=[
            spec((1, 1, bq, h), lambda b, k, i, j: (b, k, i, 0)),
            spec((1, 1, bc, h), lambda b, k, i, j: (b, k, jnp.minimum(j, nc - 1), 0)),
            spec((1, 1, bc, h), lambda b, k, i, j: (b, k, jnp.minimum(j, nc - 1), 0)),
            spec((1, 1, bs, h), lambda b, k, i, j: (b, k, jnp.maximum(j - nc, 0), 0)),
            spec((1, 1, bs, h), lambda b, k, i, j: (b, k, jnp.maximum(j - nc, 0), 0)),
            spec((1, 8, bs), lambda b, k, i, j: (b, 0, jnp.maximum(j - nc, 0))),
        ],
        out_specs=spec((1, 1, bq, h), lambda b, k, i, j: (b, k, i, 0)),
        out_shape=jax.ShapeDtypeStruct(qr.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((bq, _LANES), jnp.float32), pltpu.VMEM((bq, _LANES), jnp.float32),
                        pltpu.VMEM((bq, h), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        interpret=interpret,   # off TPU: Pallas's interpreter
        name="denoise_attention")
    dt = q.dtype
    out = call(qr, k.astype(dt), v.astype(dt), cache_k.astype(dt), cache_v.astype(dt), vis)
    return out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


def _reference(q, k, v, cache_k, cache_v, valid):
    """The same contract in plain XLA (the gradient's): one softmax over [cache where valid ; canvas]."""
    b, t, n, h = q.shape
    qg = q.reshape(b, t, k.shape[1], n // k.shape[1], h)
    scores = lambda keys: jnp.einsum("btkgh,bksh->bktgs", qg, keys, preferred_element_type=jnp.float32)  # noqa: E731
    s_cache = jnp.where(valid[:, None, None, None, :], scores(cache_k), _NEG)
    s_own = scores(k)
    m = jax.lax.stop_gradient(jnp.maximum(s_cache.max(-1), s_own.max(-1)))[..., None]
    p_cache, p_own = jnp.exp(s_cache - m), jnp.exp(s_own - m)
    weighted = lambda p, vals: jnp.einsum("bktgs,bksh->bktgh", p.astype(vals.dtype), vals,  # noqa: E731
                                          preferred_element_type=jnp.float32)
    out = (weighted(p_cache, cache_v) + weighted(p_own, v)) / (p_cache.sum(-1) + p_own.sum(-1))[..., None]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attend(q, k, v, cache_k, cache_v, valid, interpret):
    return _kernel_call(q, k, v, cache_k, cache_v, valid, interpret)


def _attend_fwd(q, k, v, cache_k, cache_v, valid, interpret):
    return _kernel_call(q, k, v, cache_k, cache_v, valid, interpret), (q, k, v, cache_k, cache_v, valid)


def _attend_bwd(interpret, res, cot):
    q, k, v, cache_k, cache_v, valid = res
    _, vjp = jax.vjp(lambda *a: _reference(*a, valid), q, k, v, cache_k, cache_v)
    return (*vjp(cot), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def kernel_flops(q_shape, canvas_keys: int, cache_keys: int) -> float:
    """FLOPs of one kernel call: q k^T and p v, 2 x 2 x queries x heads x head_dim x keys seen."""
    b, t, n, h = q_shape
    return 4.0 * b * t * n * h * (canvas_keys + cache_keys)


def denoise_attention(q: jax.Array, k: jax.Array, v: jax.Array, cache_k: jax.Array, cache_v: jax.Array,
                      valid: jax.Array, rt: Runtime | None = None) -> jax.Array:
    """Softmax attention of the canvas's q [B, T, N, H] over its own k, v [B, K, T, H] (all visible)
    and the cache's cache_k, cache_v [B, K, S, H] where valid [B, S] (bool), one softmax over both.

    Query head n reads KV head n // (N / K); no score scaling (Gemma 4's q/k norms take that role).
    Returns [B, T, N, H] in q's dtype. `rt`: the runtime compiled for (Pallas's interpreter runs the
    kernel off TPU; default: this process's backend); its observer hears of the call.
    """
    interpret = rt.kernel_interpreted if rt is not None else jax.default_backend() != "tpu"
    b, t, n, h = q.shape
    kh, s = cache_k.shape[1], cache_k.shape[2]
    if not supported(t * (n // kh), t, s, h):
        raise ValueError(f"denoise_attention needs query rows (T x G >= 128) and canvas keys in whole 128-lane "
                         f"tiles (or canvas keys under 128 in whole 8-row tiles), and cache slots and head_dim in "
                         f"whole 128-lane tiles; got T x G = {t * (n // kh)}, T = {t}, S = {s}, H = {h}")
    if rt is not None:
        rt.kernel_call("denoise_attention", kernel_flops(q.shape, t, s))
    return _attend(q, k, v, cache_k, cache_v, valid, bool(interpret))


def head_parallel(rt: Runtime, fn, q, k, v, cache_k, cache_v, valid):
    """Run the attention kernel `fn(q, k, v, cache_k, cache_v, valid, rt=) -> out` per head shard.

    q [B, T, N, H]; k, v [B, K, T, H] and cache_k, cache_v [B, K, S, H] (cache layout); valid [B, S].
    A Pallas kernel is one opaque call the partitioner cannot split, so on a mesh it runs inside a
    `shard_map` over the batch and head axes, each device on its own query heads and the KV heads
    they read. Returns None when the layout does not allow it (query and KV heads split over
    different mesh axes, or keys split along their slots or head_dim): the caller then keeps the
    XLA path. Without a mesh this is just `fn(...)`.
    """
    if rt.mesh is None:
        return fn(q, k, v, cache_k, cache_v, valid, rt=rt)
    qs = rt.spec(q.shape, ("batch", None, "heads", None))
    ks, cs = rt.spec(k.shape, CACHE_AXES), rt.spec(cache_k.shape, CACHE_AXES)
    for spec in (ks, cs):
        if spec[2] is not None or spec[3] is not None or axes_of(qs[0]) != axes_of(spec[0]) \
                or axes_of(qs[2]) != axes_of(spec[1]):
            return None
    inner = rt.local()
    return jax.shard_map(
        lambda *a: fn(*a, rt=inner), mesh=rt.mesh, check_vma=False,
        in_specs=(qs, ks, ks, cs, cs, PartitionSpec(qs[0], None)), out_specs=qs)(q, k, v, cache_k, cache_v, valid)
