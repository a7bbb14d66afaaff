"""Multi-canvas generation: prefill, then per canvas denoise -> truncate at EOS -> commit.

Two drivers give identical tokens for the same keys:
* `generate_fused`: the whole generation is one traceable program (outer `lax.while_loop` over
  canvases around the inner denoising loop); jit it once.
* `iter_canvases`: a Python loop over canvases that yields each finished canvas (streaming),
  built from the same jitted pieces; `iter_steps` additionally yields every denoising step.

Canvas c of a row uses the key `fold_in(row_key, c)`. A row that emitted an EOS is finished: its
later canvases are all pad and are neither denoised nor committed. The output has exactly
`max_new_tokens` positions.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.cache import KVCache
from dgemma_jax.model.api import encode_pass
from dgemma_jax.sampling import ops
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import denoise_canvas, denoise_step, init_state, initial_canvas, loop_running


@struct.dataclass
class GenerateOutput:
    """tokens: [B, max_new_tokens] (EOS-truncated, pad after); steps: [B, C] denoiser passes per
    canvas (0 for canvases a finished row skipped); finished: [B] row emitted an EOS;
    num_canvases: [] canvases actually run; cache: the final KV cache."""

    tokens: jax.Array
    steps: jax.Array
    finished: jax.Array
    num_canvases: jax.Array
    cache: KVCache

    def tokens_per_forward(self, pad_id: int = 0) -> np.ndarray:
        """Non-pad generated tokens / denoiser passes while unfinished, per row (HF's metric)."""
        return ops.tokens_per_forward(np.asarray(self.tokens), np.asarray(self.steps).sum(-1), pad_id)


def num_canvases(max_new_tokens: int, canvas_length: int) -> int:
    return max(1, math.ceil(max_new_tokens / canvas_length))


def canvas_keys(keys: jax.Array, index) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, index))(keys)


def commit(params, config: ModelConfig, cache: KVCache, tokens: jax.Array, active: jax.Array) -> KVCache:
    """Causal pass writing `tokens` [B, L] into the cache for the `active` rows (others write nothing)."""
    n = jnp.where(active, tokens.shape[1], 0).astype(jnp.int32)
    return encode_pass(params, config, tokens, cache.lengths, n, cache)[1]


def prefill_prompt(params, config: ModelConfig, tokens, lengths, cache: KVCache) -> KVCache:
    return encode_pass(params, config, tokens, cache.lengths, lengths, cache)[1]


def finish_canvas(sampler: SamplerConfig, argmax: jax.Array, finished: jax.Array):
    """EOS truncation: (tokens [B, L], finished_after [B])."""
    toks, has_eos = ops.truncate_at_eos(argmax, sampler.eos_ids, sampler.pad_id, finished=finished)
    return toks, finished | has_eos


def _seed(sampler, keys, seed_canvas, pinned, config):
    if seed_canvas is None:
        return initial_canvas(keys, sampler.canvas_length, config.vocab_size), None
    return seed_canvas.astype(jnp.int32), pinned


