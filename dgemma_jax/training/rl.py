"""GRPO-style reinforcement learning with verifiable rewards for uniform-state diffusion (`rl.algorithm="grpo"`).

One RL step (`GRPOStep`, driven by `train.train` exactly as an SFT step: same loop, checkpoints, mesh)::

    prompts     data.batch_size prompts (task problems or JSON lines), batch index i of the iterator
    rollouts    each prompt G = rl.group_size times through the engine's compiled fused generate, one
                key per row: split(fold_in(key(train.seed), step), B * G), with the current policy
    rewards     rl.reward ("module:function") called as f(prompt, completion, reference) -> float
    advantages  A = (r - mean_group(r)) / (std_group(r) + 1e-4)   (group-relative, d1's / GRPO's)
    update      rl.updates_per_rollout optimizer steps on the clipped surrogate (d1's diffu-GRPO form)
                   per token i of a row:  rho_i = exp(lp_i - lp_old_i)
                   loss_i = -min(rho_i A, clip(rho_i, 1 - eps, 1 + eps) A) + beta * KL_i
                   KL_i   = exp(lp_ref_i - lp_i) - (lp_ref_i - lp_i) - 1        (k3, >= 0)
                averaged over a row's valid positions, then over rows

lp is `likelihood.token_logprobs` (the Monte-Carlo estimate from the training objective), computed for
the policy, the pre-update policy (lp_old) and the frozen reference (the initial weights; with LoRA the
base without adapters) with ONE rng per step: the same noisy canvases for all three (VRPO's shared
noise), so rho = 1 and KL = 0 exactly while the parameters equal the old / reference ones. With equal
rewards in a group A = 0, and at the reference the KL's gradient is 0: the step's gradient is then 0.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dgemma_jax.config import ModelConfig
from dgemma_jax.runtime import Runtime
from dgemma_jax.training.data import Layout, chunk_example, epoch_batch
from dgemma_jax.training.evaluate import pad_prompts
from dgemma_jax.training.likelihood import token_logprobs
from dgemma_jax.training.state import LoraSpec, TrainState, model_variables

ALGORITHMS = ("grpo", "dpo")


def load_reward(spec: str | None) -> Callable[[str, str, str | None], float]:
    """The reward function named "package.module:function" (rl.reward)."""
    if not spec or ":" not in spec:
        raise ValueError(f"rl.reward must name a function as 'module:function' (e.g. "
                         f"'dgemma_jax.training.rewards:exact_match'), got {spec!r}")
    mod_name, fn_name = spec.split(":", 1)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"rl.reward {spec!r}: cannot import module {mod_name!r} ({e})") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"rl.reward {spec!r}: module {mod_name!r} has no function {fn_name!r}")
    return fn


def group_advantages(rewards, group_size: int, eps: float = 1e-4) -> np.ndarray:
    """Group-relative advantages of rewards [B * G] (rows of one prompt adjacent): (r - mean) / (std + eps)."""
    r = np.asarray(rewards, np.float32).reshape(-1, group_size)
    a = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)
    return a.reshape(-1).astype(np.float32)


def grpo_objective(lp, lp_old, lp_ref, mask, advantages, *, clip_eps: float, kl_beta: float):
    """(loss, metrics) of the clipped surrogate with the k3 KL (module docstring), per-token [B, N] inputs."""
    m = mask.astype(jnp.float32)
    a = advantages[:, None]
    ratio = jnp.exp(lp - lp_old)
    pg = -jnp.minimum(ratio * a, jnp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * a)
    d = lp_ref - lp
    kl = jnp.exp(d) - d - 1.0
    per_row = ((pg + kl_beta * kl) * m).sum(-1) / jnp.maximum(m.sum(-1), 1.0)
    loss = per_row.mean()
    denom = jnp.maximum(m.sum(), 1.0)
    clipped = (jnp.abs(ratio - 1.0) > clip_eps).astype(jnp.float32)
    return loss, {"loss": loss, "kl": (kl * m).sum() / denom, "clip_frac": (clipped * m).sum() / denom,
                  "logp_per_token": (lp * m).sum() / denom}


def grpo_loss(frozen, reference, batch: dict, rng: jax.Array, old_params, *, config: ModelConfig, num_canvases: int,
              lora: LoraSpec | None, num_samples: int, t_eps: float, clip_eps: float, kl_beta: float,
              runtime: Runtime | None = None) -> Callable:
    """The surrogate of one rollout batch as a function of the trainable parameters: f(trainable) -> (loss, metrics).

    old_params: the trainable parameters the rollouts came from (lp_old, held fixed); reference: the
    reference's full parameters (full fine-tuning), None with LoRA (the reference is then `frozen`, the
    base, without adapters). Every score uses `rng`: one set of noisy canvases for all three."""
    score = functools.partial(token_logprobs, batch=batch, rng=rng, config=config, num_canvases=num_canvases,
                              num_samples=num_samples, t_eps=t_eps, runtime=runtime)

    def policy_logprobs(trainable):
        params, adapters = model_variables(config, trainable, frozen, lora)
        return score(params, adapters=adapters)

    lp_old, mask = policy_logprobs(old_params)
    lp_old = jax.lax.stop_gradient(lp_old)
    lp_ref = jax.lax.stop_gradient(score(frozen if lora is not None else reference)[0]) if kl_beta > 0 else lp_old
    adv = batch["advantages"].astype(jnp.float32)

    def objective(trainable):
        lp, _ = policy_logprobs(trainable)
        return grpo_objective(lp, lp_old, lp_ref, mask, adv, clip_eps=clip_eps, kl_beta=kl_beta)

    return objective


def rl_update(state: TrainState, frozen, reference, batch: dict, *, optimizer: optax.GradientTransformation,
              updates: int, schedule: Callable | None = None, **loss_kw):
    """`updates` optimizer steps on one rollout batch (tokens laid out as SFT's plus "advantages" [B]);
    loss_kw: `grpo_loss`'s keywords. Metrics: the first update's (at the rollout policy)."""
    key = jax.random.wrap_key_data(state.rng)
    key, sub = jax.random.split(key)
    objective = grpo_loss(frozen, reference, batch, sub, state.params, **loss_kw)
    params, opt_state = state.params, state.opt_state
    metrics = None
    for _ in range(updates):
        (_, m), grads = jax.value_and_grad(objective, has_aux=True)(params)
        upd, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, upd)
        if metrics is None:
            metrics = dict(m, grad_norm=optax.global_norm(grads))
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step * updates), jnp.float32)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(key))
    return new, metrics


# ---------------------------------------------------------------------------- prompts
class PromptSource:
    """RL prompts: `batch(index)` -> {"prompts": [str], "references": [str or None]}, deterministic in
    (seed, index). From a task mix (its answers are the references), from picture tasks (`image_source`,
    an `image_tasks.ImageTaskSource`: the instruction is the prompt, and "images" holds the batch's
    pictures preprocessed, one per prompt) or from JSON lines (prompt_key, optional response_key as the
    reference), shuffled per epoch with `seed`."""

    def __init__(self, batch_size: int, seed: int, *, task_source=None, rows: list[tuple[str, Any]] | None = None,
                 image_source=None):
        self.batch_size, self.seed, self.task_source, self.rows = batch_size, seed, task_source, rows
        self.image_source = image_source
        self.settings = getattr(image_source, "settings", None)   # the evaluation's image processor

    @classmethod
    def from_jsonl(cls, path: str, batch_size: int, seed: int, prompt_key: str, response_key: str):
        rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                r = json.loads(line)
                if prompt_key not in r:
                    raise ValueError(f"data.path {path} line {n} has no {prompt_key!r} (the RL prompt)")
                rows.append((r[prompt_key], r.get(response_key)))
        if not rows:
            raise ValueError(f"data.path {path} holds no prompts")
        return cls(batch_size, seed, rows=rows)

    def batch(self, index: int) -> dict[str, Any]:
        if self.image_source is not None:
            from dgemma_jax.io.images import preprocess_images  # deferred: only picture tasks preprocess

            problems = self.image_source.problems(index)
            return {"prompts": [p for _, p, _ in problems], "references": [a for _, _, a in problems],
                    "images": preprocess_images([im for im, _, _ in problems], self.settings)}
        if self.task_source is not None:
            pairs = self.task_source.example_strings(index)
        else:
            pairs = epoch_batch(self.rows, index, self.batch_size, self.seed)
        return {"prompts": [p for p, _ in pairs], "references": [r for _, r in pairs]}


def completion_ids(tokens: np.ndarray, eos_ids) -> list[list[int]]:
    """Each row's generated ids before its first EOS (the answer; the layout adds the EOS fill back)."""
    out = []
    for row in np.asarray(tokens).tolist():
        end = next((j for j, t in enumerate(row) if t in eos_ids), len(row))
        out.append(row[:end])
    return out


class GRPOStep:
    """The host side of an RL step, called as the SFT step is: (state, frozen, prompt batch) -> (state, metrics).

    rollout_params(state): the current policy's inference parameters on this process (LoRA merged).
    engine(params): an `Engine` for them (one ProgramCache: every step reuses the compiled generate).
    update: the jitted `rl_update` with everything static bound: (state, frozen, reference, batch).
    place(batch): the batch as the update's input (global arrays split over the mesh's batch axes).

    Dynamic sampling (skip_equal_groups; the idea is DAPO's, Yu et al. 2025, "DAPO: an open-source LLM
    reinforcement learning system at scale"): a group whose G rewards are all equal has A = 0 and carries
    no policy gradient, only the KL term. With it, after the step's own batch, up to max_rounds - 1 more
    rounds roll out extra_prompts(step, round) (another batch of as many prompts, deterministic in
    (step, round): resume stays bit-exact) until B groups have reward variance; the update takes the
    first B such groups (the step's own first), one shape every step; when fewer exist after max_rounds,
    the step's own equal groups fill the rest. Metrics: groups_kept (the update's fraction of mixed
    groups), rollout_rounds; groups_all_equal, reward_mean and completion_length are over every
    rolled-out group."""

    def __init__(self, *, tokenizer, layout: Layout, group_size: int, reward: Callable, seed: int,
                 rollout_params: Callable, engine: Callable, update: Callable, reference, place: Callable,
                 eos_ids, pad_id: int, step_of: Callable, config: ModelConfig | None = None,
                 skip_equal_groups: bool = False, max_rounds: int = 1, extra_prompts: Callable | None = None):
        if skip_equal_groups and max_rounds > 1 and extra_prompts is None:
            raise ValueError("dynamic sampling (skip_equal_groups with max_rounds > 1) needs extra_prompts")
        self.config = config   # the model's (picture prompts are laid out for it)
        self.skip_equal_groups, self.max_rounds, self.extra_prompts = skip_equal_groups, int(max_rounds), extra_prompts
        self.tok, self.layout, self.g, self.reward, self.seed = tokenizer, layout, group_size, reward, seed
        self.rollout_params, self.engine, self.update, self.reference = rollout_params, engine, update, reference
        self.place, self.eos_ids, self.pad_id, self.step_of = place, tuple(eos_ids), pad_id, step_of

    def rollout(self, state, prompts: list[str], images=None, rnd: int = 0):
        """(prompt ids [B*G], completion ids [B*G], completion texts) from the current policy. images: an
        `ImageBatch` of one picture per prompt (each row of a group sees its prompt's picture), or None.
        rnd: the step's rollout round (dynamic sampling's extra rounds draw other keys)."""
        step = self.step_of(state)
        if images is None:
            ids = [[self.tok.bos_id] + self.tok.encode(p) for p in prompts for _ in range(self.g)]
        else:
            from dgemma_jax.io.images import prompt_with_images  # deferred: only picture prompts

            images = images.select([i // self.g for i in range(len(prompts) * self.g)])
            ids = [prompt_with_images(self.config, self.tok, prompts[i // self.g], images.select([i]))[0][0].tolist()
                   for i in range(len(prompts) * self.g)]
        if max(len(i) for i in ids) > self.layout.prompt_length:
            raise ValueError(f"an RL prompt is {max(len(i) for i in ids)} tokens but data.prompt_length is "
                             f"{self.layout.prompt_length}: raise prompt_length")
        toks, lens = pad_prompts(ids, self.layout.prompt_length, self.pad_id)
        key = jax.random.fold_in(jax.random.key(self.seed), step)
        keys = jax.random.split(jax.random.fold_in(key, rnd) if rnd else key, len(ids))
        out = self.engine(self.rollout_params(state)).generate(
            toks, lens, rng=keys, max_new_tokens=self.layout.response_capacity, images=images)
        comp = completion_ids(np.asarray(out.tokens), self.eos_ids)
        return ids, comp, [self.tok.decode(c) for c in comp]

    def _round(self, state, batch, rnd: int):
        """One rollout round of a prompt batch: per group (prompt ids [G], completions [G], rewards [G],
        (pixel values, pixel positions) or None)."""
        prompts, refs = batch["prompts"], batch["references"]
        images = batch.get("images")
        ids, comp, texts = self.rollout(state, prompts, images, rnd)
        rewards = np.asarray([float(self.reward(prompts[i // self.g], texts[i], refs[i // self.g]))
                              for i in range(len(texts))], np.float32)
        g = self.g
        return [(ids[j * g:(j + 1) * g], comp[j * g:(j + 1) * g], rewards[j * g:(j + 1) * g],
                 None if images is None else (images.pixel_values[j], images.position_ids[j]))
                for j in range(len(prompts))]

    def __call__(self, state, frozen, batch):
        b = len(batch["prompts"])
        groups = self._round(state, batch, 0)
        rolled = list(groups)
        rounds = 1
        if self.skip_equal_groups:   # dynamic sampling: more prompts until b groups with reward variance
            step = self.step_of(state)
            while sum(float(r.std()) > 0 for _, _, r, _ in rolled) < b and rounds < self.max_rounds:
                rolled += self._round(state, self.extra_prompts(step, rounds), rounds)
                rounds += 1
            mixed = [grp for grp in rolled if float(grp[2].std()) > 0]
            # too few after max_rounds: the step's own equal groups fill the batch (A = 0: KL term only)
            groups = (mixed + [grp for grp in groups if float(grp[2].std()) == 0])[:b]
        ids = [p for grp in groups for p in grp[0]]
        comp = [c for grp in groups for c in grp[1]]
        rewards = np.concatenate([grp[2] for grp in groups])
        rows = [chunk_example(p, c, self.layout) for p, c in zip(ids, comp)]
        arrays = {"tokens": np.stack([r[0] for r in rows]), "lengths": np.asarray([r[1] for r in rows], np.int32),
                  "prompt_lengths": np.asarray([r[2] for r in rows], np.int32),
                  "num_canvases": np.asarray([r[3] for r in rows], np.int32),
                  "advantages": group_advantages(rewards, self.g)}
        if groups[0][3] is not None:   # each rollout row's picture, for the likelihood's encoder pass
            arrays["pixel_values"] = np.stack([grp[3][0] for grp in groups for _ in range(self.g)]).astype(np.float32)
            arrays["pixel_positions"] = np.stack([grp[3][1] for grp in groups for _ in range(self.g)]).astype(np.int32)
        state, m = self.update(state, frozen, self.reference, self.place(arrays))
        all_r = np.concatenate([grp[2] for grp in rolled])
        grouped = rewards.reshape(-1, self.g)
        m = dict(m, reward_mean=float(all_r.mean()), reward_max=float(all_r.max()),
                 groups_all_equal=float(np.mean(all_r.reshape(-1, self.g).std(1) == 0)),
                 completion_length=float(np.mean([len(c) for grp in rolled for c in grp[1]])))
        if self.skip_equal_groups:
            m.update(groups_kept=float(np.mean(grouped.std(1) > 0)), rollout_rounds=float(rounds))
        return state, m
