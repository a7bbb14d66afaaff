"""Generation over a fixed set of slots, one request per slot, advanced one step at a time.

A server holds N slots: one KV-cache row and one canvas in flight each (a `loop.Canvas` whose
rows are different requests' canvases, each with its own step counter). A request
enters a free slot with `prefill_slot`, one prompt chunk per call (a batch-1 causal pass into that
row; the other rows are not read or written). Each tick of `slot_tick` advances every busy slot by
one denoising step of its own canvas, at its own step count; a call runs ticks until a slot's canvas
settles (or a tick budget is spent), commits the settled canvases whose request goes on with a causal
pass over K = `commit_rows(N)` of those rows at a time (not over all N), and returns. The host starts
their next canvases on the next tick, retires finished requests and feeds prompt chunks to the
slots being admitted. No slot waits for another slot's canvas (step-level continuous batching).

A slot's canvas c uses the key `fold_in(row_key, c)` and step s of it `fold_in(that, s)`, and is
committed exactly as `generate_fused` commits (EOS truncation, no commit after the request's last
canvas unless the host keeps it for prefix reuse), so a request runs the same algorithm as
`Engine.generate` with that row key. Every shape is fixed by (N, K, cache length); on XLA:CPU a
row's logits were then bit-identical whatever the other slots held (tests/test_serving_slots.py),
so a request's tokens do not depend on them there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.cache import KVCache
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.generate import canvas_start, commit, finish_canvas, prefill_prompt
from dgemma_jax.sampling.loop import Canvas, RowKnobs, denoise_step, where_rows


COMMIT_SCOPE = "slot_commit"


@struct.dataclass
class TickOutput:
    """What `slot_tick` did. state / cache: the slots' canvases (`loop.Canvas`, step [N]) and the cache
    after it; ticks: [] the ticks it ran; settled: [N] the slot's canvas ended (at the last of those
    ticks); tokens: [N, L] the settled canvases, EOS-truncated (meaningless elsewhere); eos: [N] a
    settled canvas held an EOS; steps: [N] denoising passes of the slot's current canvas so far;
    argmax: [N, L] each slot's canvas as it stands (previews); nonfinite: [N] the slot's canvas met
    non-finite logits (`loop.nonfinite_rows`: its tokens are not the model's answer)."""

    state: Canvas
    cache: KVCache
    ticks: jax.Array
    settled: jax.Array
    tokens: jax.Array
    eos: jax.Array
    steps: jax.Array
    argmax: jax.Array
    nonfinite: jax.Array


def commit_rows(slots: int) -> int:
    """How many settled canvases one commit pass writes (K): one in 8 slots, at least one (at 16 steps
    a canvas, N busy slots settle N/16 canvases a tick on average; more in one tick take more passes)."""
    return max(1, slots // 8)


def idle_slots(config: ModelConfig, sampler: SamplerConfig, slots: int) -> Canvas:
    """N idle slots: every row done, each with its own step counter."""
    keys = jax.random.wrap_key_data(jnp.zeros((slots, 2), jnp.uint32))
    return canvas_start(config, sampler, keys, jnp.zeros((slots,), jnp.int32), jnp.ones((slots,), bool))


def prefill_slot(params, config: ModelConfig, cache: KVCache, slot: jax.Array, tokens: jax.Array,
                 length: jax.Array, start: jax.Array, runtime: Runtime | None = None, images=None) -> KVCache:
    """Write a prompt chunk into row `slot` at position `start`: tokens [1, W] (right-padded), length
    [1] valid tokens.

    The row's committed length is set to `start` first: 0 for a request's first chunk, the end of the
    previous chunk for the next ones, or the length of a prefix the row already holds (prefix reuse:
    the row's first `start` positions stay as they are and are attended to). What the row held beyond
    `start` stays behind its new length, where nothing reads it. images: None, or (pixel_values,
    position_ids) of the images wholly inside this chunk (`prefill_prompt`): an image's tokens must all
    be in one chunk, since it attends to itself bidirectionally."""
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, _batch_axis(x)), cache)
    row = row.replace(lengths=jnp.broadcast_to(jnp.asarray(start, row.lengths.dtype), row.lengths.shape))
    row = prefill_prompt(params, config, tokens, length, row, runtime, images=images)
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, _batch_axis(x)), cache, row)


