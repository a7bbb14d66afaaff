"""Training DiffusionGemma: objective, data layout, LoRA, optimizer, train loop, checkpoints.

    from dgemma_jax.training import train, load_config
    summary = train(load_config("configs/train_bundled.py"))

Modules:
  corruption   uniform-state forward process (t ~ U(eps, 1), keep prob 1 - t)
  data         canvas layout (prompt + EOS-filled canvases), deterministic sources, iterator state
  tasks        checkable synthetic tasks (sort / reverse / add) and their character vocabulary
  tokenizer    CharTokenizer (pad 0, eos 1, bos 2, one id per character)
  objective    encoder AR loss + two-pass self-conditioned diffusion CE on one selected canvas
  lora         adapters on linear groups, applied unmerged in training (merged for export)
  optim        clip + AdamW + warmup/cosine (the published SFT recipe), frozen groups
  state        TrainState, LoraSpec, the LoRA split and one optimizer update, shared by every step
  step         the jitted steps: SFT's train step, GRPO's update, DPO's step (optional in/out shardings)
  rl, dpo      GRPO (rollouts, rewards, clipped surrogate) and DPO on the likelihood estimate
  checkpoint   orbax CheckpointManager wrapper (params, optimizer, step, rng, iterator position)
  evaluate     exact-match evaluation with the real sampler, max_denoising_steps sweeps
  train        the driver: train(config) / main(config) / load_config(path)
  bundled      load_bundled() -> (ModelConfig, params, SamplerConfig, tokenizer)
"""

from dgemma_jax.training.bundled import load_bundled
from dgemma_jax.training.corruption import corrupt, sample_t
from dgemma_jax.training.data import DataIterator, JsonlSource, Layout, RawTextSource, TaskSource, chunk_example
from dgemma_jax.training.lora import init_lora, merge as merge_lora
from dgemma_jax.training.objective import ObjectiveConfig, loss_fn
from dgemma_jax.training.optim import make_optimizer
from dgemma_jax.training.step import LoraSpec, TrainState, init_train_state, make_train_step
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.training.train import load_config, main, train

__all__ = [
    "CharTokenizer", "DataIterator", "JsonlSource", "Layout", "LoraSpec", "ObjectiveConfig", "RawTextSource",
    "TaskSource", "TrainState", "chunk_example", "corrupt", "init_lora", "init_train_state", "load_bundled",
    "load_config", "loss_fn", "main", "make_optimizer", "make_train_step", "merge_lora", "sample_t", "train",
]
