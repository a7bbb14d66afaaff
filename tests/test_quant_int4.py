"""Weight-only int4 with group-wise scales (`dgemma_jax.model.quant`, mode "int4"): the kernels, the
matmuls, agreement with float, sharding, checkpoints, choosing a mode by memory, and the command line.

Bounds come from measurements on the test's own inputs; each docstring gives the value and its bound."""

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.config import GLOBAL, SLIDING
from dgemma_jax.engine import Engine
from dgemma_jax.model import api
from dgemma_jax.model.layers import dequantize, project
from dgemma_jax.model.quant import (dequantize_params, int4_group, param_bytes, quantization_of, quantize_kernel_int4,
                                    quantize_params, quantized_shapes, resolve_quantize, weight_bytes)
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import SamplerConfig
from tests.reference.random_params import random_params
from tests.test_quant import _flat, _inputs, _passes, hf_checkpoint

CFG = ModelConfig.preset("tiny-6layer")
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))


def test_one_kernel_has_one_scale_per_group_along_the_contracted_axis():
    """[D=256, N, H] contracting D: groups of 128 (scale [2, N, H]); [E, F=704, D] contracting F: groups
    of gcd(704, 128) = 64; [N, H, D] contracting N and H: groups along H, one scale per head. Values
    int4 in [-7, 7], each weight within half its group's scale (round to nearest), an all-zero group
    scale 1; `project` of the pair equals the float projection of its dequantized kernel."""
    w = jax.random.normal(jax.random.key(0), (256, 3, 4), jnp.float32).at[128:, 1, 2].set(0.0)
    q = quantize_kernel_int4(w, (0,))
    assert q["int4"].dtype == jnp.int4 and q["scale"].shape == (2, 3, 4) and float(q["scale"][1, 1, 2]) == 1.0
    values = np.asarray(q["int4"]).astype(np.int32)
    assert values.min() >= -7 and values.max() == 7
    assert q["scale"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(q["scale"][0], (jnp.abs(w[:128]).max(0) / 7).astype(jnp.bfloat16))
    rep = jnp.repeat(q["scale"].astype(jnp.float32), 128, axis=0)
    assert float(jnp.max(jnp.abs(w - dequantize(q)) - rep / 2)) <= 1e-6
    x = jax.random.normal(jax.random.key(1), (2, 5, 256), jnp.float32)
    np.testing.assert_allclose(project("btd,dnh->btnh", x, q), jnp.einsum("btd,dnh->btnh", x, dequantize(q)),
                               atol=1e-5)
    assert int4_group(704) == 64 and int4_group(2816) == 128 and int4_group(2112) == 64 and int4_group(48) == 16
    down = quantize_kernel_int4(jax.random.normal(jax.random.key(2), (2, 704, 8)), (1,))
    assert down["scale"].shape == (2, 11, 8)
    o = quantize_kernel_int4(jax.random.normal(jax.random.key(3), (4, 256, 8)), (0, 1))
    assert o["scale"].shape == (4, 2, 8)


def test_the_tree_the_bytes_and_the_error_per_kernel(params=None):
    """Every kernel int8 quantizes is int4 here (router, norms, embedding stay float), the shapes match
    `quantized_shapes`, int4 holds half a byte a weight. Per kernel, the relative RMS error of the
    dequantized weights: measured max 0.112 for int4 (groups of <= 128 normal weights, bf16 scales),
    0.0065 for int8 per channel; bounds 0.14 / 0.012. Bytes: int4 (its embedding int8) 0.50x int8 here."""
    params = random_params(CFG, 1)
    q4, q8 = quantize_params(CFG, params, "int4"), quantize_params(CFG, params, "int8")
    assert quantization_of(q4) == "int4" and quantization_of(q8) == "int8"
    k4 = {k.rsplit("[", 1)[0] for k in _flat(q4) if k.endswith("['int4']")}
    k8 = {k.rsplit("[", 1)[0] for k in _flat(q8) if k.endswith("['int8']")}
    assert k4 == k8 and len(k4) > 40
    assert jax.tree.map(lambda s: (s.shape, s.dtype), quantized_shapes(CFG, "int4")) == \
        jax.tree.map(lambda x: (x.shape, x.dtype), q4)
    fl, f4, f8 = _flat(params), _flat(dequantize_params(q4)), _flat(dequantize_params(q8))
    worst4 = worst8 = 0.0
    for k in k4:
        rms = float(jnp.sqrt(jnp.mean(fl[k].astype(jnp.float32) ** 2)))
        worst4 = max(worst4, float(jnp.sqrt(jnp.mean((fl[k] - f4[k]) ** 2))) / rms)
        worst8 = max(worst8, float(jnp.sqrt(jnp.mean((fl[k] - f8[k]) ** 2))) / rms)
    assert worst4 < 0.14 and worst8 < 0.012, (worst4, worst8)
    assert param_bytes(q4) < 0.55 * param_bytes(q8)


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "capacity"])
def test_int4_matmuls_equal_the_float_model_on_the_dequantized_weights(dispatch):
    """int4 kernels dequantized right before each matmul (projections; the dense and capacity MoE
    dispatch, on the experts held there) or run as one grouped matmul per block of the contracted axis
    (ragged dispatch, the TPU path): the passes equal the float model of q * s, with the int8 embedding
    int4 mode has by default (float32 rounding only: measured max |diff| 9.1e-5 dense / capacity,
    6.4e-5 ragged at logit scale 24-30; bound 1e-3)."""
    q = quantize_params(CFG, init_params(CFG, 5), "int4")
    tokens, canvas = _inputs(CFG)
    rt = Runtime(moe_dispatch=dispatch)
    for g, r in zip(_passes(CFG, q, tokens, canvas, rt), _passes(CFG, dequantize_params(q), tokens, canvas, rt)):
        np.testing.assert_allclose(g, r, atol=1e-3, rtol=0)
        assert np.abs(r).max() > 0.1


