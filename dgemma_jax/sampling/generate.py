"""Multi-canvas generation: prefill, then per canvas start -> denoise -> truncate at EOS -> commit.

A canvas has three parts, each written once: `canvas_start` (noise or a seed, as a `loop.Canvas`),
`loop.denoise_step` (one pass; `loop.denoise_canvas` loops it to the end) and `canvas_end` (EOS
truncation and the commit). `canvas_step` is the three in a row. Every driver runs these:
* `generate_fused`: the whole generation is one traceable program (an outer `lax.while_loop` over
  canvases): each a `canvas_step`, or, where the runtime fuses the commit (`Runtime.commit_pass`,
  on an accelerator), a canvas's commit and the next canvas's first step in one pass over the
  layers (`commit_and_first_step`: each layer's weights read once for both).
* the engine's streaming drivers (`engine.drivers`: `iter_canvases`, `iter_steps`): host loops over
  the jitted `canvas_step`, or over `canvas_start`, `denoise_step` and `canvas_end`, yielding each
  canvas or step.
* the server's slots (`sampling.slots`): `canvas_start` per slot, `denoise_step` per tick,
  `finish_canvas` and `commit` for the settled ones.
Everything here is pure and traceable (but `GenerateOutput.tokens_per_forward`, a finished result's
metric, read on the host); the host drivers (Python loops, host reads) and the merging of single-row
outputs are the engine's (`engine.drivers`, `engine.rows`), which owns the jits.

Canvas c of a row uses the key `fold_in(row_key, c)`. A row that emitted an EOS is finished: its
later canvases are all pad and are neither denoised nor committed. The output has exactly
`max_new_tokens` positions.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import encode_pass, image_features_pass
from dgemma_jax.model.cache import KVCache
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import ops
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import Canvas, commit_and_step, denoise_canvas, init_state, initial_canvas


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
    """[B] the row keys of canvas `index` ([] for every row, or [B]: each row's own) from the
    request's row keys [B]: `fold_in(key, index)`."""
    index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), keys.shape[:1])
    return jax.vmap(jax.random.fold_in)(keys, index)


def commit(params, config: ModelConfig, cache: KVCache, tokens: jax.Array, active: jax.Array,
           runtime: Runtime | None = None) -> KVCache:
    """Causal pass writing `tokens` [B, L] into the cache for the `active` rows (others write nothing)."""
    return encode_pass(params, config, tokens, cache.lengths, committed_counts(tokens, active), cache, runtime=runtime)[1]


def committed_counts(tokens: jax.Array, active: jax.Array) -> jax.Array:
    """[B] int32 tokens each row commits: all L of `tokens` [B, L] for the `active` rows, none elsewhere."""
    return jnp.where(active, tokens.shape[1], 0).astype(jnp.int32)


def prefill(params, config: ModelConfig, tokens, lengths, cache: KVCache,
            runtime: Runtime | None = None, images=None, chunk: int | None = None) -> KVCache:
    """The causal pass over the prompts' tokens [B, T] (row b's first lengths[b]), traceable: what
    `model.api.prefill` does after its host checks, and the engine's `prefill` program.

    Args:
      tokens: [B, T] int32; lengths: [B] valid tokens per row, written from `cache.lengths`.
      images: None, or (pixel_values [N, P, 3 p^2], position_ids [N, P, 2]) of the prompt's N
        images, in the row-major order of their runs of image tokens (`config.image_token_id`): the
        vision tower's soft tokens replace those tokens' embeddings, and each image attends to
        itself bidirectionally.
      chunk: None (one pass over all T tokens), or the prompts go in passes of `chunk` tokens
        (`prefill_chunks`; not with images): a row's passes then have the same shapes whatever the
        other rows' prompt lengths (batch invariance, `Engine(batch_invariant=)`).
    Returns:
      the new cache (`lengths` advanced by `lengths`).
    """
    if chunk is not None and images is None:
        return prefill_chunks(params, config, tokens, lengths, cache, chunk, runtime)
    if images is None:
        return encode_pass(params, config, tokens, cache.lengths, lengths, cache, runtime=runtime)[1]
    features, _ = image_features_pass(params, config, images[0], images[1], runtime=runtime)
    within = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    return encode_pass(params, config, tokens, cache.lengths, lengths, cache, runtime=runtime,
                       image_features=features, image_tokens=(tokens == config.image_token_id) & within)[1]


