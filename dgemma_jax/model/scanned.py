"""The scanned layer layout's passes: a `lax.scan` over the repeated layer group.

`Runtime.layers` is the one switch: "unrolled" runs one traced block per layer (`Transformer`'s
own loop), "scan" runs the blocks of one group (the 26B: 5 sliding + 1 global) in a scan over the
groups, so a program compiles one group instead of 30 layers. Which entry point runs which, and
the numbers behind the choice (compile time against HBM bytes per call), are in `runtime.py`
(`LAYER_DEFAULTS`, `ENTRY_LAYERS`) and docs/tpu.md.

This module is everything a pass does differently in the scanned layout; the parameters' and
cache's stacked form and its conversions are `model.layout`. Two hooks lie outside it, where the
work is: a scanned layer writes its tokens into its entry of the stacked cache in place
(`cache.write_tokens(group=)`, `Attention.encode(group=)`), and the MoE runs its grouped matmuls
on a `PerGroup` kernel inside the branch of the group being run (`layout.per_group_switch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dgemma_jax.model import layout
from dgemma_jax.model.block import Block
from dgemma_jax.model.cache import KVCache


def scanning(model) -> bool:
    """Whether `model` (a bound `Transformer`) scans its layer groups: its runtime's layout, which
    the runtime resolved when it was built (`runtime.resolve_layers`); the parameters' own layout
    decides nothing (parameters in the other layout are converted, `unrolled_blocks`, `_scan_parts`)."""
    return model.rt.layers == "scan"


def unrolled_blocks(model, method: str) -> list:
    """Per layer, a callable running `method` of its block: the bound blocks, or (stacked parameters
    run unrolled, `Runtime(layers="unrolled")`) the blocks applied to their unstacked parameters (a copy)."""
    if not layout.is_stacked(model.variables.get("params", {})):
        return [getattr(blk, method) for blk in model.blocks]
    per_layer = {col: layout.unstack_layers(dict(t), model.cfg) if layout.is_stacked(t) else t
                 for col, t in model.variables.items()}
    out = []
    for i in range(model.cfg.num_layers):
        fn = _block_fn(model, i, method, model.rt)
        block_vars = {col: t[f"blocks_{i}"] for col, t in per_layer.items() if f"blocks_{i}" in t}
        out.append(lambda *a, fn=fn, v=block_vars: fn(v, *a))
    return out


def writing_layers(model, method: str, hs: tuple, args: tuple, extra: tuple, cache: KVCache):
    """The layers of a pass that writes the cache (the causal pass `encode`, `commit_denoise`), scanned:
    each block's `method` called as
    method(*hs, *args, cache_k, cache_v, *extra, group) -> (*hs, cache_k, cache_v), writing its entry of
    the stacked caches in place; the layers after the last whole group unrolled. Returns (hs after
    every layer, the new cache in the layout it was given)."""
    plan, c, fns = _scan_parts(model, cache, method)
    sliced, whole = layout.split_per_group(_groups(model))
    n = len(hs)

    def body(carry, xs):
        hs, ks, vs = carry[:n], list(carry[n]), list(carry[n + 1])
        g, groups = xs
        groups = layout.join_per_group(groups, whole, g)
        for j in range(plan.period):
            block_vars = {col: t[f"blocks_{j}"] for col, t in groups.items()}
            *hs, ks[j], vs[j] = fns[j](block_vars, *hs, *args, ks[j], vs[j], *extra, g)
        return (*hs, tuple(ks), tuple(vs)), None

    p = plan.period
    with jax.named_scope(layout.LAYER_LOOP_SCOPE):
        out, _ = jax.lax.scan(body, (*hs, c.keys[:p], c.values[:p]),
                              (jnp.arange(plan.groups, dtype=jnp.int32), sliced))
    hs, keys, values = out[:n], list(out[n]) + list(c.keys[p:]), list(out[n + 1]) + list(c.values[p:])
    for r, i in enumerate(plan.remainder):
        *hs, keys[p + r], values[p + r] = getattr(model.blocks[i], method)(*hs, *args, keys[p + r], values[p + r],
                                                                           *extra)
    new = c.replace(keys=tuple(keys), values=tuple(values))
    return tuple(hs), (new if cache.groups else layout.unstack_cache(new, model.cfg))


def denoise_layers(model, x, context_end, cache: KVCache):
    """The denoiser's layers, scanned: x [B, L, D] after every layer (the cache is only read)."""
    plan, c, fns = _scan_parts(model, cache, "denoise")
    sliced, whole = layout.split_per_group(_groups(model))

    def body(h, xs):
        g, groups, ks, vs = xs
        groups = layout.join_per_group(groups, whole, g)
        for j in range(plan.period):
            block_vars = {col: t[f"blocks_{j}"] for col, t in groups.items()}
            h = fns[j](block_vars, h, context_end, ks[j], vs[j])
        return h, None

    p = plan.period
    with jax.named_scope(layout.LAYER_LOOP_SCOPE):
        x, _ = jax.lax.scan(body, x, (jnp.arange(plan.groups, dtype=jnp.int32), sliced, c.keys[:p], c.values[:p]))
    for r, i in enumerate(plan.remainder):
        x = model.blocks[i].denoise(x, context_end, c.keys[p + r], c.values[p + r])
    return x


def _groups(model):
    """{collection: {"blocks_j": stacked}}: the parameters (and LoRA collection) of the scanned
    layers, stacked per group position (stacked here, a copy, when they were given unrolled);
    `layout.PER_GROUP` kernels as `PerGroup`s, which the scan passes whole to its body."""
    out = {}
    for col, tree in model.variables.items():
        if not any(k == layout.GROUPS_KEY or k.startswith("blocks_") for k in tree):
            continue
        out[col] = layout.stack_layers(dict(tree), model.cfg)[layout.GROUPS_KEY]
    return out


def _scan_parts(model, cache: KVCache, method: str):
    """(layer plan, the cache stacked, one callable per group position running `method`)."""
    plan = layout.check_scannable(model.cfg)
    rt = model.rt.observed_times(plan.groups)   # a kernel traced once in the body runs once per group
    return plan, layout.stack_cache(cache, model.cfg), [_block_fn(model, j, method, rt) for j in range(plan.period)]


def _block_fn(model, position: int, method: str, rt):
    """fn(block variables, *args): `method` of the block at layer `position`, applied to the given
    variables (rematerialized in the backward pass when the runtime says so)."""
    cfg = model.cfg

    def run(block_vars, *args):
        return Block(cfg, rt, position, parent=None).apply(block_vars, *args, method=method)

    return jax.checkpoint(run) if model.rt.remat else run

