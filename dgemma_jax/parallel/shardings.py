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
from flax import linen as nn
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import _boxed_init, logical_axes, param_shapes
from dgemma_jax.model.cache import KVCache, cache_shape, init_cache, layer_shape, layer_slots
from dgemma_jax.model.layers import dtype_of, is_quantized
from dgemma_jax.model.layout import stack_cache
from dgemma_jax.axis_rules import CACHE_AXES, rules_for
from dgemma_jax.runtime import Runtime


class Shardings:
    def __init__(self, config: ModelConfig, mesh: Mesh, rules="latency"):
        """rules: a built-in rule set's name, a JSON rules file, a mapping or (name, target) pairs
        (`axis_rules.rules_for`); checked against `mesh` (an unknown logical or mesh axis is a
        ValueError naming it)."""
        self.config = config
        # the one holder of the mesh and the rules: every runtime of these shardings is this one with
        # execution choices added (`runtime`), and every NamedSharding comes from its `sharding`
        self.placement = Runtime(mesh=mesh, rules=rules_for(rules, mesh))
        self.rules_name = rules if isinstance(rules, str) else "custom"
        shapes = param_shapes(config)
        axes = logical_axes(config)
        self.logical = axes
        self.params = jax.tree.map(
            lambda s, a: self.named(s.shape, tuple(a)), shapes, axes,
            is_leaf=lambda x: isinstance(x, PartitionSpec))
        self.replicated = NamedSharding(mesh, PartitionSpec())

    # ------------------------------------------------------------------ helpers
    @property
    def mesh(self) -> Mesh:
        return self.placement.mesh

    @property
    def rules(self) -> tuple:
        return self.placement.rules

    def named(self, shape, logical) -> NamedSharding:
        return self.placement.sharding(shape, logical)

    def runtime(self, **choices) -> Runtime:
        """A `Runtime` on this mesh and rule set (with the given execution choices): what the model's
        passes take so that their logical constraints map onto the mesh."""
        return self.placement.replace(**choices)

    @functools.cached_property
    def kv_replicas(self) -> tuple[int, ...]:
        """Per layer, how many times the cache stores each kv head (model/cache.py).

        When the mesh splits the query heads s ways but a layer has fewer kv heads than that (the
        26B's 2 global kv heads on 8 chips), a plain cache would be replicated and every step would
        slice each device's kv head out of it. Storing each kv head r times (K r divisible by s, r
        dividing the query-group size) gives every device exactly its kv head instead: less memory
        per device and no per-step copy. 1 where the kv heads already split like the query heads.
        """
        c = self.config

        def splits(size, name):  # how many ways the mesh splits a dimension of this size and name
            return self.placement.shards(size, name)

        q_split = splits(c.num_heads, "heads")
        reps = []
        for i in range(c.num_layers):
            kv, group = c.layer_kv_heads(i), c.num_heads // c.layer_kv_heads(i)
            fits = [r for r in range(1, group + 1) if group % r == 0 and splits(kv * r, "kv_heads") == q_split]
            reps.append(fits[0] if fits else 1)
        return tuple(reps)

    def cache(self, batch: int, length: int, layers: str = "unrolled") -> KVCache:
        """The cache's NamedShardings; layers="scan": the stacked layout (`model.layout`, the stacked
        axis replicated)."""
        c, reps = self.config, self.kv_replicas
        keys = tuple(self.named(layer_shape(batch, layer_slots(c, i, length), c.layer_kv_heads(i) * reps[i],
                                            c.layer_head_dim(i)), CACHE_AXES) for i in range(c.num_layers))
        out = KVCache(keys, keys, self.named((batch,), ("batch",)), reps, length=int(length))
        return stack_cache(out, c) if layers == "scan" else out

    def cache_shape(self, batch: int, length: int, layers: str = "unrolled") -> KVCache:
        """The sharded cache's shapes (`jax.ShapeDtypeStruct`s, nothing allocated)."""
        return cache_shape(self.config, batch, length, dtype_of(self.config.dtype), self.kv_replicas, layers)

    def init_cache(self, batch: int, length: int, layers: str = "unrolled") -> KVCache:
        """An empty cache created directly in its shards."""
        fn = jax.jit(functools.partial(init_cache, self.config, batch, length, dtype_of(self.config.dtype),
                                       self.kv_replicas, layers),
                     out_shardings=self.cache(batch, length, layers))
        return fn()

    def for_params(self, params) -> Any:
        """NamedShardings laid out like `params`: float parameters (then `self.params`), or parameters
        with int8 kernels {"int8", "scale"} (`model.quant`), whose values are placed like the float
        kernel and whose scales along the same logical axes (their size-1 axes replicated)."""
        def one(axes, x):
            if is_quantized(x):
                return {k: self.named(v.shape, tuple(axes)) for k, v in x.items()}
            return self.named(x.shape, tuple(axes))

        return jax.tree.map(one, self.logical, params, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def place_params(self, params) -> Any:
        """Parameters (float or with int8 kernels) placed in their shards."""
        return jax.tree.map(lambda x, s: jax.device_put(x, s), params, self.for_params(params))

    def init_params(self, rng) -> Any:
        """Random parameters created directly in their shards (no full host copy)."""
        fn = jax.jit(lambda r: nn.meta.unbox(_boxed_init(self.config, r)), out_shardings=self.params)
        return fn(rng)

    def global_array(self, x, logical=None) -> jax.Array:
        """A host array (identical on every process) as a global array, replicated or per `logical`."""
        if (isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
                and getattr(x, "is_fully_addressable", True) is False):
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
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
