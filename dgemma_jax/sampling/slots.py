"""Generation over a fixed set of slots, one request per slot, advanced one step at a time.

A server holds N slots: one KV-cache row and one canvas in flight each (a `loop.Canvas` whose
rows are different requests' canvases, each with its own step counter). A request
enters a free slot with `prefill_slot`, one prompt chunk per call (a batch-1 causal pass into that
row; the other rows are not read or written). Each tick of `slot_tick` advances every busy slot by
one denoising step of its own canvas, at its own step count; a call runs ticks until a slot's canvas
settles (or a tick budget is spent) and returns. The host starts their next canvases on the next call,
retires finished requests and feeds prompt chunks to the slots being admitted. A settled canvas whose
request goes on is committed by the next call's first tick: on an accelerator in the same pass over
the layers as that tick's step (`Runtime.commit_pass`; the weights read once for both), up to
`commit_rows(N / G)` rows of each of the G slot groups (G the data shards of a mesh, 1 without one; no
row leaves its group's chips), the slot's next canvas stepping against the cache with it written.
No slot waits for another slot's canvas (step-level continuous batching).

A slot's canvas c uses the key `fold_in(row_key, c)` and step s of it `fold_in(that, s)`, and is
committed exactly as `generate_fused` commits (EOS truncation, no commit after the request's last
canvas unless the host keeps it for prefix reuse), so a request runs the same algorithm as
`Engine.generate` with that row key. Every shape is fixed by (N, K, cache length); on XLA:CPU a
row's logits were then bit-identical whatever the other slots held (tests/test_serving_slots.py),
so a request's tokens do not depend on them there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import has_row_adapters, take_rows
from dgemma_jax.model.cache import SLOT_AXIS, KVCache, batch_axis, group_rows, put_group_rows
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.generate import committed_counts, canvas_start, commit, finish_canvas, prefill
from dgemma_jax.sampling.loop import Canvas, RowKnobs, commit_and_step, denoise_step, where_rows


COMMIT_SCOPE = "slot_commit"


@struct.dataclass
class TickOutput:
    """What `slot_tick` did. state / cache: the slots' canvases (`loop.Canvas`, step [N]) and the cache
    after it; ticks: [] the ticks it ran; settled: [N] the slot's canvas ended (at the last of those
    ticks); tokens: [N, L] the settled canvases, EOS-truncated (meaningless elsewhere); eos: [N] a
    settled canvas held an EOS; steps: [N] denoising passes of the slot's current canvas so far;
    argmax: [N, L] each slot's canvas as it stands (previews); nonfinite: [N] the slot's canvas met
    non-finite logits (`loop.nonfinite_rows`: its tokens are not the model's answer); owed: [N] settled
    canvases that go into their rows, which this call did not write (the caller hands them, with
    their `tokens`, to the next call's `commit`); committed: [N] the rows whose `commit` this call wrote."""

    state: Canvas
    cache: KVCache
    ticks: jax.Array
    settled: jax.Array
    tokens: jax.Array
    eos: jax.Array
    steps: jax.Array
    argmax: jax.Array
    nonfinite: jax.Array
    owed: jax.Array
    committed: jax.Array


def commit_rows(slots: int) -> int:
    """How many settled canvases one tick commits per slot group (K): one in 8 slots, at least one (at
    16 steps a canvas, N busy slots settle N/16 canvases a tick on average; more in one tick wait for
    the next call)."""
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
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, batch_axis(x)), cache)
    row = row.replace(lengths=jnp.broadcast_to(jnp.asarray(start, row.lengths.dtype), row.lengths.shape))
    row = prefill(params, config, tokens, length, row, runtime, images=images)
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, batch_axis(x)), cache, row)


