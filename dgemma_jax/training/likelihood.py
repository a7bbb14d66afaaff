"""A Monte-Carlo log-likelihood estimate for uniform-state diffusion (the RL and DPO objectives' score).

A diffusion model has no left-to-right factorisation, so log p(response | prompt) is estimated from the
training objective (spec §4, `objective.py`): the per-position cross-entropy of the denoiser on a canvas
re-noised at a time t is an ELBO-style term, and its negative, averaged over noise draws, is the score.
For a batch laid out as SFT's (`data.collate`: prompt, then EOS-filled canvases)::

    encoder: one causal pass over the clean prompt + all canvases -> cache (as in training)
    for each sample k < K and each canvas slot c (its context_end s = prompt_length + c * L), one scan step:
        t_kc = t_eps + (1 - t_eps) (k + u_kc) / K          (stratified over [t_eps, 1), u ~ U(0, 1))
        x_t  = uniform corruption of the clean canvas with prob t_kc          (corruption.py)
        lp_kc[i] = log softmax(denoise(x_t, context_end = s))[clean_i]        (no self-conditioning)
    token_logprobs[b, c L + i] = mean_k lp_kc[i]     (0 on canvases past the row's valid ones)

The sequence score is the sum over valid positions (the EOS fill included, as training scores it).
Unlike the training loss it scores EVERY valid canvas of a row (not one drawn at random), so the
estimate of a whole response is not a one-canvas sample; and it leaves self-conditioning out (the
estimate is then a function of (params, noise) alone, deterministic given the rng).

Variance control (VRPO, LLaDA 1.5): the noise (times, replaced positions and their tokens) depends only
on `rng` and the clean tokens, never on the parameters, so the policy, the pre-update policy and the
frozen reference scored with the same `rng` see the same noisy canvases; their difference is then far
less noisy than two independent estimates, and it is exactly 0 when the parameters are equal. The times
are stratified (one per K-th of [t_eps, 1)) instead of drawn independently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import denoise_logits
from dgemma_jax.runtime import Runtime
from dgemma_jax.training.corruption import corrupt
from dgemma_jax.training.objective import encoder_pass, gather_canvas, token_ce


def stratified_times(rng: jax.Array, batch: int, num_samples: int, eps: float) -> jax.Array:
    """[K, B] times, sample k in the k-th of K equal strata of [eps, 1)."""
    u = jax.random.uniform(rng, (num_samples, batch), jnp.float32)
    k = jnp.arange(num_samples, dtype=jnp.float32)[:, None]
    return eps + (1.0 - eps) * (k + u) / num_samples


def token_logprobs(params, batch: dict, rng: jax.Array, *, config: ModelConfig, num_canvases: int,
                   num_samples: int = 1, t_eps: float = 1e-3, adapters=None, runtime: Runtime | None = None):
    """Per-position log-likelihood estimates of the response canvases: (logp [B, C*L] float32, mask [B, C*L]).

    batch: "tokens", "lengths", "prompt_lengths", "num_canvases" (`data.collate`), and with pictures
    "pixel_values" / "pixel_positions" (`image_tasks.ImageTaskSource`'s); num_canvases: the
    layout's canvas slots C (static). rng: the noise; the same rng gives the same noisy canvases for
    any parameters (share it between the policy and the reference). Differentiable in params/adapters.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    L = config.canvas_length
    tokens = batch["tokens"].astype(jnp.int32)
    lengths = batch["lengths"].astype(jnp.int32)
    plen = batch["prompt_lengths"].astype(jnp.int32)
    b = tokens.shape[0]
    # a batch with "pixel_values" / "pixel_positions" (one picture per row) runs them through the tower
    images = (batch["pixel_values"], batch["pixel_positions"]) if "pixel_values" in batch else None
    _, cache = encoder_pass(config, params, tokens, lengths, False, adapters=adapters, runtime=runtime,
                            images=images, prompt_lengths=plen)
    k_time, k_noise = jax.random.split(rng)
    times = stratified_times(k_time, b * num_canvases, num_samples, t_eps).reshape(num_samples * num_canvases, b)

    # one scan over the K * C (sample, canvas) draws, j = k C + c: the program (and its compile time) does
    # not grow with K or C; each draw's activations are recomputed in the backward pass (checkpoint), so
    # memory holds one draw's, not K * C of them
    @jax.checkpoint
    def draw(_, xs):
        j, t = xs
        start = plen + (j % num_canvases) * L
        clean = gather_canvas(tokens, start, L)
        noisy, _ = corrupt(jax.random.fold_in(k_noise, j), clean, t, config.vocab_size)
        logits = denoise_logits(params, config, noisy, start, cache, None, adapters=adapters, runtime=runtime)
        return None, -token_ce(logits, clean)

    _, lp = jax.lax.scan(draw, None, (jnp.arange(num_samples * num_canvases, dtype=jnp.int32), times))
    lp = lp.reshape(num_samples, num_canvases, b, L).mean(0)          # [C, B, L]
    logp = jnp.transpose(lp, (1, 0, 2)).reshape(b, num_canvases * L)
    valid = jnp.arange(num_canvases, dtype=jnp.int32)[None, :] < batch["num_canvases"][:, None]
    mask = jnp.repeat(valid, L, axis=1)
    return jnp.where(mask, logp, 0.0), mask


def sequence_logprob(params, batch: dict, rng: jax.Array, **kw) -> jax.Array:
    """[B] estimated log p(response | prompt): `token_logprobs` summed over the valid positions."""
    logp, _ = token_logprobs(params, batch, rng, **kw)
    return logp.sum(-1)
