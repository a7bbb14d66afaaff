"""What goes into the engine's programs: inputs checked and shaped on the host, token budgets.

Every check runs before anything is traced, so bad input is a one-line `ValueError` naming the
argument and the fix, never a trace error. `prepare_inputs` is what `Engine.generate` runs on a
batch; `bucket_length` the prompt widths and cache lengths it rounds to; `default_new_tokens` the
budget when none is given.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import check_tokens
from dgemma_jax.model.masks import image_runs
from dgemma_jax.sampling import generate as gen
from dgemma_jax.sampling.config import SamplerConfig


def check_sampler(config: ModelConfig, sampler: SamplerConfig):
    if not isinstance(sampler, SamplerConfig):
        raise ValueError(f"sampler must be a SamplerConfig; got {type(sampler).__name__}")
    bad = [e for e in sampler.eos_ids if e >= config.vocab_size]
    if bad:
        raise ValueError(f"SamplerConfig.eos_ids {bad} are outside the vocabulary [0, {config.vocab_size}); "
                         "set eos_ids to the model's end-of-sequence ids")
    if sampler.pad_id >= config.vocab_size:
        raise ValueError(f"SamplerConfig.pad_id={sampler.pad_id} is outside the vocabulary [0, {config.vocab_size})")


def canvas_length_warning(config: ModelConfig, sampler: SamplerConfig) -> str | None:
    """A warning when the sampler's canvas length is not the one the model was trained with (its
    config's canvas_length): the denoiser has only seen canvases of that length, and on the bundled
    model other lengths give wrong answers."""
    if sampler.canvas_length == config.canvas_length:
        return None
    return (f"canvas length {sampler.canvas_length} is not the {config.canvas_length} this model was trained with "
            f"(its config's canvas_length); answers may be wrong: use a canvas length of {config.canvas_length}")


def bucket_length(n: int, minimum: int = 16) -> int:
    """The smallest length >= n of the form 2**k or 3 * 2**(k-1) (16, 24, 32, 48, 64, 96, ...).

    Programs are compiled per shape, so the engine pads prompt widths and derived cache lengths up to
    these buckets: prompts of many lengths share a handful of programs, and at most a third of a
    bucket (under half of the length it pads) is padding."""
    n = max(int(n), int(minimum))
    pow2 = 1 << (n - 1).bit_length()
    return 3 * pow2 // 4 if 3 * pow2 // 4 >= n else pow2


def prepare_inputs(config: ModelConfig, sampler: SamplerConfig, prompt_tokens, lengths, max_new_tokens: int,
                   cache_length: int | None = None, seed_canvas=None, pinned=None, committed=None,
                   bucket: bool = False):
    """Validate generate() inputs on the host (before anything is compiled) and size the cache.

    committed: [B] tokens already in a cache being continued (multi-turn), else 0.
    bucket: right-pad the prompt width with pad ids to `bucket_length`, and size a derived cache for
    the bucketed context (capped at the model's positions), so that all prompts of one bucket share
    one program. The padding is masked and never written to the cache; it changes only the order of
    floating-point sums (bench config: first-pass logits within 2.2e-3 of the exact shapes' at a scale
    of 30, benchmarks/prompt_buckets.py).
    Returns (tokens [B, P] int32, lengths [B] int32, cache_length, seed_canvas, pinned).
    """
    check_sampler(config, sampler)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((prompt_tokens, lengths))):
        raise ValueError("generate checks its inputs on the host and cannot be traced: inside jax.jit call "
                         "dgemma_jax.generate_fused (traceable; keys from dgemma_jax.row_keys)")
    tokens = check_tokens(config, prompt_tokens, "prompt_tokens")
    b, p = tokens.shape
    if b == 0 or p == 0:
        raise ValueError(f"prompt_tokens has shape {(b, p)}: generate needs at least one prompt of at least one token")
    if lengths is None:
        lengths = np.full((b,), p, np.int32)
    lengths = np.asarray(lengths)
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be an integer array of shape [{b}]; got {lengths.dtype} {lengths.shape}")
    if (lengths < 1).any() or (lengths > p).any():
        raise ValueError(f"each prompt length must be in [1, {p}] (the padded prompt width); got {lengths.tolist()}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    n_canvas = gen.num_canvases(int(max_new_tokens), sampler.canvas_length)
    ends = lengths + (0 if committed is None else np.asarray(committed))
    need = int(ends.max()) + (n_canvas - 1) * sampler.canvas_length
    last_pos = int(ends.max()) + n_canvas * sampler.canvas_length
    if last_pos > config.max_position_embeddings:
        raise ValueError(f"context ({int(ends.max())} tokens) + {n_canvas} canvas(es) of {sampler.canvas_length} "
                         f"reach position {last_pos}, beyond the model's max_position_embeddings="
                         f"{config.max_position_embeddings}; shorten the prompt or lower max_new_tokens")
    if cache_length is None:
        # bucketed: sized from the bucketed context, so one program serves a whole prompt bucket
        padded = bucket_length(int(ends.max())) + (n_canvas - 1) * sampler.canvas_length
        cache_length = max(need, min(padded, config.max_position_embeddings)) if bucket else need
    elif need > cache_length:
        raise ValueError(f"the KV cache holds {cache_length} tokens per row but the context ({int(ends.max())}) "
                         f"plus {n_canvas - 1} committed canvas(es) of {sampler.canvas_length} need {need}; "
                         f"raise cache_length to >= {need}, shorten the prompt or lower max_new_tokens "
                         f"(= {max_new_tokens})")
    if seed_canvas is not None:
        seed_canvas = check_tokens(config, seed_canvas, "seed_canvas")
        l = sampler.canvas_length
        if seed_canvas.ndim != 2 or seed_canvas.shape[0] != b or seed_canvas.shape[1] % l \
                or not l <= seed_canvas.shape[1] <= n_canvas * l:
            raise ValueError(f"seed_canvas must have shape [{b}, n * {l}] for n in 1..{n_canvas} (the first n "
                             f"canvases' starts); got {tuple(seed_canvas.shape)}")
    if pinned is not None:
        if seed_canvas is None:
            raise ValueError("pinned positions need a seed_canvas holding their tokens")
        pinned = jnp.asarray(pinned)
        if pinned.shape != seed_canvas.shape or pinned.dtype != jnp.bool_:
            raise ValueError(f"pinned must be a bool array of shape {tuple(seed_canvas.shape)}; "
                             f"got {pinned.dtype} {tuple(pinned.shape)}")
    width = max(p, min(bucket_length(p), config.max_position_embeddings)) if bucket else p
    if isinstance(tokens, np.ndarray):  # host arrays stay on the host (the engine places them)
        tokens = tokens.astype(np.int32, copy=False)
    if width > p:
        tokens = (np.pad if isinstance(tokens, np.ndarray) else jnp.pad)(
            tokens, ((0, 0), (0, width - p)), constant_values=config.pad_id)
    return tokens, np.asarray(lengths, np.int32), int(cache_length), seed_canvas, pinned


def check_images(config: ModelConfig, tokens, lengths, images):
    """The prompt's images checked against the prompt on the host: None, or (pixel_values,
    position_ids) arrays for the programs (`check_images_host`, then on the device)."""
    checked = check_images_host(config, tokens, lengths, images)
    if checked is None:
        return None
    return (jnp.asarray(checked[0], jnp.float32), jnp.asarray(checked[1], jnp.int32))


def check_images_host(config: ModelConfig, tokens, lengths, images):
    """`check_images` without the device transfer: None, or numpy (pixel_values, position_ids).

    images: an object with `pixel_values` [N, P, 3 p^2], `position_ids` [N, P, 2] and `soft_tokens`
    [N] (`dgemma_jax.io.images.preprocess_images`). The prompts must hold exactly sum(soft_tokens) image
    tokens in runs, one run of soft_tokens[i] tokens per image, in row-major order."""
    if images is None:
        tok = np.asarray(tokens)
        if config.image_token_id is not None and (tok == config.image_token_id).any():
            raise ValueError("the prompt holds image tokens but no images were given: pass images=... (the "
                             "preprocessed images whose placeholders these are) or remove the image tokens")
        return None
    if config.vision is None:
        raise ValueError(f"{config.name} is a text-only checkpoint (no vision tower): it cannot take images. "
                         "Load a checkpoint with vision weights (vision_config in its config.json) or drop the images")
    try:
        pixels, positions = np.asarray(images.pixel_values), np.asarray(images.position_ids)
        soft = [int(n) for n in np.asarray(images.soft_tokens).reshape(-1)]
    except AttributeError:
        raise ValueError("images must be preprocessed images (dgemma_jax.io.images.preprocess_images(...)): an "
                         f"object with pixel_values, position_ids and soft_tokens; got {type(images).__name__}") from None
    v = config.vision
    want = v.patch_dim
    if pixels.ndim != 3 or pixels.shape[-1] != want or positions.shape != pixels.shape[:2] + (2,):
        raise ValueError(f"images.pixel_values must be [N, patches, {want}] and position_ids [N, patches, 2]; got "
                         f"{pixels.shape} and {positions.shape}: preprocess them with this checkpoint's patch size "
                         f"({v.patch_size})")
    if len(soft) != pixels.shape[0]:
        raise ValueError(f"images.soft_tokens lists {len(soft)} images but pixel_values holds {pixels.shape[0]}")
    tok, n = np.asarray(tokens), np.asarray(lengths)
    runs = [b - a for row, length in zip(tok, n) for a, b in image_runs(row[:length], config.image_token_id)]
    if runs != soft:
        raise ValueError(f"the prompts hold {len(runs)} run(s) of image tokens of lengths {runs}, but the "
                         f"{len(soft)} image(s) give {soft} soft tokens: expand each image's placeholder with its "
                         "own soft-token count (dgemma_jax.io.images) and pass the images in prompt order")
    return (pixels, positions)


def new_tokens_that_fit(config: ModelConfig, sampler: SamplerConfig, context: int, limit: int,
                        cache_length: int | None = None) -> int:
    """The most new tokens (at most `limit`) whose canvases fit after `context` tokens: within the
    model's positions and, when given, a cache of `cache_length` (which holds all but the last
    canvas). Never less than one canvas; a context that leaves no room is `prepare_inputs`' error."""
    step = sampler.canvas_length
    canvases = (config.max_position_embeddings - context) // step
    if cache_length is not None:
        canvases = min(canvases, (cache_length - context) // step + 1)
    return max(1, min(int(limit), canvases * step))


# new tokens when not given, by the library and the command line alike: as many whole canvases of
# this many tokens as fit the model's positions (and a chat's cache) after the prompt
DEFAULT_NEW_TOKENS = 256


def default_new_tokens(config, sampler, context: int, cache_length: int | None = None) -> int:
    """The new-token budget when none is given: DEFAULT_NEW_TOKENS, capped to whole canvases that fit."""
    return new_tokens_that_fit(config, sampler, context, DEFAULT_NEW_TOKENS, cache_length)
