"""DPO-style preference optimisation for uniform-state diffusion (`rl.algorithm="dpo"`).

Pairs come from JSON lines, one {"prompt", "chosen", "rejected"} per line (keys: data.prompt_key,
rl.chosen_key, rl.rejected_key). The loss is DPO's with every log-likelihood replaced by the Monte-Carlo
estimate of `likelihood.sequence_logprob` (VRPO, LLaDA 1.5)::

    margin = beta * ((lp(chosen) - lp_ref(chosen)) - (lp(rejected) - lp_ref(rejected)))
    loss   = -log sigmoid(margin) + nll_weight * (-lp(chosen) / n_chosen), averaged over pairs

(n_chosen: the chosen row's scored positions; rl.nll_weight 0, the default, is DPO's loss; > 0 adds the
chosen answer's per-token negative log-likelihood, RPO's regulariser (Pang et al., 2024: iterative
reasoning preference optimisation), which keeps DPO from lowering both answers' likelihood.)

The policy and the frozen reference (the initial weights; with LoRA the base without adapters) are
scored with ONE rng per step, so each difference lp - lp_ref is taken on the same noisy canvases (VRPO's
shared noise: the estimate of the difference has far less variance than two independent estimates).
"""

from __future__ import annotations

import functools
import json
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dgemma_jax.config import ModelConfig
from dgemma_jax.runtime import Runtime
from dgemma_jax.training.data import Layout, collate, epoch_batch
from dgemma_jax.training.likelihood import sequence_logprob
from dgemma_jax.training.state import LoraSpec, TrainState, model_variables, optimizer_step

SIDES = ("chosen", "rejected")


class PairSource:
    """Preference pairs from JSON lines, shuffled per epoch with `seed`; `batch(index)` holds the chosen
    rows' arrays under "chosen_<key>" and the rejected rows' under "rejected_<key>" (`data.collate`'s keys).
    tokenize(str) -> ids; BOS is prepended to the prompt when bos_id is not None."""

    def __init__(self, path: str, tokenize: Callable[[str], list[int]], layout: Layout, batch_size: int,
                 seed: int = 0, prompt_key: str = "prompt", chosen_key: str = "chosen",
                 rejected_key: str = "rejected", bos_id: int | None = None):
        self.rows = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                r = json.loads(line)
                missing = [k for k in (prompt_key, chosen_key, rejected_key) if k not in r]
                if missing:
                    raise ValueError(f"preference pairs {path} line {n} lacks {', '.join(map(repr, missing))}: "
                                     f"each line needs {prompt_key!r}, {chosen_key!r} and {rejected_key!r}")
                prompt = ([bos_id] if bos_id is not None else []) + list(tokenize(r[prompt_key]))
                self.rows.append((prompt, list(tokenize(r[chosen_key])), list(tokenize(r[rejected_key]))))
        if not self.rows:
            raise ValueError(f"preference pairs {path} hold no examples")
        self.layout, self.batch_size, self.seed = layout, batch_size, seed

    def batch(self, index: int) -> dict[str, np.ndarray]:
        picked = epoch_batch(self.rows, index, self.batch_size, self.seed)
        out = {}
        for side, col in zip(SIDES, (1, 2)):
            for key, arr in collate([(r[0], r[col]) for r in picked], self.layout).items():
                out[f"{side}_{key}"] = arr
        return out


def dpo_objective(lp_c, lp_r, ref_c, ref_r, beta: float, nll_weight: float = 0.0, n_chosen=None):
    """(loss, metrics) of DPO on sequence log-likelihood estimates [B] (policy and reference); with
    nll_weight > 0 plus that times the chosen answers' per-token NLL (n_chosen [B]: their scored positions)."""
    margin = beta * ((lp_c - ref_c) - (lp_r - ref_r))
    loss = -jax.nn.log_sigmoid(margin).mean()
    if nll_weight:
        loss = loss + nll_weight * (-lp_c / jnp.maximum(n_chosen, 1)).mean()
    return loss, {"loss": loss, "margin": margin.mean(), "pair_accuracy": (margin > 0).astype(jnp.float32).mean(),
                  "chosen_logp": lp_c.mean(), "rejected_logp": lp_r.mean()}


def dpo_step(state: TrainState, frozen, reference, batch: dict, *, config: ModelConfig, num_canvases: int,
             optimizer: optax.GradientTransformation, lora: LoraSpec | None, num_samples: int, t_eps: float,
             beta: float, nll_weight: float = 0.0, schedule: Callable | None = None,
             runtime: Runtime | None = None):
    """One DPO update. reference: the reference's full parameters (full fine-tuning), None with LoRA."""
    both = {k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
            for k in ("tokens", "lengths", "prompt_lengths", "num_canvases")}
    b = batch["chosen_tokens"].shape[0]
    n_chosen = (batch["chosen_num_canvases"] * config.canvas_length).astype(jnp.float32)

    def objective_at(rng):
        score = functools.partial(sequence_logprob, batch=both, rng=rng, config=config, num_canvases=num_canvases,
                                  num_samples=num_samples, t_eps=t_eps, runtime=runtime)
        ref = jax.lax.stop_gradient(score(frozen if lora is not None else reference))

        def objective(trainable):
            params, adapters = model_variables(config, trainable, frozen, lora)
            lp = score(params, adapters=adapters)
            return dpo_objective(lp[:b], lp[b:], ref[:b], ref[b:], beta, nll_weight, n_chosen)
        return objective

    return optimizer_step(state, objective_at, optimizer, schedule)
