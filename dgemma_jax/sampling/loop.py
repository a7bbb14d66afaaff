"""Denoising one canvas: the step function and the `lax.while_loop` around it.

The loop state carries the canvas, the self-conditioning soft embeddings [B, L, D] (not logits),
the argmax history, per-row done flags and step counts. The KV cache and the parameters are
operands: read, never carried, copied or written. Randomness is per row: step `s` of a row uses
`fold_in(row_key, s)`, and `row_keys` derives a row's key from its own seed, never from its index,
so a row's random draws do not depend on the other rows. Its numbers can: a batched step shares
shapes (batch, prompt width, cache length) and the MoE dispatch with the other rows, and float
rounding that differs by ~1e-4 in the logits changes sampled tokens. `Engine` (batch_invariant, the
default) runs batches whose shapes a row's numbers do not depend on for that reason (prefilled in
fixed chunks, attending over fixed key blocks), or each row as its own program
(tests/test_batch_invariance.py).

One step (HF / SGLang / vLLM semantics, spec §3.2)::

    h = denoiser trunk(canvas, cache, soft)         z = sanitize(softcap(h E^T) / T(step))
    sampled, argmax, H, soft = ONE pass over vocab chunks of z (never a [B, L, V] buffer;
                               soft = softmax(z) @ E * sqrt(D), see sampling/fused.py)
    accept = entropy bound on H                     canvas = where(accept, sampled, fresh noise)
    done   = argmax stable vs history AND mean(H) < threshold (or step budget spent)

Finished rows are frozen (canvas, soft, history, argmax, step count). The output is the last argmax.
Pinned positions (infilling) hold the seed canvas's tokens in the canvas and in the argmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import commit_denoise_features, commit_rows_denoise_features, denoise_features
from dgemma_jax.model.cache import KVCache
from dgemma_jax.model.layers import dtype_of
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import ops
from dgemma_jax.sampling import settings as settings_lib
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.fused import head_step
from dgemma_jax.sampling.rules import StepView


@struct.dataclass
class LoopState:
    step: jax.Array        # [] int32 0-based index of the next step, or [B]: each row's own (a server's slots)
    canvas: jax.Array      # [B, L] int32, the next step's input canvas
    soft: jax.Array        # [B, L, D] self-conditioning soft embeddings (zero before step 0)
    history: jax.Array     # [B, S, L] int32 previous argmax canvases (-1 = none)
    argmax: jax.Array      # [B, L] int32 latest argmax canvas (the output)
    done: jax.Array        # [B] bool
    steps: jax.Array       # [B] int32 denoiser passes made while the row was unfinished
    nonfinite: jax.Array   # [B] bool: the row met non-finite logits (`nonfinite_rows`) at some step


@struct.dataclass
class Canvas:
    """One canvas in flight for every row: what a denoising step reads and returns.

    state: the loop state (`LoopState`); keys: [B] the canvas's row keys (step s of row b draws from
    `fold_in(keys[b], s)`); seed / pinned: [B, L] the start canvas and the positions held at its
    tokens (infilling), or None. `generate.canvas_start` makes one; `denoise_canvas` runs it to the
    end; a server's slots carry one whose rows are different requests' canvases."""

    state: LoopState
    keys: jax.Array
    seed: jax.Array | None = None
    pinned: jax.Array | None = None


@struct.dataclass
@functools.partial(settings_lib.with_fields, fields=[(k, jax.Array) for k in settings_lib.knob_fields()], first=False)
class RowKnobs:
    """The sampler settings a step reads per row: the one form they take inside the step.

    Row b uses its own temperature schedule (`temperatures` [B, N] float32: row b's temperature at
    step i, its last one repeated) and one [B] column per setting with a `knob` in
    `sampling/settings.py` (today `max_steps` int32, `entropy_bound` and `confidence` float32); the
    canvas length, stability threshold and EOS ids are shapes or batch-wide, and stay in the static
    `SamplerConfig`. Each row's values are exactly those its own `SamplerConfig` gives
    (`ops.temperature_table` per row), so a request decides the same way whatever the other rows
    run. `of(sampler, batch)` gives every row one sampler's settings (what `denoise_step` uses when
    given none); `from_samplers` one sampler per row (a server's slots).
    """

    temperatures: jax.Array    # [B, N] float32; then the knob columns (settings.knob_fields), [B] each

    @classmethod
    def of(cls, sampler: SamplerConfig, batch: int) -> "RowKnobs":
        """Every one of `batch` rows with `sampler`'s settings (constants inside a trace)."""
        return cls.from_samplers([sampler] * batch, sampler.max_denoising_steps)

    @classmethod
    def from_samplers(cls, samplers, budget: int) -> "RowKnobs":
        """Host-built knobs of one `SamplerConfig` per row; `budget` >= every row's step budget is
        the loop's own (the static sampler's `max_denoising_steps`)."""
        samplers = list(samplers)
        for b, s in enumerate(samplers):
            if s.max_denoising_steps > budget:
                raise ValueError(f"row {b} asks for {s.max_denoising_steps} denoising steps; this loop runs at "
                                 f"most {budget}")
        table = np.stack([_temperature_row(s, budget) for s in samplers])
        columns = settings_lib.knob_values(samplers, samplers[0].SETTINGS)
        return cls(temperatures=jnp.asarray(table), **{k: jnp.asarray(v) for k, v in columns.items()})

    @classmethod
    def shapes(cls, batch: int, budget: int) -> "RowKnobs":
        """The knobs of `batch` rows as `jax.ShapeDtypeStruct`s (an AOT compile's inputs)."""
        columns = {s.knob: jax.ShapeDtypeStruct((batch,), s.knob_dtype) for s in settings_lib.knob_settings()}
        return cls(temperatures=jax.ShapeDtypeStruct((batch, budget), jnp.float32), **columns)

    def columns(self) -> dict:
        """{knob: [B] array}: the per-row settings a `rules.StepView` carries."""
        return {k: getattr(self, k) for k in settings_lib.knob_fields()}


SEED_RANGE = (-(2 ** 63), 2 ** 64)  # the integer seeds accepted: any signed or unsigned 64-bit value


def seed_key(seed: int) -> jax.Array:
    """A PRNG key from an integer seed; every seed in [-2**63, 2**64) counts with all of its 64 bits.

    `jax.random.key(seed)` alone overflows above 2**63 - 1 and, without jax_enable_x64, keeps only
    the low 32 bits (seeds 0 and 2**32 gave the same stream). Here a seed is taken modulo 2**64 and its
    high and low words become the key, which is `jax.random.key(seed)` under jax_enable_x64 (for the
    default threefry keys): seeds in [0, 2**32) give the same keys as before; a negative seed is its
    two's complement (-1 == 2**64 - 1)."""
    seed = int(seed)
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise ValueError(f"seed {seed} does not fit in 64 bits; use an integer in [-2**63, 2**64)")
    seed %= 2 ** 64
    hi, lo = seed >> 32, seed & 0xFFFFFFFF
    probe = jax.random.key_data(jax.random.key(0))
    if probe.shape == (2,) and probe.dtype == jnp.uint32:  # threefry2x32: key data is [hi, lo]
        return jax.random.wrap_key_data(np.array([hi, lo], np.uint32))
    key = jax.random.key(np.uint32(lo))  # another key implementation: fold the high word in
    return jax.random.fold_in(key, hi) if hi else key


@functools.lru_cache(maxsize=256)
def _temperature_row(sampler: SamplerConfig, budget: int) -> np.ndarray:
    """A sampler's temperature per step over `budget` steps (its last one repeated past its own
    budget); cached, since a server rebuilds its slots' knobs every round from few distinct configs."""
    t = ops.temperature_table(sampler)
    row = np.full((budget,), t[-1], np.float32)
    row[:len(t)] = t
    row.flags.writeable = False
    return row


def prompt_key(seed) -> jax.Array:
    """The key stream of one prompt with integer seed `seed` (or a PRNG key): `fold_in(seed_key(seed), 0)`.

    It never depends on where the prompt stands in a batch. (It equals `split(seed_key(seed), 1)[0]`,
    the key a batch of one got before per-prompt keys, so single-prompt results are unchanged.)"""
    key = seed_key(seed) if isinstance(seed, (int, np.integer)) else seed
    return jax.random.fold_in(key, 0)


def choice_keys(seed: int, n: int) -> jax.Array:
    """[n] keys for `n` independent answers to ONE prompt with seed `seed` (the server's `n` choices):
    `split(seed_key(seed), n)`. Choice 0 of n=1 is `prompt_key(seed)`."""
    return jax.random.split(seed_key(seed), n)


def row_keys(rng, batch: int) -> jax.Array:
    """Per-row keys, each from its own row's seed and never from the row's index in the batch.

    Args:
      rng: an int seed (any 64-bit value): every row uses that seed's stream, `prompt_key(seed)` (so
        a prompt gets the same key alone or in any batch; rows with the same prompt get the same
        answer); a list/tuple/1-d array of B int seeds: row b uses `prompt_key(seeds[b])`; one PRNG
        key (or its uint32 data [2]): every row uses `fold_in(key, 0)`; [B] keys (or uint32 key data
        [B, 2]): passed through unchanged.
      batch: B.
    Returns:
      [B] typed PRNG keys.
    Raises:
      ValueError saying what is accepted, for anything else.
    """
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, (bool, np.bool_)):
        return _broadcast(prompt_key(rng), batch)
    if isinstance(rng, (list, tuple)) and rng and all(
            isinstance(s, (int, np.integer)) and not isinstance(s, (bool, np.bool_)) for s in rng):
        rng = np.asarray([int(s) % 2 ** 64 for s in rng], np.uint64)
    if isinstance(rng, (list, tuple, np.ndarray)) and np.issubdtype(np.asarray(rng).dtype, np.integer):
        arr = np.asarray(rng)
        if arr.ndim == 1 and not (arr.dtype == np.uint32 and arr.shape == (2,)):  # one int seed per row
            if arr.shape != (batch,):
                raise ValueError(f"rng lists {arr.shape[0]} seeds for {batch} prompts; pass one seed per prompt "
                                 "or a single int seed")
            return jnp.stack([prompt_key(int(s)) for s in arr])
        rng = jnp.asarray(rng)
    elif not isinstance(rng, jax.Array):
        raise ValueError(f"rng must be an integer seed, a list of one integer seed per prompt, a jax PRNG key or "
                         f"one key per row; got {type(rng).__name__} {rng!r}"[:300])
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.ndim >= 1 and rng.shape[-1] == 2 and rng.dtype == jnp.uint32:
            rng = jax.random.wrap_key_data(rng)
        elif rng.ndim == 0:  # a jax integer (may be traced): jax.random.key's stream of it
            return _broadcast(prompt_key(jax.random.key(rng)), batch)
        else:
            raise ValueError(f"rng as an array must be uint32 key data ([2] or [{batch}, 2]) or one int seed per "
                             f"prompt ([{batch}]); got {rng.dtype} {tuple(rng.shape)}")
    if rng.ndim == 0:
        return _broadcast(prompt_key(rng), batch)
    if rng.shape != (batch,):
        raise ValueError(f"rng must be one key or one key per row ([{batch}]); got shape {rng.shape}")
    return rng


