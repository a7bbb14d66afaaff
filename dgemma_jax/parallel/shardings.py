"""NamedShardings for parameters, the KV cache and the engine's inputs, from one rule set.

    mesh = make_mesh("tensor=4,expert=2")
    sh = Shardings(config, mesh, "latency")
    config, params = load_hf(path, shardings=sh.params)      # each tensor straight into its shards
    engine = Engine(config, params, sampler, shardings=sh)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import logical_axes, param_shapes
from dgemma_jax.model.cache import KVCache, init_cache
from dgemma_jax.model.layers import dtype_of
from dgemma_jax.parallel.context import sharding_context
from dgemma_jax.parallel.rules import CACHE_AXES, rules_for, spec_for


class Shardings:
    def __init__(self, config: ModelConfig, mesh: Mesh, rules: str | tuple = "latency"):
        self.config = config
        self.mesh = mesh
        self.rules = rules_for(rules) if isinstance(rules, str) else tuple(rules)
        self.rules_name = rules if isinstance(rules, str) else "custom"
        shapes = param_shapes(config)
        axes = logical_axes(config)
        self.params = jax.tree.map(
            lambda s, a: NamedSharding(mesh, spec_for(s.shape, tuple(a), self.rules, mesh)), shapes, axes,
            is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.replicated = NamedSharding(mesh, PartitionSpec())

    # ------------------------------------------------------------------ helpers
    def named(self, shape, logical) -> NamedSharding:
        return NamedSharding(self.mesh, spec_for(shape, logical, self.rules, self.mesh))

    def context(self):
        """Trace programs inside this so the model's logical constraints map onto the mesh."""
        return sharding_context(self.mesh, self.rules)

    def cache(self, batch: int, length: int) -> KVCache:
        c = self.config
        keys = tuple(self.named((batch, length, c.layer_kv_heads(i), c.layer_head_dim(i)), CACHE_AXES)
                     for i in range(c.num_layers))
        return KVCache(keys, keys, self.named((batch,), ("batch",)))

    def init_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache created directly in its shards."""
        fn = jax.jit(functools.partial(init_cache, self.config, batch, length, dtype_of(self.config.dtype)),
                     out_shardings=self.cache(batch, length))
        return fn()

    def place_params(self, params) -> Any:
        return jax.tree.map(lambda x, s: jax.device_put(x, s), params, self.params)

    def init_params(self, rng) -> Any:
        """Random parameters created directly in their shards (no full host copy)."""
        from dgemma_jax.model.api import _boxed_init
        from flax import linen as nn

        fn = jax.jit(lambda r: nn.meta.unbox(_boxed_init(self.config, r)), out_shardings=self.params)
        return fn(rng)

    def global_array(self, x, logical=None) -> jax.Array:
        """A host array (identical on every process) as a global array, replicated or per `logical`."""
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and getattr(x, "is_fully_addressable", True) is False:
            return x
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            arr = jax.make_array_from_callback(data.shape, self.replicated, lambda idx: data[idx])
            return jax.random.wrap_key_data(arr)
        host = np.asarray(x)
        sharding = self.replicated if logical is None else self.named(host.shape, logical)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def fetch(x) -> np.ndarray:
    """A (replicated or sharded) global array as a host numpy array, on every process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
