"""The two checkpoint formats on disk, telling them apart, and what a load learns of a checkpoint
before it reads a weight (used by `dgemma_jax.io.locations` before anything is read, by
`dgemma_jax.io.hf` and by `dgemma_jax.io.model_dir`, which re-exports these names).

    ours:          dgemma_model.json + an orbax params/ tree (+ a tokenizer file)
    Hugging Face:  config.json + *.safetensors (+ tokenizer files)

A load resolves the location, detects the format and reads the metadata once into a `CheckpointSource`
(`model_dir.open_checkpoint`), which the config, weight, sampler and tokenizer readers are handed; a new
format is a reader of its metadata and a loader of its weights in `model_dir`'s format table.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

META = "dgemma_model.json"
FORMAT = "dgemma_jax.model"


def detect_format(path: str | os.PathLike, need_weights: bool = True) -> str:
    """'dgemma' or 'hf'; raises FileNotFoundError / ValueError naming what is missing.
    need_weights=False: a Hugging Face config.json alone will do (describing a model, not loading it)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint {path!r} is a file; pass the checkpoint directory")
    if os.path.isfile(os.path.join(path, META)):
        return "dgemma"
    if os.path.isfile(os.path.join(path, "config.json")):
        if not need_weights or any(f.endswith(".safetensors") for f in os.listdir(path)):
            return "hf"
        raise ValueError(f"{path!r} has a config.json but no *.safetensors weights")
    raise ValueError(f"{path!r} is not a checkpoint: expected {META} (dgemma_jax) or config.json + *.safetensors "
                     "(Hugging Face)")


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """One checkpoint as a load sees it, each of its metadata files read once.

    path: the local directory of its files; weights: the fsspec URL its weights are read from when they
    are not under `path` (`locations.locate`), else None; format: 'dgemma' or 'hf'.
    config: the `ModelConfig` the weights load as (a Hugging Face vision_config whose tower the files do
    not hold is no tower; a preset's name when it equals one); declared: the config as its file states it.
    quantization: ours saved quantized: {"mode": "int8" | "int4", "embedding": bool, "vision": bool}, else None.
    sampler: the saved `SamplerConfig` (ours: the metadata's; Hugging Face: generation_config.json's) or None.
    tokenizer: the tokenizer file name the metadata names (ours), or None.
    files: the JSON metadata files read, by name (the tokenizer's special ids come from them too).
    tensors: a Hugging Face checkpoint's `io.hf.SafetensorsDir` (its headers read), or None."""

    path: str
    weights: str | None
    format: str
    config: Any
    declared: Any = None
    quantization: Mapping | None = None
    sampler: Any = None
    tokenizer: str | None = None
    files: Mapping[str, Mapping] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    tensors: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def quantized(self) -> str | None:
        """The mode a checkpoint was saved quantized with ("int8", "int4"), or None (float)."""
        return (self.quantization or {}).get("mode")

    def known_json(self) -> dict[str, Mapping]:
        """{absolute path: content} of the JSON files already read (readers of them take these instead)."""
        return {os.path.abspath(os.path.join(self.path, name)): data for name, data in self.files.items()}