def slot_tick(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, state: Canvas,
              keys: jax.Array, canvas_index: jax.Array, begin: jax.Array, active: jax.Array, last: jax.Array,
              keep: jax.Array, knobs: RowKnobs, max_ticks: jax.Array, seed: jax.Array | None = None,
              pinned: jax.Array | None = None, hold: jax.Array | None = None, end: jax.Array | None = None,
              commit: jax.Array | None = None, commit_tokens: jax.Array | None = None,
              runtime: Runtime | None = None) -> TickOutput:
    """Up to `max_ticks` ticks, each one denoising step in every busy slot, ending with the tick in
    which a slot's canvas settles. The settled canvases whose request goes on are not written here:
    they come back as `owed`, and the next call writes them in its first tick, in the same pass over
    the layers as that tick's step (`loop.commit_and_step` with rows: the weights read once for both),
    before the slot's next canvas takes its first step.

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
    commit, commit_tokens: [N] rows owed a commit (an earlier call's `owed`) and [N, L] their canvases.
    The first tick writes up to `commit_rows(N / G)` of them in each of the G slot groups (G the
    mesh's shards of the batch axis: no row leaves its group's devices); a busy row still owed after
    it does not step (its next canvas waits for its context), and the call then returns after that
    tick.
    """
    rt = runtime if runtime is not None else Runtime()
    n, width = keys.shape[0], sampler.canvas_length
    commit = jnp.zeros((n,), bool) if commit is None else commit
    commit_tokens = jnp.zeros((n, width), jnp.int32) if commit_tokens is None else commit_tokens
    rows, writes, chosen = _chosen_commits(commit, rt.shards(n, "batch"))
    fresh = canvas_start(config, sampler, keys, canvas_index, jnp.zeros_like(begin))
    canvas = jax.tree.map(lambda a, b: where_rows(begin, a, b), fresh, state)
    hold = jnp.zeros((n,), bool) if hold is None else hold
    ending = active & hold & ~begin & (jnp.zeros((n,), bool) if end is None else end)   # settles without a step
    live = active & (~canvas.state.done | ending)
    waiting = commit & ~chosen                                    # owed a commit this call does not write
    loop = canvas.state.replace(done=~live | ending | waiting)
    step = functools.partial(denoise_step, params, config, sampler, keys=canvas.keys, seed=seed, pinned=pinned,
                             knobs=knobs, runtime=runtime)
    kept = lambda lp, new: new.replace(step=jnp.where(lp.done, lp.step, new.step))   # noqa: E731 (a frozen row's step)

    def commit_tick(lp, c):   # the chosen rows written and every live canvas stepped
        g, k = rows.shape
        toks = jnp.take_along_axis(commit_tokens.reshape(g, n // g, width), rows[:, :, None], axis=1)
        if rt.fuse_commit() and not has_row_adapters(params):   # one pass over the layers
            new, c = commit_and_step(params, config, sampler, c, toks.reshape(g * k, width),
                                     committed_counts(toks.reshape(g * k, width), writes.reshape(-1)), canvas.keys, lp,
                                     seed=seed, pinned=pinned, knobs=knobs, runtime=runtime, rows=rows)
        else:   # the commit's causal pass, then the step (per-row LoRA adapters: rows of either pass differ)
            c = commit_slots(params, config, c, rows, toks, writes, runtime)
            new = step(cache=c, context_end=c.lengths, state=lp)
        return kept(lp, new), c

    with jax.named_scope(COMMIT_SCOPE):   # a scope name for the projections (benchmarks/serve_projection.py)
        first, cache = jax.lax.cond(jnp.any(commit), commit_tick, lambda lp, c: (lp, c), loop, cache)

    def tick(carry):
        t, lp = carry
        return t + 1, kept(lp, step(cache=cache, context_end=cache.lengths, state=lp))

    def going(carry):
        t, lp = carry
        return (t < max_ticks) & ~jnp.any(live & ~ending & lp.done) & jnp.any(~lp.done)

    ticks, new = jax.lax.while_loop(going, tick, (jnp.any(commit).astype(jnp.int32), first))
    settled = live & new.done & ~waiting
    toks, ended = finish_canvas(sampler, new.argmax, ~settled)
    eos = ended & settled
    owed = settled & ~hold & ((~eos & ~last) | keep)
    new = new.replace(done=new.done | ~active)   # an inactive slot stays frozen
    # the slots' state comes back placed as it went in (`Engine.new_slots`): each row with its cache row
    # on a mesh whose data axis splits the slots, the keys replicated; the next call takes it as it is
    new = jax.tree.map(lambda x: rt.constrain(x, ("batch",) + (None,) * (x.ndim - 1)), new)
    keys = rt.constrain(canvas.keys, (None,))
    return TickOutput(canvas.replace(state=new, keys=keys), cache, ticks, settled, toks, eos, new.steps, new.argmax,
                      new.nonfinite & live, owed, chosen & commit)


def _chosen_commits(commit: jax.Array, groups: int):
    """The rows of `commit` [N] one tick writes: up to K = `commit_rows(N / G)` of each of the G groups
    of N / G consecutive rows, the lowest-numbered first. Returns (rows [G, K] within each group,
    writes [G, K]: the row is owed one (fewer than K owed in a group leave the rest unwritten),
    chosen [N])."""
    n = commit.shape[0]
    per = n // groups
    go = commit.reshape(groups, per)
    rows = jnp.argsort(~go, axis=1, stable=True).astype(jnp.int32)[:, :commit_rows(per)]   # distinct rows
    writes = jnp.take_along_axis(go, rows, axis=1)
    chosen = jnp.zeros_like(go).at[jnp.arange(groups)[:, None], rows].set(writes).reshape(n)
    return rows, writes, chosen


def commit_slots(params, config: ModelConfig, cache: KVCache, rows: jax.Array, tokens: jax.Array,
                 active: jax.Array, runtime: Runtime | None = None) -> KVCache:
    """Commit settled canvases into their slots' rows, group by group, in a causal pass of their own.

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
    sub = jax.tree.map(lambda x: group_rows(x, rows), cache)
    starts = sub.lengths
    # the pass runs G * K rows: per-row LoRA adapters (the server's, `model.api.with_adapters`) follow them
    picked = (jnp.arange(g, dtype=rows.dtype)[:, None] * (cache.lengths.shape[0] // g) + rows).reshape(-1)
    sub = commit(take_rows(params, picked), config, sub, tokens.reshape(g * k, -1), active.reshape(-1), runtime)
    width = tokens.shape[-1]
    # a sliding layer's ring (fewer slots than the rows' length): the L positions may wrap round its
    # end, so the row's whole ring goes back (it is the window plus one canvas, model/cache.py)
    return jax.tree.map(lambda x, part: put_group_rows(x, part, rows, starts, width,
                                                       x.ndim > 1 and x.shape[SLOT_AXIS] < cache.max_length),
                        cache, sub)


def read_row(cache: KVCache, slot: jax.Array) -> KVCache:
    """Row `slot` of the slots' cache (a batch-1 `KVCache`: its keys, values and length), to keep
    on the host while its request is preempted."""
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, batch_axis(x)), cache)


def write_row(cache: KVCache, slot: jax.Array, row: KVCache) -> KVCache:
    """The cache with row `slot` replaced by `row` (what `read_row` gave, from any slot)."""
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, batch_axis(x)),
                        cache, row)