@pytest.mark.parametrize("preset,seed", [("tiny-6layer", 1), ("tiny-2layer", 2)])
def test_int4_agrees_with_float_on_random_configs(preset, seed):
    """Causal-pass logits of int4 vs float32 weights on held-out random models (logit scale 30),
    beside int8 on the same inputs. Measured: tiny-6layer int4 top-1 1.0, mean KL 5.6e-3, median
    |diff| 1.55, max 17.7 (int8: KL 1.6e-4, median 0.11, max 7.1); tiny-2layer int4 top-1 1.0, KL
    2.0e-5, median 0.27, max 3.1. Bounds about 2x over the worse; int4's error must exceed int8's
    (a mode that silently fell back to int8 or float would fail)."""
    cfg = ModelConfig.preset(preset)
    p = random_params(cfg, seed)
    tokens, _ = _inputs(cfg, seed, batch=4, prompt=24)
    ref = np.asarray(api.prefill(p, cfg, tokens)[0], np.float64)
    lp = jax.nn.log_softmax(ref, -1)
    stats = {}
    for mode in ("int8", "int4"):
        got = np.asarray(api.prefill(quantize_params(cfg, p, mode), cfg, tokens)[0], np.float64)
        kl = float(np.asarray((np.exp(lp) * (lp - jax.nn.log_softmax(got, -1))).sum(-1)).mean())
        stats[mode] = ((ref.argmax(-1) == got.argmax(-1)).mean(), kl, float(np.median(np.abs(ref - got))),
                       float(np.abs(ref - got).max()))
    top1, kl, med, worst = stats["int4"]
    assert top1 >= 0.97 and kl < 1.3e-2 and med < 3.2 and worst < 34.0, stats
    assert kl > stats["int8"][1] and med > stats["int8"][2], stats


