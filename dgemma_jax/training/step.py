"""Train state and the jitted train step.

The step is a pure function (state, frozen, batch) -> (state, metrics):

* full fine-tuning: state.params is the whole parameter tree, `frozen` is None;
* LoRA: state.params is the adapter tree (float32), `frozen` the base parameters (in their own
  dtype); the model runs on the base plus the UNMERGED adapters (y = x W + (alpha/r) (x A) B, see
  `lora.forward_adapters`) and only the adapters get gradients. `inference_params` merges them
  (for export / the sampler).

`make_train_step` jits it with optional in/out shardings (the model math never names a mesh; the
driver passes `NamedSharding`s built for its mesh) and donates the old state.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.runtime import Runtime
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.objective import ObjectiveConfig, loss_fn


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


def train_step(state: TrainState, frozen, batch: dict, *, config: ModelConfig, obj: ObjectiveConfig,
               optimizer: optax.GradientTransformation, schedule: Callable | None = None,
               lora: LoraSpec | None = None, runtime: Runtime | None = None):
    key = jax.random.wrap_key_data(state.rng)
    key, sub = jax.random.split(key)

    def objective(trainable):
        params, adapters = model_variables(config, trainable, frozen, lora)
        return loss_fn(params, batch, sub, config=config, obj=obj, adapters=adapters, runtime=runtime)

    (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics, grad_norm=optax.global_norm(grads))
    if schedule is not None:
        metrics["lr"] = jnp.asarray(schedule(state.step), jnp.float32)
    new = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=jax.random.key_data(key))
    return new, metrics


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
