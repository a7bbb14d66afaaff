"""The MoE's grouped matmul as one Pallas kernel (`model.gmm`, the "gmm" dispatch; Pallas's interpreter
on this CPU) against XLA's grouped matmul and the dense oracle: float, int8 and int4 kernels, ragged
group sizes with empty groups, rows past the groups, per-row combine weights, expert shards; and the
kernel compiled for a TPU holds the 26B's int4 experts' traffic to what it must move."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, Runtime
from dgemma_jax.model import gmm, moe
from dgemma_jax.model.layers import dequantize
from dgemma_jax.model.quant import quantize_kernel, quantize_kernel_int4

from test_moe import _dense, _expert_weights, _random_choices


def _kernel(w, mode):
    return {"float": lambda w: w, "int8": lambda w: quantize_kernel(w, (1,)),
            "int4": lambda w: quantize_kernel_int4(w, (1,))}[mode](w)


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("sizes,m,k,n", [((30, 0, 50, 12), 100, 256, 384),      # an empty group; rows past them
                                         ((0, 0, 7, 0, 33), 40, 128, 128),     # groups empty at both ends
                                         ((64,), 64, 192, 256)],                # one group, whole row tiles
                         ids=["ragged", "empty-ends", "one-group"])
def test_the_kernel_equals_xla_grouped_matmul_and_the_dense_product(mode, sizes, m, k, n):
    rng = np.random.default_rng(m + k + n)
    g = len(sizes)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = _kernel(jnp.asarray(rng.standard_normal((g, k, n)) * k ** -0.5, jnp.float32), mode)
    wd = w if mode == "float" else dequantize(w, jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)
    row_scale = jnp.asarray(rng.uniform(0.1, 1.5, m), jnp.float32)
    total = int(sizes.sum())
    got = np.asarray(jax.jit(lambda *a: gmm.grouped_matmul(*a, interpret=True, row_tile=32))(x, w, sizes, row_scale))
    assert got.shape == (m, n) and got.dtype == np.float32
    ref = np.asarray(jax.lax.ragged_dot(x, wd, sizes)) * np.asarray(row_scale)[:, None]
    np.testing.assert_allclose(got[:total], ref[:total], rtol=1e-5, atol=1e-5)
    # the dense oracle: each row by its group's dequantized kernel
    group = np.repeat(np.arange(g), np.asarray(sizes))
    dense = np.einsum("mk,mkn->mn", np.asarray(x)[:total], np.asarray(wd)[group]) * np.asarray(row_scale)[:total, None]
    np.testing.assert_allclose(got[:total], dense, rtol=1e-4, atol=1e-4)


def test_the_kernel_in_bfloat16_hands_out_bfloat16_close_to_the_float32_product():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((96, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 256, 256)) * 256 ** -0.5, jnp.bfloat16)
    sizes = jnp.asarray([40, 0, 56], jnp.int32)
    got = gmm.grouped_matmul(x, w, sizes, interpret=True, row_tile=32)
    assert got.dtype == jnp.bfloat16
    ref = jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["float", "int8", "int4"])
@pytest.mark.parametrize("shards,skew", [(1, False), (4, True)])
def test_the_gmm_dispatch_sums_to_the_oracle(mode, shards, skew):
    """moe.dispatch with "gmm" per expert shard (offset, shards; skewed: shard 0 needs several blocks of
    1.25x its share) against the dense oracle on the same (dequantized) kernels and "ragged"."""
    rng = np.random.default_rng(shards * 11 + skew)
    n, e, k, d, f = 48, 8, 4, 128, 64
    cfg = ModelConfig.preset("tiny-2layer", num_experts=e, top_k=k, hidden_size=d, moe_intermediate_size=f)
    z = rng.normal(size=(n, d)).astype(np.float32)
    gate_up, down = _expert_weights(rng, e, d, f)
    weights, experts = _random_choices(rng, n, e, k)
    if skew:
        experts[:, 0] = rng.integers(0, e // shards, n)
        experts = np.stack([np.concatenate([[r[0]], rng.choice([x for x in range(e) if x != r[0]], k - 1, replace=False)])
                            for r in experts]).astype(np.int32)
    gu, dn = _kernel(jnp.asarray(gate_up), mode), _kernel(jnp.asarray(down), mode)
    gud, dnd = ((gate_up, down) if mode == "float" else
                (np.asarray(dequantize(gu, jnp.float32)), np.asarray(dequantize(dn, jnp.float32))))
    ref = np.asarray(_dense(z, weights, experts, gud, dnd))
    el = e // shards
    take = lambda w, i: jax.tree.map(lambda a: a[i * el:(i + 1) * el], w)  # noqa: E731
    for name in ("gmm", "ragged"):
        rt = Runtime(moe_dispatch=name)
        fn = jax.jit(lambda z, w, x, a, b, off: moe.dispatch(cfg, rt, z, w, x, a, b, offset=off, shards=shards))
        parts = [np.asarray(fn(z, weights, experts, take(gu, i), take(dn, i), i * el)) for i in range(shards)]
        np.testing.assert_allclose(sum(parts), ref, rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_gmm_dispatch_on_an_expert_mesh_equals_dense():
    """The MoE module under an expert-sharded mesh (shard_map, 4 fake CPU devices) with "gmm" equals "dense"
    without a mesh."""
    from flax import linen as nn

    from dgemma_jax.parallel.mesh import make_mesh
    from dgemma_jax.axis_rules import rules_for

    cfg = ModelConfig.preset("tiny-6layer", hidden_size=128, moe_intermediate_size=64, num_experts=8, top_k=2)
    rng = np.random.default_rng(9)
    h = jnp.asarray(rng.normal(size=(2, 24, 128)).astype(np.float32))
    z = jnp.asarray(rng.normal(size=(2, 24, 128)).astype(np.float32))
    module = moe.MoE(cfg, Runtime(moe_dispatch="dense"))
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.2, s.shape), s.dtype),
                          nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), h, z)["params"]))
    ref = np.asarray(jax.jit(module.apply)({"params": params}, h, z))
    mesh = make_mesh("expert=4", devices=jax.devices()[:4])
    rt = Runtime(mesh=mesh, rules=rules_for("latency"), moe_dispatch="gmm")
    got = np.asarray(jax.jit(moe.MoE(cfg, rt).apply)({"params": params}, h, z))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_auto_runs_the_kernel_for_int4_experts_on_tpu_only():
    assert Runtime(moe_dispatch="gmm").dispatch() == "gmm"
    assert Runtime(platform="tpu").dispatch(int4=True) == "gmm"
    assert Runtime(platform="tpu").dispatch() == "ragged" and Runtime(platform="cpu").dispatch(int4=True) == "capacity"


@pytest.mark.parametrize("mode", ["int4", "int8", "bf16"])
def test_the_kernel_for_a_v5e_chip_moves_only_its_operands_and_result(mode):
    """The 26B's expert gate_up [128, 2816, 1408] on 4,096 routed rows, compiled for a v5e-1: the kernel's
    HBM traffic is its rows, the kernel values and scales as stored and its bfloat16 result, once each
    (+1%). XLA's int4 grouped matmul ("ragged", `moe._ragged`) moves a float32 [M, O] product per block of
    128 rows of the contracted axis on top (on int8 and bf16 alone it is at its operands too)."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from dgemma_jax.model.quant import quantize_leaf
    from dgemma_jax.perf.aot import tpu_devices
    from dgemma_jax.perf.hbm_traffic import hbm_traffic

    where = SingleDeviceSharding(tpu_devices("v5e-1")[0])
    g, i, o, m = 128, 2816, 1408, 4096
    shape = jax.ShapeDtypeStruct((g, i, o), jnp.bfloat16)
    kernel = shape if mode == "bf16" else jax.eval_shape(lambda w: quantize_leaf("layers_0/moe/gate_up", w, mode), shape)
    kernel = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), kernel)
    args = (jax.ShapeDtypeStruct((m, i), jnp.bfloat16, sharding=where), kernel,
            jax.ShapeDtypeStruct((g,), jnp.int32, sharding=where))
    stored = sum(a.size * (0.5 if a.dtype == jnp.int4 else a.dtype.itemsize) for a in jax.tree.leaves(kernel))
    must = stored + m * i * 2 + m * o * 2
    fused = jax.jit(lambda x, w, s: gmm.grouped_matmul(x, w, s)).lower(*args).compile()
    xla = jax.jit(moe._ragged).lower(*args).compile()
    got, old = hbm_traffic(fused.as_text())["total"], hbm_traffic(xla.as_text())["total"]
    print(f"{mode}: kernel {got / 1e6:.0f} MB, XLA grouped matmul {old / 1e6:.0f} MB, must move {must / 1e6:.0f} MB")
    assert must <= got <= 1.01 * must
    if mode == "int4":  # XLA's int4 grouped matmul: more (alone 1.07x; inside the 26B tick 27.7 of 63 GB)
        assert old > 1.05 * must
    assert fused.memory_analysis().temp_size_in_bytes < 4 * 2 ** 20
