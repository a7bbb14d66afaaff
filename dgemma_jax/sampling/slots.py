"""Generation over a fixed set of slots, one request per slot, advanced one step at a time.

A server holds N slots: one KV-cache row and one canvas in flight each (a `loop.Canvas` whose
rows are different requests' canvases, each with its own step counter). A request
enters a free slot with `prefill_slot`, one prompt chunk per call (a batch-1 causal pass into that
row; the other rows are not read or written). Each tick of `slot_tick` advances every busy slot by
one denoising step of its own canvas, at its own step count; a call runs ticks until a slot's canvas
settles (or a tick budget is spent), commits the settled canvases whose request goes on with a causal
pass over up to `commit_rows(N / G)` of those rows of each of the G slot groups at a time (G the
data shards of a mesh, 1 without one; never over all N, and no row leaves its group's chips), and
returns. The host starts
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
from dgemma_jax.model.api import take_rows
from dgemma_jax.model.cache import SLOT_AXIS, KVCache
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.generate import canvas_start, commit, finish_canvas, prefill
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
    position_ids) of the images wholly inside this chunk (`prefill`): an image's tokens must all
    be in one chunk, since it attends to itself bidirectionally."""
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, _batch_axis(x)), cache)
    row = row.replace(lengths=jnp.broadcast_to(jnp.asarray(start, row.lengths.dtype), row.lengths.shape))
    row = prefill(params, config, tokens, length, row, runtime, images=images)
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, _batch_axis(x)), cache, row)


def slot_tick(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, state: Canvas,
              keys: jax.Array, canvas_index: jax.Array, begin: jax.Array, active: jax.Array, last: jax.Array,
              keep: jax.Array, knobs: RowKnobs, max_ticks: jax.Array, seed: jax.Array | None = None,
              pinned: jax.Array | None = None, hold: jax.Array | None = None, end: jax.Array | None = None,
              runtime: Runtime | None = None) -> TickOutput:
    """Up to `max_ticks` ticks, each one denoising step in every busy slot, ending with the tick in
    which a slot's canvas settles; then the settled canvases whose request goes on are committed,
    `commit_rows(N / G)` rows of each slot group a causal pass (`_commit_settled`), and the call
    returns (the host starts
    their next canvases on the next tick).

    keys: [N] the requests' row keys; canvas_index: [N] int32 each slot's canvas number; begin: [N]
    the slot starts canvas `canvas_index` now (from its key's noise); active: [N] slots with a
    request (the others, and a slot whose request is gone, are frozen and write nothing); last: [N]
    the canvas is its request's last (not committed, unless `keep`); keep: [N] commit it even so (the
    host keeps the answer in the row for prefix reuse). `sampler` gives the canvas length, EOS ids
    and stability threshold; `knobs` each slot's own schedule, step budget and thresholds
    (`knobs.temperatures` is as wide as the longest budget).
    seed, pinned: [N, L] positions each slot's canvas holds at the seed's tokens this call (a structured
    request's valid prefix, `engine/structured.py`; none held in a row without pins, which steps
    exactly as without them); hold: [N] slots whose canvas the host ends and commits itself (a
    structured request's): the tick never commits them; end: [N] held slots whose canvas is complete
    (every position held): it settles in this call without another step.
    """
    fresh = canvas_start(config, sampler, keys, canvas_index, jnp.zeros_like(begin))
    canvas = jax.tree.map(lambda a, b: where_rows(begin, a, b), fresh, state)
    n = keys.shape[0]   # slots
    hold = jnp.zeros((n,), bool) if hold is None else hold
    ending = active & hold & ~begin & (jnp.zeros((n,), bool) if end is None else end)   # settles without a step
    live = active & (~canvas.state.done | ending)
    loop = canvas.state.replace(done=~live | ending)

    def tick(carry):
        t, lp = carry
        new = denoise_step(params, config, sampler, cache, cache.lengths, canvas.keys, lp, knobs=knobs,
                           seed=seed, pinned=pinned, runtime=runtime)
        return t + 1, new.replace(step=jnp.where(lp.done, lp.step, new.step))   # a frozen row keeps its step

    def going(carry):
        t, lp = carry
        return (t < max_ticks) & ~jnp.any(live & ~ending & lp.done) & jnp.any(~lp.done)

    ticks, new = jax.lax.while_loop(going, tick, (jnp.zeros((), jnp.int32), loop))
    settled = live & new.done
    toks, ended = finish_canvas(sampler, new.argmax, ~settled)
    eos = ended & settled
    with jax.named_scope(COMMIT_SCOPE):   # a scope name for the projections (benchmarks/serve_projection.py)
        cache = _commit_settled(params, config, cache, toks, settled & ~hold & ((~eos & ~last) | keep), runtime)
    new = new.replace(done=new.done | ~active)   # an inactive slot stays frozen
    # the slots' state comes back placed as it went in (`Engine.new_slots`): each row with its cache row
    # on a mesh whose data axis splits the slots, the keys replicated; the next call takes it as it is
    rt = runtime if runtime is not None else Runtime()
    new = jax.tree.map(lambda x: rt.constrain(x, ("batch",) + (None,) * (x.ndim - 1)), new)
    keys = rt.constrain(canvas.keys, (None,))
    return TickOutput(canvas.replace(state=new, keys=keys), cache, ticks, settled, toks, eos, new.steps, new.argmax,
                      new.nonfinite & live)


