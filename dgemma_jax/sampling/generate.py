"""Multi-canvas generation: prefill, then per canvas denoise -> truncate at EOS -> commit.

One `canvas_step` (start from noise or a seed, denoise to completion, truncate at EOS, commit) and
two drivers around it that give identical tokens for the same keys:
* `generate_fused`: the whole generation is one traceable program (an outer `lax.while_loop` over
  canvases, each a `canvas_step`).
* `iter_canvases`: a Python loop that runs the jitted `canvas_step` once per canvas and yields each
  finished canvas (streaming); `iter_steps` runs the same canvas step by step (`canvas_start`,
  `denoise_step`, `canvas_end`) and yields every denoising step.
Everything here is pure and traceable; the engine (`dgemma_jax.engine`) owns the jits.

Canvas c of a row uses the key `fold_in(row_key, c)`. A row that emitted an EOS is finished: its
later canvases are all pad and are neither denoised nor committed. The output has exactly
`max_new_tokens` positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import encode_pass, image_features_pass
from dgemma_jax.model.cache import KVCache, concat_rows
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import ops
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import denoise_canvas, denoise_step, init_state, initial_canvas, loop_running


@struct.dataclass
class GenerateOutput:
    """tokens: [B, max_new_tokens] (EOS-truncated, pad after); steps: [B, C] denoiser passes per
    canvas (0 for canvases a finished row skipped); finished: [B] row emitted an EOS;
    num_canvases: [] canvases actually run; cache: the final KV cache; nonfinite: [B] the row met
    non-finite logits (NaN/Inf weights or activations: its tokens are not the model's answer)."""

    tokens: jax.Array
    steps: jax.Array
    finished: jax.Array
    num_canvases: jax.Array
    cache: KVCache
    nonfinite: jax.Array

    def tokens_per_forward(self, pad_id: int = 0) -> np.ndarray:
        """Non-pad generated tokens / denoiser passes while unfinished, per row (HF's metric)."""
        return ops.tokens_per_forward(np.asarray(self.tokens), np.asarray(self.steps).sum(-1), pad_id)


def num_canvases(max_new_tokens: int, canvas_length: int) -> int:
    return max(1, math.ceil(max_new_tokens / canvas_length))


def canvas_keys(keys: jax.Array, index) -> jax.Array:
    return jax.vmap(lambda k: jax.random.fold_in(k, index))(keys)


def commit(params, config: ModelConfig, cache: KVCache, tokens: jax.Array, active: jax.Array,
           runtime: Runtime | None = None) -> KVCache:
    """Causal pass writing `tokens` [B, L] into the cache for the `active` rows (others write nothing)."""
    n = jnp.where(active, tokens.shape[1], 0).astype(jnp.int32)
    return encode_pass(params, config, tokens, cache.lengths, n, cache, runtime=runtime)[1]


def prefill_prompt(params, config: ModelConfig, tokens, lengths, cache: KVCache,
                   runtime: Runtime | None = None, images=None) -> KVCache:
    """The causal pass over the prompt. images: None, or (pixel_values [N, P, 3 p^2], position_ids
    [N, P, 2]) of the prompt's N images, in the row-major order of their runs of image tokens
    (`config.image_token_id`) in `tokens`: the vision tower's soft tokens replace those tokens'
    embeddings, and each image attends to itself bidirectionally."""
    if images is None:
        return encode_pass(params, config, tokens, cache.lengths, lengths, cache, runtime=runtime)[1]
    features, _ = image_features_pass(params, config, images[0], images[1], runtime=runtime)
    within = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return encode_pass(params, config, tokens, cache.lengths, lengths, cache, runtime=runtime,
                       image_features=features, image_tokens=(tokens == config.image_token_id) & within)[1]


def finish_canvas(sampler: SamplerConfig, argmax: jax.Array, finished: jax.Array):
    """EOS truncation: (tokens [B, L], finished_after [B])."""
    toks, has_eos = ops.truncate_at_eos(argmax, sampler.eos_ids, sampler.pad_id, finished=finished)
    return toks, finished | has_eos


def canvas_start(config: ModelConfig, sampler: SamplerConfig, keys: jax.Array, index, seed_canvas=None,
                 pinned=None):
    """Canvas `index`'s start: (canvas [B, L], pinned [B, L] or None).

    Uniform noise from the canvas keys; with a `seed_canvas`, the first canvas starts from it and holds
    its `pinned` positions (later canvases hold none). `index` may be traced."""
    noise = initial_canvas(keys, sampler.canvas_length, config.vocab_size)
    if seed_canvas is None:
        return noise, None
    first = jnp.asarray(index) == 0
    start = jnp.where(first, seed_canvas.astype(jnp.int32), noise)
    return start, None if pinned is None else pinned & first


def canvas_end(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, argmax: jax.Array,
               finished: jax.Array, last, runtime: Runtime | None = None):
    """Finish a denoised canvas: EOS truncation, then the commit of the rows that go on.

    Returns (tokens [B, L], finished_after [B], cache). A row that emitted an EOS, and every row after
    the `last` canvas, commits nothing; the causal pass is skipped when no row goes on."""
    toks, finished_after = finish_canvas(sampler, argmax, finished)
    active = ~finished_after & ~jnp.asarray(last)
    cache = jax.lax.cond(jnp.any(active), lambda cc: commit(params, config, cc, toks, active, runtime),
                         lambda cc: cc, cache)
    return toks, finished_after, cache


def canvas_step(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, keys: jax.Array, index,
                last, finished: jax.Array, seed_canvas=None, pinned=None, runtime: Runtime | None = None):
    """One canvas of a generation: start (noise or seed/pins), denoise to completion, finish, commit.

    keys: [B] per-row keys (canvas c uses `fold_in(key, c)`); index / last: the canvas index and
    whether it is the final one (either may be traced); finished: [B] rows already done (frozen).
    Returns (cache, tokens [B, L], steps [B], finished_after [B], nonfinite [B])."""
    k = canvas_keys(keys, index)
    start, pin = canvas_start(config, sampler, k, index, seed_canvas, pinned)
    state = denoise_canvas(params, config, sampler, cache, k, canvas=start, pinned=pin, done=finished,
                           runtime=runtime)
    toks, finished_after, cache = canvas_end(params, config, sampler, cache, state.argmax, finished, last, runtime)
    return cache, toks, state.steps, finished_after, state.nonfinite


def generate_fused(params, config: ModelConfig, sampler: SamplerConfig, prompt_tokens, prompt_lengths,
                   cache: KVCache, keys: jax.Array, max_new_tokens: int, seed_canvas=None,
                   pinned=None, runtime: Runtime | None = None, images=None) -> GenerateOutput:
    """The whole generation as one program (trace under jit; config/sampler/max_new_tokens/runtime static).

    keys: [B] per-row keys. seed_canvas/pinned: optional start canvas and held positions for the
    first canvas (infilling / edits). images: the prompt's images (`prefill_prompt`).
    """
    b = prompt_tokens.shape[0]
    l = sampler.canvas_length
    n_canvas = num_canvases(max_new_tokens, l)
    cache = prefill_prompt(params, config, prompt_tokens, prompt_lengths, cache, runtime, images)
    out = jnp.full((b, n_canvas * l), sampler.pad_id, jnp.int32)
    steps = jnp.zeros((b, n_canvas), jnp.int32)
    finished = jnp.zeros((b,), bool)

    def body(carry):
        c, cache, out, steps, finished, bad = carry
        cache, toks, n_steps, finished, bad_c = canvas_step(params, config, sampler, cache, keys, c,
                                                            c + 1 >= n_canvas, finished, seed_canvas, pinned, runtime)
        out = jax.lax.dynamic_update_slice_in_dim(out, toks, c * l, axis=1)
        steps = jax.lax.dynamic_update_slice_in_dim(steps, n_steps[:, None], c, axis=1)
        return c + 1, cache, out, steps, finished, bad | bad_c

    def cond(carry):
        c, _, _, _, finished, _ = carry
        return (c < n_canvas) & ~jnp.all(finished)

    c, cache, out, steps, finished, bad = jax.lax.while_loop(
        cond, body, (jnp.zeros((), jnp.int32), cache, out, steps, finished, jnp.zeros((b,), bool)))
    return GenerateOutput(out[:, :max_new_tokens], steps, finished, c, cache, bad)


def start_state(config: ModelConfig, sampler: SamplerConfig, keys: jax.Array, index, finished: jax.Array,
                seed_canvas=None, pinned=None):
    """The step-by-step driver's start of canvas `index`: (LoopState, the canvas's row keys, start
    canvas, pinned or None); the keys go to every `step_state` of the canvas."""
    k = canvas_keys(keys, index)
    start, pin = canvas_start(config, sampler, k, index, seed_canvas, pinned)
    return init_state(config, sampler, start, finished), k, start, pin


def step_state(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, canvas_keys_: jax.Array,
               state, seed=None, pinned=None, runtime: Runtime | None = None):
    """One denoising step for the step-by-step driver (canvas_keys_: from `start_state`): (new state,
    still running)."""
    new = denoise_step(params, config, sampler, cache, cache.lengths, canvas_keys_, state, seed=seed, pinned=pinned,
                       runtime=runtime)
    return new, loop_running(new, sampler)


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
    """The streaming driver. programs: the engine's jits of prefill_prompt, canvas_step, start_state,
    step_state and canvas_end (config and sampler bound), as attributes of those names."""
    l = programs.sampler.canvas_length
    n_canvas = num_canvases(max_new_tokens, l)
    cache = programs.prefill_prompt(params, tokens=prompt_tokens, lengths=prompt_lengths, cache=cache,
                                    images=images)
    finished = jnp.zeros((prompt_tokens.shape[0],), bool)
    for c in range(n_canvas):
        index, last = jnp.int32(c), jnp.bool_(c + 1 >= n_canvas)
        if per_step:
            state, k, start, pin = programs.start_state(keys, index, finished, seed_canvas, pinned)
            running = True
            while running:
                state, running = programs.step_state(params, cache, k, state, None if pin is None else start, pin)
                yield StepEvent(c, int(state.step), np.asarray(state.argmax), np.asarray(state.canvas),
                                np.asarray(state.done))
            toks, finished_after, cache = programs.canvas_end(params, cache, state.argmax, finished, last)
            steps, bad = state.steps, state.nonfinite
        else:
            cache, toks, steps, finished_after, bad = programs.canvas_step(params, cache, keys, index, last,
                                                                           finished, seed_canvas, pinned)
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


def merge_row_events(rows, max_new_tokens: int, canvas_length: int, pad_id: int,
                     final_cache: bool = False) -> Iterator:
    """The events of B single-row drivers (`iter_canvases` or `iter_steps` over batch-1 inputs) as one
    batch's, in lockstep. Step event s of canvas c shows every row: a row still denoising its step s,
    a row whose canvas already ended its last state (done), a row finished in an earlier canvas pad
    (done). A canvas event holds every row (a finished row: pad, 0 steps, finished). final_cache
    (the rows' drivers end with their caches, `iter_steps(final_cache=True)`): then the rows'
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
    if final_cache:  # every row's driver has yielded its last canvas: its cache comes next
        caches = [next(r) for r in rows]
        yield caches[0] if b == 1 else concat_rows(caches)
