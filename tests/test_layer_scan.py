"""The layers as a scan over the repeated layer group (`Runtime(layers="scan")`, model/layout.py)
compute what the unrolled layers compute, and the two parameter / cache layouts convert exactly."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, Runtime, init_params
from dgemma_jax.config import GLOBAL, SLIDING
from dgemma_jax.engine import Engine
from dgemma_jax.model import layout
from dgemma_jax.model.api import denoise_logits, encode_pass, logical_axes, param_shapes, prefill
from dgemma_jax.model.cache import init_cache
from dgemma_jax.model.quant import quantize_params
from dgemma_jax.sampling import SamplerConfig

TINY = ModelConfig.preset("tiny-6layer")
CFG12 = TINY.replace(num_layers=12, layer_types=())
# 8 layers: one whole group, then a sliding layer and a last layer forced global (run unrolled)
CFG8 = TINY.replace(num_layers=8, layer_types=())
TOKENS = np.random.RandomState(0).randint(3, TINY.vocab_size, (2, 20)).astype(np.int32)
LENGTHS = np.array([20, 13], np.int32)
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))


def _passes(cfg, params, rt, cache_layers):
    cache = init_cache(cfg, 2, 64, layers=cache_layers)
    enc = jax.jit(lambda p, c: encode_pass(p, cfg, jnp.asarray(TOKENS), c.lengths, jnp.asarray(LENGTHS), c, "all",
                                           runtime=rt))
    logits, cache = enc(params, cache)
    canvas = jnp.asarray(TOKENS[:, :16])
    den = jax.jit(lambda p, c: denoise_logits(p, cfg, canvas, c.lengths, c, runtime=rt))
    return np.asarray(logits), np.asarray(den(params, cache)), layout.unstack_cache(cache, cfg)


def test_layer_plan():
    assert layout.layer_plan(ModelConfig.preset("diffusiongemma-26b-a4b")) == layout.LayerPlan(6, 5, 30)
    p8 = layout.layer_plan(CFG8)
    assert (p8.period, p8.groups, p8.remainder) == (6, 1, (6, 7))
    assert CFG8.layer_types[6:] == (SLIDING, GLOBAL)
    # no global layer: the whole stack is one group (a scan of one: valid, nothing saved)
    assert layout.layer_plan(TINY.replace(num_layers=2, layer_types=(SLIDING, SLIDING))) == layout.LayerPlan(2, 1, 2)


# (a 6-layer stack, one group and no remainder, is the 8-layer case without its two unrolled layers)
@pytest.mark.parametrize("cfg,mixed", [(CFG12, True), (CFG8, False)], ids=["12", "8"])
def test_scan_equals_unrolled(cfg, mixed):
    """Encoder logits, the cache it writes and denoiser logits; `mixed`: also each layout run on the
    other layout's parameters and cache (converted inside the program)."""
    params = init_params(cfg, 0)
    stacked = layout.stack_layers(params, cfg)
    ref = _passes(cfg, params, Runtime(), "unrolled")
    runs = {"stacked params, stacked cache": _passes(cfg, stacked, Runtime(), "scan")}
    if mixed:
        runs["layers=scan on unrolled params and cache"] = _passes(cfg, params, Runtime(layers="scan"), "unrolled")
        runs["layers=unrolled on stacked params"] = _passes(cfg, stacked, Runtime(layers="unrolled"), "scan")
    for name, (enc, den, cache) in runs.items():
        np.testing.assert_allclose(enc, ref[0], rtol=1e-5, atol=1e-4, err_msg=name)
        np.testing.assert_allclose(den, ref[1], rtol=1e-5, atol=1e-3, err_msg=name)
        for a, b in zip(cache.keys + cache.values, ref[2].keys + ref[2].values):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5, err_msg=name)


