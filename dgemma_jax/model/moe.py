"""Mixture of experts: the Gemma 4 router and pluggable dropless dispatch strategies.

Router: r = rms_normalize(h) * router_scale * D^-1/2; p = softmax(r Wr) over ALL experts in float32;
top-k of p; renormalise the k weights to sum 1; multiply by per_expert_scale[expert].
Each expert: down_e(gelu_tanh(z G_e) * (z U_e)), z = the pre-MoE-normed input. The kernels are
gate_up [E, D, 2F] (gate columns, then up columns) and down [E, F, D].

Dispatch strategies (all dropless, all equal to the dense oracle):
* "dense"    every token through every expert, weighted by the (mostly zero) combine weights.
             The oracle; also fine for tiny expert counts.
* "ragged"   sort token-expert pairs by expert and run `lax.ragged_dot` grouped matmuls
             (the TPU/GPU path).
* "capacity" gather pairs into per-expert buffers and run one batched matmul. The buffer size is
             picked per call (`lax.switch`) as the smallest of `Runtime.moe_capacity_factor` x the mean
             load x (1, 1.1, 1.2, 1.3, 1.45, 1.6) and the token count that holds the busiest
             expert (steps of ~10%: the batched matmul's time follows its rows), so nothing
             is ever dropped and each expert's weights are read once. Fast on CPU.
* "gmm"      "ragged" with its grouped matmuls as one Pallas TPU kernel each (`model.gmm`), which reads
             int8 / int4 kernels as stored and widens and scales them on chip, and scales each
             pair's output row by its combine weight before it leaves the chip; LoRA adapters take
             the "ragged" path. Off TPU the kernel runs in Pallas's interpreter (tests).
* "auto"     "capacity" on CPU; on TPU "gmm" for int4 expert kernels, "ragged" otherwise
             (`Runtime.dispatch`). Compiled for the 26B's int4 serving tick on a v5e-1 "gmm" moves
             35.3 GB against 62.3 (43.2 vs 76.0 ms projected, 15.04 GB per chip: it fits); in bfloat16
             it moved more than "ragged" (v6e-8, 32 slots: 55.9 vs 48.1 GB a step, older code;
             benchmarks/results/gmm_kernel_projection.json), so "auto" keeps "ragged" there.

int8 (`model.quant`): an expert kernel may be an int8 pair {"int8" [E, ., .], "scale" [E, 1, .]}; every
strategy reads the int8 values, casts them to the activation dtype inside its matmul and scales the
output per expert and channel (`project`, `_ragged`), so the experts stay one byte per weight in HBM.

LoRA (unmerged): each expert kernel may carry per-expert adapters, `adapters` = {"gate_up": {"a":
[E, D, r], "b": [E, r, 2F]}, "down": {"a": [E, F, r], "b": [E, r, D]}} (scale folded into b). Every
strategy adds the float32 term (x A_e) B_e to its expert matmuls (einsums for "dense" / "capacity",
two more grouped matmuls for "ragged"), so an expert never needs a merged dense copy.

On a mesh the dispatch runs per expert shard (`expert_parallel`,
a `shard_map`): each device serves only the pairs routed to the experts it holds and the partial
outputs are summed, so expert weights never move. Where the rows are split over the experts' mesh
axes too (the "throughput" rules) each shard gathers its expert group's rows first and the sums are
reduce-scattered back to the rows' own shards. A shard's "ragged" pairs run in blocks of
`Runtime.moe_shard_rows_factor` x its expected share (a scan whose empty blocks are skipped), so each
shard does ~1/shards of the grouped-matmul work yet drops nothing when its share is larger.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec

from dgemma_jax.config import ModelConfig
from dgemma_jax.model import gmm, layout
from dgemma_jax.model.per_group import PerGroup
from dgemma_jax.model.layers import (GATED_MLP_AXES, QUANT_SCALE, adapter, dequantize, gated_mlp,
                                     gelu_tanh, is_int4, is_quantized, kernel_shape, ones_param, param, project,
                                     quant_values, rms_normalize)
from dgemma_jax.axis_rules import axes_of, entry_of
from dgemma_jax.runtime import Runtime


# Activations up to about this many bytes the TPU compiler keeps on chip between the ops of a layer;
# larger ones go through HBM, and some of the layer's code is written differently for them
# (`moe.dispatch_ragged`'s sum, `expert_parallel`'s all-reduce). Measured on the 26B's serving
# tick for v6e-8: a [tokens, hidden] float32 of 23 MB (8 slots) stayed on chip, 92 MB (32 slots) did
# not; the MoE's bfloat16 sum of 23 MB (4,096 tokens, the 32-slot tick on the "throughput" rules) moved
# fewer bytes scattered in place (a 2-layer cut: 5.77 vs 6.00 GB a tick); the line is not measured closer.
ON_CHIP_BYTES = 16 * 2 ** 20


class DenseBeside(NamedTuple):
    """A dense MLP that runs beside the experts (`expert_parallel`): its input x [N, D], its
    kernels by name (plain or int8 pairs), their logical axes by name, and mlp(x, **kernels) -> [N, D]."""

    x: jax.Array
    kernels: dict
    axes: dict
    mlp: Callable


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


def _gated(h, f):
    """[..., 2F] gate and up halves -> gelu_tanh(gate) * up [..., F]."""
    return gelu_tanh(h[..., :f]) * h[..., f:]


def _ab(adapters, name):
    return None if adapters is None else adapters.get(name)


# the scope of the int4 grouped matmul's loop over blocks of the contracted axis (perf.hbm_traffic)
BLOCK_LOOP_SCOPE = "int4_blocks"


def _ragged(x, w, sizes, ab=None):
    """Grouped matmul x [M, I] by the group's kernel w [G, I, O], plus its LoRA term in float32.

    An int8 kernel goes into the grouped matmul as int8 (mixed with x's dtype, accumulated in float32:
    the TPU kernel then streams one byte a weight; an `astype` before it made XLA write a bf16 copy of
    every expert kernel first, 3.3x the step's required HBM bytes on v6e-8), and each row is scaled by
    its group's per-channel scale [G, 1, O]. An int4 kernel, whose scales vary along I (one per block
    of I), runs as one grouped matmul per block of I, each on the int4 values as stored and scaled by
    that block's scales [G, O] (dequantizing it first kept bf16 copies of the experts: 18.4 GB of
    temporaries for the 26B's step on one v5e chip, which does not fit)."""
    f32 = jnp.float32
    if is_quantized(w):
        q, scale = quant_values(w), w[QUANT_SCALE].astype(f32)
        # each row's group: rows are laid out group after group (rows past the groups are not outputs)
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0], dtype=sizes.dtype), side="right")
        group = jnp.minimum(group, sizes.shape[0] - 1)
        blocks = scale.shape[1]
        width = q.shape[1] // blocks
        # tied to the activations: a loop around the layer (generate's, the server tick's) cannot hoist the
        # widened blocks out and keep them all (a 2-layer cut of the 26B's int4 tick for v5e-1: 2.75 GB of
        # temporaries without, 1.20 GB with; the whole tick did not fit at 37.9 GB)
        if q.dtype == jnp.int4:  # (int8 goes into the grouped matmul as stored: nothing widened to hoist)
            x, q = jax.lax.optimization_barrier((x, q))

        def block_product(j):  # block j of I: its grouped matmul, each row scaled by its group's scales
            block = jax.lax.dynamic_slice_in_dim(q, j * width, width, axis=1)
            # XLA:TPU's grouped matmul takes no int4 operand ("Unsupported element type: S4"): widened to int8
            block = block.astype(jnp.int8) if block.dtype == jnp.int4 else block
            part = jax.lax.ragged_dot(jax.lax.dynamic_slice_in_dim(x, j * width, width, axis=1), block, sizes,
                                      preferred_element_type=f32)
            return part * jax.lax.dynamic_index_in_dim(scale, j, 1, keepdims=False)[group]

        # one block at a time, summed in order: written as a Python sum, XLA:TPU scheduled every block's
        # [M, O] float32 product before the first add (the 26B's int4 prefill of 512 tokens on a v5e-1
        # held 0.5 GB of them at once)
        y = block_product(0)
        if blocks > 1:  # a loop from 0 in its own scope: perf.hbm_traffic counts its body once per block
            with jax.named_scope(BLOCK_LOOP_SCOPE):
                y = jax.lax.fori_loop(0, blocks - 1, lambda j, acc: acc + block_product(j + 1), y)
    else:
        y = jax.lax.ragged_dot(x, w, sizes)
        if ab is None:
            return y
    if ab is not None:
        h = jax.lax.ragged_dot(x.astype(f32), ab["a"].astype(f32), sizes, preferred_element_type=f32)
        y = y.astype(f32) + jax.lax.ragged_dot(h, ab["b"].astype(f32), sizes, preferred_element_type=f32)
    return y.astype(x.dtype)


