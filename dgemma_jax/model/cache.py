"""The KV cache: an explicit pytree passed in and returned, never mutated in place.

`lengths[b]` is the number of committed tokens of row `b`. A global layer's slot `s` holds the
key/value of the token at absolute position `s` (`max_length` slots; slots `>= lengths[b]` are unused
and never visible). A sliding-window layer reads only the last `window - 1` committed tokens, so its
cache is a ring of `ring_size` = min(max_length, window + canvas_length, in 128-slot tiles above 128)
slots: position p lives in slot p mod ring_size, and a row whose committed end is E holds positions [E - ring_size, E) there
(`slot_positions`). The extra canvas_length slots beyond the window let a row be rewound (prefix
reuse) by up to canvas_length + 1 tokens and still hold the window before its new end
(`rewind_ok`); when max_length <= ring_size the ring is the identity (slot = position).
A cache made with `init_cache(..., ring=False)` keeps every position in the sliding layers too (training:
its denoiser reads contexts that end before the row's end); a layer holding more slots than any ring
(`ring_limit`) is read as such, through a window slice (slot = position).

Layout: a layer's keys and values are [B, K, S, H] (batch, kv head, slot, head dim): one kv head's
slots lie together, the order the canvas's attention reads them in (a [S, H] matrix per head for the
fused cache kernel, `model.flash`, and for the XLA path's batched matmuls), so the denoise step reads
the cache where it lies and never copies it into another order. `layer_shape` is that order in one place.

KV-head replicas: layer i may store each of its K_i kv heads r_i times in a row (cache head j holds
kv head j // r_i), so that a mesh splitting the query heads more ways than there are kv heads gives
every device exactly the kv head its query heads read (no per-step slicing of a replicated cache;
the same trick as tensor-parallel serving engines use). r_i must divide the query-group size
N / K_i. The attention infers r_i from the cache's head count; the math is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.layers import dtype_of
from dgemma_jax.model.layout import stack_cache


@struct.dataclass
class KVCache:
    """keys[i], values[i]: [B, K_i r_i, S_i, H_i] for layer i; lengths: [B] int32; kv_replicas: the
    r_i (static; None = 1 everywhere). groups (static): 0 = one entry per layer (above); G > 0 = the
    stacked layout of a scanned program (`model.layout.stack_cache`): keys[j] [G, B, K, S, H] for
    each position j of the repeated layer group, then the remainder layers' own entries."""

    keys: tuple
    values: tuple
    lengths: jax.Array
    kv_replicas: tuple | None = struct.field(pytree_node=False, default=None)
    groups: int = struct.field(pytree_node=False, default=0)
    # tokens per row (the global layers' slots; the sliding layers hold a ring of `ring_size` slots)
    length: int = struct.field(pytree_node=False, default=0)

    def replicas(self, layer: int) -> int:
        return 1 if self.kv_replicas is None else self.kv_replicas[layer]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def max_length(self) -> int:
        return self.length


# the slot and kv-head axes of a cache leaf, counted from its end (a stacked leaf has a layer axis in front)
SLOT_AXIS = -2
HEAD_AXIS = -3