def _broadcast(key: jax.Array, batch: int) -> jax.Array:
    return jnp.broadcast_to(key, (batch,))


def initial_canvas(keys: jax.Array, length: int, vocab_size: int) -> jax.Array:
    """A canvas of uniform random tokens over the full vocabulary, one stream per row.

    Args:
      keys: [B] the canvas's row keys. length: L. vocab_size: V.
    Returns:
      [B, L] int32 tokens in [0, V).
    """
    return jax.vmap(lambda k: ops.uniform_tokens(jax.random.fold_in(k, 0x5eed), (length,), vocab_size))(keys)


def denoise_step_keys(keys: jax.Array, step) -> jax.Array:
    """[B, 2] keys of denoising step `step` (one for every row, or [B]: each row's own) from a
    canvas's row keys [B]: [:, 0] draws the samples (the head's uniforms or Gumbel noise), [:, 1] the
    renoise tokens."""
    step = jnp.broadcast_to(jnp.asarray(step, jnp.int32), keys.shape[:1])
    return jax.vmap(lambda k, s: jax.random.split(jax.random.fold_in(k, s)))(keys, step)


def init_state(config: ModelConfig, sampler: SamplerConfig, canvas: jax.Array,
               done: jax.Array | None = None) -> LoopState:
    """The loop state at the start of a canvas.

    Args:
      canvas: [B, L] int32 start tokens (`initial_canvas`, or a seed). done: [B] rows frozen from the
        start (default none).
    Returns:
      `LoopState` with step 0 ([]), the canvas as input and as argmax, zero soft embeddings [B, L, D],
      an empty (-1) history [B, S, L], no steps made and no non-finite flags.
    """
    b, l = canvas.shape
    return LoopState(
        step=jnp.zeros((), jnp.int32),
        canvas=canvas.astype(jnp.int32),
        soft=jnp.zeros((b, l, config.hidden_size), dtype_of(config.dtype)),
        history=ops.init_history(b, sampler),
        argmax=canvas.astype(jnp.int32),
        done=jnp.zeros((b,), bool) if done is None else done,
        steps=jnp.zeros((b,), jnp.int32),
        nonfinite=jnp.zeros((b,), bool),
    )


