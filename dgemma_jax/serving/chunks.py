"""How a prompt goes into a slot's cache row: its prefill chunks, its image blocks, and the identity
of its tokens that prefix reuse matches rows by."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from dgemma_jax.engine.inputs import check_images_host
from dgemma_jax.io.images import image_runs


def content_keys(ids: np.ndarray, image_token_id: int | None, images=None) -> np.ndarray:
    """The identity of a prompt's tokens for prefix matching: int64 ids, each image's run of image
    tokens replaced by a key of its pixels (two different images give different keys)."""
    keys = np.asarray(ids, np.int64).copy()
    if images is None or image_token_id is None:
        return keys
    for i, (b, e) in enumerate(image_runs(np.asarray(ids), image_token_id)):
        h = hashlib.blake2b(np.ascontiguousarray(images.pixel_values[i]).tobytes(), digest_size=7)
        h.update(np.ascontiguousarray(images.position_ids[i]).tobytes())
        keys[b:e] = -1 - int.from_bytes(h.digest(), "little")
    return keys


def image_blocks(config, ids: np.ndarray) -> list[tuple[int, int]]:
    """[(begin, end)] of each image in `ids`: its run of image tokens with the begin / end markers
    around it when they are there."""
    blocks = []
    for b, e in image_runs(ids, config.image_token_id):
        if b > 0 and config.boi_token_id is not None and ids[b - 1] == config.boi_token_id:
            b -= 1
        if e < len(ids) and config.eoi_token_id is not None and ids[e] == config.eoi_token_id:
            e += 1
        blocks.append((b, e))
    return blocks


def plan_chunks(config, prompt_ids: Sequence[int], widths: tuple[int, int], images=None,
                start: int = 0) -> list[tuple[int, int, int, Any]]:
    """The prompt's prefill chunks from position `start` on (what comes before is in the slot's row
    already): [(start, end, width, images wholly inside or None)].

    widths: (small, big) prefill widths; a rest of at most `small` tokens goes in one small chunk, the
    others in chunks of at most `big`, none cutting an image (its `<|image>` ... `<image|>` block): a
    chunk that would cut one ends before the image's begin marker, and the image starts the next
    chunk. ValueError (HTTP 400) when the images do not match the prompt's image tokens, or an image
    is longer than a chunk (`--prefill-chunk`)."""
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    check_images_host(config, ids[None], np.asarray([len(ids)], np.int32), images)
    blocks = image_blocks(config, ids) if images is not None else []
    small, big = widths
    for i, (b, e) in enumerate(blocks):
        if e - b > big:
            raise ValueError(f"image {i + 1} of the prompt takes {e - b} tokens (its soft tokens and markers), "
                             f"more than this server's prefill chunk of {big} tokens; an image must go into "
                             f"the cache in one chunk: restart the server with --prefill-chunk {e - b} or more, "
                             "or send a smaller image budget")
    chunks = []
    while start < len(ids):
        rest = len(ids) - start
        width = small if rest <= small else big
        end = start + min(rest, width)
        for b, e in blocks:
            if b < end < e:       # the chunk would cut this image: end before its begin marker
                end = b
        assert end > start, "an image longer than a chunk was let through"
        inside = [i for i, (b, e) in enumerate(blocks) if start <= b and e <= end]
        chunks.append((start, end, width, images.select(inside) if inside else None))
        start = end
    return chunks