def layer_shape(batch: int, slots: int, kv_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """The shape of one layer's keys (or values): [batch, kv_heads, slots, head_dim]."""
    return (int(batch), int(kv_heads), int(slots), int(head_dim))


def ring_size(config: ModelConfig, max_length: int) -> int:
    """Slots of a sliding-window layer's cache for rows of `max_length` tokens: the window plus one
    canvas (see the module docstring), from 128 up a whole number of 128-slot tiles (what the
    denoiser's cache kernel, `model.flash`, takes; the 26B: 1,280), never more than max_length."""
    size = config.sliding_window + config.canvas_length
    if size > 128:
        size = -(-size // 128) * 128
    return min(int(max_length), size)


def ring_limit(config: ModelConfig) -> int:
    """The most slots a sliding layer's ring ever has (`ring_size` of an unbounded row): a sliding
    layer's cache with more slots holds every position (`init_cache(ring=False)`)."""
    return ring_size(config, 1 << 62)


def layer_slots(config: ModelConfig, layer: int, max_length: int, ring: bool = True) -> int:
    """Cache slots of layer `layer`: max_length (global, or every layer with ring=False) or the ring
    (sliding)."""
    return int(max_length) if config.is_global(layer) or not ring else ring_size(config, max_length)


def sliding_slots(cache: KVCache) -> int:
    """The slots of the cache's sliding layers (its smallest layer entry; max_length when every
    layer holds every position)."""
    return min(k.shape[SLOT_AXIS] for k in cache.keys)


def slot_positions(ends: jax.Array, size: int) -> jax.Array:
    """[B, size] the position each slot of a ring of `size` slots holds when row b's committed end is
    ends[b]: the largest p < ends[b] with p = slot (mod size); negative = the slot holds nothing.
    (With size >= ends the identity: slot s holds position s, or nothing when s >= ends.)"""
    slot = jnp.arange(size, dtype=jnp.int32)[None, :]
    last = ends.astype(jnp.int32)[:, None] - 1
    return last - jnp.mod(last - slot, size)


def rewind_ok(config: ModelConfig, max_length: int, row_length: int, keep: int) -> bool:
    """Whether a row that holds `row_length` committed tokens can be rewound to its first `keep`
    (prefix reuse: `lengths` set to keep, the rest prefilled again): its sliding layers' rings must
    still hold the window-1 tokens before `keep`, i.e. nothing of them overwritten by the tokens
    after it. True when the ring holds the whole row, or keep is at most canvas_length + 1 tokens
    back from the row's end."""
    ring = ring_size(config, max_length)
    keep, row_length = int(keep), int(row_length)
    if keep < 0 or keep > row_length:
        return False
    return row_length <= ring or keep - (config.sliding_window - 1) >= row_length - ring


def check_replicas(config: ModelConfig, kv_replicas) -> tuple[int, ...]:
    """Per-layer kv-head replica counts (None = 1 everywhere), validated against the config."""
    if kv_replicas is None:
        return (1,) * config.num_layers
    reps = tuple(int(r) for r in kv_replicas)
    if len(reps) != config.num_layers:
        raise ValueError(f"kv_replicas has {len(reps)} entries but the model has {config.num_layers} layers")
    for i, r in enumerate(reps):
        group = config.num_heads // config.layer_kv_heads(i)
        if r < 1 or group % r:
            raise ValueError(f"kv_replicas[{i}]={r} must be >= 1 and divide the layer's query-group size "
                             f"{group} (num_heads / kv_heads)")
    return reps


def init_cache(config: ModelConfig, batch_size: int, max_length: int, dtype=None, kv_replicas=None,
               layers: str = "unrolled", ring: bool = True) -> KVCache:
    """An empty KV cache.

    Args:
      batch_size: rows B. max_length: tokens per row S (the prompt and all but the last canvas).
      dtype: the K/V dtype (default: the config's activation dtype).
      kv_replicas: optional per-layer replica counts of the kv heads (see the module docstring; the
        sharded engine picks them from its mesh, `Shardings.kv_replicas`).
      layers: "unrolled" (one entry per layer) or "scan" (stacked per layer-group position,
        `model.layout.stack_cache`).
      ring: the sliding layers hold a ring of `ring_size` slots (default); False: every position, as
        the global layers (what a denoiser reading contexts before the row's end needs: training).
    Returns:
      a `KVCache`: per layer K/V [B, K * r, S_i, H] zeros (S_i = `layer_slots`: S for a global layer,
      the ring for a sliding one) and lengths [B] zeros.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if max_length > config.max_position_embeddings:
        raise ValueError(f"max_length={max_length} exceeds the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    dtype = dtype or dtype_of(config.dtype)
    reps = check_replicas(config, kv_replicas)
    keys, values = [], []
    for i in range(config.num_layers):
        shape = layer_shape(batch_size, layer_slots(config, i, max_length, ring), config.layer_kv_heads(i) * reps[i],
                            config.layer_head_dim(i))
        keys.append(jnp.zeros(shape, dtype))
        values.append(jnp.zeros(shape, dtype))
    cache = KVCache(tuple(keys), tuple(values), jnp.zeros((batch_size,), jnp.int32), reps, length=int(max_length))
    if layers == "scan":
        return stack_cache(cache, config)
    if layers != "unrolled":
        raise ValueError(f"layers={layers!r} must be 'unrolled' or 'scan'")
    return cache


def cache_shape(config: ModelConfig, batch_size: int, max_length: int, dtype=None, kv_replicas=None,
                layers: str = "unrolled", ring: bool = True) -> KVCache:
    """The cache as `jax.ShapeDtypeStruct`s, for AOT compilation (nothing is allocated).

    Args:
      as `init_cache` (config, batch_size, max_length, dtype, kv_replicas, layers, ring).
    Returns:
      a `KVCache` whose leaves are `jax.ShapeDtypeStruct`s.
    """
    return jax.eval_shape(lambda: init_cache(config, batch_size, max_length, dtype, kv_replicas, layers, ring))


def write_tokens(cache_kv: jax.Array, new_kv: jax.Array, starts: jax.Array, num_new: jax.Array,
                 group=None, ring: bool = False) -> jax.Array:
    """Write new_kv [B, K, T, H] into cache_kv [B, K, S, H] at slots starts[b] + t for t < num_new[b].

    Padding tokens (t >= num_new[b]) and slots beyond the cache are dropped, never written.
    ring: the cache is a sliding layer's ring (module docstring): position p goes to slot p mod S,
    and of a row's new tokens only its last S are written (the earlier ones would be overwritten).
    group: cache_kv is a stacked layer cache [G, B, K, S, H] (a scanned program's, `model.layout`)
    and the tokens go into its entry `group` (scattered in place: the other entries are not copied).
    """
    b, k, t = new_kv.shape[:3]
    s = cache_kv.shape[SLOT_AXIS]
    offs = jnp.arange(t, dtype=jnp.int32)[None, :]
    slots = starts[:, None] + offs
    keep = offs < num_new[:, None]
    if ring:
        slots = jnp.mod(slots, s)
        keep &= offs >= num_new[:, None] - s
    slots = jnp.where(keep, slots, s)[:, None, :]  # out of range -> dropped
    # one (row, kv head, slot) index per [H] vector: the update is new_kv as it is, and each write
    # is one head's contiguous row of the cache (no other order of the cache is needed for it)
    rows = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    heads = jnp.arange(k, dtype=jnp.int32)[None, :, None]
    upd = new_kv.astype(cache_kv.dtype)
    if group is not None:
        return cache_kv.at[group, rows, heads, slots].set(upd, mode="drop")
    return cache_kv.at[rows, heads, slots].set(upd, mode="drop")


def group_entry(cache_kv: jax.Array, group) -> jax.Array:
    """A layer's cache: cache_kv itself, or entry `group` of a stacked layer cache [G, B, K, S, H] (a
    scanned program's, `model.layout`), read as a slice."""
    return cache_kv if group is None else jax.lax.dynamic_index_in_dim(cache_kv, group, 0, keepdims=False)


def batch_axis(x) -> int:
    """The batch axis of a cache leaf: lengths [B]; keys / values [B, K, S, H] or, stacked, [G, B, K, S, H]."""
    return 0 if x.ndim == 1 else x.ndim - 4


def _grouped(x, groups: int):
    """A cache leaf with its batch axis [N] viewed as [G, N / G]."""
    b = batch_axis(x)
    return x.reshape(x.shape[:b] + (groups, -1) + x.shape[b + 1:])


def group_rows(x, rows):
    """Rows `rows` [G, K] of a cache leaf whose N rows form G groups of N / G consecutive rows (row
    g * N / G + rows[g, k]), as a leaf of G * K rows, group-major (reads those rows only). Each row is a
    dynamic slice, batched over the groups, so on a mesh whose data axis splits the rows in G each
    group's rows stay on its devices. (A gather of whole rows, `take_along_axis`, made XLA:TPU keep
    the 26B's sliding-layer caches in another layout inside the server's commit loop and copy every
    one of them into it and back on each tick: at 32 slots on a v6e-8 split data=2,expert=4 the tick
    moved 84.6 GB per chip with the gather, 70.4 GB with the slices.)"""
    b = batch_axis(x)
    g, k = rows.shape
    xg = _grouped(x, g)

    def one_group(xgi, ri):   # one group's leaf (its rows on axis b) -> its K rows
        return jnp.stack([jax.lax.dynamic_index_in_dim(xgi, ri[j], b, keepdims=False) for j in range(k)], axis=b)

    picked = jax.vmap(one_group, in_axes=(b, 0), out_axes=b)(xg, rows)
    return picked.reshape(picked.shape[:b] + (g * k,) + picked.shape[b + 2:])


def put_group_rows(x, part, rows: jax.Array, starts: jax.Array, width: int, whole: bool, layer=None):
    """`x` (a cache leaf of N rows in G groups, as `group_rows` reads it) with its rows `rows` [G, K]
    replaced from `part` (G * K rows, `group_rows`' order) in place.

    lengths [N]: set. keys / values: the `width` slots from starts [G * K] of each row (what a commit
    of `width` tokens wrote), or with `whole` the row's every slot (a sliding layer's ring, where the
    new positions may wrap round its end). layer: x is a stacked leaf [Gl, N, K, S, H] (a scanned
    program's) and part [G * K, K, S, H] goes into its entry `layer`."""
    g, k = rows.shape
    if x.ndim == 1:                                       # lengths
        return _grouped(x, g).at[jnp.arange(g)[:, None], rows].set(part.reshape(g, k)).reshape(-1)
    if layer is not None:
        part = part[None]
    b = batch_axis(x)
    starts = starts.reshape(g, k)
    xg = _grouped(x, g)
    part = part.reshape(part.shape[:b] + (g, k) + part.shape[b + 1:])
    at = jnp.zeros_like(starts) if whole else starts
    size = part.shape[SLOT_AXIS] if whole else width
    slot_axis = xg.ndim - 1 + SLOT_AXIS                   # within one group's leaf

    def put(xi, pi, r, s):                                # row r's slots from s on := pi
        index = [jnp.zeros((), jnp.int32)] * xi.ndim
        index[b], index[slot_axis] = r, s
        if layer is not None:
            index[0] = jnp.asarray(layer, jnp.int32)
        return jax.lax.dynamic_update_slice(xi, pi, index)

    for j in range(k):                                    # K static: one in-place update of `size` slots a row
        piece = jax.vmap(lambda p, s: jax.lax.dynamic_slice_in_dim(p, s, size, slot_axis),  # noqa: B023
                         in_axes=(b, 0), out_axes=b)(jax.lax.index_in_dim(part, j, b + 1), at[:, j])
        xg = jax.vmap(put, in_axes=(b, b, 0, 0), out_axes=b)(xg, piece, rows[:, j], at[:, j])
    return xg.reshape(xg.shape[:b] + (-1,) + xg.shape[b + 2:])


def window_slice(cache_kv: jax.Array, starts: jax.Array, size: int) -> jax.Array:
    """Per-row slice of the slots cache_kv[b, :, starts[b] : starts[b] + size] -> [B, K, size, H]."""
    return jax.vmap(lambda c, s0: jax.lax.dynamic_slice_in_dim(c, s0, size, axis=1))(cache_kv, starts)


def cache_row(cache: KVCache, row: int) -> KVCache:
    """Row `row` of a cache as a batch-1 cache (a copy; either layout)."""
    take = lambda x: jax.lax.slice_in_dim(x, row, row + 1, axis=x.ndim - 4)  # noqa: E731 (batch axis)
    return cache.replace(keys=tuple(map(take, cache.keys)), values=tuple(map(take, cache.values)),
                         lengths=cache.lengths[row:row + 1])


def take_rows(cache: KVCache, rows) -> KVCache:
    """The rows `rows` (indices, in that order) of a cache as one cache (either layout)."""
    idx = jnp.asarray(rows, jnp.int32)
    take = lambda x: jnp.take(x, idx, axis=x.ndim - 4)  # noqa: E731 (batch axis)
    return cache.replace(keys=tuple(map(take, cache.keys)), values=tuple(map(take, cache.values)),
                         lengths=cache.lengths[idx])


def concat_rows(caches) -> KVCache:
    """Batch caches of the same layout stacked row-wise into one; a shorter cache's slots are padded
    with zeros up to the longest `max_length` (slots past a row's length are never read). A sliding
    layer's ring is padded likewise: a ring shorter than the longest one is a whole row (identity
    slots, `ring_size`), which stays valid in the longer ring."""
    caches = list(caches)

    def pad(x, s):
        widths = [(0, 0)] * x.ndim
        widths[x.ndim + SLOT_AXIS] = (0, s - x.shape[SLOT_AXIS])
        return jnp.pad(x, widths)

    def cat(xs):
        s = max(x.shape[SLOT_AXIS] for x in xs)
        return jnp.concatenate([pad(x, s) for x in xs], axis=xs[0].ndim - 4)

    first = caches[0]
    n = len(first.keys)
    return first.replace(keys=tuple(cat([c.keys[i] for c in caches]) for i in range(n)),
                         values=tuple(cat([c.values[i] for c in caches]) for i in range(n)),
                         lengths=jnp.concatenate([c.lengths for c in caches]),
                         length=max(c.max_length for c in caches))
