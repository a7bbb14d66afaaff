"""The denoising step's head and sampler fused into ONE pass over the vocabulary.

From the final-normed hidden state h [B, L, D] and the tied embedding E [V, D], a `lax.scan` over
vocab chunks computes, per chunk, logits = softcap(h E_c^T), z = sanitize(logits / T), and folds
them into running (online-softmax) statistics:

    m        running max of z                 arg    its first index (the argmax)
    s        sum exp(z - m)                   t      sum exp(z - m) (z - m)      (entropy = log s - t / s)
    sample   a draw from softmax(z) so far    acc    sum exp(z - m) E_v  [B, L, D]
                                                     (soft embedding = acc / s * sqrt(D))

so no [B, L, V] buffer is ever materialised: peak extra memory is a few [B, L, chunk] tiles.

Sampling is a streaming ("reservoir") categorical draw: chunk c replaces the running sample with
probability S_c / (S_<c + S_c) (its share of the mass seen so far), and a token inside the chunk is
picked by inverting its cumulative mass. The result is exactly distributed as softmax(z) while
drawing only two uniforms per position and chunk (Gumbel-max would need one per vocab entry).
The semantics equal `sampling.ops` (sanitize -> temperature -> sample/argmax/entropy,
softmax @ E) up to float32 rounding and the random stream; the separate ops remain the reference.

On an accelerator mesh that splits the vocabulary, `head_sample_stats_split` runs the same scan on
each device over its own rows of the table (inside a `shard_map`) and merges the devices' running
statistics over the vocabulary's mesh axes: maxima first, then the sums rescaled to the common max,
ties to the lower token id. `head_sample_stats_full` does the same in plain full-vocabulary
reductions over ONE [B, L, V] float32 tile (the per-chip tile is V / shards wide); it remains for a
layout the per-device scan cannot take (the table's hidden axis split, or the rows split over a
vocabulary axis). `head_step` picks the variant: the scan on CPU and where each device holds the
whole vocabulary (one TPU chip: for the 26B's head at 2 rows on a v5e-1 the scan needs no
temporaries and 1.85 GB of HBM traffic, the full pass 0.5 GB of logits and 4.17 GB), the per-device
scan on a mesh that splits it, else the full pass. On an accelerator every variant draws Gumbel-max
over the full pass's own noise (`row_gumbel`, each value at its global vocabulary column), so one
chip and a vocabulary-split slice sample the same tokens for a seed; the CPU keeps the streaming
draw above.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p
from jax.sharding import PartitionSpec as P

from dgemma_jax.model.layers import QUANT_SCALE, QUANT_VALUES, is_quantized, softcap
from dgemma_jax.axis_rules import axes_of
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.ops import StepStats, sanitize_logits


# the scope of the head's loop over vocab chunks (perf.hbm_traffic)
VOCAB_LOOP_SCOPE = "vocab_chunks"


def vocab_chunk(vocab: int, target: int = 2048) -> int:
    """The largest divisor of `vocab` that is <= target (and >= 256), else the whole vocab."""
    if vocab <= target:
        return vocab
    for c in range(target, 255, -1):
        if vocab % c == 0:
            return c
    return vocab


def _sub_block(c: int, target: int = 64) -> int:
    """Sub-block length for the in-chunk draw: the largest divisor of c that is <= target."""
    for d in range(min(c, target), 0, -1):
        if c % d == 0:
            return d
    return 1


def chunk_uniforms(keys: jax.Array, chunk_index, length: int) -> jax.Array:
    """The CPU head's two uniforms per position for vocab chunk `chunk_index`: [B, 2, length] float32
    from keys [B] (row 0 picks the token inside the chunk, row 1 decides whether the running sample
    moves into this chunk). `tests.reference.draws` exposes them for external references."""
    return jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, chunk_index), (2, length), jnp.float32))(keys)


def head_sample_stats(h: jax.Array, embedding: jax.Array, cap: float, temperature: jax.Array, keys: jax.Array,
                      embed_scale: float, chunk: int | None = None, gumbel: bool = False):
    """h [B, L, D], embedding [V, D], temperature [] f32, keys [B] (one stream per row).

    gumbel: draw as `head_sample_stats_full` does (Gumbel-max, chunk by chunk, over the same noise), so
    that one chip samples what a vocabulary-split slice samples; else the streaming inverse-CDF draw.
    Returns (StepStats(sampled, argmax, entropy) each [B, L], soft embedding [B, L, D] in h.dtype).
    """
    table, row_scale = _head_table(embedding)
    out = _scan_stats(h, table, row_scale, cap, temperature, keys, chunk, gumbel)
    return _finish(out, embed_scale, h.dtype)


def _finish(out: dict, embed_scale: float, dtype):
    """The step's statistics and soft embedding from the scan's running statistics."""
    entropy = jnp.log(out["s"]) - out["t"] / out["s"]
    soft = (out["acc"] / out["s"][..., None]) * embed_scale
    return StepStats(sampled=out["sample"], argmax=out["arg"], entropy=entropy), soft.astype(dtype)


def _scan_stats(h, embedding, row_scale, cap, temperature, keys, chunk=None, gumbel=False, offset=0,
                total: int | None = None) -> dict:
    """The running statistics of the module doc (m, s, t, arg, sample, acc; gmax with `gumbel`) after
    a scan over the rows of `embedding` [V, D] (`row_scale` [V] or None): the table's rows are the
    vocabulary's [offset, offset + V) of `total` (token ids and Gumbel columns are global)."""
    b, l, d = h.shape
    v = embedding.shape[0]
    total = v if total is None else total
    c = chunk or vocab_chunk(v)
    n = v // c
    init = dict(
        m=jnp.full((b, l), -jnp.inf, jnp.float32), s=jnp.zeros((b, l), jnp.float32),
        t=jnp.zeros((b, l), jnp.float32), arg=jnp.zeros((b, l), jnp.int32),
        sample=jnp.zeros((b, l), jnp.int32), acc=jnp.zeros((b, l, d), jnp.float32),
    )
    if gumbel:
        init["gmax"] = jnp.full((b, l), -jnp.inf, jnp.float32)

    sub = _sub_block(c)
    nsub = c // sub
    iota = jnp.arange(sub, dtype=jnp.int32)
    sub_iota = jnp.arange(nsub, dtype=jnp.int32)
    scale = jnp.float32(cap) / temperature

    # chunk i is row i of the table seen as [n, c, D] (a free reshape), taken inside the body: scanning
    # over it as `xs` made XLA:CPU copy every chunk first, and slicing rows of the [V, D] table made
    # XLA:TPU relayout the whole int8 table (738 MB for the 26B) before the loop
    chunks = embedding.reshape(n, c, d)

    def first(idx):   # the chunk's first global token id (no add where the table is the whole vocabulary)
        return idx * c if isinstance(offset, int) and offset == 0 else idx * c + offset

    def body(carry, idx):
        e_c = jax.lax.dynamic_index_in_dim(chunks, idx, 0, keepdims=False)
        logits = jnp.einsum("bld,cd->blc", h, e_c.astype(h.dtype), preferred_element_type=jnp.float32)
        if row_scale is not None:
            rs_c = jax.lax.dynamic_slice_in_dim(row_scale, idx * c, c)
            logits = logits * rs_c
        if gumbel:  # z as the full pass computes it
            z = sanitize_logits(softcap(logits, cap) / temperature)
        else:
            z = sanitize_logits(jnp.tanh(logits * (1.0 / cap)) * scale)  # softcap / T with one multiply
        # the chunk's max and its first index from per-sub-block maxima: one reduction pass over the
        # tile, then a search inside the one sub-block that holds the max (a compare-select-reduce
        # over the whole tile would cost two more passes)
        zs = z.reshape(b, l, nsub, sub)
        sub_max = zs.max(-1)
        cmax = sub_max.max(-1)
        j_max = jnp.min(jnp.where(sub_max == cmax[..., None], sub_iota, nsub), -1)
        z_blk = jnp.take_along_axis(zs, j_max[..., None, None], 2)[..., 0, :]
        carg = j_max * sub + jnp.min(jnp.where(z_blk == cmax[..., None], iota, sub), -1) + first(idx)
        m_new = jnp.maximum(carry["m"], cmax)
        alpha = jnp.exp(carry["m"] - m_new)  # 0 at the first chunk (m = -inf)
        shifted = z - m_new[..., None]
        w = jnp.exp(shifted)
        # per-sub-block masses: short contiguous sums that fuse into the exp pass; the chunk total is a
        # sum over these few values, and the entropy term below a matrix-vector product (a second plain
        # row reduction over the whole tile is several times slower on XLA:CPU)
        sub_mass = w.reshape(b, l, nsub, sub).sum(-1)
        s_c = sub_mass.sum(-1)
        s_prev = carry["s"] * alpha
        s = s_prev + s_c
        wz = jnp.einsum("blc,c->bl", w * shifted, jnp.ones((c,), jnp.float32))
        t = alpha * (carry["t"] + carry["s"] * (carry["m"] - m_new)) + wz
        t = jnp.where(jnp.isfinite(carry["m"]), t, wz)
        acc = carry["acc"] * alpha[..., None] + jnp.einsum(
            "blc,cd->bld", w if row_scale is None else w * rs_c, e_c.astype(jnp.float32))
        common = dict(m=m_new, s=s, t=t, arg=jnp.where(cmax > carry["m"], carg, carry["arg"]), acc=acc)
        if gumbel:  # the running Gumbel-max: a later chunk wins only with a strictly larger value
            zg = z + row_gumbel(keys, (l, c), first(idx), total)
            gmax = zg.max(-1)
            garg = jnp.min(jnp.where(zg == gmax[..., None], jnp.arange(c, dtype=jnp.int32), c), -1) + first(idx)
            better = gmax > carry["gmax"]
            return dict(common, gmax=jnp.where(better, gmax, carry["gmax"]),
                        sample=jnp.where(better, garg, carry["sample"])), None
        # a draw inside the chunk by inverting its cumulative mass: first the sub-block, then the
        # token inside it (two short cumulative sums instead of one over the whole chunk)
        u = chunk_uniforms(keys, idx, l)
        target = u[:, 0] * s_c
        cum_sub = jnp.cumsum(sub_mass, axis=-1)
        j = jnp.minimum(jnp.sum(cum_sub < target[..., None], axis=-1), nsub - 1).astype(jnp.int32)
        before = jnp.take_along_axis(cum_sub - sub_mass, j[..., None], -1)[..., 0]
        w_sub = jnp.take_along_axis(w.reshape(b, l, nsub, sub), j[..., None, None], 2)[..., 0, :]
        cum_in = jnp.cumsum(w_sub, axis=-1)
        inside = jnp.minimum(jnp.sum(cum_in < (target - before)[..., None], axis=-1), sub - 1).astype(jnp.int32)
        inside = j * sub + inside + first(idx)
        switch = u[:, 1] * s < s_c  # probability s_c / s of moving the sample into this chunk
        return dict(common, sample=jnp.where(switch, inside, carry["sample"])), None

    with jax.named_scope(VOCAB_LOOP_SCOPE):  # perf.hbm_traffic counts the body once per chunk
        out, _ = jax.lax.scan(body, init, jnp.arange(n, dtype=jnp.int32))
    return out