def test_stack_unstack_round_trip_exact():
    for cfg in (CFG12, CFG8):
        params = init_params(cfg, 1)
        stacked = layout.stack_layers(params, cfg)
        assert layout.is_stacked(stacked) and not layout.is_stacked(params)
        assert stacked[layout.GROUPS_KEY]["blocks_0"]["attn"]["q"].shape[0] == layout.layer_plan(cfg).groups
        back = layout.unstack_layers(stacked, cfg)
        assert set(back) == set(params)
        jax.tree.map(np.testing.assert_array_equal, back, params)
        again = layout.stack_layers(back, cfg)
        jax.tree.map(np.testing.assert_array_equal, again, stacked)
        assert layout.stack_layers(stacked, cfg) is stacked and layout.unstack_layers(params, cfg) is params
        # shapes, logical axes and int8 pairs convert the same way
        shapes = layout.stack_layers(param_shapes(cfg), cfg)
        assert jax.tree.structure(shapes) == jax.tree.structure(stacked)
        assert [s.shape for s in jax.tree.leaves(shapes)] == [x.shape for x in jax.tree.leaves(stacked)]
        axes = layout.stack_layers(logical_axes(cfg), cfg)
        assert tuple(axes[layout.GROUPS_KEY]["blocks_0"]["attn"]["q"]) == ("layers", "embed", "heads", "head_dim")
        # the expert kernels stay side by side, unstacked: the very arrays of the layers
        plan = layout.layer_plan(cfg)
        for j in range(plan.period):
            for name in ("gate_up", "down"):
                pg = stacked[layout.GROUPS_KEY][f"blocks_{j}"]["moe"][name]
                assert isinstance(pg, layout.PerGroup) and pg.index is None and len(pg.arrays) == plan.groups
                for g in range(plan.groups):
                    assert pg.arrays[g] is params[f"blocks_{plan.layer(g, j)}"]["moe"][name]
                spec = axes[layout.GROUPS_KEY][f"blocks_{j}"]["moe"][name]
                assert [tuple(a) for a in spec.arrays] == [tuple(logical_axes(cfg)["blocks_0"]["moe"][name])] * plan.groups
        q = quantize_params(cfg, params, "int8")
        qs = layout.stack_layers(q, cfg)
        gate_up = qs[layout.GROUPS_KEY]["blocks_0"]["moe"]["gate_up"]  # int8 values per group, scales stacked
        assert isinstance(gate_up["int8"], layout.PerGroup) and gate_up["scale"].shape[0] == plan.groups
        jax.tree.map(np.testing.assert_array_equal, layout.unstack_layers(qs, cfg), q)
        # the cache
        c = init_cache(cfg, 2, 32)
        c = c.replace(keys=tuple(jax.random.normal(jax.random.key(i), k.shape) for i, k in enumerate(c.keys)))
        s = layout.stack_cache(c, cfg)
        assert s.groups == layout.layer_plan(cfg).groups and s.max_length == 32
        u = layout.unstack_cache(s, cfg)
        assert u.groups == 0
        jax.tree.map(np.testing.assert_array_equal, u, c)
        jax.tree.map(np.testing.assert_array_equal, layout.stack_cache(u, cfg), s)


def test_engine_scan_generates_the_same_tokens():
    # two groups of (sliding, global): the engine's scan over groups (the 6-layer period of the 26B's
    # groups is test_scan_equals_unrolled's)
    cfg = TINY.replace(num_layers=4, layer_types=("sliding", "global") * 2)
    params = init_params(cfg, 0)
    ref = Engine(cfg, params, SAMPLER).generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32)
    eng = Engine(cfg, params, SAMPLER, runtime=Runtime(layers="scan"))
    assert layout.is_stacked(eng.params) and eng.new_cache(2, 64).groups == 2
    out = eng.generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.cache.groups == 2


def test_runtime_layers_choice():
    for platform in ("cpu", "tpu"):  # the defaults (runtime.LAYER_DEFAULTS)
        assert Runtime(platform=platform).layers == "unrolled"
    assert Runtime(platform="tpu", layers="scan").layers == "scan"
    with pytest.raises(ValueError, match="Runtime.layers"):
        Runtime(layers="rolled")


def test_checked_prefill_takes_a_stacked_cache():
    params = init_params(CFG8, 0)
    cache = init_cache(CFG8, 2, 64, layers="scan")
    _, out = prefill(layout.stack_layers(params, CFG8), CFG8, TOKENS, LENGTHS, cache=cache)
    _, ref = prefill(params, CFG8, TOKENS, LENGTHS, cache=init_cache(CFG8, 2, 64))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5),
                 layout.unstack_cache(out, CFG8), ref)


