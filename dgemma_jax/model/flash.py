"""The canvas's attention over the KV cache as ONE fused TPU kernel (Pallas flash attention).

Written in XLA, attention over a long cache materialises a [queries, keys] float32 score tile per
key block, and the TPU compiler may keep it in HBM: on v5p-8 the 26B step's global layers then
write and re-read ~0.5 GB of scores per layer at a 32k cache, more than their K/V. The kernel keeps
each score tile in on-chip memory, so the cache part costs one read of K and V and nothing else.

`cache_attention` runs jax's Pallas flash-attention kernel (`jax.experimental.pallas.ops.tpu.
flash_attention`, its forward pass with the softmax statistics) with each KV head's G query heads
folded into the query rows ([T G, H] queries against that head's [S, H] keys): every query block
then sees each K/V block once, so K and V are read once per step, straight from the cache's
[B, K, S, H] layout (model/cache.py; no copy into another order). Which slots a row may see comes in
as per-slot segment ids (a query-independent mask: the denoiser's global layers and its "block"
sliding window). The kernel returns the normalised output and each query's softmax statistics
(max and sum, whose log-sum-exp `attention.attend` uses to merge the canvas's own keys, exactly as
it merges key blocks). Its running statistics and accumulator live in on-chip scratch.
(jax's splash-attention kernel, used before, returns them as HBM outputs: ~25 MB a layer more
traffic at 32 slots on a v6e-8, ~0.4 ms of the 26B's step.)

Off TPU the same kernel runs in Pallas's interpreter (tests compare it with the XLA path on CPU).
Gradients come from the XLA formulation (a `custom_vjp`), so LoRA training through the kernel is
exact. On a mesh the kernel runs per head shard (`head_parallel`). The compiler sees the
kernel as one opaque call; `cache_attention` tells the runtime's observer its FLOPs (`kernel_flops`).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dgemma_jax.axis_rules import CACHE_AXES, axes_of
from dgemma_jax.runtime import Runtime

_NEG = -1e30


def _divisor(n: int, limit: int, step: int = 128) -> int | None:
    """The largest multiple of `step` that divides n and is <= limit (None when there is none)."""
    for c in range(min(n, limit) // step * step, 0, -step):
        if n % c == 0:
            return c
    return None


def supported(rows: int, keys: int, head_dim: int) -> bool:
    """Shapes the kernel takes: query rows (T x G), keys and head_dim in whole 128-lane tiles."""
    return rows % 128 == 0 and keys % 128 == 0 and head_dim % 128 == 0


def _block_sizes(rows: int, keys: int):
    """(block_q, block_k_major, block_k): query rows and keys a grid step holds, keys a matmul takes."""
    block_k_major = _divisor(keys, 1024)
    return _divisor(rows, 1024), block_k_major, _divisor(block_k_major, 512)


def _reference(q, k, v, valid):
    """The same contract in plain XLA (used for the gradient): out [B, T, N, H] f32, lse [B, T, N]."""
    b, t, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bksh->bktgs", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("bktgs,bksh->bktgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(jnp.isfinite(lse), lse, _NEG)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h), lse.transpose(0, 2, 1, 3).reshape(b, t, n)


def _kernel_call(q, k, v, valid, interpret):
    # deferred: the Pallas TPU ops load Mosaic machinery that only the kernel path needs
    from jax.experimental.pallas import tpu as pltpu  # (deferred, as above)
    from jax.experimental.pallas.ops.tpu import flash_attention as fa  # (deferred, as above)

    b, t, n, h = q.shape
    kh, s = k.shape[1], k.shape[2]
    g = n // kh
    # [B, K, T G, H] queries: row t * G + j is query t of the head's j-th query head
    qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, t * g, h)
    seg = fa.SegmentIds(q=jnp.ones((b, t * g), jnp.int32), kv=valid.astype(jnp.int32))
    bq, bkm, bk = _block_sizes(t * g, s)
    # off TPU: Pallas's HLO interpreter (interpret=True for every pallas_call traced inside; the
    # kernel takes no interpret argument of its own)
    with pltpu.force_tpu_interpret_mode(True) if interpret else contextlib.nullcontext():
        # the forward pass with its softmax statistics (row max m, row sum l), no scaling: the
        # kernel's own entry point (jax is pinned in setup.py) without its gradient wrapper,
        # which returns neither statistic
        out, l, m = fa._flash_attention_impl(
            qr, k.astype(q.dtype), v.astype(q.dtype), ab=None, segment_ids=seg, save_residuals=True, causal=False,
            sm_scale=1.0, block_b=1, block_q=bq, block_k_major=bkm, block_k=bk, debug=False)
    lse = m + jnp.log(l)                              # [B, K, T G]
    out = out.reshape(b, kh, t, g, h).transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)
    lse = lse.reshape(b, kh, t, g).transpose(0, 2, 1, 3).reshape(b, t, n)
    # a row that sees no slot: the kernel's masked value; mark it like the XLA path (no mass)
    lse = jnp.where(lse > 0.1 * _NEG, lse, _NEG)
    return out.astype(jnp.float32), lse.astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attend(q, k, v, valid, interpret):
    return _kernel_call(q, k, v, valid, interpret)


def _attend_fwd(q, k, v, valid, interpret):
    return _kernel_call(q, k, v, valid, interpret), (q, k, v, valid)


def _attend_bwd(interpret, res, cot):
    q, k, v, valid = res
    _, vjp = jax.vjp(lambda q, k, v: _reference(q, k, v, valid), q, k, v)
    return (*vjp(cot), None)


_attend.defvjp(_attend_fwd, _attend_bwd)


def kernel_flops(q_shape, k_shape) -> float:
    """FLOPs of one kernel call: q k^T and p v, 2 x 2 x queries x heads x keys x head_dim."""
    b, t, n, h = q_shape
    return 4.0 * b * t * n * h * k_shape[2]


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                    rt: Runtime | None = None) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q [B, T, N, H] over k, v [B, K, S, H] (the cache's layout) where valid [B, S] (bool).

    Query head n reads KV head n // (N / K); no score scaling (Gemma 4's q/k norms take that role).
    Returns (out [B, T, N, H] float32, normalised over the visible slots, and lse [B, T, N] float32,
    the log-sum-exp of the visible scores, -1e30 where a row sees no slot and out is then
    meaningless). `rt`: the runtime compiled for (Pallas's interpreter runs the kernel off TPU;
    default: this process's backend); its observer hears of the call.
    """
    interpret = rt.kernel_interpreted if rt is not None else jax.default_backend() != "tpu"
    b, t, n, h = q.shape
    if not supported(t * (n // k.shape[1]), k.shape[2], h):
        raise ValueError(f"cache_attention needs query rows, keys and head_dim in multiples of 128; got "
                         f"T x G = {t * (n // k.shape[1])}, S = {k.shape[2]}, H = {h}")
    if rt is not None:
        rt.kernel_call("cache_attention", kernel_flops(q.shape, k.shape))
    return _attend(q, k, v, valid, bool(interpret))


def head_parallel(rt: Runtime, fn, q, k, v, valid):
    """Run the attention kernel `fn(q, k, v, valid, rt=) -> (out, lse)` per head shard.

    q [B, T, N, H]; k, v [B, K, S, H] (cache layout); valid [B, S]. A Pallas kernel is one opaque
    call the partitioner cannot split, so on a mesh it runs inside a `shard_map` over the batch
    and head axes, each device on its own query heads and the KV heads they read. Returns None
    when the layout does not allow it (query and KV heads split over different mesh axes, or the
    cache split along its slots or head_dim): the caller then keeps the XLA path. Without a mesh
    this is just `fn(...)`.
    """
    if rt.mesh is None:
        return fn(q, k, v, valid, rt=rt)
    mesh = rt.mesh
    qs = rt.spec(q.shape, ("batch", None, "heads", None))
    ks = rt.spec(k.shape, CACHE_AXES)
    if ks[2] is not None or ks[3] is not None or axes_of(qs[0]) != axes_of(ks[0]) or axes_of(qs[2]) != axes_of(ks[1]):
        return None
    inner = rt.local()
    return jax.shard_map(
        lambda q, k, v, valid: fn(q, k, v, valid, rt=inner), mesh=mesh, check_vma=False,
        in_specs=(qs, ks, ks, PartitionSpec(qs[0], None)),
        out_specs=(qs, PartitionSpec(qs[0], None, qs[2])))(q, k, v, valid)
