"""Sharding changes nothing: sharded == unsharded on several meshes of 8 fake CPU devices.

The model has one sliding and one global layer, 8 experts, 8 heads: every kind of layer and every split
the meshes make (more layers add compile time, not another kind of sharding)."""

import os
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, Runtime, init_params, param_shapes
from dgemma_jax.engine import Engine
from dgemma_jax.parallel import Shardings, make_mesh, parse_mesh, spec_for
from dgemma_jax.axis_rules import rules_for
from dgemma_jax.sampling import SamplerConfig
from dgemma_jax.sampling.loop import denoise_step, init_state, row_keys

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")

CFG = ModelConfig.preset("tiny-6layer", num_heads=8, num_kv_heads=4, num_global_kv_heads=2, num_layers=2,
                          layer_types=("sliding", "global"))
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))
TOKENS = np.random.RandomState(0).randint(3, CFG.vocab_size, (2, 20)).astype(np.int32)
LENGTHS = np.array([20, 13], np.int32)


@pytest.fixture(scope="module")
def reference():
    params = init_params(CFG, 0)
    out = Engine(CFG, params, SAMPLER).generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32)
    return params, np.asarray(out.tokens)


@pytest.mark.parametrize("mesh_spec,rules", [("tensor=8", "latency"), ("expert=2,tensor=4", "latency"),
                                             ("fsdp=8", "training"), ("data=2,expert=4", "serving")])
def test_sharded_generate_equals_unsharded(reference, mesh_spec, rules):
    params, ref_tokens = reference
    sh = Shardings(CFG, make_mesh(mesh_spec), rules)
    placed = sh.place_params(params)
    out = Engine(CFG, placed, SAMPLER, shardings=sh).generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
    # the parameters really are split
    specs = {str(x.sharding.spec) for x in jax.tree.leaves(placed)}
    assert any(s != "PartitionSpec()" for s in specs)


@pytest.mark.parametrize("large", [False, True])
def test_accelerator_paths_sharded_equal_unsharded(reference, large, monkeypatch):
    """The programs built for TPU (ragged expert-parallel MoE under shard_map, full-vocab head with
    Gumbel sampling), traced here and run on the CPU devices: sharded == unsharded on meshes that
    split the experts 8 and 4 ways (each shard runs its pairs in blocks). large: the forms the MoE
    and its all-reduce take for activations past `moe.ON_CHIP_BYTES` (the 32-slot server's)."""
    from dgemma_jax.model import moe

    if large:
        monkeypatch.setattr(moe, "ON_CHIP_BYTES", 0)
    params, _ = reference
    rt = Runtime(platform="tpu", moe_dispatch="ragged", moe_shard_rows_factor=1.0)
    ref = Engine(CFG, params, SAMPLER, runtime=rt).generate(TOKENS, LENGTHS, rng=0, max_new_tokens=32)
    for mesh_spec in ("expert=8", "expert=4,tensor=2"):
        sh = Shardings(CFG, make_mesh(mesh_spec), "latency")
        out = Engine(CFG, sh.place_params(params), SAMPLER, shardings=sh, runtime=rt).generate(
            TOKENS, LENGTHS, rng=0, max_new_tokens=32)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=mesh_spec)


def test_streaming_driver_sharded(reference):
    params, ref_tokens = reference
    sh = Shardings(CFG, make_mesh("expert=2,tensor=4"), "latency")
    eng = Engine(CFG, sh.place_params(params), SAMPLER, shardings=sh)
    from dgemma_jax.engine.drivers import collect

    toks, _, _ = collect(eng.stream(TOKENS, LENGTHS, rng=0, max_new_tokens=32), 2, 32, 16, 0)
    np.testing.assert_array_equal(toks, ref_tokens)


