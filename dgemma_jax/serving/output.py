"""Output processing: what a client sees of a choice's tokens (detokenized text, stop strings, the
canvas previews), apart from the scheduling that produced them."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from dgemma_jax.serving import text as text_lib


@dataclasses.dataclass
class SeqEvent:
    """What one choice produced in one tick (all text as decoded so far, cut at a stop string)."""

    index: int                      # choice index within its request
    text: str                       # the whole committed output text so far (stop strings cut)
    token_count: int                # non-pad tokens generated so far
    steps: int                      # denoiser passes so far (finished canvases)
    canvases: int                   # canvases run so far
    finish_reason: str | None       # None while running; "stop", "length" or "cancelled" at the end
    token_ids: tuple = ()           # the generated ids so far (EOS included, pad after it dropped)
    admitted_tick: int = -1         # the tick before which this choice got its slot
    tick: int = -1                  # the tick that produced this event
    cached_tokens: int = 0          # prompt tokens its slot already held (prefix reuse): not prefilled
    provisional: str | None = None  # a preview event: the current canvas's text as it stands (not committed)


class OutputProcessor:
    """Turns a choice's generated ids into its `SeqEvent`s: decoded text (special tokens kept when the
    request asks), cut at the first of its stop strings (which finishes it), and with a preview the
    text the current canvas would add (up to its first EOS)."""

    def __init__(self, tokenizer: Any, pad_id: int, eos_ids):
        self.tokenizer, self.pad_id, self.eos_ids = tokenizer, int(pad_id), tuple(eos_ids)

    def event(self, choice, reason: str | None, tick: int, preview=None, preview_steps: int = 0) -> SeqEvent:
        """The choice's event now: `reason` its finish reason so far ("stop" when a stop string shows
        up, unless it was cancelled); preview: the slot's current canvas ids, or None."""
        request = choice.request
        ids = tuple(t for t in choice.tokens if t != self.pad_id)
        decode = functools.partial(self.tokenizer.decode_generated, skip_special=not request.keep_special)
        text, hit = text_lib.cut_at_stop(decode(ids), request.stop)
        if hit and reason != "cancelled":
            reason = "stop"
        provisional = None
        if preview is not None and not hit:
            canvas = text_lib.truncate_at(preview, self.eos_ids)
            full = decode(ids + tuple(int(t) for t in canvas if t != self.pad_id))
            # a preview ends where a stop string would end the answer (it may begin in the committed text)
            provisional = text_lib.delta(text, text_lib.cut_at_stop(full, request.stop)[0])
        return SeqEvent(choice.index, text, len(ids), choice.steps + preview_steps, choice.canvas, reason, ids,
                        choice.admitted_tick, tick, choice.cached, provisional)
