"""The DiffusionGemma training objective (spec §4): block diffusion with a clean prefix.

Per example (batch layout in `dgemma_jax.training.data`; a batch with "pixel_values" and
"pixel_positions" has one picture per row, `training.image_tasks`, run through the vision tower into
the prompt's image placeholders in step 3)::

    1. choose one valid canvas c ~ U{0..num_canvases-1}; it starts at s = prompt_length + c * L
    2. t ~ U(eps, 1); noisy = uniform corruption of the clean canvas with prob t   (corruption.py)
    3. encoder: causal pass over the CLEAN prompt + all canvases -> cache, AR next-token logits
    4. decoder pass 1 (no self-conditioning, stop-gradient) on the noisy canvas, context_end = s
    5. decoder pass 2 on the same noisy canvas, fed softmax(pass-1 logits) @ E for a random
       subset of the rows (prob sc_prob); the soft embedding of the other rows is exactly zero
    6. loss = CE(pass 2, clean canvas) over all L positions + ar_weight * AR CE

The decoder pass with context_end = s sees cache slots < s (the prompt and the clean canvases
strictly before the selected one) plus the canvas itself bidirectionally; sliding layers get the
block-anchored window as at inference. Slots >= s (the clean copy of the selected canvas and the
later canvases) are never visible: this is the block mask of §4.2 without a T x T mask.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import denoise_logits, encode_pass, image_features_pass, soft_embed_pass
from dgemma_jax.model.cache import init_cache
from dgemma_jax.runtime import Runtime
from dgemma_jax.training.corruption import corrupt, sample_t

WEIGHTINGS = ("none", "inv_t")


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Hashable knobs of the loss (a static argument of the jitted step).

    canvas_length: L of the data layout. t_eps: t ~ U(t_eps, 1). sc_prob: probability that a row's
    pass 2 is self-conditioned (0 disables pass 1 entirely). ar_weight: weight of the encoder AR
    loss (0 skips the LM head on the encoder pass). ar_on_prompt: also score next-token predictions
    inside the prompt (False: only targets in the response canvases). weighting: "none" (flat CE,
    the reference) or "inv_t" (per-example weight 1/t, clipped at max_weight).
    """

    canvas_length: int
    t_eps: float = 1e-3
    sc_prob: float = 0.5
    ar_weight: float = 1.0
    ar_on_prompt: bool = True
    weighting: str = "none"
    max_weight: float = 10.0

    def __post_init__(self):
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"ObjectiveConfig.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if not 0.0 <= self.sc_prob <= 1.0:
            raise ValueError(f"ObjectiveConfig.sc_prob must be in [0, 1], got {self.sc_prob}")
        if self.ar_weight < 0:
            raise ValueError(f"ObjectiveConfig.ar_weight must be >= 0, got {self.ar_weight}")


def select_canvas(rng, batch: dict, canvas_length: int):
    """Uniform choice among each row's valid canvases -> (index [B], start position [B])."""
    n = jnp.maximum(batch["num_canvases"], 1)
    idx = jnp.floor(jax.random.uniform(rng, n.shape) * n).astype(jnp.int32)
    idx = jnp.minimum(idx, n - 1)
    return idx, batch["prompt_lengths"] + idx * canvas_length


def gather_canvas(tokens: jax.Array, start: jax.Array, length: int) -> jax.Array:
    pos = start[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]
    return jnp.take_along_axis(tokens, pos, axis=1)


def token_ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Cross entropy per position, float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def encoder_pass(config: ModelConfig, params, tokens, lengths, want_logits: bool, cache_dtype=None, adapters=None,
                 runtime: Runtime | None = None, images: tuple[jax.Array, jax.Array] | None = None,
                 prompt_lengths: jax.Array | None = None):
    """The causal pass over whole training rows into a fresh cache: (logits or None, cache).

    images: (pixel_values [N, P, 3 p^2], positions [N, P, 2]) of the rows' pictures in row-major order,
    through the vision tower (trainable) into the `config.image_token_id` placeholders of the prompts
    (positions < prompt_lengths; a response never carries an image)."""
    b, t = tokens.shape
    cache = init_cache(config, b, t, cache_dtype, ring=False)   # the denoiser reads contexts before the row's end
    kw = {}
    if images is not None:
        feats, _ = image_features_pass(params, config, images[0], images[1], runtime=runtime)
        in_prompt = jnp.arange(t, dtype=jnp.int32)[None, :] < prompt_lengths[:, None]
        kw = dict(image_features=feats, image_tokens=(tokens == config.image_token_id) & in_prompt)
    return encode_pass(params, config, tokens, jnp.zeros((b,), jnp.int32), lengths, cache,
                       "all" if want_logits else "none", adapters=adapters, runtime=runtime, **kw)


