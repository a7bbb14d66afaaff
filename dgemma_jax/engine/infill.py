"""Infilling: the middle between a prompt (the prefix) and a suffix, over the engine's programs (host side).

DiffusionGemma was trained on one layout only (spec §4.2): prompt, then the answer cut into canvases,
the last partial canvas filled with EOS. It has no fill-in-the-middle tokens and no layout with a
suffix in the prompt. So a suffix goes where the training layout puts the end of an answer: right
after the middle, on the canvas, held there (pinned), with the rest of its canvas pinned to EOS. For
a middle of `k` tokens and a suffix of `s`, the answer region is (`layout`)

    [ middle: k free positions ][ suffix: s pinned ][ EOS pinned ... to the end of the canvas ]

spread over `ceil((k + s + 1) / L)` canvases (canvas c is columns [c L, (c + 1) L) of the seed). The
denoiser sees the suffix bidirectionally on the canvas that holds it. The middle's length is not
known, so for each prompt every candidate middle length k (`candidate_lengths`) is generated, all with
the prompt's own key (so each candidate, and the choice, is the same alone or in a batch), and the
candidate whose whole continuation (middle + suffix + EOS) the model's own causal pass (trained with
the AR co-loss, spec §4.4) finds most likely wins. A candidate too long can still end its middle
early: EOS / pad written inside the middle are dropped (`middle_of`). Cost: one generation per
candidate plus one causal pass each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from dgemma_jax.engine.inputs import bucket_length
from dgemma_jax.model import api
from dgemma_jax.sampling.loop import row_keys

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


@dataclasses.dataclass
class InfillOutput:
    """middles: each prompt's middle token ids (EOS / pad removed; the suffix is not in them);
    lengths: [B] the chosen candidate length (the middle may be shorter); candidates: [B] lists of
    (length, log-likelihood, middle ids) of every candidate tried; steps: [B] the chosen candidate's
    denoiser passes."""

    middles: list
    lengths: np.ndarray
    candidates: list
    steps: np.ndarray


def continuation_logprob(engine, prompt: Sequence[int], continuation: Sequence[int]) -> float:
    """log p(continuation | prompt) under the model's causal pass (the encoder, trained with the AR
    co-loss): the sum of next-token log-probabilities of the continuation's tokens."""
    ids = list(prompt) + list(continuation)
    # padded to a bucket of its own length (a few compiled shapes; the result never depends on other calls)
    width = min(bucket_length(len(ids)), engine.config.max_position_embeddings) if engine.bucket else len(ids)
    row = np.full((1, max(width, len(ids))), engine.config.pad_id, np.int32)
    row[0, :len(ids)] = ids
    logits, _ = api.prefill(engine.params, engine.config, row, np.asarray([len(ids)], np.int32), logits="all",
                            runtime=engine.runtime)
    logp = jax.nn.log_softmax(np.asarray(logits[0, len(prompt) - 1:len(ids) - 1], np.float32), axis=-1)
    return float(np.take_along_axis(np.asarray(logp), np.asarray(continuation)[:, None], axis=-1).sum())


def infill(engine, prompt_tokens, lengths, suffixes: Sequence[Sequence[int]], *, rng: Any = 0,
           max_new_tokens: int | None = None, max_candidates: int = DEFAULT_MAX_CANDIDATES,
           middle_lengths: Sequence[int] | None = None, nonfinite: str = "warn") -> InfillOutput:
    """Write the middle between each prompt and its suffix (`Engine.infill`).

    Args:
      prompt_tokens: [B, P] right-padded prompts (the prefixes); lengths: [B] (default P).
      suffixes: B lists of suffix token ids (no BOS; at least one token each).
      rng: as `Engine.generate` (a prompt's key comes from its own seed).
      max_new_tokens: the middle's most tokens (default: one canvas, L).
      max_candidates: how many middle lengths are tried at most (`candidate_lengths`).
      middle_lengths: the lengths to try instead (each in [0, max_new_tokens]).
    Returns:
      an `InfillOutput`.
    Raises:
      ValueError naming the problem (no suffix, a suffix id out of range, a bad length).
    """
    tokens = np.asarray(prompt_tokens)
    if tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [B, P]; got shape {tokens.shape}")
    b = tokens.shape[0]
    lengths = np.full((b,), tokens.shape[1], np.int32) if lengths is None else np.asarray(lengths)
    if len(suffixes) != b:
        raise ValueError(f"infill takes one suffix per prompt: {len(suffixes)} suffixes for {b} prompts")
    for i, s in enumerate(suffixes):
        if len(s) == 0:
            raise ValueError(f"suffix {i} is empty: infill needs a suffix of at least one token "
                             "(without one, call generate)")
        if min(s) < 0 or max(s) >= engine.config.vocab_size:
            raise ValueError(f"suffix {i} has token ids outside [0, {engine.config.vocab_size})")
    budget = engine.sampler.canvas_length if max_new_tokens is None else max_new_tokens
    if not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0; got {budget!r}")
    if middle_lengths is None:
        ks = candidate_lengths(int(budget), max_candidates)
    else:
        ks = sorted({int(k) for k in middle_lengths})
        if not ks or ks[0] < 0 or ks[-1] > budget:
            raise ValueError(f"middle_lengths must be non-empty, each in [0, {budget}]; got {list(middle_lengths)}")
    keys = row_keys(rng, b)
    l, eos = engine.sampler.canvas_length, engine.sampler.eos_ids
    if not eos:
        raise ValueError("infill needs an EOS id in the sampler (the suffix is followed by EOS on the canvas)")
    stop = tuple(eos) + (engine.sampler.pad_id,)
    middles, chosen, tried, steps = [], np.zeros((b,), np.int32), [], np.zeros((b,), np.int32)
    for i in range(b):
        prompt = tokens[i, :int(lengths[i])]
        rows = []
        for k in ks:
            seed, pinned = layout(k, suffixes[i], l, eos[0])
            out = engine.generate(prompt[None], np.asarray([len(prompt)], np.int32), rng=keys[i:i + 1],
                                  max_new_tokens=len(seed), seed_canvas=seed[None], pinned=pinned[None],
                                  nonfinite=nonfinite)
            mid = middle_of(np.asarray(out.tokens[0]), k, stop)
            score = continuation_logprob(engine, prompt, mid + list(suffixes[i]) + [eos[0]])
            rows.append((k, score, mid, int(np.asarray(out.steps[0]).sum())))
        best = max(rows, key=lambda r: r[1])   # the first (shortest) of equal scores
        middles.append(best[2])
        chosen[i], steps[i] = best[0], best[3]
        tried.append([(k, s, m) for k, s, m, _ in rows])
    return InfillOutput(middles, chosen, tried, steps)