def slot_tick(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, state: Canvas,
              keys: jax.Array, canvas_index: jax.Array, begin: jax.Array, active: jax.Array, last: jax.Array,
              keep: jax.Array, knobs: RowKnobs, max_ticks: jax.Array, runtime: Runtime | None = None) -> TickOutput:
    """Up to `max_ticks` ticks, each one denoising step in every busy slot, ending with the tick in
    which a slot's canvas settles; then the settled canvases whose request goes on are committed,
    `commit_rows(N)` rows a causal pass (`commit_slots`), and the call returns (the host starts
    their next canvases on the next tick).

    keys: [N] the requests' row keys; canvas_index: [N] int32 each slot's canvas number; begin: [N]
    the slot starts canvas `canvas_index` now (from its key's noise); active: [N] slots with a
    request (the others, and a slot whose request is gone, are frozen and write nothing); last: [N]
    the canvas is its request's last (not committed, unless `keep`); keep: [N] commit it even so (the
    host keeps the answer in the row for prefix reuse). `sampler` gives the canvas length, EOS ids
    and stability threshold; `knobs` each slot's own schedule, step budget and thresholds
    (`knobs.temperatures` is as wide as the longest budget).
    """
    fresh = canvas_start(config, sampler, keys, canvas_index, jnp.zeros_like(begin))
    canvas = jax.tree.map(lambda a, b: where_rows(begin, a, b), fresh, state)
    live = active & ~canvas.state.done
    loop = canvas.state.replace(done=~live)

    def tick(carry):
        t, lp = carry
        new = denoise_step(params, config, sampler, cache, cache.lengths, canvas.keys, lp, knobs=knobs,
                           runtime=runtime)
        return t + 1, new.replace(step=jnp.where(lp.done, lp.step, new.step))   # a frozen row keeps its step

    def going(carry):
        t, lp = carry
        return (t < max_ticks) & ~jnp.any(live & lp.done) & jnp.any(~lp.done)

    ticks, new = jax.lax.while_loop(going, tick, (jnp.zeros((), jnp.int32), loop))
    settled = live & new.done
    toks, ended = finish_canvas(sampler, new.argmax, ~settled)
    eos = ended & settled
    with jax.named_scope(COMMIT_SCOPE):   # a scope name for the projections (benchmarks/serve_projection.py)
        cache = _commit_settled(params, config, cache, toks, settled & ((~eos & ~last) | keep), runtime)
    new = new.replace(done=new.done | ~active)   # an inactive slot stays frozen
    return TickOutput(canvas.replace(state=new), cache, ticks, settled, toks, eos, new.steps, new.argmax,
                      new.nonfinite & live)


def _commit_settled(params, config: ModelConfig, cache: KVCache, tokens: jax.Array, go_on: jax.Array,
                    runtime: Runtime | None) -> KVCache:
    """Commit the `go_on` rows' canvases, K = `commit_rows(N)` rows a pass (none when no row goes on)."""
    n = go_on.shape[0]
    kk = commit_rows(n)
    order = jnp.argsort(~go_on, stable=True).astype(jnp.int32)   # the rows to commit first
    count = jnp.sum(go_on)

    def one(carry):
        i, c = carry
        begin = jnp.minimum(i * kk, n - kk)          # a K-slice of distinct rows (the last one may overlap)
        at = begin + jnp.arange(kk)
        rows = jax.lax.dynamic_slice_in_dim(order, begin, kk)
        return i + 1, commit_slots(params, config, c, rows, tokens[rows], (at >= i * kk) & (at < count), runtime)

    return jax.lax.while_loop(lambda carry: carry[0] * kk < count, one, (jnp.zeros((), jnp.int32), cache))[1]


def commit_slots(params, config: ModelConfig, cache: KVCache, rows: jax.Array, tokens: jax.Array,
                 active: jax.Array, runtime: Runtime | None = None) -> KVCache:
    """Commit settled canvases into their slots' rows: rows [K] distinct slot numbers, tokens [K, L]
    their canvases, active [K] which of them to write. A causal pass over those K rows only, whatever
    the number of slots; only the L new positions of each row are written back (in place)."""
    sub = jax.tree.map(lambda x: _rows_of(x, rows), cache)
    starts = sub.lengths
    sub = commit(params, config, sub, tokens, active, runtime)
    width = tokens.shape[1]

    def write_back(x, part):
        if x.ndim == 1:                                   # lengths
            return x.at[rows].set(part)
        b = _batch_axis(x)
        for k in range(rows.shape[0]):                    # K static: one in-place update of L positions a row
            piece = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(part, k, 1, b), starts[k], width, b + 1)
            at = [jnp.zeros((), jnp.int32)] * x.ndim
            at[b], at[b + 1] = rows[k], starts[k]
            x = jax.lax.dynamic_update_slice(x, piece, at)
        return x

    return jax.tree.map(write_back, cache, sub)


def _rows_of(x, rows):
    """The K rows `rows` of a cache leaf, one dynamic slice each (reads those rows only)."""
    b = _batch_axis(x)
    return jnp.concatenate([jax.lax.dynamic_slice_in_dim(x, rows[k], 1, b) for k in range(rows.shape[0])], axis=b)


def _batch_axis(x) -> int:
    """The batch axis of a cache leaf: lengths [B]; keys / values [B, S, K, H] or, stacked, [G, B, S, K, H]."""
    return 0 if x.ndim == 1 else x.ndim - 4