def ar_loss(logits, tokens, lengths, prompt_lengths, on_prompt: bool):
    """Mean next-token CE over targets tokens[:, 1:] inside each row's valid length."""
    tgt = tokens[:, 1:]
    pos = jnp.arange(1, tokens.shape[1], dtype=jnp.int32)[None, :]
    mask = pos < lengths[:, None]
    if not on_prompt:
        mask &= pos >= prompt_lengths[:, None]
    ce = token_ce(logits[:, :-1], tgt)
    m = mask.astype(jnp.float32)
    return (ce * m).sum() / jnp.maximum(m.sum(), 1.0)


def loss_fn(params, batch: dict, rng: jax.Array, *, config: ModelConfig, obj: ObjectiveConfig,
            sc_override: jax.Array | None = None, canvas_override: jax.Array | None = None,
            t_override: jax.Array | None = None, noise_override: jax.Array | None = None,
            return_logits: bool = False, adapters=None, runtime: Runtime | None = None):
    """Total loss and metrics for one batch (differentiable in `params`).

    The *_override arguments pin the random choices (tests): sc_override [B] bool (self-conditioning
    on/off per row), canvas_override [B] canvas index, t_override [B], noise_override [B, L] noisy
    canvas tokens. adapters: the unmerged LoRA collection (`lora.forward_adapters`) added to the
    base kernels in every pass, or None. runtime: how the passes run (`dgemma_jax.runtime`).
    Returns (loss, metrics dict of scalars); with return_logits the metrics also hold "logits" [B, L, V]
    (pass 2), "clean" [B, L] and "noisy" [B, L].
    """
    L = obj.canvas_length
    tokens = batch["tokens"].astype(jnp.int32)
    lengths = batch["lengths"].astype(jnp.int32)
    plen = batch["prompt_lengths"].astype(jnp.int32)
    b = tokens.shape[0]
    k_sel, k_t, k_noise, k_sc = jax.random.split(rng, 4)

    idx, start = select_canvas(k_sel, batch, L)
    if canvas_override is not None:
        idx = canvas_override.astype(jnp.int32)
        start = plen + idx * L
    clean = gather_canvas(tokens, start, L)
    t = sample_t(k_t, b, obj.t_eps) if t_override is None else t_override.astype(jnp.float32)
    noisy, _ = corrupt(k_noise, clean, t, config.vocab_size)
    if noise_override is not None:
        noisy = noise_override.astype(jnp.int32)

    want_ar = obj.ar_weight > 0
    images = (batch["pixel_values"], batch["pixel_positions"]) if "pixel_values" in batch else None
    enc_logits, cache = encoder_pass(config, params, tokens, lengths, want_ar, adapters=adapters, runtime=runtime,
                                     images=images, prompt_lengths=plen)

    soft = None
    sc_on = jnp.zeros((b,), bool)
    if obj.sc_prob > 0 or sc_override is not None:
        sc_on = jax.random.bernoulli(k_sc, obj.sc_prob, (b,)) if sc_override is None else sc_override
        sg = jax.lax.stop_gradient
        logits1 = denoise_logits(sg(params), config, noisy, start, sg(cache), None,
                                 adapters=None if adapters is None else sg(adapters), runtime=runtime)
        soft = soft_embed_pass(params, config, sg(logits1), adapters=adapters, runtime=runtime)
        soft = soft * sc_on[:, None, None].astype(soft.dtype)
    logits = denoise_logits(params, config, noisy, start, cache, soft, adapters=adapters, runtime=runtime)

    ce = token_ce(logits, clean)                                # [B, L]
    per_example = ce.mean(-1)
    if obj.weighting == "inv_t":
        w = jnp.minimum(1.0 / t, obj.max_weight)
        diff = (per_example * w).mean()
    else:
        diff = per_example.mean()
    total = diff
    metrics: dict[str, Any] = {"diffusion_loss": diff}
    if want_ar:
        ar = ar_loss(enc_logits, tokens, lengths, plen, obj.ar_on_prompt)
        total = total + obj.ar_weight * ar
        metrics["ar_loss"] = ar
    pred = jnp.argmax(logits, -1)
    metrics.update(
        loss=total,
        canvas_token_acc=(pred == clean).mean(),
        canvas_exact=(pred == clean).all(-1).mean(),
        mean_t=t.mean(),
        sc_frac=sc_on.astype(jnp.float32).mean(),
    )
    if return_logits:
        metrics.update(logits=logits, clean=clean, noisy=noisy)
    return total, metrics