def _constrain(rt, x, logical):
    return x if rt is None else rt.constrain(x, logical)


def _expert_ffn_dense(z, gate_up, down, adapters=None, rt: Runtime | None = None):
    """All experts on all tokens: z [N, D] -> [N, E, D]."""
    h = _constrain(rt, project("nd,edf->nef", z, gate_up, _ab(adapters, "gate_up")), (None, "experts", None))
    return project("nef,efd->ned", _gated(h, kernel_shape(down)[1]), down, _ab(adapters, "down"))


def _local_pairs(weights, experts, valid):
    """Pairs this shard's experts serve: ids clamped in range and weights zeroed where not `valid`."""
    if valid is None:
        return weights, experts
    return jnp.where(valid, weights, 0.0), jnp.where(valid, experts, 0)


def dispatch_dense(z, weights, experts, gate_up, down, valid=None, adapters=None, rt: Runtime | None = None):
    n, e = z.shape[0], kernel_shape(gate_up)[0]
    weights, experts = _local_pairs(weights, experts, valid)
    combine = jnp.zeros((n, e), jnp.float32).at[jnp.arange(n)[:, None], experts].add(weights)
    y = _expert_ffn_dense(z, gate_up, down, adapters, rt)
    return jnp.einsum("ned,ne->nd", y, combine.astype(y.dtype))


