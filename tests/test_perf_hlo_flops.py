"""`perf.hlo_flops.dot_flops`: the compiled program's matrix products with every loop counted per trip
(XLA:TPU's cost_analysis counts a loop body once)."""

import jax
import jax.numpy as jnp
import pytest

from dgemma_jax.perf.hlo_flops import dot_flops

M, K = 128, 256


def _scanned(x, w):
    """8 matmuls in a scan, then 3 in a fori_loop, then one outside any loop."""
    y = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0]
    y = jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w[i]), y)
    return y @ w[0]


def _args(sharding=None):
    return (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sharding),
            jax.ShapeDtypeStruct((8, K, K), jnp.bfloat16, sharding=sharding))


ONE = 2 * M * K * K  # one [M, K] x [K, K] product


def test_cpu_loops_count_per_trip():
    compiled = jax.jit(_scanned).lower(*_args()).compile()
    got = dot_flops(compiled.as_text())
    assert got["flops"] == 12 * ONE
    assert sorted(t for _, t in got["loops"]) == [3, 8] and got["uncounted_loops"] == 0


def test_tpu_loops_count_per_trip_where_cost_analysis_counts_one():
    pytest.importorskip("libtpu")
    from dgemma_jax.perf.aot import tpu_devices

    shard = jax.sharding.SingleDeviceSharding(tpu_devices("v5e-1")[0])
    compiled = jax.jit(_scanned).lower(*_args(shard)).compile()
    # the TPU compiler's own count: each loop body once (3 products and a little elementwise work)
    assert compiled.cost_analysis()["flops"] < 3.2 * ONE
    got = dot_flops(compiled.as_text())  # its HLO writes the products as convolutions, the trips as i < N
    assert got["flops"] == 12 * ONE
    assert sorted(t for _, t in got["loops"]) == [3, 8] and got["uncounted_loops"] == 0


def test_a_loop_of_unknown_length_counts_once_and_is_reported():
    def f(x, w, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] @ w[0], c[1] + 1), (x, 0))[0]

    compiled = jax.jit(f).lower(*_args(), jax.ShapeDtypeStruct((), jnp.int32)).compile()
    got = dot_flops(compiled.as_text())
    assert got["flops"] == ONE and got["uncounted_loops"] == 1


# XLA:TPU's own form of the 26B head's `bld,cd->blc` (16 rows of 256 canvas tokens by a 2,048-row vocab
# chunk, per chip on v6e-8 at 32 slots): a window of 16 sliding over an input of 1 padded by 15 on each
# side, so that one tap in 16 meets the input. Counting the whole window counted it 16x, most of the
# 3.6x this reader first found on the 26B's serving tick.
_PADDED_WINDOW = """HloModule m

ENTRY %main (p0: bf16[2048,2816,1], p1: bf16[16,256,2816]) -> f32[2048,16,256] {
  %p0 = bf16[2048,2816,1]{1,0,2} parameter(0)
  %p1 = bf16[16,256,2816]{2,1,0} parameter(1)
  ROOT %convolution.28 = f32[2048,16,256]{2,0,1} convolution(%p0, %p1), """ \
    """window={size=16 pad=15_15 rhs_reversal=1}, dim_labels=bf0_0oi->b0f, """ \
    """metadata={op_name="jit(f)/bld,cd->blc/dot_general"}
}
"""

# XLA:TPU's grouped matmul (`lax.ragged_dot`), a Mosaic custom call: 10,240 rows of 2,816 by their
# experts' [2,816, 1,408] kernels
_RAGGED = """HloModule m

ENTRY %main (g: s32[33], x: bf16[10240,2816], w: bf16[32,2816,1408]) -> bf16[10240,1408] {
  %g = s32[33]{0} parameter(0)
  %x = bf16[10240,2816]{1,0} parameter(1)
  %w = bf16[32,2816,1408]{2,1,0} parameter(2)
  ROOT %ragged-dot-none = bf16[10240,1408]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call", """ \
    """frontend_attributes={mosaic_fusion_entry_point="true",ragged_dot_tiling="256,2816,1408"}, """ \
    """metadata={op_name="jit(f)/ragged_dot_general/ragged-dot-none"}
}
"""


def test_a_window_over_padding_counts_only_the_taps_that_meet_the_input():
    got = dot_flops(_PADDED_WINDOW)
    assert got["flops"] == 2 * 16 * 256 * 2048 * 2816   # rows x tokens x vocab chunk x hidden
    assert got["by_scope"] == {"bld,cd->blc/dot_general": got["flops"]}


def test_the_tpu_grouped_matmul_counts_its_rows():
    assert dot_flops(_RAGGED)["flops"] == 2 * 10240 * 2816 * 1408


def test_a_loop_of_skipped_blocks_counts_one_trip_and_its_upper_bound_every_trip():
    """The ragged MoE's per-shard blocks (`moe.dispatch_ragged`): each block's products sit in a
    conditional whose other branch does none, run only while pairs are left; a loop whose every
    trip computes counts them all."""
    def skipped(x, w, n):
        body = lambda c, i: (c + jax.lax.cond(i < n, lambda: x @ w[i], lambda: jnp.zeros_like(x)), None)  # noqa: E731
        return jax.lax.scan(body, jnp.zeros_like(x), jnp.arange(4))[0]

    def both(x, w, n):
        body = lambda c, i: (c + jax.lax.cond(i < n, lambda: x @ w[i], lambda: x @ w[0] * 2), None)  # noqa: E731
        return jax.lax.scan(body, jnp.zeros_like(x), jnp.arange(4))[0]

    n = jax.ShapeDtypeStruct((), jnp.int32)
    got = dot_flops(jax.jit(skipped).lower(*_args(), n).compile().as_text())
    assert got["flops"] == ONE and got["flops_upper_bound"] == 4 * ONE and len(got["skipped_block_loops"]) == 1
    got = dot_flops(jax.jit(both).lower(*_args(), n).compile().as_text())
    assert got["flops"] == got["flops_upper_bound"] == 4 * ONE and got["skipped_block_loops"] == []