def nonfinite_rows(h: jax.Array, soft: jax.Array) -> jax.Array:
    """[B] bool: the rows whose logits this step were not all finite, from the step's hidden state
    h [B, L, D] and its soft embedding [B, L, D] (no [B, L, V] pass). A non-finite logit comes from a
    non-finite h (then the row's logits are NaN) or a non-finite embedding row (then softmax @ E is
    NaN: the sanitized logit's zero weight times NaN), short of float32 overflow of h . E; the sampler
    maps NaN logits to impossible tokens (`ops.sanitize_logits`), so without this flag a poisoned
    model answers pad silently."""
    return ~(jnp.isfinite(h).all((1, 2)) & jnp.isfinite(soft).all((1, 2)))


def where_rows(mask, new, old):
    """`new` where the row's `mask` [B] is set, else `old` (any trailing shape)."""
    return jnp.where(mask.reshape(mask.shape + (1,) * (new.ndim - 1)), new, old)


def denoise_step(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, context_end: jax.Array,
                 keys: jax.Array, state: LoopState, seed: jax.Array | None = None,
                 pinned: jax.Array | None = None, knobs: RowKnobs | None = None,
                 runtime: Runtime | None = None, with_features: bool = False):
    """One denoising step for every unfinished row (pure; jit it or run it in a while_loop).

    Args:
      params, config: the model. sampler: static settings (canvas length, history, EOS ids).
      cache: the read-only KV cache [B, S]; context_end: [B] int32 committed tokens each row attends to.
      keys: [B] the canvas's row keys. state: the `LoopState` to advance (rows already done are kept).
      seed, pinned: [B, L] the start canvas and the positions held at its tokens, or None.
      knobs: per-row settings (`RowKnobs`); default `RowKnobs.of(sampler, B)`.
      runtime: how the pass runs (`dgemma_jax.runtime`; default: this backend, one device).
      with_features: also return the step's final-normed hidden state h [B, L, D] (structured output's
        DINGO decoder reads the step's distributions from it).
    Returns:
      the next `LoopState` (with h: `(state, h)`): step + 1; canvas, soft, history and argmax advanced for the unfinished
      rows (the positions `sampler.accept` keeps, fresh noise elsewhere); done set where
      `sampler.stop` says (by default: stable and confident) or the row's step budget is spent.
    """
    runtime = runtime if runtime is not None else Runtime()
    knobs = knobs if knobs is not None else RowKnobs.of(sampler, keys.shape[0])
    h = denoise_features(params, config, state.canvas, context_end, cache, state.soft, runtime=runtime)
    new = _advance(params, config, sampler, h, keys, state, seed, pinned, knobs, runtime)
    return (new, h) if with_features else new


