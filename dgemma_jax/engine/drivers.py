"""The streaming drivers: Python loops over the engine's jitted canvas programs, yielding as they go.

`iter_canvases` runs the jitted `canvas_step` (`sampling.generate`) once per canvas and yields each
finished canvas (a `CanvasEvent`); `iter_steps` runs the jitted `canvas_start`, `denoise_step` and
`canvas_end` itself and yields every denoising step (a `StepEvent`) as well. Both read the device's
results to the host (numpy events) between programs, so they are host code, not traceable; the
canvas functions they call are `sampling.generate`'s, the ones `generate_fused` and the server's slots
run. `collect` assembles the canvas events into `generate`'s tokens. `Engine.stream` / `Engine.steps`
call these (`engine.rows` splits and merges them for batch-invariant rows).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax.numpy as jnp
import numpy as np

from dgemma_jax.model.cache import KVCache
from dgemma_jax.sampling.generate import num_canvases


@dataclasses.dataclass
class CanvasEvent:
    """One finished canvas from `iter_canvases` (host numpy arrays)."""

    index: int
    tokens: np.ndarray       # [B, L] EOS-truncated (the last canvas: only the tokens still owed)
    steps: np.ndarray        # [B]
    finished: np.ndarray     # [B]
    nonfinite: np.ndarray | None = None  # [B] the row met non-finite logits in this canvas


@dataclasses.dataclass
class StepEvent:
    """One denoising step from `iter_steps`."""

    canvas_index: int
    step: int
    argmax: np.ndarray       # [B, L] current argmax canvas
    canvas: np.ndarray       # [B, L] next input canvas (accepted samples + fresh noise)
    done: np.ndarray         # [B]


def _iterate(programs, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
             pinned, per_step: bool, images=None) -> Iterator:
    """The streaming driver. programs: the engine's jits (`engine.Programs`: config, sampler and
    runtime bound; called with keywords)."""
    sampler = programs.sampler
    l = sampler.canvas_length
    n_canvas = num_canvases(max_new_tokens, l)
    cache = programs.prefill(params, tokens=prompt_tokens, lengths=prompt_lengths, cache=cache, images=images)
    finished = jnp.zeros((prompt_tokens.shape[0],), bool)
    for c in range(n_canvas):
        index, last = jnp.int32(c), jnp.bool_(c + 1 >= n_canvas)
        if per_step:
            canvas = programs.canvas_start(keys=keys, index=index, finished=finished, seed_canvas=seed_canvas,
                                           pinned=pinned)
            state, running = canvas.state, True
            while running:
                state = programs.denoise_step(params, cache=cache, context_end=cache.lengths, keys=canvas.keys,
                                              state=state, seed=canvas.seed, pinned=canvas.pinned)
                step, done = int(state.step), np.asarray(state.done)
                yield StepEvent(c, step, np.asarray(state.argmax), np.asarray(state.canvas), done)
                running = step < sampler.max_denoising_steps and not done.all()
            toks, finished_after, cache = programs.canvas_end(params, cache=cache, argmax=state.argmax,
                                                              finished=finished, last=last)
            steps, bad = state.steps, state.nonfinite
        else:
            cache, toks, steps, finished_after, bad = programs.canvas_step(
                params, cache=cache, keys=keys, index=index, last=last, finished=finished, seed_canvas=seed_canvas,
                pinned=pinned)
        # the last canvas's event carries only the tokens still owed (max_new_tokens in all, as generate)
        owed = max_new_tokens - c * l
        yield CanvasEvent(c, np.asarray(toks)[:, :owed], np.asarray(steps), np.asarray(finished_after),
                          np.asarray(bad))
        finished = finished_after
        if bool(jnp.all(finished)):
            break
    yield cache


def iter_canvases(programs, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens,
                  seed_canvas=None, pinned=None, images=None) -> Iterator[CanvasEvent]:
    """Yield each finished canvas as soon as it is committed (streaming driver)."""
    for ev in _iterate(programs, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
                       pinned, per_step=False, images=images):
        if isinstance(ev, CanvasEvent):
            yield ev


def iter_steps(programs, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens,
               seed_canvas=None, pinned=None, images=None,
               final_cache: bool = False) -> Iterator[StepEvent | CanvasEvent | KVCache]:
    """Yield every denoising step (a `StepEvent`) and every finished canvas (a `CanvasEvent`);
    final_cache: then the `KVCache` holding everything committed (`generate_fused`'s `cache`)."""
    for ev in _iterate(programs, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
                       pinned, per_step=True, images=images):
        if final_cache or not isinstance(ev, KVCache):
            yield ev


def collect(events, batch: int, max_new_tokens: int, canvas_length: int, pad_id: int):
    """Assemble `CanvasEvent`s into (tokens [B, max_new_tokens], steps [B, C], finished [B])."""
    n = num_canvases(max_new_tokens, canvas_length)
    out = np.full((batch, n * canvas_length), pad_id, np.int32)
    steps = np.zeros((batch, n), np.int32)
    finished = np.zeros((batch,), bool)
    for ev in events:
        if isinstance(ev, CanvasEvent):
            out[:, ev.index * canvas_length:ev.index * canvas_length + ev.tokens.shape[1]] = ev.tokens
            steps[:, ev.index] = ev.steps
            finished = ev.finished
    return out[:, :max_new_tokens], steps, finished