def test_rules_and_mesh_parsing():
    mesh = make_mesh("tensor=4,expert=2")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 4, "expert": 2}
    rules = rules_for("latency")
    # divisible dims are split, indivisible ones replicated, a mesh axis is used once per array
    assert spec_for((16, 64, 64), ("experts", "embed", "expert_gate_up"), rules, mesh) == \
        jax.sharding.PartitionSpec(("expert", "tensor"), None, None)
    assert spec_for((8, 64), ("heads", "embed"), rules, mesh) == jax.sharding.PartitionSpec(("tensor", "expert"), None)
    assert spec_for((64, 2, 32), ("embed", "kv_heads", "head_dim"), rules, mesh) == \
        jax.sharding.PartitionSpec(None, None, None)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        parse_mesh("model=8", 8)
    with pytest.raises(ValueError, match="multiply to the device count"):
        parse_mesh("data=3,tensor=4", 8)
    with pytest.raises(ValueError, match="unknown sharding rule set"):
        rules_for("fastest")


def test_kv_replicas_give_each_device_its_kv_head():
    """When the query heads split more ways than a layer's kv heads, the cache stores each kv head
    r times so that every device holds exactly the one kv head its query heads read."""
    for mesh_spec, rules, want in [("tensor=8", "latency", (2, 4)),          # (sliding, global) layers
                                   ("expert=2,tensor=4", "latency", (2, 4)),
                                   ("tensor=4", "latency", (1, 2)),
                                   ("fsdp=8", "training", (1, 1))]:
        devices = jax.devices()[:int(np.prod([int(p.split("=")[1]) for p in mesh_spec.split(",")]))]
        sh = Shardings(CFG, make_mesh(mesh_spec, devices=devices), rules)
        assert sh.kv_replicas == want, mesh_spec
        shapes, shards = sh.cache_shape(1, 64), sh.cache(1, 64)
        q_per_device = sh.named((CFG.num_heads,), ("heads",)).shard_shape((CFG.num_heads,))[0]
        for i in range(CFG.num_layers):
            heads = shapes.keys[i].shape[1]
            assert heads == CFG.layer_kv_heads(i) * want[i]
            per_device = shards.keys[i].shard_shape(shapes.keys[i].shape)[1]
            # a device's kv heads serve exactly its query heads (none sliced out, none extra)
            assert per_device * (CFG.num_heads // heads) == q_per_device, (mesh_spec, i)


def test_kv_replicas_remove_the_per_step_cache_slice():
    """The compiled denoise step on tensor=8 slices no whole-length K/V out of the cache; with the
    replicas turned off (a replicated global cache) it does, once per global K and V."""
    def cache_slices(sh):
        ab = lambda t, s: jax.tree.map(lambda a, n: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=n), t, s)  # noqa: E731
        ps, cache = ab(param_shapes(CFG), sh.params), ab(sh.cache_shape(1, 64), sh.cache(1, 64))
        keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), 1))
        state = jax.eval_shape(lambda: init_state(CFG, SAMPLER, jnp.zeros((1, 16), jnp.int32)))
        step = jax.jit(lambda p, c, k, s: denoise_step(p, CFG, SAMPLER, c, c.lengths, k, s, runtime=sh.runtime()))
        hlo = step.lower(ps, cache, keys, state).compile().as_text()
        return re.findall(r"= f32\[1,\d+,64,\d+\]\S* dynamic-slice\(", hlo)  # all 64 slots of some heads ([B, K, S, H])

    sh = Shardings(CFG, make_mesh("tensor=8"), "latency")
    assert sh.kv_replicas[-1] == 4 and cache_slices(sh) == []
    plain = Shardings(CFG, make_mesh("tensor=8"), "latency")
    plain.__dict__["kv_replicas"] = (1,) * CFG.num_layers  # override the cached property: no replicas
    assert len(cache_slices(plain)) >= 2