def test_hbm_traffic_counts_the_models_layer_scan_once_per_group():
    """The scanned step's compiled loop carries `LAYER_LOOP_SCOPE`, so perf.hbm_traffic / collectives
    count its body once per group (it stands for the unrolled layers); other loops count once."""
    from dgemma_jax.perf.hbm_traffic import loop_runs

    params = layout.stack_layers(init_params(CFG12, 0), CFG12)
    cache = init_cache(CFG12, 2, 64, layers="scan")
    canvas = jnp.asarray(TOKENS[:, :16])
    fn = jax.jit(lambda p, c: denoise_logits(p, CFG12, canvas, c.lengths, c, runtime=Runtime(layers="scan")))
    text = fn.lower(params, cache).compile().as_text()
    loops = [line for line in text.splitlines() if " while(" in line]
    runs = sorted(loop_runs(text, line) for line in loops)
    scoped = [line for line in loops if layout.LAYER_LOOP_SCOPE in line]
    assert len(scoped) == 1 and loop_runs(text, scoped[0]) == layout.layer_plan(CFG12).groups == 2, runs
    assert all(loop_runs(text, line) == 1 for line in loops if line not in scoped)

def test_hbm_traffic_counts_a_loop_nested_in_the_layer_scan_once_per_group():
    """A loop inside the scan body (the MoE's row blocks) has the scope in its op_name too: it runs
    once per group iteration, not its own trip count times."""
    from dgemma_jax.perf.hbm_traffic import hbm_traffic

    scope = f"jit(f)/Transformer._denoise_layers/{layout.LAYER_LOOP_SCOPE}"
    text = f"""HloModule m

%cond_in (p: (s32[], f32[1024])) -> pred[] {{
  %p = (s32[], f32[1024]) parameter(0)
  %c = s32[] constant(7)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %c), direction=LT
}}

%body_in (q: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %q = (s32[], f32[1024]) parameter(0)
  %x = f32[1024] get-tuple-element(%q), index=1
  %y = f32[1024] negate(%x)
  %j = s32[] get-tuple-element(%q), index=0
  ROOT %t = (s32[], f32[1024]) tuple(%j, %y)
}}

%cond (p2: (s32[], f32[1024])) -> pred[] {{
  %p2 = (s32[], f32[1024]) parameter(0)
  %c2 = s32[] constant(5)
  %i2 = s32[] get-tuple-element(%p2), index=0
  ROOT %lt2 = pred[] compare(%i2, %c2), direction=LT
}}

%body (q2: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %q2 = (s32[], f32[1024]) parameter(0)
  ROOT %inner = (s32[], f32[1024]) while(%q2), condition=%cond_in, body=%body_in, metadata={{op_name="{scope}/while/body/moe/while"}}
}}

ENTRY %main (a: (s32[], f32[1024])) -> (s32[], f32[1024]) {{
  %a = (s32[], f32[1024]) parameter(0)
  ROOT %w = (s32[], f32[1024]) while(%a), condition=%cond, body=%body, metadata={{op_name="{scope}/while"}}
}}
"""  # noqa: E501 (an HLO module as XLA prints it)
    assert hbm_traffic(text)["total"] == 5 * 2 * 4096  # 5 groups x the negate's read and write


@pytest.mark.slow
@pytest.mark.parametrize("quantize,bound", [(None, 1.05), ("int8", 1.15)], ids=["float", "int8"])
def test_a_scanned_step_compiles_for_tpu_and_is_held_against_the_same_requirement(quantize, bound):
    """`compile_report(layers="scan")` end to end for v5e-8 (int8: stacked int8 pairs): the report reads
    the requirement per layer whatever the layout, counts the scanned body once per group, and the
    scanned step's HBM traffic stays near the unrolled one's. The bounds are this float32 config's
    measurements (1.014x float, 1.11x int8) plus a margin; before the expert kernels went in per group
    (layout.PerGroup), the copies of their slices made it 1.42x and 1.20x."""
    pytest.importorskip("libtpu")
    from dgemma_jax.perf.aot import compile_report

    un, sc = (compile_report(CFG12, "v5e-8", mesh="expert=4,tensor=2", context=64, prompt=16,
                             programs=("denoise_step",), layers=layers, quantize=quantize)
              for layers in ("unrolled", "scan"))
    assert sc["layers"] == "scan" and un["layers"] == "unrolled"
    a, b = un["programs"]["denoise_step"], sc["programs"]["denoise_step"]
    assert a["required_bytes"] == b["required_bytes"] > 0
    # cost_analysis counts the loop body once (half the layers' FLOPs here); the reports' FLOPs
    # (perf.hlo_flops) and hbm_traffic count it once per group
    assert b["compiler_flops"] < 0.75 * a["compiler_flops"]
    assert b["flops"] == pytest.approx(a["flops"], rel=0.02) and b["uncounted_loops"] == a["uncounted_loops"]
    assert 0.9 * a["hbm_bytes"] <= b["hbm_bytes"] <= bound * a["hbm_bytes"]


