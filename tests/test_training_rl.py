"""RL and preference fine-tuning (issue 48): the likelihood estimate, the GRPO surrogate, the DPO loss.

* the Monte-Carlo log-likelihood estimate's gradient equals its central finite differences (float64);
* the estimate is a function of (params, rng) alone: one rng gives the policy and the reference the
  same noisy canvases (their difference is exactly 0 at equal params), another rng other ones;
* the GRPO surrogate has exactly zero gradient when every group's rewards are equal (A = 0, and the
  KL's gradient vanishes at the reference), and a non-zero one otherwise;
* DPO's loss at the reference is log 2 with a non-zero gradient that raises the chosen answer's
  estimate over the rejected one's;
* recipe errors name the key and the fix.

The end-to-end runs (resume after SIGKILL, two processes) are tests/test_training_rl_runs.py.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import init_params
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.data import Layout, TaskSource, collate
from dgemma_jax.training.dpo import dpo_objective
from dgemma_jax.training.likelihood import sequence_logprob, token_logprobs
from dgemma_jax.training.recipe import TrainConfig
from dgemma_jax.training.rl import GRPOStep, group_advantages, grpo_loss, load_reward
from dgemma_jax.training.step import LoraSpec
from dgemma_jax.training.tasks import Task, TaskMix, task_tokenizer
from dgemma_jax.training.train import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny(**changes):
    rc = load_config(os.path.join(ROOT, "configs", "train_tiny.py"))
    over = {k: tuple(v) if isinstance(v, list) else v for k, v in rc.model.overrides.to_dict().items()}
    return ModelConfig(**{**over, **changes})


# One model for every test (compiles dominate: each distinct program is compiled once here). Every token
# takes all experts (top_k = num_experts): the MoE's top-k choice is piecewise constant, and a finite
# difference across a flip measures the jump, not the slope; all-experts routing keeps the estimate smooth.
CANVASES = 2


@pytest.fixture(scope="module")
def tiny():
    cfg = _tiny(num_experts=2, top_k=2)
    lay = Layout(prompt_length=12, num_canvases=CANVASES, canvas_length=cfg.canvas_length)
    src = TaskSource(TaskMix([Task("sort", 3, 7)]), task_tokenizer(), lay, batch_size=8, seed=3)
    batch = {k: jnp.asarray(v) for k, v in src.batch(0).items()}
    assert len(set(np.asarray(batch["num_canvases"]).tolist())) > 1  # rows with different canvas counts
    return cfg, init_params(cfg, 0), lay, batch


@functools.partial(jax.jit, static_argnames=("cfg", "num_samples"))
def _token_logprobs(params, batch, rng, *, cfg, num_samples):
    return token_logprobs(params, batch, rng, config=cfg, num_canvases=CANVASES, num_samples=num_samples)


def _seq(params, batch, rng, cfg, num_samples=2):
    return _token_logprobs(params, batch, rng, cfg=cfg, num_samples=num_samples)[0].sum(-1)


def _perturbed(params, seed, scale):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def test_likelihood_gradient_matches_finite_differences(tiny):
    # float32 (the model computes in float32 at best): central differences along a random direction
    # (N(0, 0.01^2) per element), step 3e-3, agree with the reverse-mode slope to 5e-3 (measured: 2e-3 and
    # 3e-4 for the two directions; a 10x longer step is 5-13% off, curvature, and a 10x shorter one 1.5%
    # off, the float32 rounding of a sum of ~-376)
    cfg, params, lay, batch = tiny
    f = jax.jit(jax.value_and_grad(
        lambda p: sequence_logprob(p, batch, jax.random.key(5), config=cfg, num_canvases=CANVASES).sum()))
    _, grad = f(params)
    for seed in (7, 8):
        direction = _perturbed(jax.tree.map(jnp.zeros_like, params), seed, 0.01)
        analytic = sum(float((g * d).sum()) for g, d in zip(jax.tree.leaves(grad), jax.tree.leaves(direction)))
        eps = 3e-3
        plus = f(jax.tree.map(lambda p, d: p + eps * d, params, direction))[0]
        minus = f(jax.tree.map(lambda p, d: p - eps * d, params, direction))[0]
        numeric = float((plus - minus) / (2 * eps))
        assert abs(analytic) > 1.0  # a real slope, not 0 = 0
        np.testing.assert_allclose(analytic, numeric, rtol=5e-3)
    # every parameter group that the estimate reads gets a gradient (encoder KV and denoiser alike)
    assert float(jnp.abs(grad["embedding"]).max()) > 0


def test_shared_noise_makes_the_estimate_a_function_of_params_and_rng(tiny):
    cfg, params, lay, batch = tiny
    lp, mask = _token_logprobs(params, batch, jax.random.key(0), cfg=cfg, num_samples=2)
    again, _ = _token_logprobs(params, batch, jax.random.key(0), cfg=cfg, num_samples=2)
    other, _ = _token_logprobs(params, batch, jax.random.key(1), cfg=cfg, num_samples=2)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(again))       # reference == policy at equal params
    assert not np.allclose(np.asarray(lp), np.asarray(other))               # another rng: other noise
    # positions past a row's valid canvases are masked and score 0
    n = np.asarray(batch["num_canvases"])
    m = np.asarray(mask).reshape(len(n), lay.num_canvases, -1)
    assert (m.all(-1) == (np.arange(lay.num_canvases)[None] < n[:, None])).all()
    assert (np.asarray(lp)[~np.asarray(mask)] == 0).all() and (np.asarray(lp)[np.asarray(mask)] < 0).all()
    # shared noise: the policy-minus-reference difference varies less across rngs than with independent noise
    moved = _perturbed(params, 3, 0.005)
    shared = [np.asarray(_seq(moved, batch, jax.random.key(s), cfg) - _seq(params, batch, jax.random.key(s), cfg))
              for s in range(6)]
    apart = [np.asarray(_seq(moved, batch, jax.random.key(s), cfg) - _seq(params, batch, jax.random.key(100 + s), cfg))
             for s in range(6)]
    assert np.var(shared, axis=0).mean() < 0.1 * np.var(apart, axis=0).mean()


@functools.partial(jax.jit, static_argnames=("cfg", "lora", "kl_beta"))
def _grads(trainable, frozen, reference, old, batch, *, cfg, lora, kl_beta):
    obj = grpo_loss(frozen, reference, batch, jax.random.key(9), old, config=cfg, num_canvases=CANVASES,
                    lora=lora, num_samples=1, t_eps=1e-3, clip_eps=0.2, kl_beta=kl_beta)
    return jax.grad(lambda p: obj(p)[0])(trainable)


def _grpo_grads(cfg, batch, trainable, frozen, reference, old, rewards, lora=None, kl_beta=0.04):
    b = dict(batch, advantages=jnp.asarray(group_advantages(rewards, 4)))
    return _grads(trainable, frozen, reference, old, b, cfg=cfg, lora=lora, kl_beta=kl_beta)


def _max_abs(tree):
    return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))


EQUAL = [1.0] * 4 + [0.25] * 4          # two groups of 4, each all-equal
UNEQUAL = [1.0, 0.0, 0.0, 0.0] + [0.25] * 4


def test_grpo_gradient_is_zero_when_every_group_has_equal_rewards(tiny):
    cfg, params, lay, batch = tiny
    assert (group_advantages(EQUAL, 4) == 0).all()
    # full fine-tuning at the reference (the first step): policy term exactly 0 (A = 0); the KL's gradient
    # (1 - exp(lp_ref - lp)) is 0 up to rounding: the policy's and the reference's scores are the same
    # math on the same noise, compiled apart in one program (they differ by ~1e-7)
    signal = _max_abs(_grpo_grads(cfg, batch, params, None, params, params, UNEQUAL))
    assert signal > 1e-3
    assert _max_abs(_grpo_grads(cfg, batch, params, None, params, params, EQUAL)) < 1e-4 * signal
    # away from the reference the KL term pulls back to it (non-zero with equal rewards)...
    moved = _perturbed(params, 4, 0.02)
    assert _max_abs(_grpo_grads(cfg, batch, moved, None, params, moved, EQUAL)) > 1e-2 * signal


def test_grpo_gradient_without_kl_is_exactly_zero_away_from_the_reference_with_equal_rewards(tiny):
    # ...and without it the gradient is exactly 0 (A = 0): nothing but the advantages drives the update
    cfg, params, lay, batch = tiny
    moved = _perturbed(params, 4, 0.02)
    assert _max_abs(_grpo_grads(cfg, batch, moved, None, params, moved, UNEQUAL, kl_beta=0.0)) > 1e-3
    assert _max_abs(_grpo_grads(cfg, batch, moved, None, params, moved, EQUAL, kl_beta=0.0)) == 0.0


def test_grpo_gradient_is_zero_with_lora_when_every_group_has_equal_rewards(tiny):
    # adapters trainable, base frozen, the reference the base: at fresh adapters (B = 0: policy = reference)
    cfg, params, lay, batch = tiny
    spec = LoraSpec(2, 2.0, ("attention", "mlp"))
    adapters = lora_lib.init_lora(cfg, params, jax.random.key(1), spec.rank, spec.groups)
    signal = _max_abs(_grpo_grads(cfg, batch, adapters, params, None, adapters, UNEQUAL, lora=spec))
    assert signal > 1e-4
    assert _max_abs(_grpo_grads(cfg, batch, adapters, params, None, adapters, EQUAL, lora=spec)) < 1e-4 * signal


def test_dpo_loss_at_the_reference_and_its_direction(tiny):
    cfg, params, lay, batch = tiny
    tok = task_tokenizer()
    prompts = [[tok.bos_id] + tok.encode("s3142=")] * 4
    chosen = collate([(p, tok.encode(a)) for p, a in zip(prompts, ["1234"] * 4)], lay)
    rejected = collate([(p, tok.encode(a)) for p, a in zip(prompts, ["4321", "12345", "1243", "2134"])], lay)
    both = {k: jnp.concatenate([jnp.asarray(chosen[k]), jnp.asarray(rejected[k])]) for k in chosen}
    rng = jax.random.key(2)
    ref = _seq(params, both, rng, cfg)

    def loss(p):
        lp = sequence_logprob(p, both, rng, config=cfg, num_canvases=CANVASES, num_samples=2)
        return dpo_objective(lp[:4], lp[4:], ref[:4], ref[4:], 0.5)[0]

    value, grad = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(float(value), np.log(2.0), rtol=1e-5)  # margin 0 at the reference (up to rounding)
    stepped = jax.tree.map(lambda p, g: p - 1e-3 * g, params, grad)  # a small step: first order
    lp = _seq(stepped, both, rng, cfg)
    assert float(((lp[:4] - ref[:4]) - (lp[4:] - ref[4:])).min()) > 0  # chosen up relative to rejected, each pair


def test_rl_recipe_errors_name_the_key():
    base = {"model": {}, "data": {"prompt_length": 4, "num_canvases": 1, "batch_size": 1},
            "train": {"workdir": "/tmp/x", "num_steps": 1}, "optimizer": {}}
    with pytest.raises(ValueError, match="rl.reward"):
        TrainConfig.from_recipe({**base, "rl": {"algorithm": "grpo"}})
    with pytest.raises(ValueError, match="rl.algorithm"):
        TrainConfig.from_recipe({**base, "rl": {"algorithm": "ppo"}})
    with pytest.raises(ValueError, match="rl.group_size"):
        TrainConfig.from_recipe({**base, "rl": {"group_size": 1, "reward": "m:f"}})
    with pytest.raises(ValueError, match="did you mean"):
        TrainConfig.from_recipe({**base, "rl": {"group_sise": 4, "reward": "m:f"}})
    assert TrainConfig.from_recipe({**base, "rl": {"algorithm": "dpo"}}).rl.dpo_beta == 0.1
    with pytest.raises(ValueError, match="module:function"):
        load_reward("exact_match")
    with pytest.raises(ValueError, match="no function 'nope'"):
        load_reward("dgemma_jax.training.rewards:nope")
    assert load_reward("dgemma_jax.training.rewards:exact_match")("p", "12", "12") == 1.0


def test_dpo_objective_values():
    lp_c, lp_r = jnp.asarray([-3.0, -10.0]), jnp.asarray([-4.0, -2.0])
    ref_c, ref_r = jnp.asarray([-5.0, -9.0]), jnp.asarray([-4.0, -4.0])
    loss, m = dpo_objective(lp_c, lp_r, ref_c, ref_r, 0.5)
    margin = 0.5 * np.asarray([(-3 + 5) - (-4 + 4), (-10 + 9) - (-2 + 4)])      # [1.0, -1.5]
    np.testing.assert_allclose(float(loss), np.mean(np.log1p(np.exp(-margin))), rtol=1e-6)
    assert float(m["pair_accuracy"]) == 0.5
    # rl.nll_weight adds the chosen answers' per-token NLL (RPO's regulariser)
    with_nll, _ = dpo_objective(lp_c, lp_r, ref_c, ref_r, 0.5, 2.0, jnp.asarray([8.0, 16.0]))
    np.testing.assert_allclose(float(with_nll) - float(loss), 2.0 * np.mean([3 / 8, 10 / 16]), rtol=1e-6)


class _CharTok:
    bos_id = 2

    def encode(self, s):
        return [ord(c) for c in s]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class _FakeEngine:
    """Rows whose prompt starts with "m" answer "a" / "b" alternately (a mixed group), others "a"."""

    def generate(self, toks, lens, *, rng, max_new_tokens, images=None):
        out = np.ones((len(toks), max_new_tokens), np.int32)   # EOS (1) after the answer
        for i, (t, n) in enumerate(zip(np.asarray(toks), np.asarray(lens))):
            out[i, 0] = ord("b") if t[1] == ord("m") and i % 2 else ord("a")
        return type("Out", (), {"tokens": out})()


def _grpo_step(skip, max_rounds=3, extra=("m1", "m2", "e3", "m3")):
    seen = {}

    def update(state, frozen, reference, batch):
        seen["batch"] = batch
        return state, {}

    def extra_prompts(step, rnd):
        seen.setdefault("rounds", []).append((step, rnd))
        return {"prompts": list(extra), "references": ["a"] * len(extra)}

    step = GRPOStep(tokenizer=_CharTok(), layout=Layout(prompt_length=8, num_canvases=1, canvas_length=4),
                    group_size=4, reward=lambda p, c, r: float(c == r), seed=0, rollout_params=lambda s: None,
                    engine=lambda p: _FakeEngine(), update=update, reference=None, place=lambda b: b,
                    eos_ids=(1,), pad_id=0, step_of=lambda s: 7, skip_equal_groups=skip, max_rounds=max_rounds,
                    extra_prompts=extra_prompts)
    _, m = step(None, None, {"prompts": ["e0", "m0", "e1", "e2"], "references": ["a"] * 4})
    adv = np.asarray(seen["batch"]["advantages"]).reshape(4, 4)
    prompts = ["".join(chr(t) for t in row[1:3]) for row in np.asarray(seen["batch"]["tokens"])[::4]]
    return adv, prompts, m, seen.get("rounds", [])


def test_dynamic_sampling_updates_only_groups_whose_rewards_differ():
    # without it: the step's batch as rolled out, three of its four groups all correct (A = 0)
    adv, prompts, m, rounds = _grpo_step(False)
    assert prompts == ["e0", "m0", "e1", "e2"] and int((np.abs(adv).max(1) > 0).sum()) == 1 and rounds == []
    assert m["groups_all_equal"] == 0.75 and "groups_kept" not in m
    # with it: one more round of extra prompts (step 7's round 1), the update holds only mixed groups
    adv, prompts, m, rounds = _grpo_step(True)
    assert rounds == [(7, 1)] and prompts == ["m0", "m1", "m2", "m3"]
    assert (np.abs(adv).max(1) > 0).all() and m["groups_kept"] == 1.0 and m["rollout_rounds"] == 2.0
    assert m["groups_all_equal"] == 0.5   # over all 8 groups rolled out
    # bounded: max_rounds rounds at most; too few mixed groups -> the step's own equal groups fill, reported
    adv, prompts, m, rounds = _grpo_step(True, max_rounds=3, extra=("e4", "e5", "e6", "e7"))
    assert rounds == [(7, 1), (7, 2)] and prompts == ["m0", "e0", "e1", "e2"]
    assert m["groups_kept"] == 0.25 and m["rollout_rounds"] == 3.0
    with pytest.raises(ValueError, match="extra_prompts"):
        GRPOStep(tokenizer=None, layout=None, group_size=2, reward=None, seed=0, rollout_params=None, engine=None,
                 update=None, reference=None, place=None, eos_ids=(1,), pad_id=0, step_of=None,
                 skip_equal_groups=True, max_rounds=2)


@pytest.mark.parametrize("layers, dispatch, kernel", [("scan", "dense", "xla"), ("unrolled", "ragged", "auto")])
def test_the_rollouts_run_the_recipes_execution_choices(layers, dispatch, kernel, tmp_path):
    """model.overrides' execution choices (layer layout, MoE dispatch, attention kernel) reach the RL
    step's rollout engine as well as its update (the 26B's update is compiled scanned,
    benchmarks/aot_rl.py; its rollouts ran unrolled with the default dispatch whatever the recipe said)."""
    from dgemma_jax.training.train import Run

    cfg = load_config(os.path.join(ROOT, "configs", "rl_tiny.py"),
                      {"model.overrides.layers": layers, "model.overrides.moe_dispatch": dispatch,
                       "model.overrides.attn_kernel": kernel, "train.workdir": str(tmp_path)})
    run = Run(cfg)
    assert (run.runtime.layers, run.runtime.moe_dispatch, run.runtime.attn_kernel) == (layers, dispatch, kernel)
    engine = run.step_fn.engine(run.inference_params())
    assert (engine.runtime.layers, engine.runtime.moe_dispatch, engine.runtime.attn_kernel) == (layers, dispatch,
                                                                                                 kernel)
    assert engine.runtime.mesh is None
