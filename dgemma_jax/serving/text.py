"""Output text for the server: decoding, stop strings, thinking split, streaming deltas."""

from __future__ import annotations

from typing import Sequence

from dgemma_jax.io.chat import strip_thinking

__all__ = ["cut_at_stop", "stream_safe", "split_reasoning", "delta", "truncate_at"]


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` up to (not including) the earliest stop string, and whether one occurred."""
    cut = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


def stream_safe(text: str, stops: Sequence[str]) -> str:
    """The part of a still-growing `text` that can be sent: it holds back a tail that may be the
    start of a stop string (so a stop string split across canvases is never streamed)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[:len(text) - hold]


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """(reasoning_content, content) of a chat output; reasoning is None when thinking is off and
    the model wrote no thought channel."""
    thought, answer = strip_thinking(text)
    return (thought if (thinking or thought) else None), answer


def delta(sent: str, now: str) -> str:
    """What to send after `sent` to reach `now`; "" when `now` does not extend it (a trimmed or
    re-split field is finalised by the last event, not streamed backwards)."""
    return now[len(sent):] if now.startswith(sent) else ""


def truncate_at(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """`tokens` up to and including the first EOS id (all of them when there is none)."""
    out = []
    for t in tokens:
        out.append(int(t))
        if int(t) in eos_ids:
            break
    return out
