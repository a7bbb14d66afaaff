"""Generation over a fixed set of slots, one request per slot (continuous batching).

A server holds N slots: one KV-cache row each. A request enters a free slot with `prefill_slot`
(a batch-1 causal pass into that row; the other rows are not read or written). Then `slot_round`
denoises one canvas for every active slot together and commits it, so the slots advance canvas by
canvas, each at its own canvas index, with its own key stream and sampler settings (`RowKnobs`).
Between rounds the host retires finished requests and prefills waiting ones into their slots.

A slot's canvas c uses the key `fold_in(row_key, c)` and commits exactly as `generate_fused` does
(EOS truncation, no commit after the request's last canvas), so a request runs the same algorithm
as `Engine.generate` with that row key. Every shape is fixed by (N, cache length); on XLA:CPU a row's
logits were then bit-identical whatever the other slots held (tests/test_serving_slots.py), so a
request's tokens do not depend on them there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.cache import KVCache
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.generate import commit, finish_canvas, prefill_prompt
from dgemma_jax.sampling.loop import RowKnobs, denoise_canvas, initial_canvas


@struct.dataclass
class RoundOutput:
    """One canvas per slot. tokens: [N, L] EOS-truncated (pad for inactive slots); steps: [N]
    denoiser passes; eos: [N] the canvas held an EOS (active slots only); cache: the cache with
    the canvases committed where the request goes on; nonfinite: [N] the slot met non-finite logits
    (`loop.nonfinite_rows`: its tokens are not the model's answer)."""

    tokens: jax.Array
    steps: jax.Array
    eos: jax.Array
    cache: KVCache
    nonfinite: jax.Array


def prefill_slot(params, config: ModelConfig, cache: KVCache, slot: jax.Array, tokens: jax.Array,
                 length: jax.Array, fresh: jax.Array, runtime: Runtime | None = None, images=None) -> KVCache:
    """Write a prompt chunk into row `slot`: tokens [1, W] (right-padded), length [1] valid tokens.

    fresh: the chunk starts a new request (the row's committed length is reset to 0 first; what the
    row held before stays behind its new length, where nothing reads it); otherwise the chunk is
    appended causally after what the row holds, so a long prompt goes in as several chunks of one
    compiled width. images: None, or (pixel_values, position_ids) of the images wholly inside this
    chunk (`prefill_prompt`): an image's tokens must all be in one chunk, since it attends to itself
    bidirectionally."""
    row = jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=0), cache)
    row = row.replace(lengths=jnp.where(fresh, jnp.zeros_like(row.lengths), row.lengths))
    row = prefill_prompt(params, config, tokens, length, row, runtime, images=images)
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_slice_in_dim(x, r, slot, axis=0), cache, row)


def slot_round(params, config: ModelConfig, sampler: SamplerConfig, cache: KVCache, keys: jax.Array,
               canvas_index: jax.Array, active: jax.Array, last: jax.Array, knobs: RowKnobs,
               runtime: Runtime | None = None) -> RoundOutput:
    """Denoise one canvas in every active slot and commit those that go on.

    keys: [N] the requests' row keys; canvas_index: [N] int32 each slot's canvas number; active: [N]
    slots running a canvas this round (the others are frozen and write nothing); last: [N] this is
    the request's last canvas (not committed). `sampler` gives the canvas length, EOS ids, stability
    threshold and the loop's step bound; `knobs` each slot's own schedule and thresholds.
    """
    k = jax.vmap(jax.random.fold_in)(keys, canvas_index)
    start = initial_canvas(k, sampler.canvas_length, config.vocab_size)
    state = denoise_canvas(params, config, sampler, cache, k, canvas=start, done=~active, knobs=knobs,
                           runtime=runtime)
    toks, ended = finish_canvas(sampler, state.argmax, ~active)
    eos = ended & active
    go_on = active & ~eos & ~last
    cache = jax.lax.cond(jnp.any(go_on), lambda c: commit(params, config, c, toks, go_on, runtime),
                         lambda c: c, cache)
    return RoundOutput(toks, state.steps, eos, cache, state.nonfinite & active)