def commit_and_step(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, tokens: jax.Array,
                    num_new: jax.Array, keys: jax.Array, state: LoopState, seed: jax.Array | None = None,
                    pinned: jax.Array | None = None, knobs: RowKnobs | None = None,
                    runtime: Runtime | None = None, rows: jax.Array | None = None) -> tuple[LoopState, KVCache]:
    """The commit of tokens [B, T] (row b's first num_new[b]; `generate.commit`) and then `denoise_step`
    of the next canvas's `state` against the cache it leaves, in ONE pass over the layers
    (`model.api.commit_denoise_features`: the layers' weights read once for both). Returns (the next
    `LoopState`, the cache with the tokens written): what the commit and the step give, one after
    the other.

    rows: None, or [G, K]: a server's slots (`slots.slot_tick`), where tokens [G K, T] go into those
    rows of each of the cache's G groups of rows (`model.api.commit_rows_denoise_features`) and
    every row's canvas steps."""
    runtime = runtime if runtime is not None else Runtime()
    knobs = knobs if knobs is not None else RowKnobs.of(sampler, keys.shape[0])
    if rows is None:
        h, cache = commit_denoise_features(params, config, tokens, num_new, state.canvas, cache, state.soft,
                                           runtime=runtime)
    else:
        h, cache = commit_rows_denoise_features(params, config, tokens, rows, num_new, state.canvas, cache,
                                                state.soft, runtime=runtime)
    return _advance(params, config, sampler, h, keys, state, seed, pinned, knobs, runtime), cache