@pytest.mark.parametrize("dispatch", ["capacity", "dense"])
def test_expert_parallelism_moves_no_expert_weights(dispatch):
    """With experts over an 8-way `expert` axis the compiled step all-gathers no expert weights."""
    cfg = CFG.replace(num_experts=8)
    sh = Shardings(cfg, make_mesh("expert=8"), "latency")
    ps = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), param_shapes(cfg), sh.params)
    assert ps["blocks_0"]["moe"]["gate_up"].sharding.spec[0] == "expert"
    cache = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n),
                         sh.cache_shape(1, 64), sh.cache(1, 64))
    keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), 1))
    state = jax.eval_shape(lambda: init_state(cfg, SAMPLER, jnp.zeros((1, 16), jnp.int32)))
    rt = sh.runtime(moe_dispatch=dispatch)
    step = jax.jit(lambda p, c, k, s: denoise_step(p, cfg, SAMPLER, c, c.lengths, k, s, runtime=rt))
    hlo = step.lower(ps, cache, keys, state).compile().as_text()
    one_expert = cfg.hidden_size * 2 * cfg.moe_intermediate_size
    gathers = [(int(np.prod([int(d) for d in m.group(1).split(",") if d])), m.group(2))
               for m in re.finditer(r"= \w+\[([\d,]*)\][^=]*? all-gather\((.*)", hlo)]
    in_moe = [n for n, rest in gathers if "experts_" in rest or "moe" in rest]
    assert not in_moe or max(in_moe) < one_expert, f"the MoE all-gathers {max(in_moe)} elements (>= one expert)"
    # nothing anywhere gathers as much as half of one layer's expert weights
    assert all(n < cfg.num_experts * one_expert // 2 for n, _ in gathers), gathers


@pytest.mark.parametrize("mesh_spec,fused,large", [("expert=2,tensor=4", True, False), ("expert=2,tensor=4", True, True),
                                                    ("data=2,tensor=4", True, False), ("fsdp=2,tensor=4", False, False)])
def test_dense_mlp_sums_with_the_experts_in_one_all_reduce(mesh_spec, fused, large, monkeypatch):
    """Where the dense MLP's hidden units are split over exactly the experts' mesh axes, its partial
    output is summed in the experts' all-reduce: per layer one all-reduce for the MoE and dense
    branches (not one each). With FSDP (embed split) the dense MLP stays XLA's; the same tokens either
    way (test_sharded_generate_equals_unsharded, the training tests). large: the form for activations
    past `moe.ON_CHIP_BYTES` (the pair stacked, not concatenated), still one all-reduce."""
    from dgemma_jax.model import moe
    from dgemma_jax.perf.collectives import collectives

    if large:
        monkeypatch.setattr(moe, "ON_CHIP_BYTES", 0)

    rules = "latency" if "fsdp" not in mesh_spec else "training"  # training: embed split over fsdp
    sh = Shardings(CFG, make_mesh(mesh_spec), rules)
    ps = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), param_shapes(CFG), sh.params)
    batch = 2 if "data" in mesh_spec or "fsdp" in mesh_spec else 1
    cache = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n),
                         sh.cache_shape(batch, 64), sh.cache(batch, 64))
    keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), batch))
    state = jax.eval_shape(lambda: init_state(CFG, SAMPLER, jnp.zeros((batch, 16), jnp.int32)))
    rt = sh.runtime(moe_dispatch="ragged")
    step = jax.jit(lambda p, c, k, s: denoise_step(p, CFG, SAMPLER, c, c.lengths, k, s, runtime=rt))
    hlo = step.lower(ps, cache, keys, state).compile().as_text()
    inside = re.search(r"_ffw/moe/experts_ragged/shard_map/dense_mlp/", hlo) is not None
    assert inside == fused  # the dense MLP's matmuls run in the experts' per-shard body, or as XLA's
    if not fused:
        return
    reduces = [c for c in collectives(hlo, 8) if c["kind"] == "all-reduce"]
    in_blocks = lambda pattern: sum(c["count"] for c in reduces if re.search(r"blocks_(N|\d+)[._]" + pattern, c["scope"]))
    assert in_blocks(r".*_ffw/dense_mlp/") == 0, reduces  # no all-reduce of the dense MLP's own
    assert in_blocks(r".*_ffw/moe/experts_ragged/shard_map/psum") == CFG.num_layers, reduces
    rows = 16 * batch // (2 if "data" in mesh_spec else 1)
    assert all(c["bytes"] == 2 * rows * CFG.hidden_size * 4 for c in reduces if "shard_map/psum" in c["scope"])


