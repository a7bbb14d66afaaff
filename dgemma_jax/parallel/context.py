"""The sharding context the model's logical constraints consult (set only by drivers).

Model code calls `constrain(x, logical_axes)`; without an active context it is the identity, so
the model math never depends on a mesh. Drivers (the engine, the trainer) trace their programs
inside `sharding_context(mesh, rules)`.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dgemma_jax.parallel.rules import CACHE_AXES, spec_for

_STATE = threading.local()


@contextlib.contextmanager
def _holding(ctx):
    prev = getattr(_STATE, "ctx", None)
    _STATE.ctx = ctx
    try:
        yield
    finally:
        _STATE.ctx = prev


def sharding_context(mesh, rules):
    return _holding((mesh, rules))


def active():
    return getattr(_STATE, "ctx", None)


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
    """Pin x's sharding to the mesh axes its logical axis names map to (identity without a context)."""
    ctx = active()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(x.shape, logical, rules, mesh)))


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def expert_parallel(fn, z, weights, experts, gate_up, down, adapters=None):
    """Run the MoE dispatch `fn` per shard: each device serves only the experts it holds and the
    outputs are summed over those mesh axes.

    fn(z, weights, experts, gate_up, down, adapters, offset=, shards=) -> [N, D] float32 partial output
    for the local experts [offset, offset + E_local). `adapters` (per-expert LoRA pairs, every leaf
    [E, ., .], or None) are split over the experts exactly like the kernels. Tokens (z [N, D], weights / experts [N, k]) are split
    like the batch and replicated over the model axes, so no expert weight ever moves (with FSDP the
    weights' `embed` dimension is gathered per layer, as for every FSDP layer). Each expert is whole
    on one shard (gate_up [E, D, 2F] keeps gate and up side by side). Without a sharding context
    this is just `fn(...)` with all experts local.
    """
    ctx = active()
    if ctx is None:
        return fn(z, weights, experts, gate_up, down, adapters)
    mesh, rules = ctx
    tok = _axes(spec_for(z.shape[:1], ("batch",), rules, mesh)[0])
    ex = tuple(a for a in _axes(spec_for(gate_up.shape[:1], ("experts",), rules, mesh)[0]) if a not in tok)
    if not (tok or ex):
        return fn(z, weights, experts, gate_up, down, adapters)
    shards = 1
    for a in ex:
        shards *= mesh.shape[a]
    e_local = gate_up.shape[0] // shards
    spec = lambda axes: (axes if len(axes) != 1 else axes[0]) if axes else None  # noqa: E731

    def body(z, weights, experts, gate_up, down, adapters):
        index = jnp.zeros((), jnp.int32)
        for a in ex:
            index = index * mesh.shape[a] + jax.lax.axis_index(a)
        y = fn(z, weights, experts, gate_up, down, adapters, offset=index * e_local, shards=shards)
        return jax.lax.psum(y, ex) if ex else y

    t = spec(tok)
    kernel = P(spec(ex), None, None)
    with _holding(None):  # no logical constraints inside the per-shard body
        return jax.shard_map(
            body, mesh=mesh, check_vma=False,
            in_specs=(P(t, None), P(t, None), P(t, None), kernel, kernel,
                      None if adapters is None else jax.tree.map(lambda _: kernel, adapters)),
            out_specs=P(t, None))(z, weights, experts, gate_up, down, adapters)


def head_parallel(fn, q, k, v, valid):
    """Run the attention kernel `fn(q, k, v, valid) -> (out, lse)` per head shard.

    q [B, T, N, H]; k, v [B, S, K, H] (cache layout); valid [B, S]. A Pallas kernel is one opaque
    call the partitioner cannot split, so under a sharding context it runs inside a `shard_map`
    over the batch and head axes, each device on its own query heads and the KV heads they read.
    Returns None when the layout does not allow it (query and KV heads split over different mesh
    axes, or the cache split along its slots or head_dim): the caller then keeps the XLA path.
    Without a sharding context this is just `fn(...)`.
    """
    ctx = active()
    if ctx is None:
        return fn(q, k, v, valid)
    mesh, rules = ctx
    qs = spec_for(q.shape, ("batch", None, "heads", None), rules, mesh)
    ks = spec_for(k.shape, CACHE_AXES, rules, mesh)
    if ks[1] is not None or ks[3] is not None or _axes(qs[0]) != _axes(ks[0]) or _axes(qs[2]) != _axes(ks[2]):
        return None
    with _holding(None):
        return jax.shard_map(
            fn, mesh=mesh, check_vma=False,
            in_specs=(qs, ks, ks, P(qs[0], None)),
            out_specs=(qs, P(qs[0], None, qs[2])))(q, k, v, valid)