def _advance(params, config: ModelConfig, sampler: SamplerConfig, h: jax.Array, keys: jax.Array, state: LoopState,
             seed, pinned, knobs: RowKnobs, runtime: Runtime) -> LoopState:
    """A denoising step from its pass's final-normed hidden state h [B, L, D]: the head and sampler,
    the accept and stop rules, every unfinished row advanced (`denoise_step`)."""
    step_keys = denoise_step_keys(keys, state.step)  # [B, 2]
    column = jnp.broadcast_to(jnp.minimum(state.step, knobs.temperatures.shape[1] - 1), keys.shape[:1])
    temp = jnp.take_along_axis(knobs.temperatures, column[:, None], axis=1)[:, :, None]
    with jax.named_scope("head_sampler_pass"):  # a scope name for profiles (benchmarks/step_profile.py)
        stats, soft = head_step(h, params["embedding"], config.final_logit_softcap,
                                temp, step_keys[:, 0], config.embed_scale, runtime)
    argmax, entropy = stats.argmax, stats.entropy
    if pinned is not None:
        argmax = jnp.where(pinned, seed, argmax)
        free = (~pinned).astype(jnp.float32)
        mean_h = (entropy * free).sum(-1) / jnp.maximum(free.sum(-1), 1.0)
        # a row holding no position decides exactly as without pins (a server's slots, where only some
        # rows hold positions, decide as each would alone)
        mean_h = jnp.where(pinned.any(-1), mean_h, entropy.mean(-1))
    else:
        mean_h = entropy.mean(-1)
    view = StepView(step=state.step + 1, argmax=argmax, history=state.history, entropy=entropy, mean_entropy=mean_h,
                    **knobs.columns())
    noise = jax.vmap(lambda k: ops.uniform_tokens(k, h.shape[1:2], config.vocab_size))(step_keys[:, 1])
    canvas = ops.renoise(stats.sampled, sampler.accept(view), noise)
    if pinned is not None:
        canvas = jnp.where(pinned, seed, canvas)
    active = ~state.done
    new = LoopState(
        step=state.step + 1,
        canvas=where_rows(active, canvas, state.canvas),
        soft=where_rows(active, soft, state.soft),
        history=where_rows(active, ops.push_history(state.history, argmax), state.history),
        argmax=where_rows(active, argmax, state.argmax),
        done=state.done | sampler.stop(view) | (view.step >= knobs.max_steps),   # the budget binds every rule
        steps=state.steps + active.astype(jnp.int32),
        nonfinite=state.nonfinite | (active & nonfinite_rows(h, soft)),
    )
    return new


def loop_running(state: LoopState, sampler: SamplerConfig) -> jax.Array:
    """[] bool: a row of the canvas still denoises and the loop's step budget is not spent."""
    return jnp.all(state.step < sampler.max_denoising_steps) & ~jnp.all(state.done)


def denoise_canvas(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, canvas: Canvas, *,
                   knobs: RowKnobs | None = None, runtime: Runtime | None = None) -> Canvas:
    """Denoise a canvas to completion in ONE `lax.while_loop` of `denoise_step` (traceable; jit the caller).

    Args:
      cache: the read-only KV cache [B, S]; each row attends to its `cache.lengths` committed tokens.
      canvas: the start (`generate.canvas_start`); rows already done stay frozen.
      knobs: per-row settings (`RowKnobs`; `sampler.max_denoising_steps` bounds the loop).
    Returns:
      the `Canvas` at its end; `.state.argmax` [B, L] is the output, `.state.steps` [B] the passes made.
    """
    step = functools.partial(denoise_step, params, config, sampler, cache, cache.lengths, canvas.keys,
                             seed=canvas.seed, pinned=canvas.pinned, knobs=knobs, runtime=runtime)
    return canvas.replace(state=jax.lax.while_loop(lambda s: loop_running(s, sampler), step, canvas.state))
