"""The bundled model: a small DiffusionGemma-architecture model trained from scratch on digit tasks.

    from dgemma_jax.training.bundled import load_bundled
    config, params, sampler, tokenizer = load_bundled()
    engine = Engine(config, params, sampler)
    prompt = [tokenizer.bos_id] + tokenizer.encode("s9504046258782031=")
    out = engine.generate(np.asarray([prompt]), max_new_tokens=24)
    tokenizer.decode(out.tokens[0])          # -> "0001223445567889"

Reading (`asset_path`, `load_bundled`, `load_metadata`) lives in `dgemma_jax.io.bundled`; this module
re-exports it and adds the writing and the training-side helpers.

Asset directory (dgemma_jax/assets/<name>/, written by `save_bundled`) is an ordinary dgemma_jax
model directory (`dgemma_jax.io.model_dir`), so `dgemma generate --checkpoint <dir>` works too::

    params/               orbax checkpoint of the parameters (float32)
    dgemma_model.json     ModelConfig, the SamplerConfig the stated accuracy was measured with,
                          the tokenizer file name
    tokenizer.json        the CharTokenizer vocabulary
    metadata.json         recipe, training time, tasks, measured accuracy (+ the CI sample's)
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.sampling.config import SamplerConfig
# reading a bundled model lives in io (inference need not import the trainer); re-exported here
from dgemma_jax.io.bundled import ASSETS_DIR, DEFAULT_NAME, asset_path, load_bundled, load_metadata  # noqa: F401
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.io.model_dir import save_model
from dgemma_jax.training.checkpoint import load_params
from dgemma_jax.training.tasks import TaskMix
from dgemma_jax.training.train import Run, train


def save_bundled(path: str, config: ModelConfig, params, sampler: SamplerConfig, tokenizer: CharTokenizer,
                 metadata: dict[str, Any]) -> None:
    os.makedirs(path, exist_ok=True)
    if os.path.exists(os.path.join(path, "params")):
        shutil.rmtree(os.path.join(path, "params"))
    tok_file = os.path.join(path, "tokenizer.json")
    tokenizer.save(tok_file)
    save_model(path, config, jax.device_get(params), sampler=sampler, tokenizer_file=tok_file)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(metadata, f, indent=1)


def heldout_pairs(metadata: dict[str, Any], n: int, seed: int) -> list[tuple[str, str]]:
    """Held-out problems from the model's task mix (a seed stream the training data never uses:
    training batches come from default_rng([data_seed, batch_index]), these from
    default_rng([seed, 99]) with seed != data_seed)."""
    mix = TaskMix.from_config(metadata["tasks"])
    rng = np.random.default_rng([int(seed), 99])
    return [mix.sample(rng) for _ in range(n)]


def train_or_reload(cfg, workdir: str, skip_train: bool, fresh: bool):
    """The bundling scripts' first step: train the recipe `cfg` in `workdir` (from scratch when `fresh`),
    or with `skip_train` rebuild its Run and read the parameters and summary an earlier run exported
    there. Returns (run, host params, summary)."""
    if fresh and os.path.isdir(workdir):
        shutil.rmtree(workdir)
    if skip_train:
        with open(os.path.join(workdir, "summary.json")) as f:
            summary = json.load(f)
        return Run(cfg), load_params(os.path.join(workdir, "export")), summary
    summary = train(cfg)
    run = summary.pop("run")
    return run, jax.device_get(run.inference_params()), summary
