"""`perf.memory_peak`: the buffers live at a compiled program's memory peak, from XLA's own dumps."""

import jax
import jax.numpy as jnp
import pytest

from dgemma_jax.perf.memory_peak import compile_with_peak, read_peak


def _head_like(x, table):
    """A [512, 4096] float32 product read by two reductions: XLA must keep it whole."""
    z = x @ table.T
    return jnp.exp(z - z.max(-1, keepdims=True)).sum(-1), jnp.argmax(z + jnp.sin(z), -1)


def test_the_peak_names_the_buffer_that_makes_it_and_the_op_that_made_it():
    lowered = jax.jit(_head_like).lower(jnp.zeros((512, 256)), jnp.zeros((4096, 256)))
    compiled, peak = compile_with_peak(lowered, top=3)
    top = peak["largest"][0]
    assert top["bytes"] == 512 * 4096 * 4 and top["shape"].startswith("f32[512,4096]")
    assert top["kind"] == "temporary" and top["op"].endswith("dot_general"), top
    assert peak["bytes_by_kind"]["parameter"] == (512 + 4096) * 256 * 4
    mem = compiled.memory_analysis()
    assert peak["bytes_by_kind"]["temporary"] <= mem.temp_size_in_bytes
    assert peak["peak_bytes"] == sum(peak["bytes_by_kind"].values())
    assert len(peak["largest"]) <= 3
    # the compiled program is the real one: it runs
    s, i = compiled(jnp.ones((512, 256)), jnp.ones((4096, 256)))
    assert s.shape == (512,) and i.shape == (512,)


def test_a_smaller_program_has_a_smaller_peak():
    """The same reductions over a quarter of the product: the peak's largest buffer shrinks with it."""
    small = jax.jit(_head_like).lower(jnp.zeros((128, 256)), jnp.zeros((4096, 256)))
    _, peak = compile_with_peak(small, top=1)
    assert peak["largest"][0]["bytes"] == 128 * 4096 * 4


def test_a_directory_without_a_dump_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="no buffer assignment dumped"):
        read_peak(str(tmp_path))


def test_a_program_the_tpu_compiler_refuses_comes_back_with_its_peak():
    """A v5e-1 cannot hold a [65536, 65536] float32 product: the compiler's RESOURCE_EXHAUSTED error
    carries the peak it had assigned, the product first."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from dgemma_jax.perf.aot import tpu_devices

    where = SingleDeviceSharding(tpu_devices("v5e-1")[0])
    lowered = jax.jit(_head_like).lower(jax.ShapeDtypeStruct((65536, 256), jnp.float32, sharding=where),
                                        jax.ShapeDtypeStruct((65536, 256), jnp.float32, sharding=where))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as refused:
        compile_with_peak(lowered, top=2)
    top = refused.value.memory_peak["largest"][0]
    assert top["bytes"] == 65536 * 65536 * 4 and top["op"].endswith("dot_general"), top
