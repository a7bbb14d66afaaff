"""The MoE's grouped matmul as ONE Pallas TPU kernel that reads the expert kernels as stored.

`grouped_matmul(x, w, sizes)`: rows x [M, K] laid out group after group (group g: `sizes[g]` rows),
each multiplied by its group's kernel w [G, K, N]: a float array, an int8 pair {"int8" [G, K, N],
"scale" [G, 1, N]} or an int4 pair {"int4" [G, K, N], "scale" [G, K / B, N]} (`model.quant`). Each
grid step takes one tile of rows and one group's whole [K, N] (or [K, tn]) kernel tile into on-chip
memory, widens the int8 / int4 values there (int4: times each block's scales), multiplies in the
activation dtype with a float32 accumulator, scales an int8 product by its per-channel scales and,
when given, every row by its own factor (the router's combine weight, `row_scale`), and writes the
tile once in the output dtype. So HBM sees each expert's weights once per output tile, as stored (one
byte a weight, half a byte in int4), the rows once, and the product once: no widened copy of a
kernel and no float32 product goes through HBM (XLA's grouped matmul on int4 summed a float32 [M, N]
product per block of K in HBM; `moe._ragged`).

The grid is (output tiles, row tiles of the groups) with jax's megablox group metadata
(`make_group_metadata`): a row tile that straddles two groups is visited once per group and its rows
stored under a mask; consecutive visits of one group keep its kernel tile (the pipeline fetches a
block only when its index changes); empty groups are not visited; rows past the last group are not
written (undefined: the caller masks them). Off TPU the kernel runs in Pallas's interpreter (tests
compare it with `lax.ragged_dot` and the dense oracle on CPU). The compiler sees one opaque custom call:
the caller tells the runtime's observer its FLOPs, and `perf.hbm_traffic` counts its operands and
results, i.e. the projection assumes the kernel streams them at HBM bandwidth.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma_jax.model.layers import QUANT_SCALE, is_int4, is_quantized, quant_values

# rows per tile, and the most bytes of one [K, tn] kernel tile widened to the activation dtype
ROW_TILE = 128
TILE_BYTES = 8 * 2 ** 20
VMEM_LIMIT = 100 * 2 ** 20


def _out_tile(k: int, n: int, itemsize: int) -> int:
    """tn: the whole N when a [K, N] tile fits `TILE_BYTES`, else the largest multiple of 128 dividing N
    that does (N itself when none does)."""
    if k * n * itemsize <= TILE_BYTES:
        return n
    for tn in range(n // 128 * 128, 0, -128):
        if n % tn == 0 and k * tn * itemsize <= TILE_BYTES:
            return tn
    return n


def flops(m: int, k: int, n: int) -> float:
    """FLOPs of one call over m rows (every row counted, as the kernel's tiles compute)."""
    return 2.0 * m * k * n


def grouped_matmul(x: jax.Array, w, sizes: jax.Array, row_scale: jax.Array | None = None, *,
                   out_dtype=None, interpret: bool = False, row_tile: int = ROW_TILE) -> jax.Array:
    """x [M, K] (rows sorted by group) times its group's kernel: [M, N] in `out_dtype` (default x's).

    w: [G, K, N] float, or an int8 / int4 pair (module docstring). sizes [G] int32: rows per group
    (their sum <= M; rows past it are undefined in the output). row_scale: optional [M] float32, each
    output row's factor (applied to the float32 product in the kernel)."""
    from jax.experimental import pallas as pl  # deferred: Mosaic machinery only the kernel path needs
    from jax.experimental.pallas import tpu as pltpu  # deferred: as above
    from jax.experimental.pallas.ops.tpu.megablox.gmm import make_group_metadata  # deferred: as above

    out_dtype = x.dtype if out_dtype is None else out_dtype
    quant = "int4" if is_int4(w) else ("int8" if is_quantized(w) else None)
    q = quant_values(w) if quant else w
    scale = w[QUANT_SCALE].astype(jnp.float32) if quant else None
    g, k, n = q.shape
    m = x.shape[0]
    if x.shape[1] != k:
        raise ValueError(f"grouped_matmul: x has {x.shape[1]} columns, the kernels {k} rows")
    tm = min(row_tile, -(-m // 16) * 16)
    pad = -m % tm
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, k), x.dtype)])
        if row_scale is not None:
            row_scale = jnp.concatenate([row_scale, jnp.zeros((pad,), row_scale.dtype)])
    mp = m + pad
    tn = _out_tile(k, n, jnp.dtype(x.dtype).itemsize)
    tiles_n = n // tn if n % tn == 0 else -(-n // tn)
    blocks = scale.shape[1] if quant == "int4" else 1
    (offsets, group_ids, m_tile_ids), num_tiles = make_group_metadata(
        group_sizes=sizes.astype(jnp.int32), m=mp, tm=tm, start_group=jnp.zeros((), jnp.int32),
        num_nonzero_groups=g, visit_empty_groups=False)
    scaled_rows = row_scale is not None

    def kernel(offsets, group_ids, m_tile_ids, *refs):
        x_ref, w_ref = refs[:2]
        rest = refs[2:]
        s_ref = rest[0] if quant else None
        r_ref = rest[1 if quant else 0] if scaled_rows else None
        out_ref = refs[-1]
        t = pl.program_id(1)
        wt = w_ref[...]
        if quant == "int4":  # each block of K rows times its scales, widened on chip
            wt = wt.astype(jnp.float32).reshape(blocks, k // blocks, wt.shape[-1]) * s_ref[...][:, None, :]
            wt = wt.reshape(k, -1)
        acc = jax.lax.dot_general(x_ref[...], wt.astype(x_ref.dtype), (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
        if quant == "int8":
            acc = acc * s_ref[...]
        if scaled_rows:
            acc = acc * r_ref[...]
        # store the rows of this tile that belong to this visit's group
        group = group_ids[t]
        row = m_tile_ids[t] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (row >= offsets[group]) & (row < offsets[group + 1])
        out_ref[...] = jnp.where(mine, acc, out_ref[...].astype(jnp.float32)).astype(out_ref.dtype)

    def rows_map(n_i, t, offsets, group_ids, m_tile_ids):
        return m_tile_ids[t], 0

    def kernel_map(n_i, t, offsets, group_ids, m_tile_ids):
        return group_ids[t], 0, n_i

    def out_map(n_i, t, offsets, group_ids, m_tile_ids):
        return m_tile_ids[t], n_i

    in_specs = [pl.BlockSpec((tm, k), rows_map), pl.BlockSpec((None, k, tn), kernel_map)]
    operands = [x, q]
    if quant:
        in_specs.append(pl.BlockSpec((None, scale.shape[1], tn), kernel_map))
        operands.append(scale)
    if scaled_rows:
        in_specs.append(pl.BlockSpec((tm, 1), rows_map))
        operands.append(row_scale.astype(jnp.float32)[:, None])
    call = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, in_specs=in_specs, out_specs=pl.BlockSpec((tm, tn), out_map),
            grid=(tiles_n, num_tiles)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=VMEM_LIMIT),
        interpret=interpret,
        cost_estimate=pl.CostEstimate(flops=int(flops(mp, k, n)), transcendentals=0,
                                      bytes_accessed=int(x.size * x.dtype.itemsize * tiles_n + _bytes(q) + _bytes(scale)
                                                         + mp * n * jnp.dtype(out_dtype).itemsize)),
    )
    out = call(offsets, group_ids, m_tile_ids, *operands)
    return out[:m] if pad else out


def _bytes(a) -> int:
    if a is None:
        return 0
    return int(a.size * (0.5 if a.dtype == jnp.int4 else jnp.dtype(a.dtype).itemsize))