@pytest.mark.slow
def test_the_per_group_switch_hands_out_bfloat16(monkeypatch):
    """A switch's result lives in HBM on TPU: every scanned layer writes the MoE's [T, D] output out of
    its per-group switch and reads it back. The dispatch ends in bfloat16 in every branch, but the
    compiler hoisted that common cast out of the switch, so float32 crossed, twice the bytes (26B
    v6e-8: 0.17 GB a step, 2.3% of it), until a barrier kept it in (`layout.per_group_switch`). AOT for v5e-8 in
    bfloat16, scanned: each of the 6 layers in the body has its switch, handing out bfloat16."""
    pytest.importorskip("libtpu")
    from dgemma_jax.perf import aot

    texts = []
    real = aot.hbm_traffic
    monkeypatch.setattr(aot, "hbm_traffic", lambda text: texts.append(text) or real(text))
    aot.compile_report(CFG12, "v5e-8", mesh="expert=4,tensor=2", context=64, prompt=16, dtype="bfloat16",
                       programs=("denoise_step",), layers="scan")
    # every conditional but those nested in a switch's branches (the MoE's skipped blocks): the
    # switches, whatever the compiler renamed them to when it moved code across them
    conds = re.findall(r"= (\S+) conditional\(.*op_name=\"([^\"]*)\"", texts[-1])
    switches = [t for t, name in conds if layout.PER_GROUP_SCOPE + "/cond/branch_" not in name]
    assert len(switches) == 6 and all(t.startswith("bf16[") for t in switches), conds


@pytest.mark.slow
@pytest.mark.parametrize("name", ["float", "int8"])  # one case each: two pytest-xdist workers share them
def test_scan_runs_the_grouped_matmul_on_per_group_kernels_on_an_expert_mesh(name):
    """The accelerator program ("ragged" grouped matmuls per expert shard under shard_map) scanned: the
    expert kernels go in whole as `PerGroup`s and each grouped matmul picks its group's array, float
    and int8 alike; the tokens and the denoiser's logits are the unrolled program's."""
    from dgemma_jax.parallel import Shardings, make_mesh

    # two groups of (sliding, global), split over 2 experts x 4 heads
    cfg = ModelConfig.preset("tiny-6layer", num_heads=8, num_kv_heads=4, num_global_kv_heads=2, num_layers=4,
                             layer_types=(SLIDING, GLOBAL, SLIDING, GLOBAL))
    assert layout.layer_plan(cfg) == layout.LayerPlan(2, 2, 4)
    sh = Shardings(cfg, make_mesh("expert=2,tensor=4"), "latency")
    params = init_params(cfg, 3)
    canvas = jnp.asarray(TOKENS[:, :16])
    p = params if name == "float" else quantize_params(cfg, params, "int8")
    out, logits = {}, {}
    for layers in ("unrolled", "scan"):
        rt = Runtime(platform="tpu", moe_dispatch="ragged", moe_shard_rows_factor=1.0, layers=layers)
        eng = Engine(cfg, sh.place_params(p), SAMPLER, shardings=sh, runtime=rt)
        assert layout.is_stacked(eng.params) == (layers == "scan")
        if layers == "scan":
            pg = eng.params[layout.GROUPS_KEY]["blocks_0"]["moe"]["gate_up"]
            assert isinstance(pg["int8"] if name == "int8" else pg, layout.PerGroup)
        out[layers] = np.asarray(eng.generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32).tokens)
        cache = eng.new_cache(2, 64)
        _, cache = jax.jit(lambda p_, c: encode_pass(p_, cfg, jnp.asarray(TOKENS), c.lengths,
                                                     jnp.asarray(LENGTHS), c, "none", runtime=eng.runtime))(
            eng.params, cache)
        logits[layers] = np.asarray(jax.jit(lambda p_, c: denoise_logits(p_, cfg, canvas, c.lengths, c,
                                                                        runtime=eng.runtime))(eng.params, cache))
    np.testing.assert_array_equal(out["scan"], out["unrolled"], err_msg=name)
    np.testing.assert_allclose(logits["scan"], logits["unrolled"], rtol=1e-5, atol=1e-3, err_msg=name)


