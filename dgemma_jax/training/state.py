"""The train state and the LoRA split every step shares (SFT's `step.train_step`, GRPO's `rl.rl_update`,
DPO's `dpo.dpo_step`): a module of its own so those losses and `step`, which jits all of them, import it
without importing each other.

* full fine-tuning: state.params is the whole parameter tree, `frozen` is None;
* LoRA: state.params is the adapter tree (float32), `frozen` the base parameters (in their own
  dtype); the model runs on the base plus the UNMERGED adapters (y = x W + (alpha/r) (x A) B, see
  `lora.forward_adapters`) and only the adapters get gradients. `inference_params` merges them
  (for export / the sampler).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.training import lora as lora_lib


@struct.dataclass
class TrainState:
    step: jax.Array        # [] int32: number of updates applied
    params: Any            # trainable tree (full params or LoRA adapters)
    opt_state: Any
    rng: jax.Array         # raw PRNG key data (uint32), split once per step


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    groups: tuple[str, ...]


def init_train_state(trainable, optimizer: optax.GradientTransformation, rng: jax.Array | int) -> TrainState:
    key = jax.random.key(rng) if isinstance(rng, int) else rng
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=trainable, opt_state=optimizer.init(trainable),
                      rng=jnp.asarray(key, jnp.uint32))


def model_variables(config: ModelConfig, state_params, frozen, lora: LoraSpec | None):
    """(params, adapters) the model trains with: the full tree and None, or the frozen base and the
    adapters laid out for the model's "lora" collection (unmerged)."""
    if lora is None:
        return state_params, None
    return frozen, lora_lib.forward_adapters(config, frozen, state_params, lora.alpha, lora.rank)


def inference_params(config: ModelConfig, state_params, frozen, lora: LoraSpec | None):
    """One parameter tree for inference / export (adapters merged into the base, in its dtype)."""
    if lora is None:
        return state_params
    return lora_lib.merge(config, frozen, state_params, lora.alpha, lora.rank)


def optimizer_step(state: TrainState, objective_at: Callable, optimizer: optax.GradientTransformation,
                   schedule: Callable | None = None):
    """One optimizer update, the shape every one-update step shares (SFT's, DPO's): the state's key split
    once, objective_at(subkey) -> f(trainable) -> (loss, metrics) differentiated, the update applied.
    Returns (new state, metrics + grad_norm, + lr at state.step when a schedule is given)."""
    key = jax.random.wrap_key_data(state.rng)
    key, sub = jax.random.split(key)
    (_, metrics), grads = jax.value_and_grad(objective_at(sub), has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(key)), metrics
