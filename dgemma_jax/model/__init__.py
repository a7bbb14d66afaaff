"""Pure functional DiffusionGemma model (Flax linen modules + functional entry points)."""

from dgemma_jax.model.api import denoise, image_features, init_params, logical_axes, param_shapes, prefill, soft_embed
from dgemma_jax.model.cache import KVCache, cache_shape, init_cache
