"""The canvas's attention over the KV cache as ONE fused TPU kernel (Pallas splash attention).

Written in XLA, attention over a long cache materialises a [queries, keys] float32 score tile per
key block, and the TPU compiler may keep it in HBM: on v5p-8 the 26B step's global layers then
write and re-read ~0.5 GB of scores per layer at a 32k cache, more than their K/V. The kernel keeps
each score tile in on-chip memory, so the cache part costs one read of K and V and nothing else.

`cache_attention` runs jax's splash-attention kernel in its multi-query form, one call per batch
row and KV head, with that head's G query heads folded into the query rows ([T G, H] queries
against [S, H] keys): every query block then sees each K/V block once, so K and V are read once per
step. Which slots a row may see comes in as per-slot segment ids (a query-independent mask: the
denoiser's global layers and its "block" sliding window). The kernel returns the normalised output
and the log-sum-exp of each query's scores; `attention.attend` merges that with the canvas's own
keys by log-sum-exp, exactly as it merges key blocks.

Off TPU the same kernel runs in Pallas's interpreter (tests compare it with the XLA path on CPU).
Gradients come from the XLA formulation (a `custom_vjp`), so LoRA training through the kernel is
exact. On a mesh the kernel runs per head shard (`head_parallel`). The compiler sees the
kernel as one opaque call; `cache_attention` tells the runtime's observer its FLOPs (`kernel_flops`).
"""

from __future__ import annotations

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


def _kernel(rows: int, keys: int, interpret: bool):
    # deferred: the Pallas TPU ops load Mosaic machinery that only the kernel path needs
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk, splash_attention_mask as sm

    block_q = _divisor(rows, 1024)
    block_kv = _divisor(keys, 1024)
    sizes = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=_divisor(block_kv, 512))
    mask = sm.MultiHeadMask([sm.FullMask((rows, keys))])
    return sk, sk.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, save_residuals=True,
                                  interpret=interpret)


def _reference(q, k, v, valid):
    """The same contract in plain XLA (used for the gradient): out [B, T, N, H] f32, lse [B, T, N]."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, h)
    s = jnp.einsum("btkgh,bskh->bktgs", qg, k, preferred_element_type=jnp.float32)
    s = jnp.where(valid[:, None, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    out = jnp.einsum("bktgs,bskh->bktgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    lse = jnp.where(jnp.isfinite(lse), lse, _NEG)
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h), lse.transpose(0, 2, 1, 3).reshape(b, t, n)


def _kernel_call(q, k, v, valid, interpret):
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    sk, kern = _kernel(t * g, s, interpret)
    # [B, K, T G, H] queries: row t * G + j is query t of the head's j-th query head
    qr = q.reshape(b, t, kh, g, h).transpose(0, 2, 1, 3, 4).reshape(b, kh, 1, t * g, h)
    kr, vr = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]: a bitcast when K = 1
    q_seg = jnp.ones((t * g,), jnp.int32)

    def one(qh, kk, vv, ok):
        out, (lse,) = kern(qh, kk, vv, sk.SegmentIds(q=q_seg, kv=ok.astype(jnp.int32)))
        return out[0], lse[0]

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out, lse = jax.vmap(per_head)(qr, kr, vr, valid)  # [B, K, T G, H], [B, K, T G]
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
    return 4.0 * b * t * n * h * k_shape[1]


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array,
                    rt: Runtime | None = None) -> tuple[jax.Array, jax.Array]:
    """Softmax attention of q [B, T, N, H] over k, v [B, S, K, H] where valid [B, S] (bool).

    Query head n reads KV head n // (N / K); no score scaling (Gemma 4's q/k norms take that role).
    Returns (out [B, T, N, H] float32, normalised over the visible slots, and lse [B, T, N] float32,
    the log-sum-exp of the visible scores, -1e30 where a row sees no slot and out is then
    meaningless). `rt`: the runtime compiled for (Pallas's interpreter runs the kernel off TPU;
    default: this process's backend); its observer hears of the call.
    """
    interpret = rt.kernel_interpreted if rt is not None else jax.default_backend() != "tpu"
    b, t, n, h = q.shape
    if not supported(t * (n // k.shape[2]), k.shape[1], h):
        raise ValueError(f"cache_attention needs query rows, keys and head_dim in multiples of 128; got "
                         f"T x G = {t * (n // k.shape[2])}, S = {k.shape[1]}, H = {h}")
    if rt is not None:
        rt.kernel_call("cache_attention", kernel_flops(q.shape, k.shape))
    return _attend(q, k, v, valid, bool(interpret))


def head_parallel(rt: Runtime, fn, q, k, v, valid):
    """Run the attention kernel `fn(q, k, v, valid, rt=) -> (out, lse)` per head shard.

    q [B, T, N, H]; k, v [B, S, K, H] (cache layout); valid [B, S]. A Pallas kernel is one opaque
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
    if ks[1] is not None or ks[3] is not None or axes_of(qs[0]) != axes_of(ks[0]) or axes_of(qs[2]) != axes_of(ks[2]):
        return None
    inner = rt.local()
    return jax.shard_map(
        lambda q, k, v, valid: fn(q, k, v, valid, rt=inner), mesh=mesh, check_vma=False,
        in_specs=(qs, ks, ks, PartitionSpec(qs[0], None)),
        out_specs=(qs, PartitionSpec(qs[0], None, qs[2])))(q, k, v, valid)
