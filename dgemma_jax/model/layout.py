"""Two layouts of the layers: one subtree per layer ("unrolled", the stored layout) and stacked
per position of the repeated layer group ("scan", what a `lax.scan` over the groups reads).

The 26B model repeats one 6-layer group (5 sliding + 1 global) five times. A scanned program
compiles that group once instead of 30 layers (`Runtime.layers`). Its parameters are stacked per
group position: `params["layer_groups"]["blocks_j"]` holds layers j, P + j, 2P + j, ... along a new
leading axis (P = the period, G = the number of whole groups); layers after the last whole group
(a count that is not a multiple of the period, or a last layer forced global out of pattern) keep
their own `blocks_i` subtree and run unrolled after the scan. Every other parameter is unchanged.

Except the expert kernels (`PER_GROUP`): a `PerGroup` holds their G arrays side by side, unstacked.
The TPU's grouped matmul is an opaque call that reads whole arrays: fed the slice of a stacked
kernel, the compiled loop first copies the slice out (a read and a write of every expert weight
per step: 2.56x the 26B step's HBM traffic on v6e-8). The scan passes a `PerGroup` in whole with
the group being run, and the MoE dispatch runs in the `lax.switch` branch of that group
(`per_group_switch`) on its arrays as they lie. The switch sits around the whole dispatch, not
each grouped matmul: around a matmul alone, the compiler staged one branch's kernel into on-chip
memory on every pass whether that branch ran or not (1.33x). Matmuls that XLA fuses (every
other kernel) slice a stacked array for free.

Checkpoints, the Hugging Face loader, converters, LoRA and int8 quantization all produce and
consume the unrolled layout; `stack_layers` / `unstack_layers` convert any pytree laid out like the
parameters (arrays, `jax.ShapeDtypeStruct`s, `NamedSharding`s, logical `PartitionSpec`s, the LoRA
collection, int8 {"int8", "scale"} pairs) exactly, both ways. The engine converts once at load, so
its jitted programs never copy weights.

The KV cache has the same two layouts (`stack_cache` / `unstack_cache`): stacked, `keys[j]` for
j < P is [G, B, K_j, S, H_j] (group position j of every group) and `keys[P + r]` the r-th remainder
layer's [B, K, S, H]; `KVCache.groups` = G says which (0 = one entry per layer).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dgemma_jax.config import GLOBAL, ModelConfig
from dgemma_jax.model.layers import INT4_VALUES, QUANT_VALUES
from dgemma_jax.model.per_group import PerGroup

GROUPS_KEY = "layer_groups"
# the named scope of the scan over layer groups: the perf readers (`perf.hbm_traffic.loop_runs`) count its
# loop body once per group, since every run streams that group's weights
LAYER_LOOP_SCOPE = "layer_groups"
# the named scope of `per_group_switch` (its conditional in a compiled program is "<scope>/cond")
PER_GROUP_SCOPE = "per_group_switch"
LAYER_AXIS = "layers"  # the logical name of the stacked axis (replicated: no rule maps it)
# parameters read by an opaque kernel (the MoE's grouped matmuls), kept per group (a `PerGroup`) in
# the stacked layout: (path suffix) of the float kernel; a quantized kernel's "int8"/"int4" values likewise
PER_GROUP = (("moe", "gate_up"), ("moe", "down"))


def _is_per_group(x) -> bool:
    return isinstance(x, PerGroup)


def has_per_group(tree) -> bool:
    return any(_is_per_group(x) for x in jax.tree.leaves(tree, is_leaf=_is_per_group))


def per_group_branches(tree) -> int:
    """How many branches `per_group_switch` traces for `tree` (its `PerGroup`s' group count; one runs)."""
    return len(next(x for x in jax.tree.leaves(tree, is_leaf=_is_per_group) if _is_per_group(x)).arrays)


def per_group_switch(fn, tree, *args):
    """fn(tree with each `PerGroup` as its group's array, *args), run in the `lax.switch` branch of
    the group being run: each branch hands fn the arrays it reads as they are, so an opaque kernel
    (the TPU's grouped matmul) reads them in place, and the compiler stages a branch's weights only
    when that branch runs. Every `PerGroup` in the tree must be at the same group.

    On TPU a switch's result lives in HBM: what the branches return is written out and read back.
    Each branch's result passes an optimization barrier, so the compiler cannot hoist work common to
    every branch out of the switch (it moved the MoE's final cast to bfloat16 out, and the float32
    sum crossed: twice the bytes); return the narrowest form the caller needs."""
    groups = [x for x in jax.tree.leaves(tree, is_leaf=_is_per_group) if _is_per_group(x)]
    n = len(groups[0].arrays)

    def branch(i, *a):
        picked = jax.tree.map(lambda x: x.arrays[i] if _is_per_group(x) else x, tree, is_leaf=_is_per_group)
        return jax.lax.optimization_barrier(fn(picked, *a))

    with jax.named_scope(PER_GROUP_SCOPE):
        return jax.lax.switch(groups[0].index, [functools.partial(branch, i) for i in range(n)], *args)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    period: int      # layers per group (the 26B: 6 = 5 sliding + 1 global)
    groups: int      # whole groups scanned (the 26B: 5)
    num_layers: int

    @property
    def scanned(self) -> int:
        return self.period * self.groups

    @property
    def remainder(self) -> tuple[int, ...]:
        """The layers after the last whole group (run unrolled)."""
        return tuple(range(self.scanned, self.num_layers))

    def layer(self, group: int, position: int) -> int:
        return group * self.period + position


def layer_plan(config: ModelConfig) -> LayerPlan:
    """The repeated group: its period is the first global layer's index + 1; whole groups are the
    longest run of repeats of the first group's layer types from layer 0."""
    types = config.layer_types
    period = types.index(GLOBAL) + 1 if GLOBAL in types else len(types)
    groups = 0
    while (groups + 1) * period <= len(types) and types[groups * period:(groups + 1) * period] == types[:period]:
        groups += 1
    return LayerPlan(period, groups, len(types))


def check_scannable(config: ModelConfig) -> LayerPlan:
    plan = layer_plan(config)
    if plan.groups < 1:
        raise ValueError(f"{config.name}: no repeated layer group to scan (layer_types {config.layer_types}); "
                         "use Runtime(layers='unrolled')")
    return plan


# ------------------------------------------------------------------ leaves
def _is_leaf(x) -> bool:
    return isinstance(x, (P, jax.ShapeDtypeStruct, NamedSharding, PerGroup))


def _stack(*xs):
    x0 = xs[0]
    if isinstance(x0, P):  # logical axis names
        return P(LAYER_AXIS, *x0)
    if isinstance(x0, NamedSharding):
        return NamedSharding(x0.mesh, P(None, *x0.spec))
    if isinstance(x0, jax.ShapeDtypeStruct):
        sh = x0.sharding
        if isinstance(sh, NamedSharding):
            sh = NamedSharding(sh.mesh, P(None, *sh.spec))
        return jax.ShapeDtypeStruct((len(xs),) + tuple(x0.shape), x0.dtype, sharding=sh)
    return jnp.stack(xs)


def _index(x, g: int):
    if isinstance(x, PerGroup):
        return x.arrays[g]
    if isinstance(x, P):
        return P(*tuple(x)[1:])
    if isinstance(x, NamedSharding):
        return NamedSharding(x.mesh, P(*tuple(x.spec)[1:]))
    if isinstance(x, jax.ShapeDtypeStruct):
        sh = x.sharding
        if isinstance(sh, NamedSharding):
            sh = NamedSharding(sh.mesh, P(*tuple(sh.spec)[1:]))
        return jax.ShapeDtypeStruct(tuple(x.shape)[1:], x.dtype, sharding=sh)
    return x[g]


# ------------------------------------------------------------------ parameters
def is_stacked(tree) -> bool:
    """Whether a parameter-like tree is in the stacked ("scan") layout."""
    return hasattr(tree, "keys") and GROUPS_KEY in tree


def stack_layers(params, config: ModelConfig):
    """The unrolled parameter tree (or any tree laid out like it) in the stacked layout. A tree
    already stacked is returned as it is. Layers of one group position must have equal structures."""
    if is_stacked(params):
        return params
    plan = check_scannable(config)
    out = {k: v for k, v in params.items() if not _scanned_key(k, plan)}
    groups = {}
    for j in range(plan.period):
        trees = [params[f"blocks_{plan.layer(g, j)}"] for g in range(plan.groups)]
        try:
            groups[f"blocks_{j}"] = _stack_tree(trees)
        except ValueError as e:
            raise ValueError(f"layers {[plan.layer(g, j) for g in range(plan.groups)]} (group position {j}) have "
                             f"different parameter structures and cannot be stacked: {e}; use "
                             "Runtime(layers='unrolled')") from None
    out[GROUPS_KEY] = groups
    return out


def unstack_layers(params, config: ModelConfig):
    """The stacked tree back in the unrolled (stored) layout, exactly. An unrolled tree is returned as it is."""
    if not is_stacked(params):
        return params
    plan = layer_plan(config)
    out = {k: v for k, v in params.items() if k != GROUPS_KEY}
    groups = params[GROUPS_KEY]
    for j in range(plan.period):
        for g in range(plan.groups):
            out[f"blocks_{plan.layer(g, j)}"] = jax.tree.map(lambda x, g=g: _index(x, g), groups[f"blocks_{j}"],
                                                             is_leaf=_is_leaf)
    return {k: out[k] for k in _ordered(out)}


def _per_group(path: tuple) -> bool:
    return any(path[-len(p):] == p or path[-len(p) - 1:] in (p + (QUANT_VALUES,), p + (INT4_VALUES,)) for p in PER_GROUP)


def _stack_tree(trees, path=()):
    """The layers' trees (one per group) stacked leaf by leaf; `PER_GROUP` leaves side by side."""
    if _per_group(path) and not isinstance(trees[0], Mapping):
        return PerGroup(trees)
    if isinstance(trees[0], Mapping):
        keys = list(trees[0])
        if any(list(t) != keys for t in trees[1:]):
            raise ValueError(f"different keys under {'/'.join(path) or 'the layer'}")
        return {k: _stack_tree([t[k] for t in trees], path + (k,)) for k in keys}
    return jax.tree.map(_stack, *trees, is_leaf=_is_leaf)


def split_per_group(tree):
    """A stacked group tree -> (the tree with each `PerGroup` replaced by None: what a scan slices,
    the `PerGroup`s alone: what its body takes whole)."""
    is_pg = lambda x: isinstance(x, PerGroup)  # noqa: E731
    return (jax.tree.map(lambda x: None if is_pg(x) else x, tree, is_leaf=is_pg),
            jax.tree.map(lambda x: x if is_pg(x) else None, tree, is_leaf=is_pg))


def join_per_group(sliced, whole, index):
    """`split_per_group`'s two halves back in one tree, each `PerGroup` at group `index`."""
    if isinstance(whole, PerGroup):
        return whole.at(index)
    if isinstance(whole, Mapping):
        return {k: join_per_group(sliced[k], whole[k], index) for k in whole}
    return sliced


def _scanned_key(key: str, plan: LayerPlan) -> bool:
    return key.startswith("blocks_") and key[7:].isdigit() and int(key[7:]) < plan.scanned


def _ordered(tree) -> list:
    """Keys with blocks_i in layer order (the order `init_params` produces)."""
    def rank(k):
        return (1, int(k[7:]), "") if k.startswith("blocks_") and k[7:].isdigit() else (0, 0, k)
    return sorted(tree, key=rank)


# ------------------------------------------------------------------ cache
def stack_cache(cache, config: ModelConfig):
    """A `KVCache` (or a tree of its shardings / shapes) with one entry per layer -> the stacked
    layout (`KVCache.groups` = G). A stacked cache is returned as it is."""
    if cache.groups:
        return cache
    plan = check_scannable(config)

    def one(seq):
        stacked = [_stack(*[seq[plan.layer(g, j)] for g in range(plan.groups)]) for j in range(plan.period)]
        return tuple(stacked) + tuple(seq[i] for i in plan.remainder)

    return cache.replace(keys=one(cache.keys), values=one(cache.values), groups=plan.groups)


def unstack_cache(cache, config: ModelConfig):
    """The stacked cache with one entry per layer again (exact). An unrolled cache is returned as it is."""
    if not cache.groups:
        return cache
    plan = layer_plan(config)

    def one(seq):
        layers = [None] * plan.num_layers
        for j in range(plan.period):
            for g in range(plan.groups):
                layers[plan.layer(g, j)] = _index(seq[j], g)
        for r, i in enumerate(plan.remainder):
            layers[i] = seq[plan.period + r]
        return tuple(layers)

    return cache.replace(keys=one(cache.keys), values=one(cache.values), groups=0)


def cache_layer_shapes(cache, config: ModelConfig) -> list[tuple[tuple, tuple]]:
    """Per layer (keys shape, values shape) of a cache in either layout (nothing is copied)."""
    if cache.groups:
        cache = jax.eval_shape(lambda c: unstack_cache(c, config), cache)
    return [(tuple(k.shape), tuple(v.shape)) for k, v in zip(cache.keys, cache.values)]