def _commit_settled(params, config: ModelConfig, cache: KVCache, tokens: jax.Array, go_on: jax.Array,
                    runtime: Runtime | None) -> KVCache:
    """Commit the `go_on` rows' canvases (none when no row goes on), group by group.

    The N slots form G groups of N / G consecutive rows, G the shards of the batch axis on the mesh
    (`Runtime.shards(N, "batch")`: 1 without a mesh or with the batch replicated). Each pass commits
    up to `commit_rows(N / G)` rows of every group, so a group's rows never leave the devices that
    hold them (no cache row moves between data shards); K = G * commit_rows(N / G) rows a pass."""
    n = go_on.shape[0]
    groups = 1 if runtime is None else runtime.shards(n, "batch")
    per = n // groups
    kk = commit_rows(per)
    go = go_on.reshape(groups, per)
    order = jnp.argsort(~go, axis=1, stable=True).astype(jnp.int32)   # each group's rows to commit first
    counts = jnp.sum(go, axis=1)                                       # [G]
    grouped = tokens.reshape(groups, per, tokens.shape[-1])

    def one(carry):
        i, c = carry
        begin = jnp.minimum(i * kk, per - kk)          # a K-slice of distinct rows (the last one may overlap)
        at = begin + jnp.arange(kk)
        rows = jax.lax.dynamic_slice_in_dim(order, begin, kk, axis=1)    # [G, kk], within each group
        active = (at[None, :] >= i * kk) & (at[None, :] < counts[:, None])
        canvases = jnp.take_along_axis(grouped, rows[:, :, None], axis=1)
        return i + 1, commit_slots(params, config, c, rows, canvases, active, runtime)

    return jax.lax.while_loop(lambda carry: carry[0] * kk < jnp.max(counts), one,
                              (jnp.zeros((), jnp.int32), cache))[1]


