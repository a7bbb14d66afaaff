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