def _kernel_matmul(rt: Runtime):
    """The "gmm" dispatch's grouped matmul: mm(x, w, sizes, row_scale=None) by the Pallas kernel, its FLOPs
    told to the runtime's observer (the compiler's cost analysis cannot see into it)."""
    def mm(x, w, sizes, row_scale=None):
        k, n = kernel_shape(w)[1:]
        rt.kernel_call("grouped_matmul", gmm.flops(x.shape[0], k, n))
        return gmm.grouped_matmul(x, w, sizes, row_scale, interpret=rt.kernel_interpreted)
    return mm


def dispatch_ragged(z, weights, experts, gate_up, down, valid=None, rows: int | None = None, adapters=None,
                    kernel=None):
    """Grouped matmuls over the (token, expert) pairs sorted by expert; dropless.

    kernel: None for XLA's grouped matmuls (`lax.ragged_dot`, `_ragged`), or the "gmm" dispatch's
    `mm(x, w, sizes, row_scale)` (`_kernel_matmul`), which also scales each pair's row by its combine
    weight on chip and hands out the activation dtype.

    valid: optional bool [N, k], the pairs this shard serves (the rest are sorted last and skipped).
    rows: process the sorted pairs in blocks of `rows` (a `lax.scan` whose blocks past the last
    valid pair are skipped at run time), so an expert shard holding ~1/X of the pairs does ~1/X of
    the work, without dropping any pair when its share is larger.
    """
    n, k = experts.shape
    e, d, f = kernel_shape(down)[0], z.shape[1], kernel_shape(down)[1]
    flat = experts.reshape(-1)
    ok = jnp.ones_like(flat, bool) if valid is None else valid.reshape(-1)
    key = jnp.where(ok, flat, e)  # pairs of other shards sort after every local expert
    order = jnp.argsort(key, stable=True)
    sizes = jnp.zeros((e,), jnp.int32).at[key].add(1, mode="drop")
    total = n * k if valid is None else jnp.sum(sizes)
    w_sorted = weights.reshape(-1)[order]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes

    # a token's pair outputs are summed in the activation dtype, as the reference sums its experts'
    # outputs (and as "capacity" and "dense" do): in bfloat16 a float32 sum wrote and read twice the bytes
    acc_dtype = z.dtype

    def add_block(acc, lo, length):
        """acc [N, D] (None: zeros) plus the weighted outputs of sorted pairs [lo, lo + length),
        scattered into their tokens' rows."""
        idx = jax.lax.dynamic_slice_in_dim(order, lo, length)
        token = idx // k
        in_block = jnp.clip(jnp.minimum(ends, lo + length) - jnp.maximum(starts, lo), 0, length).astype(jnp.int32)
        live = (lo + jnp.arange(length)) < total  # rows past the groups are not defined outputs
        wgt = jax.lax.dynamic_slice_in_dim(w_sorted, lo, length)
        dest = jnp.where(live, token, n)  # a row that is not an output is dropped by the scatter's index
        if kernel is not None:
            h = _gated(kernel(z[token], gate_up, in_block), f)
            y = kernel(h, down, in_block, wgt)
        else:
            # each pair's combine weight scales its hidden row (F wide, in the gating's pass) rather than
            # its output row (D wide: a pass of its own before the scatter), as "capacity" does
            h = _gated(_ragged(z[token], gate_up, in_block, _ab(adapters, "gate_up")), f)
            y = _ragged(h * wgt[:, None].astype(h.dtype), down, in_block, _ab(adapters, "down"))
        acc = jnp.zeros((n, d), acc_dtype) if acc is None else acc
        return acc.at[dest].add(y.astype(acc_dtype), mode="drop")

    if rows is None or rows >= n * k:
        return add_block(None, 0, n * k).astype(z.dtype)
    nblocks = -(-n * k // rows)
    pad = nblocks * rows - n * k
    if pad:  # padded slots are never live (they sit past `total`)
        order = jnp.concatenate([order, jnp.zeros((pad,), order.dtype)])
        w_sorted = jnp.concatenate([w_sorted, jnp.zeros((pad,), w_sorted.dtype)])

    if n * d * jnp.dtype(acc_dtype).itemsize > ON_CHIP_BYTES:
        # a sum too large to stay on chip: each block scatters into it in place (only its rows read
        # and written), and a block past the last valid pair leaves it as it is
        def body(acc, i):
            lo = i * rows
            return jax.lax.cond(lo < total, lambda a: add_block(a, lo, rows), lambda a: a, acc), None
    else:
        # on chip, a block's own [N, D] sum added to the total costs nothing, and the in-place form
        # would keep the total in HBM
        def body(acc, i):
            lo = i * rows
            part = jax.lax.cond(lo < total, lambda: add_block(None, lo, rows), lambda: jnp.zeros((n, d), acc_dtype))
            return acc + part, None

    out, _ = jax.lax.scan(body, jnp.zeros((n, d), acc_dtype), jnp.arange(nblocks, dtype=jnp.int32))
    return out.astype(z.dtype)


def capacity_for(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    cap = int(math.ceil(factor * num_tokens * top_k / num_experts))
    cap = max(8, -(-cap // 8) * 8)
    return min(cap, num_tokens)


# buffer sizes tried, as multiples of `moe_capacity_factor` x the mean load (the token count always follows)
CAPACITY_STEPS = (1.0, 1.1, 1.2, 1.3, 1.45, 1.6)


def capacity_levels(num_tokens: int, top_k: int, num_experts: int, factor: float) -> tuple[int, ...]:
    """The per-expert buffer sizes the capacity dispatch chooses from, ascending; the last is
    `num_tokens`, the most pairs one expert can get (a token picks each expert at most once)."""
    levels = {capacity_for(num_tokens, top_k, num_experts, factor * m) for m in CAPACITY_STEPS}
    return tuple(sorted(levels | {num_tokens}))


def dispatch_capacity(z, weights, experts, gate_up, down, capacity, valid=None, adapters=None,
                      rt: Runtime | None = None):
    """Per-expert buffers, dropless. `capacity`: rows per expert, or a tuple of candidate sizes.

    The busiest expert's load picks the smallest size that holds it (`lax.switch`), and one batched
    matmul runs at that size, so every expert's weights are read once per call. The token count is
    always a candidate (the largest load possible), so nothing is ever dropped; a typical step pays
    for the first size only. `rt`: the runtime whose mesh the expert buffers are laid out on (None: none).
    """
    n, k = experts.shape
    e, d = kernel_shape(gate_up)[:2]
    caps = (int(capacity),) if isinstance(capacity, (int, np.integer)) else tuple(int(c) for c in capacity)
    caps = tuple(sorted(set(min(c, n) for c in caps) | {n}))
    flat = experts.reshape(-1)
    ok = jnp.ones_like(flat, bool) if valid is None else valid.reshape(-1)
    # rank of each (token, choice) pair inside its expert, in token order (other shards' pairs: none)
    onehot = jax.nn.one_hot(jnp.where(ok, flat, e), e, dtype=jnp.int32)
    counts = jnp.cumsum(onehot, axis=0)
    rank = (counts - onehot)[jnp.arange(n * k), jnp.where(ok, flat, 0)]
    rows = jnp.concatenate([z, jnp.zeros((1, d), z.dtype)])
    wgt = weights.reshape(-1)  # a pair outside `ok` never holds a slot, so its weight is never read

    def buffered(cap):
        # gather (not scatter) the buffers: slot -> the pair it holds (or a zero row)
        slot = jnp.where(ok, flat * cap + rank, e * cap)
        pair = jnp.full((e * cap + 1,), n * k, jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32))
        buf = _constrain(rt, rows[pair[:-1] // k].reshape(e, cap, d), ("experts", None, "embed"))
        # each slot's combine weight scales its hidden row (F wide, fused into the gating) rather than
        # its output row (D wide, a separate pass)
        w_slot = jnp.concatenate([wgt, jnp.zeros((1,), wgt.dtype)])[pair[:-1]].reshape(e, cap, 1)
        h = _gated(project("ecd,edf->ecf", buf, gate_up, _ab(adapters, "gate_up")), kernel_shape(down)[1])
        h = h * w_slot.astype(buf.dtype)
        y = _constrain(rt, project("ecf,efd->ecd", h, down, _ab(adapters, "down")), ("experts", None, "embed"))
        y = jnp.concatenate([y.reshape(e * cap, d), jnp.zeros((1, d), y.dtype)])
        return y[slot].reshape(n, k, d).sum(1)

    if len(caps) == 1:
        return buffered(caps[0])
    busiest = counts[-1].max()
    level = jnp.sum(jnp.asarray(caps[:-1], jnp.int32) < busiest)
    return jax.lax.switch(level, [functools.partial(buffered, c) for c in caps])


def dispatch(cfg: ModelConfig, rt: Runtime, z, weights, experts, gate_up, down, adapters=None, offset=0,
             shards: int = 1):
    """Run the runtime's dispatch strategy on the experts held here: gate_up/down hold experts
    [offset, offset + E_local).

    z [N, D]; weights/experts [N, k] with GLOBAL expert ids. `shards` is the number of expert shards
    (1 = all experts local); pairs routed to other shards contribute nothing here. `adapters`: the
    local experts' LoRA pairs (see the module docstring) or None.

    A scanned layer's kernels come as `layout.PerGroup`s: the whole dispatch then runs in one
    `lax.switch` branch per group, each on its group's arrays as they lie in HBM (`per_group_switch`),
    and hands its output out in z's dtype (the switch's result crosses HBM); float32 after it.
    """
    if layout.has_per_group((gate_up, down)):
        # every branch is traced and one runs: each branch's kernel calls count 1 / branches
        branch_rt = rt.observed_times(1 / layout.per_group_branches((gate_up, down)))
        y = layout.per_group_switch(
            lambda kernels, z, weights, experts: _dispatch_here(cfg, branch_rt, z, weights, experts, *kernels,
                                                                adapters, offset, shards),
            (gate_up, down), z, weights, experts)
    else:
        y = _dispatch_here(cfg, rt, z, weights, experts, gate_up, down, adapters, offset, shards)
    return y.astype(jnp.float32)


def int4_experts(kernel) -> bool:
    """Whether the expert kernel (an array, a quantized pair, or a scanned layer's `PerGroup` of them)
    is int4: what `Runtime.dispatch` needs to resolve "auto"."""
    if isinstance(kernel, PerGroup):
        kernel = kernel.arrays[0]
    return is_int4(kernel)


def _dispatch_here(cfg, rt, z, weights, experts, gate_up, down, adapters, offset, shards):
    """`dispatch` on these kernels (arrays or quantized pairs), in z's dtype. The ragged grouped matmuls
    read int4 pairs as they are (`_ragged`); the dense and capacity strategies (CPU, tests) dequantize
    them to z's dtype here, on the experts held here (inside the expert-parallel body)."""
    strategy = rt.dispatch(int4_experts(gate_up))
    if strategy == "gmm" and adapters is not None:  # the kernel adds no LoRA term
        strategy = "ragged"
    if strategy not in ("ragged", "gmm"):
        gate_up, down = (dequantize(w, z.dtype) if is_int4(w) else w for w in (gate_up, down))
    e_local = kernel_shape(gate_up)[0]
    valid = None
    if shards > 1:
        local = experts - offset
        valid = (local >= 0) & (local < e_local)
        experts = jnp.where(valid, local, 0)
    if strategy == "dense":
        y = dispatch_dense(z, weights, experts, gate_up, down, valid, adapters, rt)
    elif strategy in ("ragged", "gmm"):
        rows = None
        if shards > 1:  # blocks of ~factor x this shard's expected share of the pairs
            rows = -(-int(math.ceil(rt.moe_shard_rows_factor * z.shape[0] * cfg.top_k / shards)) // 8) * 8
        y = dispatch_ragged(z, weights, experts, gate_up, down, valid, rows, adapters,
                            kernel=_kernel_matmul(rt) if strategy == "gmm" else None)
    else:
        levels = capacity_levels(z.shape[0], cfg.top_k, cfg.num_experts, rt.moe_capacity_factor)
        y = dispatch_capacity(z, weights, experts, gate_up, down, levels, valid, adapters, rt)
    return y.astype(z.dtype)


class MoE(nn.Module):
    """Router + experts. `__call__(h, z)`: h [B, T, D] routes, z [B, T, D] is processed."""

    cfg: ModelConfig
    rt: Runtime

    @nn.compact
    def __call__(self, h: jax.Array, z: jax.Array, dense=None):
        """h routes, z is processed. dense: optional (x, kernels) of the dense MLP that runs beside the
        experts (`gated_mlp` on `GatedMLP` kernels, x shaped like z); then returns (experts' output,
        dense MLP output or None): the dense output where the mesh let both be summed in one
        all-reduce (`expert_parallel`), None where the caller runs the dense MLP itself."""
        cfg = self.cfg
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        w_router = param(self, "router", (d, e), ("embed", "experts_router"), cfg)
        router_scale = ones_param(self, "router_scale", (d,), ("norm",), cfg)
        expert_scale = ones_param(self, "expert_scale", (e,), ("experts_router",), cfg)
        # gate and up side by side in one [E, D, 2F] kernel (gate columns first, as HF's gate_up_proj):
        # the grouped-matmul kernels want the output dimension minor and a multiple of 128, which
        # a separate size-2 axis would break (TPU layouts pad it, and every step would copy).
        gate_up = param(self, "gate_up", (e, d, 2 * f), ("experts", "embed", "expert_gate_up"), cfg)
        down = param(self, "down", (e, f, d), ("experts", "expert_mlp", "embed"), cfg)

        shape = z.shape
        hf = h.reshape(-1, d)
        zf = z.reshape(-1, d)
        with jax.named_scope("router"):
            weights, experts = route(hf, w_router, router_scale, expert_scale, cfg.top_k, cfg.rms_norm_eps)
        # float kernels in the activation dtype; int8 kernels stay int8 (cast inside each matmul)
        gate_up, down = (w if is_quantized(w) else w.astype(z.dtype) for w in (gate_up, down))
        adapters = {k: ab for k in ("gate_up", "down") if (ab := adapter(self, k)) is not None} or None
        with jax.named_scope(f"experts_{self.rt.dispatch(int4_experts(gate_up))}"):
            beside = None if dense is None else DenseBeside(dense[0].reshape(-1, d), dense[1], GATED_MLP_AXES,
                                                            gated_mlp)
            y = expert_parallel(self.rt, lambda rt, *a, **k: dispatch(cfg, rt, *a, **k), zf, weights, experts,
                                        gate_up, down, adapters, dense=beside)
        if dense is None:
            return y.reshape(shape).astype(z.dtype)
        y, yd = y
        return y.reshape(shape).astype(z.dtype), None if yd is None else yd.reshape(dense[0].shape)


def expert_parallel(rt: Runtime, fn, z, weights, experts, gate_up, down, adapters=None, dense=None):
    """Run the MoE dispatch `fn` per shard: each device serves only the experts it holds and the
    outputs are summed over those mesh axes.

    fn(rt, z, weights, experts, gate_up, down, adapters, offset=, shards=) -> [N, D] float32 partial
    output for the local experts [offset, offset + E_local). `adapters` (per-expert LoRA pairs,
    every leaf [E, ., .], or None) are split over the experts exactly like the kernels. Tokens (z
    [N, D], weights / experts [N, k]) are split like the batch and replicated over the model axes,
    so no expert weight ever moves (with FSDP the weights' `embed` dimension is gathered per layer,
    as for every FSDP layer). Each expert is whole on one shard (gate_up [E, D, 2F] keeps gate and
    up side by side). gate_up / down may be int8 pairs {"int8", "scale"} (every leaf [E, ., .]):
    split over the experts like float kernels. Without a mesh this is just `fn(...)` with all experts local.

    Where the tokens are split over some of the experts' mesh axes too (the "throughput" rules: rows
    over every axis), each shard first gathers the rows of its group along those axes (`all_gather`),
    serves its experts' pairs among them, and the group's partial outputs are summed and split back to
    each shard's own rows in one `psum_scatter`, in the activation dtype. A layer then moves its rows
    once each way, where splitting the attention's heads too would all-reduce its output as well as
    the experts' sum (the 26B's 32-slot serving tick on v6e-8: 6.1 ms of ICI a step against 16.6 on the
    "serving" rules, benchmarks/results/serve_projection_v6e-8_throughput.json, a projection).

    dense: optional `DenseBeside`, a dense MLP that runs beside the experts (Gemma 4's parallel
    dense and MoE branches). Where the dense kernels' hidden units are split over exactly
    the experts' mesh axes (and nothing else is split), the dense MLP runs inside the same
    per-shard body on its hidden-unit slices and both partial outputs are summed in one all-reduce
    (one collective per layer instead of two: each costs a latency on the inter-chip links); then
    this returns (experts' output, dense output). Elsewhere (no mesh, FSDP, other splits) it
    returns (experts' output, None) and the caller runs the dense MLP as any layer.
    """
    if rt.mesh is None:
        y = fn(rt, z, weights, experts, gate_up, down, adapters)
        return y if dense is None else (y, None)
    mesh = rt.mesh
    tok = axes_of(rt.spec(z.shape[:1], ("batch",))[0])
    n_experts = jax.tree.leaves(gate_up)[0].shape[0]  # a float kernel, or an int8 pair's values and scales
    ex_all = axes_of(rt.spec((n_experts,), ("experts",))[0])
    ex = tuple(a for a in ex_all if a not in tok)       # experts split, tokens whole: partial outputs summed
    gathered = tuple(a for a in ex_all if a in tok)     # both split: tokens gathered, outputs reduce-scattered
    # the dense MLP joins the experts' body only where its partial sums meet theirs in one all-reduce
    dense_specs = None if dense is None or gathered else _dense_beside_experts(rt, dense.kernels, dense.axes, ex)
    if dense is not None and dense_specs is None:  # the caller's, partitioned by XLA
        return expert_parallel(rt, fn, z, weights, experts, gate_up, down, adapters), None
    if not (tok or ex):
        return fn(rt, z, weights, experts, gate_up, down, adapters)
    shards = 1
    for a in ex_all:
        shards *= mesh.shape[a]
    e_local = n_experts // shards
    inner = rt.local()  # no logical constraints inside the per-shard body

    def body(z, weights, experts, gate_up, down, adapters, dense_x, dense_kernels):
        index = jnp.zeros((), jnp.int32)
        for a in ex_all:
            index = index * mesh.shape[a] + jax.lax.axis_index(a)
        if gathered:  # every token of the expert group, in the order `psum_scatter` hands the rows back
            z, weights, experts = (jax.lax.all_gather(x, gathered, axis=0, tiled=True) for x in (z, weights, experts))
        y = fn(inner, z, weights, experts, gate_up, down, adapters, offset=index * e_local, shards=shards)
        if gathered:  # summed over the group and split back to this shard's own tokens in one collective
            y = jax.lax.psum_scatter(y.astype(z.dtype), gathered, scatter_dimension=0, tiled=True)
        if dense_kernels is None:
            return jax.lax.psum(y, ex) if ex else y
        # this shard's hidden units give a partial sum too: both reduced as one array, one
        # all-reduce (XLA keeps two psums, or one psum of a tuple, as two collectives on TPU);
        # in the activation dtype, as XLA:TPU reduces the experts' float32 partial anyway
        # past ON_CHIP_BYTES stacked on a new leading axis, not side by side: concatenated along the
        # hidden axis, the compiler laid the reduced [N, 2D] out column-major (the concatenation then
        # free) and every layer copied both halves back to row-major, in float32, for the norms after
        # it; below, the concatenation stays on chip and the stack would be written out
        yd = dense.mlp(dense_x, **dense_kernels)
        if 2 * yd.size * yd.dtype.itemsize > ON_CHIP_BYTES:
            both = jax.lax.psum(jnp.stack([y.astype(yd.dtype), yd]), ex)
            return both[0], both[1]
        both = jax.lax.psum(jnp.concatenate([y.astype(yd.dtype), yd], axis=-1), ex)
        return both[:, :y.shape[-1]], both[:, y.shape[-1]:]

    t = entry_of(tok)
    kernel = PartitionSpec(entry_of(ex_all), None, None)
    rows = PartitionSpec(t, None)
    dense_x, dense_kernels = (None, None) if dense is None else (dense.x, dense.kernels)
    return jax.shard_map(
        body, mesh=mesh, check_vma=False,
        in_specs=(rows, rows, rows, _kernel_specs(gate_up, kernel), _kernel_specs(down, kernel),
                  None if adapters is None else jax.tree.map(lambda _: kernel, adapters),
                  None if dense is None else rows, dense_specs),
        out_specs=rows if dense is None else (rows, rows))(
            z, weights, experts, gate_up, down, adapters, dense_x, dense_kernels)


def _dense_beside_experts(rt: Runtime, kernels, axes, ex):
    """The per-shard in_specs of a dense MLP's kernels when they can run inside the experts'
    body: every leaf split only along its "mlp" dimension and over exactly the mesh axes `ex`
    (then each shard's output is a partial sum over `ex`, like the experts'); else None."""
    if not ex:
        return None
    specs = {}
    for name, kernel in kernels.items():
        logical = axes[name]
        leaf_specs = []
        for leaf in jax.tree.leaves(kernel):
            spec = rt.spec(leaf.shape, logical)
            entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
            for entry, name_ in zip(entries, logical):
                if entry is not None and (name_ != "mlp" or set(axes_of(entry)) != set(ex)):
                    return None
            if leaf.shape[logical.index("mlp")] > 1 and entries[logical.index("mlp")] is None:
                return None  # the hidden units replicated: no partial sum to add
            leaf_specs.append(spec)
        specs[name] = jax.tree.unflatten(jax.tree.structure(kernel), leaf_specs)
    return specs


def _kernel_specs(tree, kernel: PartitionSpec):
    """in_specs of an expert kernel's tree: every [E, ., .] leaf split like `kernel`; the scalar group
    index of a scanned layer's per-group kernel (`model.layout.PerGroup`) replicated."""
    return jax.tree.map(lambda x: kernel if x.ndim else PartitionSpec(), tree)