def commit_slots(params, config: ModelConfig, cache: KVCache, rows: jax.Array, tokens: jax.Array,
                 active: jax.Array, runtime: Runtime | None = None) -> KVCache:
    """Commit settled canvases into their slots' rows, group by group.

    Args:
      cache: the slots' cache, N rows in G groups of N / G consecutive rows.
      rows: [G, K] distinct row numbers within each group (row g * N / G + rows[g, k] of the cache).
      tokens: [G, K, L] their canvases. active: [G, K] which of them to write.
    Returns:
      the cache with those rows' L new positions written (in place) after one causal pass over the
      G * K rows only, whatever the number of slots. Reads and writes are batched over the groups,
      so on a mesh whose data axis splits the slots each group stays on its own devices.
    """
    g, k = rows.shape
    sub = jax.tree.map(lambda x: _rows_of(x, rows), cache)
    starts = sub.lengths.reshape(g, k)
    # the pass runs G * K rows: per-row LoRA adapters (the server's, `model.api.with_adapters`) follow them
    picked = (jnp.arange(g, dtype=rows.dtype)[:, None] * (cache.lengths.shape[0] // g) + rows).reshape(-1)
    sub = commit(take_rows(params, picked), config, sub, tokens.reshape(g * k, -1), active.reshape(-1), runtime)
    width = tokens.shape[-1]

    def write_back(x, part):
        b = _batch_axis(x)
        # a sliding layer's ring (fewer slots than the rows' length): the L positions may wrap round its
        # end, so the row's whole ring goes back (it is the window plus one canvas, model/cache.py)
        whole = x.ndim > 1 and x.shape[SLOT_AXIS] < cache.max_length
        x = _grouped(x, g)
        part = part.reshape(part.shape[:b] + (g, k) + part.shape[b + 1:])
        if x.ndim == 2:                                   # lengths [G, N / G]
            return x.at[jnp.arange(g)[:, None], rows].set(part).reshape(-1)
        at = jnp.zeros_like(starts) if whole else starts
        size = part.shape[SLOT_AXIS] if whole else width
        slot_axis = x.ndim - 1 + SLOT_AXIS                # within one group's leaf

        def put(xg, pg, r, s):                            # row r's slots from s on := pg
            index = [jnp.zeros((), jnp.int32)] * xg.ndim
            index[b], index[slot_axis] = r, s
            return jax.lax.dynamic_update_slice(xg, pg, index)

        for j in range(k):                                # K static: one in-place update of L positions a row
            piece = jax.vmap(lambda p, s: jax.lax.dynamic_slice_in_dim(p, s, size, slot_axis),  # noqa: B023
                             in_axes=(b, 0), out_axes=b)(jax.lax.index_in_dim(part, j, b + 1), at[:, j])
            x = jax.vmap(put, in_axes=(b, b, 0, 0), out_axes=b)(x, piece, rows[:, j], at[:, j])
        return x.reshape(x.shape[:b] + (-1,) + x.shape[b + 2:])

    return jax.tree.map(write_back, cache, sub)


def _grouped(x, groups: int):
    """A cache leaf with its batch axis [N] viewed as [G, N / G]."""
    b = _batch_axis(x)
    return x.reshape(x.shape[:b] + (groups, -1) + x.shape[b + 1:])


def _rows_of(x, rows):
    """Rows `rows` [G, K] (within each group) of a cache leaf, as a leaf of G * K rows (reads those rows
    only). Each row is a dynamic slice, batched over the groups: a gather of whole rows
    (`take_along_axis`) made XLA:TPU keep the 26B's sliding-layer caches in another layout inside the
    commit loop and copy every one of them into it and back on each tick: at 32 slots on a v6e-8 split
    data=2,expert=4 the tick moved 84.6 GB per chip with the gather, 70.4 GB with the slices."""
    b = _batch_axis(x)
    g, k = rows.shape
    xg = _grouped(x, g)

    def group_rows(xgi, ri):   # one group's leaf (its rows on axis b) -> its K rows
        return jnp.stack([jax.lax.dynamic_index_in_dim(xgi, ri[j], b, keepdims=False) for j in range(k)], axis=b)

    picked = jax.vmap(group_rows, in_axes=(b, 0), out_axes=b)(xg, rows)
    return picked.reshape(picked.shape[:b] + (g * k,) + picked.shape[b + 2:])


def _batch_axis(x) -> int:
    """The batch axis of a cache leaf: lengths [B]; keys / values [B, K, S, H] or, stacked, [G, B, K, S, H]."""
    return 0 if x.ndim == 1 else x.ndim - 4


def read_row(cache: KVCache, slot: jax.Array) -> KVCache:
    """Row `slot` of the slots' cache (a batch-1 `KVCache`: its keys, values and length), to keep
    on the host while its request is preempted."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, _batch_axis(x)), cache)


def write_row(cache: KVCache, slot: jax.Array, row: KVCache) -> KVCache:
    """The cache with row `slot` replaced by `row` (what `read_row` gave, from any slot)."""
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, _batch_axis(x)),
                        cache, row)