def prefill_chunks(params, config: ModelConfig, tokens, lengths, cache: KVCache, chunk: int,
                   runtime: Runtime | None = None) -> KVCache:
    """`prefill` in causal passes of `chunk` tokens [B, chunk]: pass j writes row b's tokens
    [j * chunk, (j + 1) * chunk) that lie within lengths[b] (a row whose prompt has ended writes
    nothing, and its cache keeps every bit), until the longest prompt is in. A row's passes are the
    same whatever the other rows' prompts and the width T they are padded to."""
    b, t = tokens.shape
    n = -(-t // chunk)
    chunks = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)), constant_values=config.pad_id).reshape(b, n, chunk)
    lengths = lengths.astype(jnp.int32)

    def body(carry):
        j, cache = carry
        part = jax.lax.dynamic_index_in_dim(chunks, j, 1, keepdims=False)
        num = jnp.clip(lengths - j * chunk, 0, chunk).astype(jnp.int32)
        return j + 1, encode_pass(params, config, part, cache.lengths, num, cache, runtime=runtime)[1]

    count = (jnp.max(lengths) + chunk - 1) // chunk
    return jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.zeros((), jnp.int32), cache))[1]


def finish_canvas(sampler: SamplerConfig, argmax: jax.Array, finished: jax.Array):
    """EOS truncation: (tokens [B, L], finished_after [B])."""
    toks, has_eos = ops.truncate_at_eos(argmax, sampler.eos_ids, sampler.pad_id, finished=finished)
    return toks, finished | has_eos


def canvas_start(config: ModelConfig, sampler: SamplerConfig, keys: jax.Array, index, finished: jax.Array | None = None,
                 seed_canvas=None, pinned=None) -> Canvas:
    """The start of canvas `index` for every row, ready for `denoise_step` / `denoise_canvas`.

    Args:
      keys: [B] the requests' row keys (the canvas's keys are `canvas_keys(keys, index)`).
      index: [] the canvas number for every row, or [B] each row's own; may be traced. The step
        counter takes its shape.
      finished: [B] rows that are done (frozen from the start); default none.
      seed_canvas, pinned: [B, n * L] the starts of the first n canvases and the positions held at
        their tokens (infilling: canvas c takes columns [c * L, (c + 1) * L)); later canvases start
        from noise and hold none.
    Returns:
      a `Canvas` of uniform noise from the canvas keys (or the seed), its loop state fresh.
    """
    keys = canvas_keys(keys, index)
    l = sampler.canvas_length
    start = initial_canvas(keys, l, config.vocab_size)
    seed = None
    if seed_canvas is not None:
        b, n = seed_canvas.shape[0], seed_canvas.shape[1] // l
        row_index = jnp.broadcast_to(jnp.asarray(index, jnp.int32), (b,))
        covered = (row_index < n)[:, None]                                   # [B, 1]
        which = jnp.clip(row_index, 0, n - 1)[:, None, None]

        def piece(x):  # [B, n * L] -> [B, L]: each row's canvas `index` of the seed
            return jnp.take_along_axis(x.reshape(b, n, l), which, axis=1)[:, 0]

        start = jnp.where(covered, piece(seed_canvas.astype(jnp.int32)), start)
        pinned = None if pinned is None else piece(pinned) & covered
        seed = start if pinned is not None else None
    state = init_state(config, sampler, start, finished)
    return Canvas(state.replace(step=jnp.zeros(jnp.shape(index), jnp.int32)), keys, seed,
                  None if seed_canvas is None else pinned)


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


def commit_and_first_step(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, tokens: jax.Array,
                          active: jax.Array, canvas: Canvas, runtime: Runtime | None = None):
    """The commit of the previous canvases tokens [B, L] for the `active` rows (others write nothing)
    and the first denoising step of `canvas` (`canvas_start`) after them, in one pass over the layers
    (`loop.commit_and_step`). Returns (the canvas's `LoopState` after its first step, the cache with
    the tokens written): `commit` and then `loop.denoise_step`, with each layer's weights read once."""
    return commit_and_step(params, config, sampler, cache, tokens, committed_counts(tokens, active), canvas.keys,
                           canvas.state, canvas.seed, canvas.pinned, runtime=runtime)


def canvas_step(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, keys: jax.Array, index,
                last, finished: jax.Array, seed_canvas=None, pinned=None, runtime: Runtime | None = None):
    """One canvas of a generation: `canvas_start`, `denoise_canvas`, `canvas_end`.

    keys: [B] per-row keys (canvas c uses `fold_in(key, c)`); index / last: the canvas index and
    whether it is the final one (either may be traced); finished: [B] rows already done (frozen).
    Returns (cache, tokens [B, L], steps [B], finished_after [B], nonfinite [B])."""
    canvas = canvas_start(config, sampler, keys, index, finished, seed_canvas, pinned)
    state = denoise_canvas(params, config, sampler, cache, canvas, runtime=runtime).state
    toks, finished_after, cache = canvas_end(params, config, sampler, cache, state.argmax, finished, last, runtime)
    return cache, toks, state.steps, finished_after, state.nonfinite