def test_engine_int4_sharded_equals_unsharded():
    """int4 values and group scales are placed by the float kernels' logical axes (a scale's grouped
    axis too, where the mesh divides it) and a mesh run gives the unsharded tokens; Engine(quantize=
    "int4") equals passing int4 parameters."""
    from dgemma_jax.parallel import Shardings, make_mesh

    cfg = ModelConfig.preset("tiny-6layer", num_heads=8, num_kv_heads=4, num_global_kv_heads=2,
                             num_layers=3, layer_types=(SLIDING, SLIDING, GLOBAL))
    p = random_params(cfg, 4)
    q = quantize_params(cfg, p, "int4")
    tokens = np.random.RandomState(0).randint(3, cfg.vocab_size, (2, 20)).astype(np.int32)
    lengths = np.array([20, 13], np.int32)
    ref = Engine(cfg, q, SAMPLER).generate(tokens, lengths, rng=0, max_new_tokens=32)
    again = Engine(cfg, p, SAMPLER, quantize="int4").generate(tokens, lengths, rng=0, max_new_tokens=32)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(ref.tokens))
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    sh = Shardings(cfg, make_mesh("expert=2,tensor=4"), "latency")
    placed = sh.place_params(q)
    down = placed["blocks_0"]["moe"]["down"]
    assert down["int4"].dtype == jnp.int4 and down["int4"].sharding.spec[0] == ("expert", "tensor")
    out = Engine(cfg, placed, SAMPLER, shardings=sh).generate(tokens, lengths, rng=0, max_new_tokens=32)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))


def test_int4_checkpoint_round_trip(tmp_path):
    """save_model writes int4 values as int4 (orbax keeps the dtype) with their bfloat16 group scales
    and records mode int4; load_model reads back identical arrays."""
    from dgemma_jax.io.model_dir import load_model, save_model

    q = quantize_params(CFG, random_params(CFG, 1), "int4")
    save_model(tmp_path / "q", CFG, q, sampler=SAMPLER)
    meta = json.loads((tmp_path / "q" / "dgemma_model.json").read_text())
    # no tower here; int4 quantizes the embedding (in int8) by default
    assert meta["quantization"] == {"mode": "int4", "embedding": True, "vision": False}
    cfg, back, sampler = load_model(tmp_path / "q")
    assert cfg == CFG and quantization_of(back) == "int4"
    fq, fb = _flat(q), _flat(back)
    assert fq.keys() == fb.keys()
    for k in fq:
        assert fb[k].dtype == fq[k].dtype, k
        np.testing.assert_array_equal(np.asarray(fb[k]).astype(np.float32), np.asarray(fq[k]).astype(np.float32),
                                      err_msg=k)


def _devices(*gib):
    return [types.SimpleNamespace(memory_stats=lambda g=g: {"bytes_limit": int(g * 2**30)}) for g in gib]


def test_auto_picks_the_first_mode_that_fits_the_devices_the_weights_go_to():
    """The released 26B from its shapes: 47.0 GiB of weights in bf16, 24.3 in int8, 12.6 in int4 (int4
    kernels with bf16 group scales, int8 embedding). A v5e-8 (8 x 14.67 GiB, 15.75 GB) keeps bf16, a
    v6e-1 (29.1 GiB) takes int8, a v5e-1 (14.67 GiB) int4, 8 GiB is an error naming the sizes; the CPU
    (no memory statistics) never quantizes; explicit modes pass through."""
    big = ModelConfig.preset("diffusiongemma-26b-a4b")
    sizes = {m: weight_bytes(big, None if m == "none" else m) / 2**30 for m in ("none", "int8", "int4")}
    assert 46.5 < sizes["none"] < 47.5 and 24 < sizes["int8"] < 24.5 and 12.4 < sizes["int4"] < 12.8, sizes
    v5e, v6e = 15.75e9 / 2**30, 31.25e9 / 2**30
    assert resolve_quantize(big, "auto", _devices(*[v5e] * 8)) is None
    assert resolve_quantize(big, "auto", _devices(v6e)) == "int8"
    assert resolve_quantize(big, "auto", _devices(v5e)) == "int4"
    with pytest.raises(ValueError, match=r"needs .* GiB of weights .* in int4, but 1 device\(s\) leave 7.2 GiB"):
        resolve_quantize(big, "auto", _devices(8))
    assert resolve_quantize(big, "auto", jax.devices()[:1]) is None  # CPU: no memory statistics
    assert resolve_quantize(big, "int4", _devices(80)) == "int4" and resolve_quantize(big, "none") is None
    with pytest.raises(ValueError, match="unknown quantize value 'int2'"):
        resolve_quantize(big, "int2")


