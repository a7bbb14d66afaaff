"""The sharding context the model's logical constraints consult (set only by drivers).

Model code calls `constrain(x, logical_axes)`; without an active context it is the identity, so
the model math never depends on a mesh. Drivers (the engine, the trainer) trace their programs
inside `sharding_context(mesh, rules)`.
"""

from __future__ import annotations

import contextlib
import threading

import jax
from jax.sharding import NamedSharding

_STATE = threading.local()


@contextlib.contextmanager
def sharding_context(mesh, rules):
    prev = getattr(_STATE, "ctx", None)
    _STATE.ctx = (mesh, rules)
    try:
        yield
    finally:
        _STATE.ctx = prev


def active():
    return getattr(_STATE, "ctx", None)


def constrain(x: jax.Array, logical: tuple) -> jax.Array:
    """Pin x's sharding to the mesh axes its logical axis names map to (identity without a context)."""
    ctx = active()
    if ctx is None:
        return x
    from dgemma_jax.parallel.rules import spec_for

    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(x.shape, logical, rules, mesh)))