def generate_fused(params, config: ModelConfig, sampler: SamplerConfig, prompt_tokens, prompt_lengths,
                   cache: KVCache, keys: jax.Array, max_new_tokens: int, seed_canvas=None,
                   pinned=None, runtime: Runtime | None = None, images=None,
                   prefill_chunk: int | None = None) -> GenerateOutput:
    """The whole generation as one program: prefill, then canvases in one `lax.while_loop`.

    Traceable (jit the caller; config, sampler, max_new_tokens and runtime static). No input checks:
    `engine.inputs.prepare_inputs` does the host's.

    Args:
      prompt_tokens: [B, P] int32, right-padded; prompt_lengths: [B] int32.
      cache: a `KVCache` [B, S], S >= the longest prompt + all but the last canvas.
      keys: [B] PRNG keys, one per row (`row_keys`); canvas c of row b uses `fold_in(keys[b], c)`.
      max_new_tokens: the output's width; `ceil(max_new_tokens / L)` canvases at most.
      seed_canvas, pinned: [B, n * L] the first n canvases' starts and their held positions (infilling), or None.
      runtime: how the passes run (default: this backend, one device).
      images: the prompt's images (pixel_values [N, P, 3 p^2], position_ids [N, P, 2]), or None.
      prefill_chunk: prefill in passes of this many tokens (`prefill_chunks`), or None: one pass.
    Returns:
      `GenerateOutput`: tokens [B, max_new_tokens] (EOS-truncated, pad after), steps [B, C],
      finished [B], num_canvases [], cache (prompt and committed canvases), nonfinite [B].
    """
    b = prompt_tokens.shape[0]
    l = sampler.canvas_length
    n_canvas = num_canvases(max_new_tokens, l)
    cache = prefill(params, config, prompt_tokens, prompt_lengths, cache, runtime, images, prefill_chunk)
    out = jnp.full((b, n_canvas * l), sampler.pad_id, jnp.int32)
    steps = jnp.zeros((b, n_canvas), jnp.int32)
    finished = jnp.zeros((b,), bool)

    rt = runtime if runtime is not None else Runtime()
    none = jnp.zeros((b,), bool)

    def cond(carry):
        c, finished = carry[0], carry[4]
        return (c < n_canvas) & ~jnp.all(finished)

    def record(c, out, steps, toks, state):
        out = jax.lax.dynamic_update_slice_in_dim(out, toks, c * l, axis=1)
        return out, jax.lax.dynamic_update_slice_in_dim(steps, state[:, None], c, axis=1)

    if not rt.fuse_commit():   # each canvas committed by its own causal pass (`canvas_step`)
        def body(carry):
            c, cache, out, steps, finished, bad = carry
            cache, toks, n_steps, finished, bad_c = canvas_step(params, config, sampler, cache, keys, c,
                                                                c + 1 >= n_canvas, finished, seed_canvas, pinned,
                                                                runtime)
            out, steps = record(c, out, steps, toks, n_steps)
            return c + 1, cache, out, steps, finished, bad | bad_c

        c, cache, out, steps, finished, bad = jax.lax.while_loop(
            cond, body, (jnp.zeros((), jnp.int32), cache, out, steps, finished, none))
        return GenerateOutput(out[:, :max_new_tokens], steps, finished, c, cache, bad)

    def fused_body(carry):
        c, cache, out, steps, finished, bad, toks, go_on = carry
        # canvas c's first step in one pass with the commit of canvas c - 1's rows that go on (none at
        # c = 0: a commit of no tokens writes nothing), then its other steps
        canvas = canvas_start(config, sampler, keys, c, finished, seed_canvas, pinned)
        first, cache = commit_and_first_step(params, config, sampler, cache, toks, go_on, canvas, runtime)
        state = denoise_canvas(params, config, sampler, cache, canvas.replace(state=first), runtime=runtime).state
        toks, finished = finish_canvas(sampler, state.argmax, finished)
        out, steps = record(c, out, steps, toks, state.steps)
        # a row that emitted an EOS, and every row after the last canvas, commits nothing
        return c + 1, cache, out, steps, finished, bad | state.nonfinite, toks, ~finished & (c + 1 < n_canvas)

    c, cache, out, steps, finished, bad, _, _ = jax.lax.while_loop(
        cond, fused_body, (jnp.zeros((), jnp.int32), cache, out, steps, finished, none,
                           jnp.full((b, l), sampler.pad_id, jnp.int32), none))
    return GenerateOutput(out[:, :max_new_tokens], steps, finished, c, cache, bad)