@pytest.mark.parametrize("mesh_spec", ["data=2,expert=4", "expert=8"])
def test_throughput_rules_gather_rows_for_the_experts(mesh_spec):
    """The "throughput" rules split the rows over every mesh axis and only the experts (and the vocabulary)
    over theirs: each expert shard gathers its group's rows for the MoE and reduce-scatters the sums back. Same
    tokens as unsharded on data=2,expert=4 (CPU dispatch and the TPU path's ragged dispatch); on both
    meshes the compiled step's layers move rows only: per layer one all-gather and one reduce-scatter
    of the MoE's rows, no all-reduce, no expert weight gathered."""
    from dgemma_jax.perf.collectives import collectives

    tokens = np.random.RandomState(1).randint(3, CFG.vocab_size, (8, 20)).astype(np.int32)
    lengths = np.array([20, 13, 7, 20, 16, 3, 11, 19], np.int32)
    params = init_params(CFG, 0)
    group = 4 if mesh_spec.startswith("data") else 8   # the rows an expert shard gathers come from this many chips
    sh = Shardings(CFG, make_mesh(mesh_spec), "throughput")
    placed = sh.place_params(params)
    assert placed["blocks_0"]["moe"]["gate_up"].sharding.spec[0] is not None  # the experts are split
    split = {jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_leaves_with_path(placed)
             if any(entry is not None for entry in x.sharding.spec)}
    assert split == {f"['blocks_{i}']['moe']['{k}']" for i in range(CFG.num_layers) for k in ("gate_up", "down")} \
        | {"['embedding']"}   # and the vocabulary
    # the tokens on one mesh (the other runs the same code with a group of 8): the CPU dispatch and the TPU path's
    runtimes = (None, Runtime(platform="tpu", moe_dispatch="ragged", moe_shard_rows_factor=1.0)) if group == 4 else ()
    for rt in runtimes:
        kw = {} if rt is None else {"runtime": rt}
        ref = Engine(CFG, params, SAMPLER, **kw).generate(tokens, lengths, rng=0, max_new_tokens=32)
        rt_sh = {} if rt is None else {"runtime": sh.runtime(platform="tpu", moe_dispatch="ragged",
                                                              moe_shard_rows_factor=1.0)}
        out = Engine(CFG, placed, SAMPLER, shardings=sh, **rt_sh).generate(tokens, lengths, rng=0, max_new_tokens=32)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens), err_msg=str(rt))

    ps = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), param_shapes(CFG), sh.params)
    cache = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n),
                         sh.cache_shape(8, 64), sh.cache(8, 64))
    keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), 8))
    state = jax.eval_shape(lambda: init_state(CFG, SAMPLER, jnp.zeros((8, 16), jnp.int32)))
    rt = sh.runtime(platform="tpu", moe_dispatch="ragged")
    step = jax.jit(lambda p, c, k, s: denoise_step(p, CFG, SAMPLER, c, c.lengths, k, s, runtime=rt))
    found = collectives(step.lower(ps, cache, keys, state).compile().as_text(), 8)
    in_layers = [c for c in found if re.search(r"blocks_(N|\d+)[._]", c["scope"])]
    kinds = lambda kind: sum(c["count"] for c in in_layers if c["kind"] == kind)  # noqa: E731
    assert kinds("all-reduce") == 0, in_layers
    assert kinds("reduce-scatter") == CFG.num_layers, in_layers
    rows_bytes = 8 * 16 // (8 // group) * CFG.hidden_size * 4    # the group's rows, float32 on the CPU
    assert all(c["bytes"] == rows_bytes for c in in_layers if c["kind"] == "reduce-scatter"), in_layers
    # the largest thing gathered is the group's rows (no expert kernel: one layer's is 8x those rows)
    gate_up = CFG.num_experts * CFG.hidden_size * 2 * CFG.moe_intermediate_size * 4
    assert max(c["bytes"] for c in found if c["kind"] == "all-gather") == rows_bytes < gate_up, found


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_distributed_equals_single_process(reference, tmp_path):
    """Two processes (gloo on 127.0.0.1, 4 CPU devices each) on one global 8-device mesh produce the
    same tokens as this single process."""
    _, ref_tokens = reference
    worker = os.path.join(os.path.dirname(__file__), "helpers", "mp_generate.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    port = _free_port()
    multi = tmp_path / "multi.npy"
    procs = [subprocess.Popen([sys.executable, worker, str(port), "2", str(i), str(multi)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outs = [p.communicate(timeout=400)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    np.testing.assert_array_equal(np.load(multi), ref_tokens)


_UNSHARDED_GRADS: dict = {}


# (expert-split training with the CPU capacity dispatch is covered by the trainer's mesh test in
# test_training.py; here the TPU path's ragged blocks; without fsdp the dense MLP runs inside the
# experts' shard_map and its gradients flow back through that body)
@pytest.mark.parametrize("mesh_spec,dispatch", [("fsdp=8", "auto"), ("data=2,fsdp=2,tensor=2", "auto"),
                                                ("fsdp=2,expert=4", "ragged"), ("data=2,expert=2,tensor=2", "ragged")])
def test_sharded_training_loss_and_grads_equal_unsharded(reference, mesh_spec, dispatch):
    from dgemma_jax.training.data import Layout, collate
    from dgemma_jax.training.objective import ObjectiveConfig, loss_fn

    params, _ = reference
    layout = Layout(prompt_length=6, num_canvases=2, canvas_length=8)
    rng = np.random.RandomState(1)
    examples = [(rng.randint(3, CFG.vocab_size, rng.randint(2, 7)).tolist(),
                 rng.randint(3, CFG.vocab_size, rng.randint(3, 15)).tolist()) for _ in range(8)]
    batch = {k: jnp.asarray(v) for k, v in collate(examples, layout).items()}
    obj = ObjectiveConfig(canvas_length=8, sc_prob=0.5)
    # "ragged": the expert-parallel grouped-matmul blocks
    grad_fn = lambda rt: jax.value_and_grad(lambda p, b, k: loss_fn(p, b, k, config=CFG, obj=obj, runtime=rt)[0])  # noqa: E731
    key = jax.random.key(7)
    if dispatch not in _UNSHARDED_GRADS:  # the one-device reference, computed once per dispatch
        _UNSHARDED_GRADS[dispatch] = jax.jit(grad_fn(Runtime(moe_dispatch=dispatch)))(params, batch, key)
    loss0, grads0 = _UNSHARDED_GRADS[dispatch]

    sh = Shardings(CFG, make_mesh(mesh_spec), "training")
    placed = sh.place_params(params)
    sbatch = {k: jax.device_put(v, sh.named(v.shape, ("batch",) + (None,) * (v.ndim - 1))) for k, v in batch.items()}
    loss1, grads1 = jax.jit(grad_fn(sh.runtime(moe_dispatch=dispatch)))(placed, sbatch, key)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-5)
    # float32 reassociation across shards: compare each leaf relative to its own scale, with an
    # absolute floor at the model's gradient scale (the last layer's scalar feeds the final RMSNorm,
    # which is scale invariant, so its true gradient is 0 and its computed one pure rounding noise)
    floor = 1e-5 * max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(grads0))
    worst = 0.0
    for a, b in zip(jax.tree.leaves(grads1), jax.tree.leaves(grads0)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.abs(a - b).max()
        worst = max(worst, err / max(np.abs(b).max(), floor))
        assert err <= 5e-3 * np.abs(b).max() + floor
    print(f"{mesh_spec}: loss {float(loss1):.6f} vs {float(loss0):.6f}, "
          f"worst leaf max|dgrad| / max(max|grad|, floor) {worst:.1e}")


def test_load_hf_straight_into_shards(reference, tmp_path):
    """Each checkpoint tensor is placed directly into its device shards (no full replicated copy)."""
    from dgemma_jax import load_hf, save_hf

    params, _ = reference
    save_hf(params, CFG, tmp_path)
    sh = Shardings(CFG, make_mesh("expert=2,tensor=4"), "latency")
    cfg2, loaded = load_hf(tmp_path, dtype="float32", shardings=sh.params)
    assert cfg2.num_heads == CFG.num_heads
    for (path, a), s, b in zip(jax.tree_util.tree_flatten_with_path(loaded)[0], jax.tree.leaves(sh.params),
                               jax.tree.leaves(params)):
        assert a.sharding == s, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    gate_up = loaded["blocks_0"]["moe"]["gate_up"]
    assert gate_up.addressable_shards[0].data.shape[0] == CFG.num_experts // 8  # only this device's expert