def test_cli_generate_and_convert_int4(tmp_path, capsys):
    """`dgemma convert --quantize int4` writes an int4 checkpoint; generate from it equals `dgemma
    generate --quantize int4` on the float one and `DiffusionGemma.from_pretrained(quantize="int4")`;
    `--quantize auto` on the CPU runs the float model; a bad value is a usage error."""
    from dgemma_jax import DiffusionGemma
    from dgemma_jax.cli import main

    _, hf = hf_checkpoint(tmp_path)
    assert main(["convert", str(hf), str(tmp_path / "q4"), "--quantize", "int4", "--quiet"]) == 0
    assert "an int4 dgemma_jax checkpoint" in capsys.readouterr().out
    meta = json.loads((tmp_path / "q4" / "dgemma_model.json").read_text())
    assert meta["quantization"]["mode"] == "int4"

    gen = ["generate", "--prompt", "w5 w7 w9", "--max-new-tokens", "16", "--seed", "1", "--quiet"]

    def answer(*args):
        assert main(gen + list(args)) == 0
        return capsys.readouterr().out

    from_int4 = answer("--checkpoint", str(tmp_path / "q4"))
    assert from_int4.strip() and answer("--checkpoint", str(hf), "--quantize", "int4") == from_int4
    dg = DiffusionGemma.from_pretrained(str(hf), quantize="int4")
    assert quantization_of(dg.params) == "int4"
    assert dg.generate("w5 w7 w9", max_new_tokens=16, seed=1) == from_int4.rstrip("\n")
    plain = answer("--checkpoint", str(hf))
    assert answer("--checkpoint", str(hf), "--quantize", "auto") == plain
    assert quantization_of(DiffusionGemma.from_pretrained(str(hf), quantize="auto").params) is None  # CPU
    with pytest.raises(SystemExit):
        main(gen + ["--checkpoint", str(hf), "--quantize", "int2"])


def test_qwix_int4_kernels_read_as_they_are(tmp_path):
    """The other side's own quantized arrays (tests/golden/qwix_int4.npz, made by qwix 0.1.8's
    `qwix.quantize(w, jnp.int4, tiled_axes=...)`): qwix lays out int4 kernels as this project does
    (values shaped like the kernel, bf16 scales with the contracted axis counted in tiles), so a qwix pair
    is an int4 kernel here. Our dequantization equals qwix's own exactly (in bf16, where qwix computes it);
    `project` and the ragged expert matmul on it equal the float matmul on values x scales (numpy, float32);
    saved and restored through our
    checkpoint format it comes back identical. Our own quantizer differs from qwix's by its convention
    (absmax / 7 over [-7, 7] against qwix's absmax / 7.5 over [-8, 7]), checked here too, so the test
    would notice either side changing."""
    from dgemma_jax.model import moe

    data = np.load(os.path.join(os.path.dirname(__file__), "golden", "qwix_int4.npz"))
    assert str(data["qwix_version"]) == "0.1.8"
    pairs = {}
    for name in ("q", "moe_down"):
        pair = {"int4": jnp.asarray(data[f"{name}/values"], jnp.int4),
                "scale": jnp.asarray(data[f"{name}/scale"], jnp.bfloat16)}
        # qwix dequantizes in the scale's dtype (bf16): ours, rounded to bf16, is the same array
        np.testing.assert_array_equal(np.asarray(dequantize(pair, jnp.bfloat16)).astype(np.float32),
                                      data[f"{name}/dequantized"])
        values = np.asarray(data[f"{name}/values"]).astype(int)
        assert values.min() == -8 and values.max() <= 7  # qwix uses int4's -8; ours never does
        ours = quantize_kernel_int4(jnp.asarray(data[f"{name}/w"]), (int(data[f"{name}/axis"]),))
        assert ours["scale"].shape == pair["scale"].shape and np.asarray(ours["int4"]).astype(int).min() >= -7
        pairs[name] = pair
    x = jax.random.normal(jax.random.key(0), (3, 5, 256), jnp.float32)
    exact = {n: data[f"{n}/values"].astype(np.float32) * np.repeat(data[f"{n}/scale"], t, axis=a)
             for n, t, a in (("q", 128, 0), ("moe_down", 64, 1))}
    np.testing.assert_allclose(project("btd,dnh->btnh", x, pairs["q"]), jnp.einsum("btd,dnh->btnh", x, exact["q"]),
                               atol=1e-5)
    h = jax.random.normal(jax.random.key(1), (6, 704), jnp.float32)
    sizes = jnp.asarray([4, 2], jnp.int32)
    np.testing.assert_allclose(moe._ragged(h, pairs["moe_down"], sizes),
                               jax.lax.ragged_dot(h, jnp.asarray(exact["moe_down"]), sizes), atol=1e-4)
    from dgemma_jax.io.model_dir import load_params, save_params

    save_params(str(tmp_path / "p"), {"k": pairs["moe_down"]})
    back = load_params(str(tmp_path / "p"), {"k": jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                                               pairs["moe_down"])})
    assert back["k"]["int4"].dtype == jnp.int4
    np.testing.assert_array_equal(np.asarray(dequantize(back["k"])), exact["moe_down"])


