"""The two checkpoint formats on disk, and telling them apart (used by `dgemma_jax.io.locations`
before anything is read, and by `dgemma_jax.io.model_dir`, which re-exports these names).

    ours:          dgemma_model.json + an orbax params/ tree (+ a tokenizer file)
    Hugging Face:  config.json + *.safetensors (+ tokenizer files)
"""

from __future__ import annotations

import os

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
