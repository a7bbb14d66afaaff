"""The Runtime: how a program runs, one explicit frozen value instead of module globals.

Checks its validation and hashing, that what it says is what the traced program does (dispatch,
kernel, platform, mesh constraints), and that ModelConfig no longer carries execution choices.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import Engine, ModelConfig, Runtime, SamplerConfig, init_cache, init_params
from dgemma_jax.io.model_dir import config_from_dict, config_to_dict
from dgemma_jax.model import api
from dgemma_jax.model.cache import ring_size
from dgemma_jax.parallel import Shardings, make_mesh
from dgemma_jax.runtime import split_choices

CFG = ModelConfig.preset("tiny-2layer")

BAD = [
    (dict(moe_dispatch="sparse"), "moe_dispatch"),
    (dict(moe_capacity_factor=0.0), "moe_capacity_factor"),
    (dict(moe_shard_rows_factor=-1.0), "moe_shard_rows_factor"),
    (dict(attn_key_block=0), "attn_key_block"),
    (dict(attn_key_block=True), "attn_key_block"),
    (dict(attn_kernel="splash"), "attn_kernel"),
    (dict(remat=1), "remat"),
    (dict(platform="tpu7"), "platform"),
    (dict(mesh="expert=2"), "mesh"),
]


@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_invalid_runtime_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"Runtime\.{field}\b"):
        Runtime(**kwargs)
    with pytest.raises(ValueError, match=rf"Runtime\.{field}\b"):
        Runtime().replace(**kwargs)


def test_default_platform_and_dispatch_follow_the_backend():
    rt = Runtime()
    assert rt.platform == jax.default_backend()
    assert Runtime(platform="cpu").dispatch() == "capacity" == Runtime(platform="cpu").dispatch(int4=True)
    assert Runtime(platform="tpu").dispatch() == "ragged" and Runtime(platform="gpu").dispatch() == "ragged"
    # int4 experts: the Pallas grouped-matmul kernel on TPU (a Mosaic kernel: TPU only)
    assert Runtime(platform="tpu").dispatch(int4=True) == "gmm"
    assert Runtime(platform="gpu").dispatch(int4=True) == "ragged"
    for s in ("dense", "ragged", "capacity"):
        rt = Runtime(platform="tpu", moe_dispatch=s)
        assert rt.dispatch() == s == rt.dispatch(int4=True)
    assert Runtime(platform="tpu").use_kernel() and not Runtime(platform="cpu").use_kernel()
    assert Runtime(platform="cpu", attn_kernel="pallas").use_kernel()
    assert not Runtime(platform="tpu", attn_kernel="xla").use_kernel()


def test_hashable_static_argument_with_the_mesh_in_it():
    mesh = make_mesh("expert=2", devices=jax.devices()[:2])
    a, b = Runtime(mesh=mesh, rules=[("batch", "data")]), Runtime(mesh=mesh, rules=(("batch", "data"),))
    assert a == b and hash(a) == hash(b) and a != Runtime()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.remat = True
    assert a.local().mesh is None and a.local().rules == ()
    traces = []
    g = jax.jit(lambda x, rt: (traces.append(rt), x + 1)[1], static_argnums=1)
    g(1, a), g(2, b), g(3, Runtime())
    assert len(traces) == 2


def test_shards_counts_the_pieces_a_named_dimension_is_split_into():
    """What `sampling.fused.head_step` asks to pick the head: is the vocabulary whole on each device?"""
    from dgemma_jax.axis_rules import rules_for
    assert Runtime().shards(262144, "vocab") == 1
    mesh = make_mesh("data=2,expert=4", devices=jax.devices()[:8])
    rt = Runtime(mesh=mesh, rules=rules_for("latency"))
    assert rt.shards(262144, "vocab") == 4 and rt.shards(8, "batch") == 2
    assert Runtime(mesh=mesh, rules=(("batch", "data"),)).shards(262144, "vocab") == 1
    assert rt.shards(6, "vocab") == 1  # a size the axes do not divide stays whole


def test_model_config_holds_no_execution_choices():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert not names & {"moe_dispatch", "moe_capacity_factor", "moe_shard_rows_factor", "attn_kernel",
                        "attn_key_block", "remat"}
    for call in (lambda: ModelConfig.preset("tiny-2layer", moe_dispatch="dense"),
                 lambda: CFG.replace(remat=True)):
        with pytest.raises(ValueError, match="Runtime"):
            call()


def test_split_choices_and_older_stored_configs():
    model, choices = split_choices({"dtype": "bfloat16", "remat": True, "moe_dispatch": "dense"})
    assert model == {"dtype": "bfloat16"} and choices == {"remat": True, "moe_dispatch": "dense"}
    assert Runtime(**choices).remat is True
    # a config stored by a version whose ModelConfig held the choices still loads, without them
    old = dict(config_to_dict(CFG), moe_dispatch="dense", attn_kernel="auto", remat=False, attn_key_block=4096)
    assert config_from_dict(old) == CFG
    with pytest.raises(ValueError, match="unknown ModelConfig field"):
        config_from_dict(dict(config_to_dict(CFG), nonsense=1))


def _denoise_jaxpr(rt):
    params = api.param_shapes(CFG)
    cache = init_cache(CFG, 1, 8)
    canvas = jnp.zeros((1, CFG.canvas_length), jnp.int32)
    return str(jax.make_jaxpr(lambda p, c: api.denoise_logits(p, CFG, canvas, c.lengths, c, runtime=rt))(params,
                                                                                                      cache))


def test_the_dispatch_the_runtime_names_is_the_one_traced():
    """Each strategy traces its own program (grouped matmuls only for ragged, the Pallas kernel only for gmm)."""
    dense, ragged, capacity = (_denoise_jaxpr(Runtime(platform="cpu", moe_dispatch=s))
                               for s in ("dense", "ragged", "capacity"))
    assert "ragged_dot" in ragged and "ragged_dot" not in dense and "ragged_dot" not in capacity
    assert dense != capacity
    # "auto" traces exactly what it resolves to on the platform named
    assert _denoise_jaxpr(Runtime(platform="cpu")) == capacity
    tpu_gmm = _denoise_jaxpr(Runtime(platform="tpu", moe_dispatch="gmm", attn_kernel="xla"))
    assert "pallas_call" in tpu_gmm and "pallas_call" not in ragged and "ragged_dot" not in tpu_gmm
    assert _denoise_jaxpr(Runtime(platform="tpu", attn_kernel="xla")) == ragged


def test_the_mesh_constraints_appear_only_with_a_mesh():
    mesh = make_mesh("expert=2", devices=jax.devices()[:2])
    plain = _denoise_jaxpr(Runtime(platform="cpu"))
    placed = _denoise_jaxpr(Shardings(CFG, mesh, "latency").runtime(platform="cpu"))
    assert "sharding_constraint" not in plain and "shard_map" not in plain
    assert "sharding_constraint" in placed and "shard_map" in placed


class _Count:
    def __init__(self):
        self.calls = []

    def kernel_call(self, name, flops):
        self.calls.append((name, flops))


def test_the_observer_hears_each_kernel_call_with_its_flops():
    cfg = ModelConfig.preset("tiny-2layer", hidden_size=128, num_heads=2, head_dim=128, num_kv_heads=1,
                             global_head_dim=128, canvas_length=128, sliding_window=128)
    params = api.param_shapes(cfg)
    cache = init_cache(cfg, 1, 256)
    canvas = jnp.zeros((1, 128), jnp.int32)
    seen = _Count()
    rt = Runtime(platform="cpu", attn_kernel="pallas", observer=seen)
    jax.make_jaxpr(lambda p, c: api.denoise_logits(p, cfg, canvas, c.lengths, c, runtime=rt))(params, cache)
    # the global layer reads all 256 slots; the "block" sliding layer its ring (window + canvas: 256 slots)
    assert ring_size(cfg, 256) == 256
    # each over its slots and the 128 canvas keys
    assert sorted(f for _, f in seen.calls) == [4.0 * 128 * 2 * 128 * (256 + 128)] * 2
    assert {n for n, _ in seen.calls} == {"denoise_attention"}
    assert rt != Runtime(platform="cpu", attn_kernel="pallas")  # compared by identity: its own programs


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
def test_auto_traces_int4_experts_through_the_grouped_matmul_kernel_for_tpu(quantize):
    """Runtime(platform="tpu") with the default dispatch: the model's int4 expert kernels go through the
    Pallas grouped matmul (the observer hears it, twice a layer: gate_up and down); int8 and bfloat16
    experts keep XLA's grouped matmul."""
    from dgemma_jax import quantize_params

    params = init_params(CFG, 0)
    if quantize:
        params = quantize_params(CFG, params, quantize)
    cache = init_cache(CFG, 1, 64)
    canvas = jnp.zeros((1, CFG.canvas_length), jnp.int32)
    seen = _Count()
    rt = Runtime(platform="tpu", observer=seen)
    jax.make_jaxpr(lambda p, c: api.denoise_logits(p, CFG, canvas, c.lengths, c, runtime=rt))(params, cache)
    matmuls = [n for n, _ in seen.calls if n == "grouped_matmul"]
    assert len(matmuls) == (2 * CFG.num_layers if quantize == "int4" else 0)


