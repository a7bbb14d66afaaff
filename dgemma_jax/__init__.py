"""dgemma_jax: DiffusionGemma (uniform-state text diffusion with a Gemma 4 MoE) in JAX/Flax.

Public API (see README "Library API"; in full: docs/api.md):
  ModelConfig, SamplerConfig      frozen, validated configs (`SamplerConfig.for_model(config)`)
  Runtime                         how programs run: mesh, platform, MoE dispatch, attention kernel
  Engine, generate                compiled prefill + multi-canvas denoising (fused or streamed)
  DiffusionGemma                  text in, text out: `DiffusionGemma.from_pretrained(path).generate(...)`
  load_hf, save_hf                Hugging Face checkpoints <-> params (safetensors, no torch)
  init_params, init_cache         random parameters, an empty KV cache
  prefill, denoise, soft_embed    the two model passes (causal encoder; bidirectional denoiser)
  image_features                  the vision tower's soft tokens for a prompt's images
  generate_fused, row_keys,       traceable pieces for your own jit / loop: the whole generation as one
  initial_canvas, init_state,     traceable function, per-row keys, a canvas's start, one denoising step
  denoise_step                    (docs/api.md, "Your own loop")
  quantize_params                 weight-only int8 kernels (`Engine(..., quantize="int8")` does it for you)
"""

from dgemma_jax.backends import skip_absent_tpu

skip_absent_tpu()  # before JAX starts its backends: no libtpu probing noise on a machine without a TPU

from dgemma_jax.config import ModelConfig  # noqa: E402
from dgemma_jax.engine import Engine, generate  # noqa: E402
from dgemma_jax.io.hf import load_hf, save_hf  # noqa: E402
from dgemma_jax.model import (KVCache, cache_shape, denoise, image_features, init_cache, init_params,  # noqa: E402
                              logical_axes, param_shapes, prefill, soft_embed)
from dgemma_jax.model.quant import quantize_params  # noqa: E402
from dgemma_jax.pipeline import DiffusionGemma  # noqa: E402
from dgemma_jax.runtime import Runtime  # noqa: E402
from dgemma_jax.sampling.config import SamplerConfig  # noqa: E402
from dgemma_jax.sampling.generate import generate_fused  # noqa: E402
from dgemma_jax.sampling.loop import denoise_step, init_state, initial_canvas, row_keys  # noqa: E402

__all__ = ["DiffusionGemma", "Engine", "KVCache", "ModelConfig", "Runtime", "SamplerConfig", "cache_shape", "denoise",
           "denoise_step", "generate", "generate_fused", "image_features", "init_cache", "init_params", "init_state",
           "initial_canvas", "load_hf", "logical_axes", "param_shapes", "prefill", "quantize_params", "row_keys",
           "save_hf", "soft_embed"]

__version__ = "0.1.0"
