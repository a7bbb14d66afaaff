"""Pure JAX pieces of the DiffusionGemma entropy-bound sampler.

Everything here is a stateless function over arrays, safe to call under
`jax.jit` / `lax.while_loop`. The denoising loop itself lives elsewhere.

Shape letters used in the docstrings:
  B  batch size
  L  canvas length
  V  vocabulary size
  S  number of remembered argmax canvases (= config.history_length: the
     stability threshold capped at the step budget)

One denoising step, in terms of these functions (spec section 3.2):

  z      = sanitize_logits(apply_temperature(raw_logits, config, step))
  stats  = sample_step_stats(z, key_sample)
  accept = entropy_bound_accept(stats.entropy, config.entropy_bound)
  canvas = renoise(stats.sampled, accept,
                   uniform_tokens(key_noise, stats.sampled.shape, V))
  done   = stop_decision(stats.argmax, history,
                         stats.entropy.mean(-1), config.confidence_threshold)
  history = push_history(history, stats.argmax)

The semantics follow the Hugging Face reference
(`transformers/models/diffusion_gemma/generation_diffusion_gemma.py`); the
places where rounding or tie-breaking matters are noted per function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

if TYPE_CHECKING:  # annotations only: the config imports the rules, which call these ops
    from dgemma_jax.sampling.config import SamplerConfig

__all__ = [
    "StepStats",
    "LOGIT_LIMIT",
    "DEFAULT_VOCAB_CHUNK",
    "temperature",
    "temperature_table",
    "apply_temperature",
    "sanitize_logits",
    "sample_step_stats",
    "entropy_bound_accept",
    "renoise",
    "uniform_tokens",
    "init_history",
    "push_history",
    "stop_decision",
    "truncate_at_eos",
    "tokens_per_forward",
]

# Magnitude that non-finite logits are mapped to by `sanitize_logits`. It is
# far above any real (softcapped, tempered) logit, and small enough that the
# difference of two sanitized logits, divided by any sane temperature, is
# still finite in float32 (so `z - max(z)` never becomes -inf or NaN).
LOGIT_LIMIT = 1e30


class StepStats(NamedTuple):
    """Per-position results of one pass over the tempered logits."""

    sampled: jax.Array  # int32 [B, L]: Gumbel-max draw from softmax(z)
    argmax: jax.Array  # int32 [B, L]: argmax(z), first index on ties
    entropy: jax.Array  # float32 [B, L]: entropy of softmax(z), in nats


# --------------------------------------------------------------------------
# Temperature
# --------------------------------------------------------------------------


def temperature_table(config: SamplerConfig) -> np.ndarray:
    """Temperatures of all N steps, float32 [N], computed on the host.

    Entry i = t_min + (t_max - t_min) * ((N - i) / N), evaluated in float32
    in exactly HF's order: HF counts `cur_step` = N - i down from N to 1 as an
    int32 tensor, so `cur_step / N` is a float32 division and both Python
    constants are rounded to float32. (Done in NumPy because XLA rewrites a
    division by a constant into a multiplication by its reciprocal, which is
    off by one ulp for some steps.)
    """
    n_total = config.max_denoising_steps
    remaining = np.arange(n_total, 0, -1, dtype=np.float32)
    frac = remaining / np.float32(n_total)
    span = np.float32(config.t_max - config.t_min)
    return (np.float32(config.t_min) + span * frac).astype(np.float32)


def temperature(config: SamplerConfig, step) -> jax.Array:
    """Linear temperature of denoising step `step` (0-based), float32.

    T = t_min + (t_max - t_min) * (N - step) / N, N = max_denoising_steps, so
    step 0 gives t_max and step N-1 gives t_min + (t_max - t_min) / N. The
    values are bit-identical to HF's LinearTemperatureScheduleLogitsProcessor
    (see `temperature_table`). Steps outside [0, N) are clipped into it.

    Args:
      config: the sampler config (static).
      step: int or int array of any shape (e.g. a traced int32 scalar).
    Returns:
      float32 array with the shape of `step`.
    """
    table = jnp.asarray(temperature_table(config))
    index = jnp.clip(jnp.asarray(step, jnp.int32), 0, config.max_denoising_steps - 1)
    return table[index]


def apply_temperature(logits: jax.Array, config: SamplerConfig, step) -> jax.Array:
    """Tempered ("processed") logits: float32(logits) / temperature(step).

    Written as a division like HF's, but XLA compiles x / T as x * (1 / T),
    so values can differ from torch's by one float32 ulp (T itself is exact).

    Args:
      logits: [..., V] raw decoder logits, any float dtype.
      step: scalar 0-based step index (may be traced).
    Returns:
      float32 [..., V].
    """
    return logits.astype(jnp.float32) / temperature(config, step)


# --------------------------------------------------------------------------
# Logit hygiene
# --------------------------------------------------------------------------


def sanitize_logits(logits: jax.Array) -> jax.Array:
    """Returns float32 logits with every value finite and within +-LOGIT_LIMIT.

    NaN -> -LOGIT_LIMIT (the token becomes impossible), +inf -> +LOGIT_LIMIT,
    -inf -> -LOGIT_LIMIT; finite values beyond the limit are clipped. Hence:
      * a row whose logits are all NaN (or all -inf) becomes uniform;
      * a row with several +inf logits splits its mass evenly over them;
      * softmax, entropy, argmax and Gumbel-max sampling stay finite and
        return ids in [0, V).

    Args:
      logits: [..., V], any float dtype.
    Returns:
      float32 [..., V].
    """
    x = logits.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), jnp.float32(-LOGIT_LIMIT), x)
    return jnp.clip(x, -LOGIT_LIMIT, LOGIT_LIMIT)


# --------------------------------------------------------------------------
# Sampling statistics
# --------------------------------------------------------------------------


def _gumbel_from_uniform(u: jax.Array) -> jax.Array:
    u = u.astype(jnp.float32)
    tiny = jnp.finfo(jnp.float32).tiny
    u = jnp.clip(u, tiny, jnp.float32(1.0) - jnp.finfo(jnp.float32).epsneg)
    return -jnp.log(-jnp.log(u))


# Default vocab chunk of `sample_step_stats`. 262144 / 16384 = 16 chunks.
DEFAULT_VOCAB_CHUNK = 16384


class _Partial(NamedTuple):
    # Statistics of a vocab range, per position [B, L], relative to the
    # global row max m.
    s: jax.Array  # sum exp(z - m)
    t: jax.Array  # sum exp(z - m) * (z - m)
    arg: jax.Array  # first index of the max logit in the range
    top: jax.Array  # max logit in the range
    garg: jax.Array  # first index of the max of (z - m) + g in the range
    gtop: jax.Array  # that max


def _chunk_partial(z: jax.Array, m: jax.Array, g: jax.Array, offset) -> _Partial:
    shifted = z - m[..., None]  # <= 0, -inf for -inf logits
    w = jnp.exp(shifted)
    y = shifted + g
    return _Partial(
        s=jnp.sum(w, axis=-1),
        t=jnp.sum(jnp.where(w > 0, w * shifted, 0.0), axis=-1),
        arg=jnp.argmax(z, axis=-1).astype(jnp.int32) + offset,
        top=jnp.max(z, axis=-1),
        garg=jnp.argmax(y, axis=-1).astype(jnp.int32) + offset,
        gtop=jnp.max(y, axis=-1),
    )


def _merge_partial(a: _Partial, b: _Partial) -> _Partial:
    """Combines the statistics of a vocab range `a` with the next range `b`."""
    b_top = b.top > a.top  # strict: on ties the earlier (lower) id wins
    b_gtop = b.gtop > a.gtop
    return _Partial(
        s=a.s + b.s,
        t=a.t + b.t,
        arg=jnp.where(b_top, b.arg, a.arg),
        top=jnp.where(b_top, b.top, a.top),
        garg=jnp.where(b_gtop, b.garg, a.garg),
        gtop=jnp.where(b_gtop, b.gtop, a.gtop),
    )


def sample_step_stats(
    tempered_logits: jax.Array,
    key: jax.Array | None = None,
    *,
    gumbel: jax.Array | None = None,
    uniform: jax.Array | None = None,
    chunk_size: int | None = DEFAULT_VOCAB_CHUNK,
) -> StepStats:
    """Sample, argmax and entropy of softmax(z) for every canvas position.

    Exactly one source of randomness must be given:
      key:      a PRNG key; standard Gumbel noise is drawn from it, chunk by
                chunk (chunk i uses `fold_in(key, i)`), so the draw for a
                given key depends on `chunk_size`.
      gumbel:   explicit Gumbel(0, 1) noise with the shape of z.
      uniform:  explicit U(0, 1) draws with the shape of z, turned into
                Gumbel noise by -log(-log(u)) (u clipped into (0, 1)).
    The sample is argmax((z - m) + g), m = max(z) (Gumbel-max, distributed as
    softmax(z)): the same law as HF's `torch.multinomial(softmax(z))` with a
    different RNG. Shifting by m first keeps the noise resolvable for huge
    logits (e.g. several sanitized +inf, or a tiny temperature).

    Computation: one max reduction over the vocab, then one pass over vocab
    chunks of `chunk_size` ids accumulating per position
      s = sum exp(z - m),  t = sum exp(z - m) (z - m),
    the first index of the max of z, and the first index of the max of
    (z - m) + g. Then, in float32,
      H = log(s) - t / s   ( = logsumexp(z) - sum_v p_v z_v ),
    with 0 * log 0 = 0 (a -inf logit contributes nothing); s >= 1 and
    t <= 0, so H >= 0. With chunking, the extra memory is
    O(B * L * chunk_size) (one chunk of noise and its reductions) instead of
    several [B, L, V] temporaries (XLA materialises threefry bits for a
    full-size draw). `chunk_size=None` (or >= V) uses a single chunk. Ties
    go to the lowest id, as in jnp/torch argmax.
    For explicit noise the results do not depend on `chunk_size` (entropy
    up to float32 summation order).

    Args:
      tempered_logits: float [B, L, V] (any leading dims). Finite or -inf,
        with at least one finite value per row: run `sanitize_logits` first
        when the model may produce NaN/+inf.
      key / gumbel / uniform: see above.
      chunk_size: static vocab chunk length.
    Returns:
      StepStats(sampled int32 [B, L], argmax int32 [B, L],
                entropy float32 [B, L]).
    """
    given = sum(x is not None for x in (key, gumbel, uniform))
    if given != 1:
        raise ValueError(
            "sample_step_stats needs exactly one of key=, gumbel=, uniform= "
            f"(got {given})"
        )
    z = tempered_logits.astype(jnp.float32)
    vocab = z.shape[-1]
    chunk = vocab if chunk_size is None else max(1, min(int(chunk_size), vocab))
    n_chunks = -(-vocab // chunk)
    ragged = vocab % chunk != 0
    m = jnp.max(z, axis=-1)

    def partial_at(index):
        # The last chunk of a ragged vocab is slid back to end at V; the ids it
        # shares with the previous chunk are masked out (-inf: no mass, never
        # the max), so every id is counted exactly once.
        start = jnp.minimum(index * chunk, vocab - chunk)
        zc = lax.dynamic_slice_in_dim(z, start, chunk, axis=-1)
        if key is not None:
            g = jax.random.gumbel(
                jax.random.fold_in(key, index), z.shape[:-1] + (chunk,), jnp.float32
            )
        else:
            src = jnp.broadcast_to(gumbel if gumbel is not None else uniform, z.shape)
            g = lax.dynamic_slice_in_dim(src, start, chunk, axis=-1)
            g = g.astype(jnp.float32) if gumbel is not None else _gumbel_from_uniform(g)
        if ragged:
            ids = start + lax.broadcasted_iota(jnp.int32, zc.shape, zc.ndim - 1)
            zc = jnp.where(ids >= index * chunk, zc, -jnp.inf)
        return _chunk_partial(zc, m, g, start)

    if n_chunks == 1:
        acc = partial_at(jnp.int32(0))
    else:
        lead = z.shape[:-1]
        empty = _Partial(
            s=jnp.zeros(lead, jnp.float32),
            t=jnp.zeros(lead, jnp.float32),
            arg=jnp.zeros(lead, jnp.int32),
            top=jnp.full(lead, -jnp.inf, jnp.float32),
            garg=jnp.zeros(lead, jnp.int32),
            gtop=jnp.full(lead, -jnp.inf, jnp.float32),
        )

        def body(carry, index):
            return _merge_partial(carry, partial_at(index)), None

        acc, _ = lax.scan(body, empty, jnp.arange(n_chunks, dtype=jnp.int32))

    entropy = jnp.log(acc.s) - acc.t / acc.s
    return StepStats(
        sampled=acc.garg.astype(jnp.int32),
        argmax=acc.arg.astype(jnp.int32),
        entropy=entropy.astype(jnp.float32),
    )


# --------------------------------------------------------------------------
# Entropy-bound acceptance and renoising
# --------------------------------------------------------------------------


def _two_sum(a, b):
    s = a + b
    b_virtual = s - a
    err = (a - (s - b_virtual)) + (b - b_virtual)
    return s, err


def _combine_double_float(x, y):
    (x_hi, x_lo), (y_hi, y_lo) = x, y
    s, e = _two_sum(x_hi, y_hi)
    e = e + (x_lo + y_lo)
    hi = s + e
    lo = e - (hi - s)
    return hi, lo


def _cumsum_rounded_f32(x: jax.Array) -> jax.Array:
    """Inclusive cumsum over the last axis, each output ~correctly rounded.

    torch's CPU cumsum for float32 accumulates in float64 and rounds each
    prefix to float32. A plain float32 scan (jnp.cumsum) rounds differently;
    a double-float (hi, lo) associative scan reproduces torch's prefixes
    except in astronomically rare midpoint cases, on any backend.
    """
    hi, _ = lax.associative_scan(
        _combine_double_float, (x, jnp.zeros_like(x)), axis=x.ndim - 1
    )
    return hi


def entropy_bound_accept(entropy: jax.Array, bound) -> jax.Array:
    """Which positions the entropy-bound sampler accepts.

    Per row: sort the entropies ascending (stable: equal entropies keep their
    position order), take the inclusive prefix sums C_k of the sorted values
    h_k, accept rank k iff C_k - h_k <= bound (i.e. the sum of the entropies
    ranked strictly below k is at most `bound`), and scatter the decision
    back to canvas positions. The lowest-entropy position is always accepted.

    This is HF's `EntropyBoundSampler.accept_canvas` rule: non-strict <=,
    `C_k - h_k` evaluated in float32 from prefix sums rounded to float32
    once (torch's CPU cumsum accumulates float32 in float64), and `bound`
    rounded to float32. One deliberate difference: HF ranks equal entropies
    with `torch.sort(stable=False)`, whose order among equal keys is an
    artifact of the algorithm (not stable on CPU for rows longer than 16,
    different again on CUDA). We rank them by position, so when several
    exactly-equal entropies straddle the cut-off we accept the lowest ids;
    HF accepts the same number of them, possibly at other positions.

    Args:
      entropy: float [B, L] (any leading dims).
      bound: Python float or scalar array (the entropy bound).
    Returns:
      bool [B, L].
    """
    h = entropy.astype(jnp.float32)
    order = jnp.argsort(h, axis=-1, stable=True)
    h_sorted = jnp.take_along_axis(h, order, axis=-1)
    below = _cumsum_rounded_f32(h_sorted) - h_sorted
    keep_sorted = below <= jnp.asarray(bound, jnp.float32)
    return jnp.put_along_axis(
        jnp.zeros(h.shape, jnp.bool_), order, keep_sorted, axis=-1, inplace=False
    )


def renoise(sampled: jax.Array, accept: jax.Array, noise_tokens: jax.Array) -> jax.Array:
    """Next canvas: the sampled token where accepted, fresh noise elsewhere.

    Equals HF's accept_canvas + renoise_canvas composition (the input canvas
    does not survive anywhere, every unaccepted position is renoised).

    Args:
      sampled: int [B, L] tokens sampled this step.
      accept: bool [B, L] from `entropy_bound_accept`.
      noise_tokens: int [B, L] uniform tokens (see `uniform_tokens`).
    Returns:
      int [B, L] with the dtype of `sampled`.
    """
    return jnp.where(accept, sampled, noise_tokens.astype(sampled.dtype))


def uniform_tokens(key: jax.Array, shape: Sequence[int], vocab_size: int) -> jax.Array:
    """i.i.d. uniform token ids over the full vocab [0, vocab_size), int32.

    Used both for the initial canvas and for renoising (special ids included,
    as in HF's `randint(0, vocab_size)`).
    """
    return jax.random.randint(key, tuple(shape), 0, vocab_size, dtype=jnp.int32)


# --------------------------------------------------------------------------
# Adaptive stopping (stable and confident)
# --------------------------------------------------------------------------


def init_history(batch_size: int, config: SamplerConfig) -> jax.Array:
    """Empty argmax history: int32 [B, S, L] filled with -1.

    -1 is never a token id, so nothing is stable until S argmax canvases have
    been pushed (HF initialises its history the same way). S is
    `config.history_length`: the stability threshold, capped at the step
    budget (a larger threshold can never be met, and the cap decides the same).
    """
    return jnp.full(
        (batch_size, config.history_length, config.canvas_length), -1, jnp.int32
    )


def push_history(history: jax.Array, argmax: jax.Array) -> jax.Array:
    """Drops the oldest argmax canvas and appends `argmax` as the newest.

    Args:
      history: int [B, S, L], oldest first.
      argmax: int [B, L].
    Returns:
      int [B, S, L].
    """
    return jnp.concatenate(
        [history[:, 1:], argmax[:, None, :].astype(history.dtype)], axis=1
    )


def stop_decision(
    argmax: jax.Array,
    history: jax.Array,
    mean_entropy: jax.Array,
    confidence_threshold,
) -> jax.Array:
    """HF's StableAndConfidentStoppingCriteria for one step (history not yet
    updated with `argmax`; call `push_history` afterwards).

    stable    = argmax equals every one of the S history canvases at every
                position (so with a fresh -1 history nothing is stable);
    confident = mean_entropy < confidence_threshold (strict, threshold
                rounded to float32 as in torch).

    Args:
      argmax: int [B, L] argmax canvas of this step.
      history: int [B, S, L] previous argmax canvases.
      mean_entropy: float [B] mean over L of the tempered entropies.
      confidence_threshold: a float, or float [B]: one threshold per row (a server's slots each
        run their own request's settings).
    Returns:
      bool [B]: stable & confident.
    """
    stable = jnp.all(history == argmax[:, None, :].astype(history.dtype), axis=(1, 2))
    confident = mean_entropy.astype(jnp.float32) < jnp.asarray(confidence_threshold, jnp.float32)
    return stable & confident


# --------------------------------------------------------------------------
# End of sequence and metrics
# --------------------------------------------------------------------------


def truncate_at_eos(
    tokens: jax.Array,
    eos_ids: Sequence[int],
    pad_id: int,
    *,
    finished: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Keeps each row up to and including its first EOS and pads the rest.

    Matches HF's `_finalize_canvas`: every token after the first token whose
    id is in `eos_ids` becomes `pad_id` (later EOS ids included); rows without
    EOS are unchanged. If `finished` is given, rows already finished in an
    earlier canvas are replaced entirely by `pad_id` (HF does the same).

    Args:
      tokens: int [B, L] committed (argmax) canvas.
      eos_ids: static sequence of EOS ids (may be empty: no truncation).
      pad_id: id written after EOS.
      finished: optional bool [B], rows finished before this canvas.
    Returns:
      (tokens int [B, L] same dtype, has_eos bool [B]: this canvas contains
      an EOS before truncation).
    """
    eos_ids = tuple(int(e) for e in eos_ids)
    pad = jnp.asarray(pad_id, tokens.dtype)
    if eos_ids:
        eos = jnp.asarray(eos_ids, tokens.dtype)
        is_eos = jnp.any(tokens[..., None] == eos, axis=-1)
        eos_before = jnp.cumsum(is_eos.astype(jnp.int32), axis=-1) - is_eos.astype(jnp.int32)
        out = jnp.where(eos_before > 0, pad, tokens)
        has_eos = jnp.any(is_eos, axis=-1)
    else:
        out = tokens
        has_eos = jnp.zeros(tokens.shape[:-1], jnp.bool_)
    if finished is not None:
        out = jnp.where(finished[..., None], pad, out)
    return out, has_eos


def tokens_per_forward(sequences, decoder_passes, pad_id: int | None = 0, prompt_length: int = 0):
    """HF's `_compute_tokens_per_forward` metric, float32 [B].

    (number of generated tokens that are not `pad_id`) / (decoder passes made
    while the row was unfinished), where generated tokens are
    `sequences[:, prompt_length:]`. With `pad_id=None` every generated token
    counts. Zero passes give inf/nan, as in HF.

    Works on NumPy arrays (returns NumPy) and on JAX arrays (returns JAX).

    Args:
      sequences: int [B, T] (prompt + generated) or [B, G] with prompt_length=0.
      decoder_passes: int [B].
      pad_id: pad id, or None.
      prompt_length: number of leading prompt tokens to skip.
    """
    xp = jnp if isinstance(sequences, jax.Array) or isinstance(decoder_passes, jax.Array) else np
    new = xp.asarray(sequences)[..., prompt_length:]
    if pad_id is None:
        valid = xp.full(new.shape[:-1], new.shape[-1])
    else:
        valid = xp.sum(new != pad_id, axis=-1)
    num = xp.asarray(valid).astype(xp.float32)
    den = xp.asarray(decoder_passes).astype(xp.float32)
    if xp is np:
        with np.errstate(divide="ignore", invalid="ignore"):
            return num / den
    return num / den