def test_engine_runtime_and_shardings_must_agree():
    params = init_params(CFG, 0)
    mesh = make_mesh("expert=2", devices=jax.devices()[:2])
    sh = Shardings(CFG, mesh, "latency")
    e = Engine(CFG, sh.place_params(params), SamplerConfig.for_model(CFG), shardings=sh,
               runtime=Runtime(moe_dispatch="dense"))
    assert e.runtime.mesh is mesh and e.runtime.moe_dispatch == "dense"
    other = make_mesh("data=2", devices=jax.devices()[:2])
    with pytest.raises(ValueError, match="mesh and rules differ"):
        Engine(CFG, params, shardings=sh, runtime=Runtime(mesh=other, rules=sh.rules))
    with pytest.raises(ValueError, match="runtime must be a dgemma_jax.Runtime"):
        Engine(CFG, params, runtime="cpu")


def test_engine_dispatch_choice_changes_nothing_but_the_program():
    """The same tokens from every dispatch (they all equal the dense oracle), through the engine."""
    params = init_params(CFG, 0)
    prompt = np.array([[5, 6, 7, 8]], np.int32)
    outs = [np.asarray(Engine(CFG, params, runtime=Runtime(moe_dispatch=s)).generate(prompt, rng=3).tokens)
            for s in ("dense", "capacity", "ragged")]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_a_scanned_program_counts_each_grouped_matmul_once_per_layer():
    """The scanned layout traces a layer group once (its kernels run once per group) and the MoE of a
    layer in one `lax.switch` branch per group (all traced, one runs): the observer hears the int4
    grouped matmuls' FLOPs of the unrolled program, not times the groups again (5x on the 26B's
    scanned generate for a v5e-1 before: 3.65 TFLOP a step for 0.73)."""
    from dgemma_jax import quantize_params
    from dgemma_jax.model.layout import stack_layers

    cfg = ModelConfig.preset("tiny-6layer", num_layers=12)
    params = quantize_params(cfg, init_params(cfg, 0), "int4")
    canvas = jnp.zeros((1, cfg.canvas_length), jnp.int32)
    totals = {}
    for layers, p in (("unrolled", params), ("scan", stack_layers(params, cfg))):
        seen = _Count()
        rt = Runtime(platform="tpu", observer=seen, layers=layers, attn_kernel="xla")
        cache = init_cache(cfg, 1, 64, layers=layers)
        jax.make_jaxpr(lambda p, c: api.denoise_logits(p, cfg, canvas, c.lengths, c, runtime=rt))(p, cache)
        totals[layers] = sum(f for n, f in seen.calls if n == "grouped_matmul")
    assert totals["unrolled"] > 0
    assert totals["scan"] == pytest.approx(totals["unrolled"])
