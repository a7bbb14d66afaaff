"""Uniform-state forward process (spec §4.1): linear schedule, keep probability 1 - t.

    t ~ U(eps, 1) per example;  x_t[i] = x_0[i] with prob 1 - t, else a uniform token in [0, V)

There is no mask token: the whole vocabulary is the noise (a replacement can draw the same token
back, so the fraction of *changed* tokens is t * (1 - 1/V)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_t(rng: jax.Array, batch: int, eps: float = 1e-3) -> jax.Array:
    """Noise levels t ~ U(eps, 1), float32 [B]."""
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"t_eps must be in [0, 1), got {eps}")
    return jax.random.uniform(rng, (batch,), jnp.float32, minval=eps, maxval=1.0)


def corrupt(rng: jax.Array, tokens: jax.Array, t: jax.Array, vocab_size: int):
    """Replace each token of tokens [B, L] independently with prob t[b] by a uniform id in [0, V).

    Returns (noisy [B, L] int32, replaced [B, L] bool) where `replaced` marks the positions that drew
    a fresh token (which may equal the original).
    """
    k_mask, k_tok = jax.random.split(rng)
    replaced = jax.random.uniform(k_mask, tokens.shape, jnp.float32) < t[:, None]
    noise = jax.random.randint(k_tok, tokens.shape, 0, vocab_size, jnp.int32)
    return jnp.where(replaced, noise, tokens.astype(jnp.int32)), replaced
