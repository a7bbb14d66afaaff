"""Infilling: where a suffix's tokens go on the canvases, and which middle lengths are tried (host-side, pure).

DiffusionGemma was trained on one layout only (spec §4.2): prompt, then the answer cut into canvases,
the last partial canvas filled with EOS. It has no fill-in-the-middle tokens and no layout with a
suffix in the prompt. So a suffix goes where the training layout puts the end of an answer: right
after the middle, on the canvas, held there (pinned), with the rest of its canvas pinned to EOS. For
a middle of `k` tokens and a suffix of `s`, the answer region is

    [ middle: k free positions ][ suffix: s pinned ][ EOS pinned ... to the end of the canvas ]

spread over `ceil((k + s + 1) / L)` canvases (canvas c is columns [c L, (c + 1) L) of the seed). The
denoiser sees the suffix bidirectionally on the canvas that holds it. The middle's length is not
known, so several `k` are tried (`candidate_lengths`) and the engine's driver (`engine.infill`) keeps
the one whose text the model's own causal pass (trained with the AR co-loss, spec §4.4) finds most
likely. A candidate too long can still end its middle early: EOS / pad written inside the middle are
dropped (`middle_of`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["layout", "candidate_lengths", "middle_of", "DEFAULT_MAX_CANDIDATES"]

DEFAULT_MAX_CANDIDATES = 32


def layout(middle: int, suffix_ids: Sequence[int], canvas_length: int, eos_id: int):
    """The seed and pinned mask of a middle of `middle` free tokens followed by the suffix and EOS.

    Returns (seed [n L] int32, pinned [n L] bool), n = ceil((middle + len(suffix) + 1) / L): the free
    positions hold 0 in the seed (noise replaces them), the suffix and the EOS fill are pinned."""
    s = len(suffix_ids)
    n = -(-(middle + s + 1) // canvas_length)
    seed = np.full((n * canvas_length,), eos_id, np.int32)
    seed[:middle] = 0
    seed[middle:middle + s] = np.asarray(suffix_ids, np.int32)
    pinned = np.ones((n * canvas_length,), bool)
    pinned[:middle] = False
    return seed, pinned


def candidate_lengths(max_middle: int, limit: int = DEFAULT_MAX_CANDIDATES) -> list[int]:
    """The middle lengths tried: every k in [0, max_middle] when they are at most `limit`, else `limit`
    lengths spread evenly over that range (0 and max_middle included; a longer middle may end early)."""
    if max_middle < 0:
        raise ValueError(f"the middle's budget must be >= 0 tokens; got {max_middle}")
    if limit < 1:
        raise ValueError(f"infill needs at least one candidate length; got limit={limit}")
    if max_middle + 1 <= limit:
        return list(range(max_middle + 1))
    if limit == 1:
        return [max_middle]
    return sorted({round(i * max_middle / (limit - 1)) for i in range(limit)})


def middle_of(tokens, middle: int, stop_ids: Sequence[int]) -> list[int]:
    """The middle's tokens from a candidate's output row: its first `middle` tokens without the
    EOS / pad (`stop_ids`) written among them."""
    stop = set(int(t) for t in stop_ids)
    return [int(t) for t in np.asarray(tokens)[:middle] if int(t) not in stop]
