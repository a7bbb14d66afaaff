"""A batch as blocks of rows and back: the host side of the engine's batch invariance.

`Engine(batch_invariant=True)` runs a batch as one program per group of rows (those starting new caches,
those continuing a cache of one length, a row with images alone) or, with an int N, per block of N rows
(`Engine._blocks`): `merge_outputs` / `take_rows` put the fused program's outputs back into the call's
batch and order; `split_rows` gives each row of a block its own view of the block's streaming driver
(`row_of`), and `merge_row_events` runs the rows' drivers (`engine.drivers`) in lockstep as one
batch's events.
Host code (Python loops, numpy), not traceable.
"""

from __future__ import annotations

import collections
from typing import Iterator

import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine.drivers import CanvasEvent, StepEvent
from dgemma_jax.model.cache import KVCache, cache_row, concat_rows
from dgemma_jax.model.cache import take_rows as cache_take_rows
from dgemma_jax.sampling.generate import GenerateOutput, num_canvases


def merge_outputs(outs) -> GenerateOutput:
    """The outputs of single-row generations as one batch's (caches padded to the longest, `concat_rows`)."""
    outs = list(outs)
    if len(outs) == 1:
        return outs[0]
    return GenerateOutput(tokens=jnp.concatenate([o.tokens for o in outs]),
                          steps=jnp.concatenate([o.steps for o in outs]),
                          finished=jnp.concatenate([o.finished for o in outs]),
                          num_canvases=jnp.max(jnp.stack([o.num_canvases for o in outs])),
                          cache=concat_rows([o.cache for o in outs]),
                          nonfinite=jnp.concatenate([o.nonfinite for o in outs]))


def take_rows(out: GenerateOutput, rows) -> GenerateOutput:
    """The rows `rows` (indices, in that order) of a batch's output."""
    idx = jnp.asarray(rows, jnp.int32)
    return out.replace(tokens=out.tokens[idx], steps=out.steps[idx], finished=out.finished[idx],
                       cache=cache_take_rows(out.cache, rows), nonfinite=out.nonfinite[idx])


def row_of(item, r: int):
    """Row `r` of a driver's event or cache of a batch (as a batch of one)."""
    one = slice(r, r + 1)
    if isinstance(item, StepEvent):
        return StepEvent(item.canvas_index, item.step, item.argmax[one], item.canvas[one], item.done[one])
    if isinstance(item, CanvasEvent):
        return CanvasEvent(item.index, item.tokens[one], item.steps[one], item.finished[one],
                           None if item.nonfinite is None else item.nonfinite[one])
    return cache_row(item, r)


def split_rows(events: Iterator, n: int) -> list[Iterator]:
    """The driver of a block of n rows as n single-row drivers (what `merge_row_events` takes): each
    yields its row of every event, pulling the block's next event when its own are used up."""
    events, buffers = iter(events), [collections.deque() for _ in range(n)]

    def view(r):
        while True:
            if not buffers[r]:
                item = next(events, None)
                if item is None:
                    return
                for i in range(n):
                    buffers[i].append(row_of(item, i))
            yield buffers[r].popleft()

    return [view(r) for r in range(n)]


def merge_row_events(rows, max_new_tokens: int, canvas_length: int, pad_id: int,
                     final_cache: bool = False) -> Iterator:
    """The events of B single-row drivers (`drivers.iter_canvases` or `drivers.iter_steps` over batch-1
    inputs) as one batch's, in lockstep. Step event s of canvas c shows every row: a row still denoising its step s,
    a row whose canvas already ended its last state (done), a row finished in an earlier canvas pad
    (done). A canvas event holds every row (a finished row: pad, 0 steps, finished). final_cache
    (the rows' drivers end with their caches, `drivers.iter_steps(final_cache=True)`): then the rows'
    caches as one (`concat_rows`, as `merge_outputs`)."""
    rows = list(rows)
    b = len(rows)
    finished = np.zeros((b,), bool)
    pad = np.full((1, canvas_length), pad_id, np.int32)
    for c in range(num_canvases(max_new_tokens, canvas_length)):
        owed = min(canvas_length, max_new_tokens - c * canvas_length)
        live = [i for i in range(b) if not finished[i]]
        last = {i: StepEvent(c, 0, pad, pad, np.ones((1,), bool)) for i in range(b)}
        ends: dict[int, CanvasEvent] = {}
        while len(ends) < len(live):
            stepped = False
            for i in live:
                if i in ends:
                    continue
                ev = next(rows[i])
                if isinstance(ev, CanvasEvent):
                    ends[i] = ev
                else:
                    last[i], stepped = ev, True
            if stepped:
                yield StepEvent(c, max(last[i].step for i in live),
                                np.concatenate([last[i].argmax for i in range(b)]),
                                np.concatenate([last[i].canvas for i in range(b)]),
                                np.concatenate([last[i].done for i in range(b)]))
        tokens = np.concatenate([ends[i].tokens if i in ends else pad[:, :owed] for i in range(b)])
        steps = np.concatenate([ends[i].steps if i in ends else np.zeros((1,), np.int32) for i in range(b)])
        finished = np.concatenate([ends[i].finished if i in ends else np.ones((1,), bool) for i in range(b)])
        bad = np.concatenate([np.asarray(ends[i].nonfinite) if i in ends and ends[i].nonfinite is not None
                              else np.zeros((1,), bool) for i in range(b)])
        yield CanvasEvent(c, tokens, steps, finished, bad)
        if finished.all():
            break
    if final_cache:  # every row's driver has yielded its last canvas: its cache comes next (a row of a
        # block, `split_rows`, may first show the canvases the rest of its block ran on: skipped)
        caches = [next(x for x in r if isinstance(x, KVCache)) for r in rows]
        yield caches[0] if b == 1 else concat_rows(caches)
