"""LoRA runs unmerged in the forward pass (y = x W + (alpha/r) (x A) B, adapters float32, base frozen in
its own dtype), for every target group including the per-expert adapters of each MoE dispatch path.

* with a bf16 base, one LoRA step changes the logits by what a float32 computation of the adapters'
  delta predicts (folding the adapters into the bf16 kernels, as training used to, rounds much of
  that delta away);
* the unmerged forward equals the merged export (float32 base) for dense / ragged / capacity
  dispatch, and under an expert-parallel mesh.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import init_params
from dgemma_jax.runtime import Runtime, split_choices
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.data import Layout, TaskSource
from dgemma_jax.training.objective import ObjectiveConfig, loss_fn
from dgemma_jax.training.optim import make_optimizer
from dgemma_jax.training.step import LoraSpec, init_train_state, make_train_step
from dgemma_jax.training.tasks import Task, TaskMix, task_tokenizer
from dgemma_jax.training.train import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUPS = ("attention", "mlp", "experts", "self_conditioning")


def _tiny_config(**kw) -> ModelConfig:
    rc = load_config(os.path.join(ROOT, "configs", "train_tiny.py"))
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in rc.model.overrides.to_dict().items()}
    return ModelConfig(**split_choices({**over, **kw})[0])


def _source(cfg):
    lay = Layout(prompt_length=12, num_canvases=3, canvas_length=cfg.canvas_length)
    return TaskSource(TaskMix([Task("sort", 8, 9)]), task_tokenizer(), lay, batch_size=4, seed=3)


def _pinned(cfg, batch):
    """loss_fn keyword arguments pinning every random choice (self-conditioning on for all rows, so
    the self-conditioning MLP and its adapters are in the path)."""
    b, L = batch["tokens"].shape[0], cfg.canvas_length
    return dict(canvas_override=jnp.ones((b,), jnp.int32), t_override=jnp.full((b,), 0.5),
                noise_override=jax.random.randint(jax.random.key(5), (b, L), 0, cfg.vocab_size),
                sc_override=jnp.ones((b,), bool), return_logits=True)


def _get(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def test_bf16_base_lora_step_changes_logits_by_the_float32_delta():
    """bf16 base kernels, float32 activations (so the comparison sees parameter rounding only): after
    one LoRA step at lr 1e-4, the model's logits move by what the float32 adapters predict, measured
    against the same model with each adapted kernel replaced by W + (alpha/r) A B in float32."""
    cfg = _tiny_config(param_dtype="bfloat16", dtype="float32")
    params = init_params(cfg, 0)
    spec = LoraSpec(rank=4, alpha=8.0, groups=GROUPS)
    targets = lora_lib.target_paths(cfg, GROUPS)
    src = _source(cfg)
    obj = ObjectiveConfig(canvas_length=cfg.canvas_length)
    adapters0 = jax.device_get(lora_lib.init_lora(cfg, params, jax.random.key(1), spec.rank, GROUPS))
    opt, sched = make_optimizer(peak_lr=1e-4, end_lr=1e-5, warmup_steps=0, total_steps=10)
    step = make_train_step(cfg, obj, opt, schedule=sched, lora=spec)
    base_before = jax.device_get(params)
    state, _ = step(init_train_state(jax.tree.map(jnp.asarray, adapters0), opt, 0), params, src.batch(0))
    adapters1 = jax.device_get(state.params)
    # only the adapters are trained: the state holds the adapter tree (float32), the base is untouched
    assert jax.tree.structure(adapters1) == jax.tree.structure(adapters0)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(adapters1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(base_before)):
        assert a.dtype == jnp.bfloat16 and np.array_equal(np.asarray(a), b)

    batch = {k: jnp.asarray(v) for k, v in src.batch(1).items()}
    pinned = _pinned(cfg, batch)

    @jax.jit
    def unmerged(p, a):
        fwd = lora_lib.forward_adapters(cfg, p, a, spec.alpha, spec.rank)
        return loss_fn(p, batch, jax.random.key(0), config=cfg, obj=obj, adapters=fwd, **pinned)[1]["logits"]

    @jax.jit
    def plain(p):
        return loss_fn(p, batch, jax.random.key(0), config=cfg, obj=obj, **pinned)[1]["logits"]

    def upcast(p):  # the adapted kernels in float32 (exact), everything else as it is
        return jax.tree_util.tree_map_with_path(
            lambda k, w: w.astype(jnp.float32) if lora_lib.path_str(k) in targets else w, p)

    got = np.asarray(unmerged(params, adapters1) - unmerged(params, adapters0))
    want = np.asarray(plain(lora_lib.merge(cfg, upcast(params), adapters1, spec.alpha, spec.rank))
                      - plain(upcast(params)))
    scale = np.abs(want).max()
    assert scale > 1e-2, scale                                     # the step did move the logits
    assert np.abs(got - want).max() < 1e-3 * scale, (np.abs(got - want).max(), scale)
    # what training saw before: the adapters folded into the bf16 kernels lose a large part of the delta
    old = np.asarray(plain(lora_lib.merge(cfg, params, adapters1, spec.alpha, spec.rank)) - plain(params))
    assert np.abs(old - want).max() > 0.1 * scale, (np.abs(old - want).max(), scale)


@pytest.mark.parametrize("dispatch", ["dense", "ragged", "capacity"])
def test_unmerged_forward_equals_merged_export(dispatch):
    """Float32 base, random nonzero adapters on every group (per-expert adapters included): the
    unmerged forward (encoder, both decoder passes, self-conditioning) gives the merged model's loss
    and logits within float32 rounding."""
    cfg, rt = _tiny_config(), Runtime(moe_dispatch=dispatch)
    params = init_params(cfg, 0)
    rank, alpha = 2, 4.0
    adapters = lora_lib.init_lora(cfg, params, jax.random.key(1), rank, GROUPS)
    leaves, treedef = jax.tree.flatten(adapters)
    adapters = jax.tree.unflatten(treedef, [0.1 * jax.random.normal(jax.random.key(i), x.shape)
                                            for i, x in enumerate(leaves)])
    batch = {k: jnp.asarray(v) for k, v in _source(cfg).batch(0).items()}
    obj = ObjectiveConfig(canvas_length=cfg.canvas_length)
    pinned = _pinned(cfg, batch)

    @jax.jit
    def run(p, fwd):
        return loss_fn(p, batch, jax.random.key(0), config=cfg, obj=obj, adapters=fwd, runtime=rt, **pinned)

    loss_u, m_u = run(params, lora_lib.forward_adapters(cfg, params, adapters, alpha, rank))
    loss_m, m_m = run(lora_lib.merge(cfg, params, adapters, alpha, rank), None)
    _, m_0 = run(params, None)
    moved = np.abs(np.asarray(m_m["logits"]) - np.asarray(m_0["logits"])).max()
    assert moved > 1.0, moved                                        # the adapters matter
    np.testing.assert_allclose(np.asarray(m_u["logits"]), np.asarray(m_m["logits"]), atol=1e-4, rtol=0)
    np.testing.assert_allclose(float(loss_u), float(loss_m), rtol=1e-5)
    np.testing.assert_allclose(float(m_u["ar_loss"]), float(m_m["ar_loss"]), rtol=1e-5)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_unmerged_experts_under_expert_parallel_mesh():
    """Per-expert adapters split over an expert mesh axis with their experts (inside the MoE's
    shard_map): the same loss and logits as on one device."""
    from dgemma_jax.parallel import Shardings, make_mesh

    cfg = _tiny_config()
    params = init_params(cfg, 0)
    adapters = lora_lib.init_lora(cfg, params, jax.random.key(1), 2, ("experts",))
    adapters = jax.tree.map(lambda x: 0.1 * jax.random.normal(jax.random.key(x.size), x.shape), adapters)
    batch = {k: jnp.asarray(v) for k, v in _source(cfg).batch(0).items()}
    obj = ObjectiveConfig(canvas_length=cfg.canvas_length)
    pinned = _pinned(cfg, batch)

    def run(p, a, rt):
        fwd = lora_lib.forward_adapters(cfg, p, a, 4.0, 2)
        return loss_fn(p, batch, jax.random.key(0), config=cfg, obj=obj, adapters=fwd, runtime=rt, **pinned)

    loss1, m1 = jax.jit(run, static_argnums=2)(params, adapters, Runtime(moe_dispatch="ragged"))
    sh = Shardings(cfg, make_mesh("fsdp=2,expert=4"), "training")
    placed = sh.place_params(params)
    assert not placed["blocks_0"]["moe"]["gate_up"].sharding.is_fully_replicated
    loss8, m8 = jax.jit(run, static_argnums=2)(placed, adapters, sh.runtime(moe_dispatch="ragged"))
    np.testing.assert_allclose(float(loss8), float(loss1), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m8["logits"]), np.asarray(m1["logits"]), atol=1e-4, rtol=0)
