"""Random Hugging Face DiffusionGemma checkpoints drawn with numpy alone (no torch).

The reference comparisons (live against transformers, or against the golden files in tests/golden)
need the SAME weights on both sides. They are drawn here, in numpy, from a seed and the checkpoint's
tensor list (name -> shape, in the `save_pretrained` layout), so the JAX side can rebuild them
bit for bit without torch: the golden files store the seed, the tensor list and transformers' own
config.json, never the weights.

The distributions are those of `hf_reference.build_reference_model(randomize=True)`:
  * every norm weight (7 per layer, q_norm, k_norm, final norm, self-conditioning pre_norm),
    router.scale and router.per_expert_scale ~ U[0.5, 1.5];
  * both `layer_scalar` copies (encoder, decoder) ~ U[0.3, 1.7], drawn independently;
  * Linear / expert weights ~ N(0, (proj_gain / sqrt(fan_in))^2);
  * the (tied) embedding ~ N(0, (embed_rms / sqrt(H))^2);
  * router.proj ~ N(0, router_std^2);
  * vision-tower tensors (unused by text; the tiny tower's) ~ N(0, 0.02^2).
Each tensor has its own stream, `default_rng([seed, crc32(name)])`, so the values do not depend on
the order of the tensor list.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from typing import Iterable

import numpy as np

VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")


def _is_norm_or_scale(name: str, ndim: int) -> bool:
    parts = name.rsplit(".", 2)
    return ndim == 1 and ((len(parts) == 3 and "norm" in parts[-2])
                          or name.endswith("router.scale") or name.endswith("per_expert_scale"))


def random_tensor(name: str, shape: tuple[int, ...], seed: int, hidden_size: int, *, proj_gain: float = 1.0,
                  embed_rms: float = 1.5, router_std: float = 1.0) -> np.ndarray:
    """One float32 tensor of the checkpoint (see the module doc for the distributions)."""
    shape = tuple(int(s) for s in shape)
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])

    def normal(std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def uniform(lo, hi):
        return (rng.random(shape) * (hi - lo) + lo).astype(np.float32)

    if name.startswith(VISION_PREFIXES):
        return normal(0.02)
    if name.endswith("layer_scalar"):
        return uniform(0.3, 1.7)
    if _is_norm_or_scale(name, len(shape)):
        return uniform(0.5, 1.5)
    if name.endswith("embed_tokens.weight"):
        return normal(embed_rms / math.sqrt(hidden_size))
    if name.endswith("router.proj.weight"):
        return normal(router_std)
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return normal(proj_gain / math.sqrt(shape[-1]))
    if len(shape) == 2 and name.endswith(".weight"):  # nn.Linear [out, in]
        return normal(proj_gain / math.sqrt(shape[1]))
    raise ValueError(f"no distribution for tensor {name} {shape}")


def random_state_dict(spec: Iterable[tuple[str, Iterable[int]]], seed: int, hidden_size: int,
                      **kwargs) -> dict[str, np.ndarray]:
    """{name: float32 array} for a tensor list [(name, shape), ...] in the save_pretrained layout."""
    return {name: random_tensor(name, tuple(shape), seed, hidden_size, **kwargs) for name, shape in spec}


def write_checkpoint(path: str | os.PathLike, config_json: str, generation_config_json: str | None,
                     spec: Iterable[tuple[str, Iterable[int]]], seed: int, **kwargs) -> str:
    """A Hugging Face checkpoint directory (config.json, generation_config.json, model.safetensors)
    holding `random_state_dict(spec, seed)`. `config_json` is transformers' own config.json text.
    Readable by `dgemma_jax.load_hf` and by transformers' `from_pretrained`. Returns the path."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hidden = int(json.loads(config_json)["text_config"]["hidden_size"])
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(config_json)
    if generation_config_json is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            f.write(generation_config_json)
    save_file(random_state_dict(spec, seed, hidden, **kwargs), os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return path