def generate_fused(params, config: ModelConfig, sampler: SamplerConfig, prompt_tokens, prompt_lengths,
                   cache: KVCache, keys: jax.Array, max_new_tokens: int, seed_canvas=None,
                   pinned=None) -> GenerateOutput:
    """The whole generation as one program (trace under jit; config/sampler/max_new_tokens static).

    keys: [B] per-row keys. seed_canvas/pinned: optional start canvas and held positions for the
    first canvas (infilling / edits).
    """
    b = prompt_tokens.shape[0]
    l = sampler.canvas_length
    n_canvas = num_canvases(max_new_tokens, l)
    cache = prefill_prompt(params, config, prompt_tokens, prompt_lengths, cache)
    out = jnp.full((b, n_canvas * l), sampler.pad_id, jnp.int32)
    steps = jnp.zeros((b, n_canvas), jnp.int32)
    finished = jnp.zeros((b,), bool)

    def body(carry):
        c, cache, out, steps, finished = carry
        k = canvas_keys(keys, c)
        if seed_canvas is None:
            start, pin = initial_canvas(k, l, config.vocab_size), None
        else:
            rnd = initial_canvas(k, l, config.vocab_size)
            start = jnp.where(c == 0, seed_canvas.astype(jnp.int32), rnd)
            pin = None if pinned is None else pinned & (c == 0)
        state = denoise_canvas(params, config, sampler, cache, k, canvas=start, pinned=pin, done=finished)
        toks, finished_after = finish_canvas(sampler, state.argmax, finished)
        out = jax.lax.dynamic_update_slice_in_dim(out, toks, c * l, axis=1)
        steps = jax.lax.dynamic_update_slice_in_dim(steps, state.steps[:, None], c, axis=1)
        last = c + 1 >= n_canvas
        active = ~finished_after & ~last
        cache = jax.lax.cond(jnp.any(active), lambda cc: commit(params, config, cc, toks, active),
                             lambda cc: cc, cache)
        return c + 1, cache, out, steps, finished_after

    def cond(carry):
        c, _, _, _, finished = carry
        return (c < n_canvas) & ~jnp.all(finished)

    c, cache, out, steps, finished = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), cache, out, steps, finished))
    return GenerateOutput(out[:, :max_new_tokens], steps, finished, c, cache)


@dataclasses.dataclass
class CanvasEvent:
    """One finished canvas from `iter_canvases` (host numpy arrays)."""

    index: int
    tokens: np.ndarray       # [B, L] EOS-truncated (the last canvas: only the tokens still owed)
    steps: np.ndarray        # [B]
    finished: np.ndarray     # [B]


@dataclasses.dataclass
class StepEvent:
    """One denoising step from `iter_steps`."""

    canvas_index: int
    step: int
    argmax: np.ndarray       # [B, L] current argmax canvas
    canvas: np.ndarray       # [B, L] next input canvas (accepted samples + fresh noise)
    done: np.ndarray         # [B]


class Pieces:
    """The separately jitted programs used by the Python drivers.

    They are module-level jits with the configs as static arguments, so every `Pieces` (and every
    `Engine`) with equal configs shares one compilation per input shape.
    """

    def __init__(self, config: ModelConfig, sampler: SamplerConfig, donate: bool = True, shardings=None):
        self.config, self.sampler = config, sampler
        if shardings is None:
            pre, com = (_prefill_donated, _commit_donated) if donate else (_prefill_jit, _commit_jit)
            jits = dict(prefill=pre, commit=com, canvas=_canvas_jit, step=_step_jit, start=_start_jit,
                        finish=_finish_jit)
        else:  # private jits, traced inside the mesh's sharding context
            dn = ("cache",) if donate else ()
            jits = dict(
                prefill=_in_context(shardings, jax.jit(prefill_prompt, static_argnames=("config",),
                                                       donate_argnames=dn)),
                commit=_in_context(shardings, jax.jit(commit, static_argnames=("config",), donate_argnames=dn)),
                canvas=_in_context(shardings, jax.jit(_canvas_driver, static_argnames=("config", "sampler"))),
                step=_in_context(shardings, jax.jit(_step_driver, static_argnames=("config", "sampler"))),
                start=_in_context(shardings, jax.jit(_start_state, static_argnames=("config", "sampler"))),
                finish=_in_context(shardings, jax.jit(finish_canvas, static_argnums=(0,))),
            )
        self.prefill = functools.partial(jits["prefill"], config=config)
        self.commit = functools.partial(jits["commit"], config=config)
        self.canvas = functools.partial(jits["canvas"], config=config, sampler=sampler)
        self.step = functools.partial(jits["step"], config=config, sampler=sampler)
        self.start = functools.partial(jits["start"], config=config, sampler=sampler)
        self.finish = functools.partial(jits["finish"], sampler)


def _in_context(shardings, fn):
    def run(*args, **kwargs):
        with shardings.context():
            return fn(*args, **kwargs)

    return run


