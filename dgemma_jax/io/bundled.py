"""Reading the models bundled with the package (dgemma_jax/assets/<name>/, ordinary dgemma_jax model
directories): the inference side of `dgemma_jax.training.bundled`, which writes them and re-exports
these names. Kept in io so that loading the bundled model (`dgemma generate` without --checkpoint,
`DiffusionGemma.from_pretrained()`) does not import the trainer.

    from dgemma_jax.io.bundled import load_bundled
    config, params, sampler, tokenizer = load_bundled()
"""

from __future__ import annotations

import json
import os
from typing import Any

from dgemma_jax.io.model_dir import load_model, load_model_tokenizer, read_checkpoint

ASSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
DEFAULT_NAME = "dgemma-tiny-digits"
VISION_NAME = "dgemma-tiny-vision-digits"  # the bundled model with a vision tower (pictures of digits)
BUNDLED = "bundled"  # the checkpoint value naming the default bundled model; "bundled:NAME" names another


def bundled_names() -> list[str]:
    """The bundled models in this installation."""
    return sorted(n for n in os.listdir(ASSETS_DIR) if os.path.isdir(os.path.join(ASSETS_DIR, n))) \
        if os.path.isdir(ASSETS_DIR) else []


def bundled_choice(checkpoint: str | None) -> tuple[bool, str | None]:
    """Whether a checkpoint value names a bundled model, and which: (True, None) for None, "" or
    "bundled" (the default one), (True, NAME) for "bundled:NAME", (False, None) for anything else."""
    if checkpoint in (None, "", BUNDLED):
        return True, None
    if isinstance(checkpoint, str) and checkpoint.startswith(BUNDLED + ":"):
        return True, checkpoint[len(BUNDLED) + 1:]
    return False, None


def asset_path(name: str | None = None) -> str:
    return os.path.join(ASSETS_DIR, name or DEFAULT_NAME)


def bundled_dir(name: str | None = None, path: str | None = None) -> str:
    """The directory of a bundled model (default: the digits model), or FileNotFoundError naming the
    bundled ones."""
    root = path or asset_path(name)
    if not os.path.isdir(root):
        names = ", ".join(bundled_names()) or "none"
        raise FileNotFoundError(f"no bundled model at {root} (bundled here: {names}); the scripts/train_*bundled.py "
                                "scripts create them")
    return root


def load_bundled(name: str | None = None, path: str | None = None):
    """(ModelConfig, params, SamplerConfig, tokenizer) of a bundled model (default: the digits model)."""
    source = read_checkpoint(bundled_dir(name, path))
    config, params, sampler = load_model(source)
    return config, params, sampler, load_model_tokenizer(source)


def load_metadata(name: str | None = None, path: str | None = None) -> dict[str, Any]:
    with open(os.path.join(path or asset_path(name), "metadata.json")) as f:
        return json.load(f)