# The scan's running soft-embedding sum is a [B, L, D] float32 carried through every vocab chunk: past
# about this size XLA:TPU keeps it in HBM and reads and writes it once a chunk (the 26B's head at 32 slots
# on v6e-8: 46 MB a chip, 2.95 GB a step over 32 chunks), so `_scan_stats_in_parts` scans the rows in
# parts whose sums stay on chip, each part reading the table once more. (`model.moe.ON_CHIP_BYTES`)
CARRY_ON_CHIP_BYTES = 32 * 2 ** 20


def _scan_stats_in_parts(h, embedding, row_scale, cap, temperature, keys, chunk=None, gumbel=False, offset=0,
                         total: int | None = None) -> dict:
    """`_scan_stats` over parts of the rows h [B, ...] (the fewest equal parts whose running sum holds
    at most `CARRY_ON_CHIP_BYTES`; one part when it is that small already), concatenated: each row's
    statistics are its own, so the parts give what one scan gives. temperature: [] or [B, 1, 1]."""
    b = h.shape[0]
    row = math.prod(h.shape[1:]) * 4
    parts = next((p for p in range(1, b + 1) if b % p == 0 and (b // p) * row <= CARRY_ON_CHIP_BYTES), b)
    if parts == 1:
        return _scan_stats(h, embedding, row_scale, cap, temperature, keys, chunk, gumbel, offset, total)
    n = b // parts
    per_row = jnp.ndim(temperature) > 0 and temperature.shape[0] == b
    outs = [_scan_stats(h[i * n:(i + 1) * n], embedding, row_scale, cap,
                        temperature[i * n:(i + 1) * n] if per_row else temperature, keys[i * n:(i + 1) * n],
                        chunk, gumbel, offset, total) for i in range(parts)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)


def head_sample_stats_split(h: jax.Array, embedding, cap: float, temperature: jax.Array, keys: jax.Array,
                            embed_scale: float, rt: Runtime, chunk: int | None = None):
    """`head_sample_stats_full` (same contract, the same tokens for a seed) on a mesh that splits the
    vocabulary, as the scan: each device scans its own rows of the table (no [B, L, V] logits, the
    table read once), drawing the Gumbel noise of its rows' global columns, and the devices' running
    statistics are merged over the vocabulary's mesh axes (`_merge`: maxima, then the sums rescaled to
    the common max; a tie goes to the lower token id, as `argmax` gives it).

    Where the rows are split over the vocabulary's mesh axes too (the "throughput" rules: rows over
    every axis), each device first gathers the rows of its group along those axes, scans them against
    its rows of the table, and keeps its own rows' merged statistics (the soft embeddings' sums
    reduce-scattered): the table is read once a step in quarters, not whole on every chip.

    temperature: [B, 1, 1] or []. Returns None where the layout does not allow it (the table's
    hidden axis, or h's sequence or hidden axis, split; the rows split over some of the vocabulary's
    axes but not all): the caller then keeps the full pass."""
    table, row_scale = _head_table(embedding)
    v, d = table.shape
    mesh = rt.mesh
    spec_e = rt.spec((v, d), ("vocab", "embed"))
    spec_h = rt.spec(h.shape, ("batch", "seq", "embed"))
    vocab, batch = axes_of(spec_e[0]), axes_of(spec_h[0])
    gathered = bool(set(vocab) & set(batch))
    if not vocab or spec_e[1] is not None or spec_h[1] is not None or spec_h[2] is not None \
            or (gathered and not set(vocab) <= set(batch)):
        return None
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32).reshape((-1, 1, 1)), (h.shape[0], 1, 1))
    rows = P(spec_h[0])
    local = v // math.prod(mesh.shape[a] for a in vocab)
    impl = jax.random.key_impl(keys)
    args = (h, table, temperature, jax.random.key_data(keys)) + (() if row_scale is None else (row_scale,))
    specs = (P(spec_h[0], None, None), P(spec_e[0], None), P(spec_h[0], None, None), rows) \
        + (() if row_scale is None else (P(spec_e[0]),))

    def body(h, table, temperature, keys, row_scale=None):
        shard = jnp.zeros((), jnp.int32)
        for a in vocab:   # the device's position along the vocabulary's axes, major to minor
            shard = shard * mesh.shape[a] + jax.lax.axis_index(a)
        own = h.shape[0]
        if gathered:   # the group's rows, in the order the merge hands each device its own back
            h, temperature, keys = (jax.lax.all_gather(x, vocab, axis=0, tiled=True) for x in (h, temperature, keys))
        out = _scan_stats_in_parts(h, table, row_scale, cap, temperature, jax.random.wrap_key_data(keys, impl=impl),
                                   chunk, gumbel=True, offset=shard * local, total=v)
        return _finish(_merge(out, vocab, v, own_rows=(shard * own, own) if gathered else None), embed_scale, h.dtype)

    row_out = P(spec_h[0], None)
    return jax.shard_map(body, mesh=mesh, in_specs=specs, check_vma=False,
                         out_specs=(StepStats(row_out, row_out, row_out), P(spec_h[0], None, None)))(*args)


def _merge(out: dict, axes: tuple, vocab: int, own_rows: tuple | None = None) -> dict:
    """Running statistics of disjoint vocabulary shards (one per device along `axes`) merged into
    those of the whole vocabulary, on every device; own_rows (start, count): only those rows kept on
    this device, the [rows, L, D] sums reduce-scattered (tiled over `axes`, in their order)."""
    m = jax.lax.pmax(out["m"], axes)
    scale = jnp.exp(out["m"] - m)
    s = jax.lax.psum(out["s"] * scale, axes)
    t = jax.lax.psum((out["t"] + out["s"] * (out["m"] - m)) * scale, axes)
    arg = jax.lax.pmin(jnp.where(out["m"] == m, out["arg"], vocab), axes)
    gmax = jax.lax.pmax(out["gmax"], axes)
    sample = jax.lax.pmin(jnp.where(out["gmax"] == gmax, out["sample"], vocab), axes)
    merged = dict(m=m, s=s, t=t, arg=arg, sample=sample, gmax=gmax)
    if own_rows is None:
        return dict(merged, acc=jax.lax.psum(out["acc"] * scale[..., None], axes))
    start, count = own_rows
    merged = {k: jax.lax.dynamic_slice_in_dim(x, start, count, 0) for k, x in merged.items()}
    acc = jax.lax.psum_scatter(out["acc"] * scale[..., None], axes, scatter_dimension=0, tiled=True)
    return dict(merged, acc=acc)


def head_sample_stats_full(h: jax.Array, embedding: jax.Array, cap: float, temperature: jax.Array,
                           keys: jax.Array, embed_scale: float, rt: Runtime | None = None):
    """`head_sample_stats` as full-vocabulary reductions (the accelerator variant, same contract); the
    logits and noise are laid out on `rt`'s mesh when it has one."""
    rt = rt or Runtime()
    embedding, row_scale = _head_table(embedding)
    logits = jnp.einsum("bld,vd->blv", h, embedding.astype(h.dtype), preferred_element_type=jnp.float32)
    if row_scale is not None:
        logits = logits * row_scale
    logits = rt.constrain(logits, ("batch", "seq", "vocab"))
    z = sanitize_logits(softcap(logits, cap) / temperature)
    m = z.max(-1, keepdims=True)
    w = jnp.exp(z - m)
    s = w.sum(-1)
    entropy = jnp.log(s) - (w * (z - m)).sum(-1) / s
    gumbel = row_gumbel(keys, z.shape[1:])
    gumbel = rt.constrain(gumbel, ("batch", "seq", "vocab"))
    stats = StepStats(sampled=jnp.argmax(z + gumbel, -1).astype(jnp.int32), argmax=jnp.argmax(z, -1).astype(jnp.int32),
                      entropy=entropy)
    probs = w / s[..., None]
    probs = (probs if row_scale is None else probs * row_scale).astype(h.dtype)
    soft = jnp.einsum("blv,vd->bld", probs, embedding.astype(h.dtype), preferred_element_type=jnp.float32)
    return stats, (soft * embed_scale).astype(h.dtype)


def row_gumbel(keys: jax.Array, shape: tuple[int, ...], start=0, total: int | None = None) -> jax.Array:
    """Standard Gumbel noise [B, *shape] float32, row b drawn from keys[b]: the values of
    `jax.random.gumbel(keys[b], shape)` under jax's default (partitionable) threefry. With `total`,
    the columns [start, start + shape[-1]) of `jax.random.gumbel(keys[b], (*shape[:-1], total))`
    (`start` may be traced): one vocabulary chunk of the full draw.

    Written out because the vmapped `jax.random.gumbel` shares its threefry counters between the rows,
    and XLA:TPU then stores them as two uint32 arrays of `shape` (512 MiB for a 256-token canvas over
    the 262,144-token vocabulary, the largest temporaries of a one-chip denoising step). Here the
    counters are one iota over the whole [B, *shape] block, which fuses into the sampling reduction.
    Needs threefry keys and fewer than 2**32 values per row.
    """
    total = shape[-1] if total is None else int(total)
    size = int(np.prod(shape[:-1])) * total
    if size >= 2 ** 32:
        raise ValueError(f"row_gumbel draws at most 2**32 - 1 values per row, got {size}")
    words = jax.random.key_data(keys)  # [B, 2] uint32: threefry's key pair per row
    full = (words.shape[0], *shape)

    def word(i):
        return jnp.broadcast_to(words[:, i].reshape((-1,) + (1,) * len(shape)), full)

    # the row-major position of each value inside its row (threefry's low counter word; the high word
    # is 0 below 2**32 values), as jax.random's partitionable threefry numbers them
    count = lax.broadcasted_iota(jnp.uint32, full, len(shape)) + jnp.asarray(start, jnp.uint32)
    stride = total
    for axis in range(len(full) - 2, 0, -1):
        count = count + lax.broadcasted_iota(jnp.uint32, full, axis) * jnp.uint32(stride)
        stride *= full[axis]
    hi, lo = threefry2x32_p.bind(word(0), word(1), jnp.zeros(full, jnp.uint32), count)
    # jax.random.uniform's float from 32 random bits: 23 mantissa bits under the exponent of 1.0, minus 1,
    # floored at the smallest normal float as jax.random.gumbel asks
    mantissa = lax.shift_right_logical(hi ^ lo, jnp.uint32(9)) | jnp.uint32(np.float32(1.0).view(np.uint32))
    u = jnp.maximum(lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0, jnp.finfo(jnp.float32).tiny)
    return -jnp.log(-jnp.log(u))


def _head_table(embedding):
    """(table [V, D], per-row scale [V] float32 or None): an int8 embedding {"int8", "scale"} is read
    as its int8 rows, each row's scale applied to its logit and to its weight in the soft embedding."""
    if is_quantized(embedding):
        return embedding[QUANT_VALUES], embedding[QUANT_SCALE][:, 0].astype(jnp.float32)
    return embedding, None


def head_step(h, embedding, cap, temperature, keys, embed_scale, rt: Runtime):
    """The denoising step's fused head for where `rt` compiles (see the module doc), tried in this order:
    on CPU the scan over vocab chunks; where each device holds the whole vocabulary (one TPU chip) the
    same scan with Gumbel noise; on a mesh that splits the vocabulary the per-device scan with merged
    statistics (`head_sample_stats_split`); where its layout does not allow that, the full pass."""
    if rt.platform == "cpu":
        return head_sample_stats(h, embedding, cap, temperature, keys, embed_scale)
    if rt.shards(_head_table(embedding)[0].shape[0], "vocab") == 1:
        return head_sample_stats(h, embedding, cap, temperature, keys, embed_scale, gumbel=True)
    split = head_sample_stats_split(h, embedding, cap, temperature, keys, embed_scale, rt)
    if split is not None:
        return split
    return head_sample_stats_full(h, embedding, cap, temperature, keys, embed_scale, rt)
