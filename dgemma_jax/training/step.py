"""The jitted steps: SFT's train step, GRPO's update and DPO's step, and the eval loss.

Each step is a pure function (state, frozen, [reference,] batch) -> (state, metrics) over a
`state.TrainState` (full fine-tuning: state.params is the whole tree and frozen None; LoRA: the
adapters, and frozen the base, see `state`). SFT's loss is `objective.loss_fn`; GRPO's
`rl.grpo_loss` (`rl.rl_update`), DPO's `dpo.dpo_objective` (`dpo.dpo_step`).

`make_train_step` / `make_rl_update` / `make_dpo_step` jit them (the model math never names a mesh:
arguments carry their shardings, or the driver passes `NamedSharding`s) and donate the old state.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import optax

from dgemma_jax.config import ModelConfig
from dgemma_jax.runtime import Runtime
from dgemma_jax.training.dpo import dpo_step
from dgemma_jax.training.objective import ObjectiveConfig, loss_fn
from dgemma_jax.training.rl import rl_update
from dgemma_jax.training.state import (LoraSpec, TrainState, inference_params, init_train_state, model_variables,
                                       optimizer_step)

__all__ = ["LoraSpec", "TrainState", "inference_params", "init_train_state", "make_dpo_step", "make_eval_loss",
           "make_rl_update", "make_train_step", "model_variables", "train_step"]


def train_step(state: TrainState, frozen, batch: dict, *, config: ModelConfig, obj: ObjectiveConfig,
               optimizer: optax.GradientTransformation, schedule: Callable | None = None,
               lora: LoraSpec | None = None, runtime: Runtime | None = None):
    def objective_at(rng):
        def objective(trainable):
            params, adapters = model_variables(config, trainable, frozen, lora)
            return loss_fn(params, batch, rng, config=config, obj=obj, adapters=adapters, runtime=runtime)
        return objective

    return optimizer_step(state, objective_at, optimizer, schedule)


def make_train_step(config: ModelConfig, obj: ObjectiveConfig, optimizer: optax.GradientTransformation, *,
                    schedule: Callable | None = None, lora: LoraSpec | None = None, in_shardings=None,
                    out_shardings=None, donate: bool = True, runtime: Runtime | None = None):
    """jit(train_step) for these static configs. in_shardings: (state, frozen, batch) shardings;
    out_shardings: (state, metrics) shardings; both optional (default: let XLA place things).
    runtime: how the passes run (mesh and rules, remat, MoE dispatch; `dgemma_jax.runtime`)."""
    fn = functools.partial(train_step, config=config, obj=obj, optimizer=optimizer, schedule=schedule, lora=lora,
                           runtime=runtime)
    kw: dict[str, Any] = {}
    if in_shardings is not None:
        kw["in_shardings"] = in_shardings
    if out_shardings is not None:
        kw["out_shardings"] = out_shardings
    return jax.jit(fn, donate_argnums=(0,) if donate else (), **kw)


def make_eval_loss(config: ModelConfig, obj: ObjectiveConfig, lora: LoraSpec | None = None,
                   runtime: Runtime | None = None):
    """jit(loss) without an update: (state_params, frozen, batch, rng) -> metrics."""

    def f(trainable, frozen, batch, rng):
        params, adapters = model_variables(config, trainable, frozen, lora)
        return loss_fn(params, batch, rng, config=config, obj=obj, adapters=adapters, runtime=runtime)[1]

    return jax.jit(f)


def make_rl_update(config: ModelConfig, optimizer: optax.GradientTransformation, *, num_canvases: int,
                   lora: LoraSpec | None, num_samples: int, t_eps: float, clip_eps: float, kl_beta: float,
                   updates: int = 1, schedule: Callable | None = None, runtime: Runtime | None = None,
                   donate: bool = True):
    """jit(`rl.rl_update`): (state, frozen, reference, batch) -> (state, metrics), GRPO's update of one
    rollout batch (SFT's layout plus "advantages" [B]); reference None with LoRA (the base is it)."""
    fn = functools.partial(rl_update, config=config, num_canvases=num_canvases, optimizer=optimizer, lora=lora,
                           num_samples=num_samples, t_eps=t_eps, clip_eps=clip_eps, kl_beta=kl_beta,
                           updates=updates, schedule=schedule, runtime=runtime)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())


def make_dpo_step(config: ModelConfig, optimizer: optax.GradientTransformation, *, num_canvases: int,
                  lora: LoraSpec | None, num_samples: int, t_eps: float, beta: float, nll_weight: float = 0.0,
                  schedule: Callable | None = None, runtime: Runtime | None = None, donate: bool = True):
    """jit(`dpo.dpo_step`): (state, frozen, reference, batch) -> (state, metrics), one DPO update of a
    batch of pairs ("chosen_<key>" / "rejected_<key>"); reference None with LoRA."""
    fn = functools.partial(dpo_step, config=config, num_canvases=num_canvases, optimizer=optimizer, lora=lora,
                           num_samples=num_samples, t_eps=t_eps, beta=beta, nll_weight=nll_weight,
                           schedule=schedule, runtime=runtime)
    return jax.jit(fn, donate_argnums=(0,) if donate else ())
