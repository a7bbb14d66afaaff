"""Attention masks as pure functions over absolute positions.

Masks compare absolute positions: a key slot's position comes with it (a global layer's slot `s`
holds position `s` of its row; a sliding layer's ring slot the position `cache.slot_positions` gives,
negative when empty). All masks are boolean, True = may attend.

Causal encoder pass (prefill / commit), window W = 4, one row with 3 cached + 3 new tokens::

    key pos ->   0 1 2 3 4 5
    q pos 3      x x x x . .        sliding: q - W < k <= q  (itself + W-1 previous)
    q pos 4      . x x x x .
    q pos 5      . . x x x x

With images (the reference's generate() mask), the tokens of one image also see each other in both
directions, on sliding layers beyond the window too. W = 2, an image at positions 1..4 (i)::

    key pos ->   0 1 2 3 4 5
    q pos 0  t   x . . . . .
    q pos 1  i   x x x x x .        causal window OR the whole image
    q pos 4  i   . x x x x .
    q pos 5  t   . . . . x x        text: causal (windowed) only

Denoiser pass, context E = 5 committed tokens, W = 4, canvas of 3 (positions 5..7)::

    "block" (the reference)             "band" (Google's JAX sampler)
    ctx pos ->  0 1 2 3 4 | canvas      ctx pos ->  0 1 2 3 4 | canvas
    row 0       . . x x x | x x x       row 0       . . x x x | x x x
    row 1       . . x x x | x x x       row 1       . . . x x | x x x
    row 2       . . x x x | x x x       row 2       . . . . x | x x x

Global layers see every committed token in both modes. The canvas block is always fully visible.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def causal_mask(q_pos: jax.Array, k_pos: jax.Array, valid_end: jax.Array, window: int | None,
                image_span: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Causal (optionally sliding) mask for the encoder pass.

    q_pos: [B, T] query positions; k_pos: [B, S] positions held by the key slots;
    valid_end: [B] one past the last valid position (slots at or beyond it are unused or padding).
    image_span: optional (lo, hi) [B, T]: the positions [lo, hi) of the image a query belongs to
    (lo = hi for text queries). Such a query also sees every key of its image, later ones and ones
    beyond the sliding window included (see `image_spans`). Returns [B, T, S].
    """
    q = q_pos[:, :, None]
    k = k_pos[:, None, :]
    if image_span is None:
        mask = (k <= q) & (k < valid_end[:, None, None]) & (k >= 0)
        if window is not None:
            mask &= k > q - window
        return mask
    seen = k <= q
    if window is not None:
        seen &= k > q - window
    lo, hi = image_span
    seen |= (k >= lo[:, :, None]) & (k < hi[:, :, None])
    return seen & (k < valid_end[:, None, None]) & (k >= 0)


def image_spans(image_tokens: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The image block of every token of an encoder pass, as absolute positions [lo, hi).

    image_tokens: [B, T] bool, True on image placeholder tokens (the token at position starts[b] + t);
    starts: [B]. Each maximal run of consecutive image tokens in a row is one image (the released
    prompt layout puts boi / eoi text tokens around every image, so two images never touch; the
    reference groups runs of mm_token_type_ids the same way). Text tokens get lo = hi = 0 (an empty
    span). Returns (lo, hi), each [B, T] int32.
    """
    b, t = image_tokens.shape
    img = image_tokens.astype(bool)
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None, :], (b, t))
    prev = jnp.pad(img[:, :-1], ((0, 0), (1, 0)))
    nxt = jnp.pad(img[:, 1:], ((0, 0), (0, 1)))
    first = jax.lax.cummax(jnp.where(img & ~prev, idx, 0), axis=1)  # the run's first token
    last = jax.lax.cummin(jnp.where(img & ~nxt, idx + 1, t), axis=1, reverse=True)  # one past its last
    base = starts.astype(jnp.int32)[:, None]
    zero = jnp.zeros_like(idx)
    return jnp.where(img, base + first, zero), jnp.where(img, base + last, zero)


def image_runs(ids: Any, image_token_id: int) -> list[tuple[int, int]]:
    """Host-side twin of `image_spans` for one 1-D id sequence: [(start, end)] of each run of consecutive
    image tokens, one image each (positions relative to `ids`)."""
    is_img = np.concatenate([[False], np.asarray(ids) == image_token_id, [False]])
    edges = np.flatnonzero(is_img[1:] != is_img[:-1]).tolist()
    return list(zip(edges[::2], edges[1::2]))


def denoise_context_mask(q_pos: jax.Array, k_pos: jax.Array, context_end: jax.Array,
                         window: int | None, variant: str = "block") -> jax.Array:
    """Which committed-context slots the canvas sees in the denoiser pass.

    q_pos: [B, L] canvas positions (context_end + j); k_pos: [B, S]; context_end: [B] = E.
    Global layers (window None): every k < E. Sliding "block": the same last W-1 committed tokens
    [E-W+1, E) for every row. Sliding "band": row at position q sees (q-W, E).
    Returns [B, L or 1, S].
    """
    e = context_end[:, None, None]
    k = k_pos[:, None, :]
    mask = (k < e) & (k >= 0)
    if window is None:
        return mask
    if variant == "block":
        return mask & (k > e - window)
    if variant == "band":
        return mask & (k > q_pos[:, :, None] - window)
    raise ValueError(f"unknown denoise window variant {variant!r}; use 'block' or 'band'")
