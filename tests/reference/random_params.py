"""Random parameters with every norm weight, scale and layer scalar moved away from 1: the draw the
parity, behaviour and int8 checks use, so that no norm or scalar can be silently ignored."""

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.model.api import param_shapes


def random_params(cfg, seed):
    """Norms / scales / scalars U(0.5, 1.5), the embedding N(0, 1), every other kernel N(0, 0.15)."""
    rng = np.random.default_rng(seed)

    def draw(path, s):
        name = jax.tree_util.keystr(path)
        if "scale" in name or "scalar" in name:
            x = rng.uniform(0.5, 1.5, s.shape)
        elif "embedding" in name:
            x = rng.normal(0, 1.0, s.shape)
        else:
            x = rng.normal(0, 0.15, s.shape)
        return jnp.asarray(x.astype(np.float32))

    return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg))