def test_a_quantizing_load_on_a_mesh_equals_quantizing_after_and_is_placed_like_quantize_params(tmp_path):
    """`load_checkpoint(..., mesh=, quantize="int4")` (each tensor quantized as it is read, then laid out by
    `Shardings.place_params`) gives exactly the int4 parameters of quantizing the float load, and every
    leaf sits where `Shardings.for_params` puts it."""
    from dgemma_jax.parallel import Shardings, make_mesh
    from dgemma_jax.pipeline import load_checkpoint

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    cfg, hf = hf_checkpoint(tmp_path)
    mesh = make_mesh("expert=2,tensor=4")
    _, streamed, _, _ = load_checkpoint(str(hf), mesh=mesh, quantize="int4")
    _, plain, _, _ = load_checkpoint(str(hf))
    want = quantize_params(cfg, plain, "int4")
    placement = _flat(Shardings(cfg, mesh, "latency").for_params(want))
    got = _flat(streamed)
    assert got.keys() == _flat(want).keys() and quantization_of(streamed) == "int4"
    for k, x in _flat(want).items():
        assert got[k].dtype == x.dtype, k
        np.testing.assert_array_equal(np.asarray(got[k]).astype(np.float32), np.asarray(x).astype(np.float32),
                                      err_msg=k)
        assert got[k].sharding.is_equivalent_to(placement[k], x.ndim), k


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_the_grouped_matmul_of_the_26bs_experts_holds_one_block_at_a_time_on_a_v5e_chip(mode):
    """The 26B's expert gate_up [128, 2816, 1408] on 4,096 routed rows (2 canvases or a 512-token
    prompt, top-8), compiled for a v5e-1: the quantized grouped matmul needs under two [M, O] float32
    block products of temporaries. Written as a Python sum over its 22 int4 blocks, XLA scheduled every
    block's product (and widened block) before the first add: 1,019 MiB."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from dgemma_jax.model import moe
    from dgemma_jax.model.quant import quantize_leaf
    from dgemma_jax.perf.aot import tpu_devices

    where = SingleDeviceSharding(tpu_devices("v5e-1")[0])
    g, i, o, m = 128, 2816, 1408, 4096
    kernel = jax.eval_shape(lambda w: quantize_leaf("layers_0/moe/gate_up", w, mode),
                            jax.ShapeDtypeStruct((g, i, o), jnp.bfloat16))
    kernel = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), kernel)
    assert kernel["int4" if mode == "int4" else "int8"].shape == (g, i, o)
    compiled = jax.jit(moe._ragged).lower(jax.ShapeDtypeStruct((m, i), jnp.bfloat16, sharding=where), kernel,
                                          jax.ShapeDtypeStruct((g,), jnp.int32, sharding=where)).compile()
    temp, product = compiled.memory_analysis().temp_size_in_bytes, m * o * 4
    print(f"{mode}: grouped matmul temporaries {temp / 2**20:.1f} MiB, one block product {product / 2**20:.0f} MiB")
    assert temp < 2 * product
    # the HBM traffic count reads every block once: the loop over blocks counts once per block
    from dgemma_jax.perf.hbm_traffic import hbm_traffic
    values = g * i * o // (2 if mode == "int4" else 1)
    traffic = hbm_traffic(compiled.as_text())["total"]
    print(f"{mode}: HBM traffic {traffic / 1e6:.0f} MB, kernel values {values / 1e6:.0f} MB")
    assert values <= traffic < values + 2 * product * (i // 128) + 4 * m * i