def test_each_entry_point_resolves_auto_to_its_measured_layout():
    """--layers auto: on TPU the scan for generate, chat and the notebook (a cold start's compile time
    outweighs its per-call cost), unrolled for serve; unrolled on every other platform; an explicit
    --layers wins everywhere. The notebook takes its choice from the same table."""
    import json
    import os

    from dgemma_jax.cli import build_parser
    from dgemma_jax.cli_run import runtime_for
    from dgemma_jax.runtime import resolve_layers

    p = build_parser()
    want = {"generate": "scan", "chat": "scan", "serve": "unrolled"}
    for command, wanted in want.items():
        args = p.parse_args([command])
        assert runtime_for(args, platform="tpu").layers == wanted
        assert runtime_for(args, platform="cpu").layers == "unrolled"
        assert runtime_for(p.parse_args([command, "--layers", "unrolled"]), platform="tpu").layers == "unrolled"
        assert runtime_for(p.parse_args([command, "--layers", "scan"]), platform="cpu").layers == "scan"
    assert resolve_layers("auto", "tpu", entry="notebook") == "scan"
    assert resolve_layers("auto", "gpu", entry="notebook") == "unrolled"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "launch", "colab_tpu.ipynb")) as f:
        cells = "".join("".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code")
    assert 'resolve_layers("auto", jax.default_backend(), entry="notebook")' in cells


@pytest.mark.slow
def test_lora_training_gradients_through_the_scan_equal_the_unrolled():
    """What `model.overrides.layers="scan"` gives the trainer (the 26B's RL step is compiled so,
    benchmarks/aot_rl.py): the likelihood RL scores with, and its gradient in the LoRA adapters with
    remat on, through the scanned layers (the unrolled base and adapters stacked inside the program)
    are the unrolled layers' up to float32 reassociation. Measured: relative gradient difference 7.6e-6."""
    from dgemma_jax.training import lora as lora_lib
    from dgemma_jax.training.data import Layout, collate
    from dgemma_jax.training.likelihood import token_logprobs
    from dgemma_jax.training.state import LoraSpec, model_variables

    cfg = TINY.replace(num_layers=4, layer_types=(SLIDING, GLOBAL) * 2)
    params = init_params(cfg, 0)
    spec = LoraSpec(4, 8.0, ("attention", "mlp"))
    adapters = lora_lib.init_lora(cfg, params, jax.random.key(1), 4, spec.groups)
    adapters = jax.tree.map(lambda x: x + 0.01 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), adapters)
    rng = np.random.RandomState(1)
    examples = [(rng.randint(3, 200, 5).tolist(), rng.randint(3, 200, 20).tolist()) for _ in range(2)]
    batch = {k: jnp.asarray(v) for k, v in collate(examples, Layout(prompt_length=6, num_canvases=2,
                                                                     canvas_length=16)).items()}

    def score(a, rt):
        p, lora = model_variables(cfg, a, params, spec)
        lp, mask = token_logprobs(p, batch=batch, rng=jax.random.key(3), config=cfg, num_canvases=2, num_samples=1,
                                  t_eps=1e-3, runtime=rt, adapters=lora)
        return (lp * mask).sum()

    got = {lay: jax.jit(jax.value_and_grad(lambda a, lay=lay: score(a, Runtime(layers=lay, remat=True))))(adapters)
           for lay in ("unrolled", "scan")}
    np.testing.assert_allclose(float(got["scan"][0]), float(got["unrolled"][0]), rtol=1e-5)
    assert abs(float(got["unrolled"][0])) > 1.0
    for a, b in zip(jax.tree.leaves(got["scan"][1]), jax.tree.leaves(got["unrolled"][1])):
        assert np.abs(np.asarray(b)).max() > 0
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-4 * np.abs(np.asarray(b)).max())
