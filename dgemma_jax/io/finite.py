"""The load-time check that a checkpoint's weights are finite.

A weight holding NaN or Inf makes every logit it touches non-finite; the sampler maps those to
impossible tokens, so such a model answers with pad at the step cap and nothing says why. Every
load path (`io.hf.load_hf`, `io.model_dir.load_model`, and through them the bundled models and
`pipeline.load_checkpoint`) calls `check_finite` on the parameters it read.

Cost: one jitted program of one fused all-finite reduction per floating-point tensor (on the
devices that hold it, sharded or not), then one transfer of a few booleans; nothing is copied to
the host. Integer tensors (int8 kernels) cannot hold NaN and are skipped.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def tensor_name(path) -> str:
    """The name of a parameter in our checkpoints' trees: its keys joined by '/'."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)


def first_nonfinite(params) -> tuple[str, object] | None:
    """(name, array) of the first floating-point parameter holding NaN or Inf, or None."""
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    ok = np.asarray(_all_finite([x for _, x in flat]))
    bad = np.flatnonzero(~ok)
    if bad.size == 0:
        return None
    path, x = flat[int(bad[0])]
    return tensor_name(path), x


def check_finite(params, checkpoint, hf_name: Callable[[str], str] | None = None) -> None:
    """ValueError naming the first tensor of `checkpoint` that holds NaN or Inf (see the module doc).

    hf_name: maps our parameter name to the name the checkpoint's files use (a Hugging Face
    directory's safetensors names); default: our name, as our orbax checkpoints store it."""
    found = first_nonfinite(params)
    if found is None:
        return
    name, x = found
    n_nan, n_inf = int(jnp.isnan(x).sum()), int(jnp.isinf(x).sum())  # on the devices holding x
    stored = hf_name(name) if hf_name is not None else name
    raise ValueError(f"checkpoint {str(checkpoint)!r}: tensor {stored!r} holds {n_nan} NaN and {n_inf} Inf "
                     f"value(s) of {x.size}: these weights would give non-finite logits (pad-only answers); "
                     "re-download or re-convert the checkpoint, or, if training wrote it, resume from an earlier "
                     "step with a lower learning rate")