def _canvas_driver(params, cache, keys, start, pinned, done, *, config, sampler):
    return denoise_canvas(params, config, sampler, cache, keys, canvas=start, pinned=pinned, done=done)


def _step_driver(params, cache, keys, state, seed, pinned, *, config, sampler):
    new = denoise_step(params, config, sampler, cache, cache.lengths, keys, state, seed=seed, pinned=pinned)
    return new, loop_running(new, sampler)


def _start_state(keys, seed_canvas, done, *, config, sampler):
    canvas = initial_canvas(keys, sampler.canvas_length, config.vocab_size) if seed_canvas is None else seed_canvas
    return init_state(config, sampler, canvas, done)


_prefill_jit = jax.jit(prefill_prompt, static_argnames=("config",))
_prefill_donated = jax.jit(prefill_prompt, static_argnames=("config",), donate_argnames=("cache",))
_commit_jit = jax.jit(commit, static_argnames=("config",))
_commit_donated = jax.jit(commit, static_argnames=("config",), donate_argnames=("cache",))
_canvas_jit = jax.jit(_canvas_driver, static_argnames=("config", "sampler"))
_step_jit = jax.jit(_step_driver, static_argnames=("config", "sampler"))
_start_jit = jax.jit(_start_state, static_argnames=("config", "sampler"))
_finish_jit = jax.jit(finish_canvas, static_argnums=(0,))
fused_jit = jax.jit(generate_fused, static_argnames=("config", "sampler", "max_new_tokens"),
                    donate_argnames=("cache",))


def _iterate(pieces: Pieces, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
             pinned, per_step: bool) -> Iterator:
    sampler, config = pieces.sampler, pieces.config
    n_canvas = num_canvases(max_new_tokens, sampler.canvas_length)
    cache = pieces.prefill(params, tokens=prompt_tokens, lengths=prompt_lengths, cache=cache)
    finished = jnp.zeros((prompt_tokens.shape[0],), bool)
    for c in range(n_canvas):
        k = canvas_keys(keys, c)
        seed = seed_canvas.astype(jnp.int32) if (c == 0 and seed_canvas is not None) else None
        pin = pinned if (c == 0 and seed is not None) else None
        if per_step:
            state = pieces.start(k, seed, finished)
            start = state.canvas
            running = True
            while running:
                state, running = pieces.step(params, cache, k, state, start if pin is not None else None, pin)
                yield StepEvent(c, int(state.step), np.asarray(state.argmax), np.asarray(state.canvas),
                                np.asarray(state.done))
        else:
            start = initial_canvas(k, sampler.canvas_length, config.vocab_size) if seed is None else seed
            state = pieces.canvas(params, cache, k, start, pin, finished)
        toks, finished_after = pieces.finish(state.argmax, finished)
        last = c + 1 >= n_canvas
        active = ~finished_after & (not last)
        # the last canvas's event carries only the tokens still owed (max_new_tokens in all, as generate)
        owed = max_new_tokens - c * sampler.canvas_length
        yield CanvasEvent(c, np.asarray(toks)[:, :owed], np.asarray(state.steps), np.asarray(finished_after))
        finished = finished_after
        if bool(jnp.all(finished)) or last:
            break
        cache = pieces.commit(params, cache=cache, tokens=toks, active=active)
    yield cache


def iter_canvases(pieces: Pieces, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens,
                  seed_canvas=None, pinned=None) -> Iterator[CanvasEvent]:
    """Yield each finished canvas as soon as it is committed (streaming driver)."""
    for ev in _iterate(pieces, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
                       pinned, per_step=False):
        if isinstance(ev, CanvasEvent):
            yield ev


def iter_steps(pieces: Pieces, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens,
               seed_canvas=None, pinned=None) -> Iterator[StepEvent | CanvasEvent]:
    """Yield every denoising step (a `StepEvent`) and every finished canvas (a `CanvasEvent`)."""
    for ev in _iterate(pieces, params, prompt_tokens, prompt_lengths, cache, keys, max_new_tokens, seed_canvas,
                       pinned, per_step=True):
        if not isinstance(ev, KVCache):
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
