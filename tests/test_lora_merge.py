"""Merging LoRA adapters into a bf16 base (`training.lora.merge`): the sum is formed in float32 and rounded to
bf16 once. benchmarks/lora_merge_bf16.py measures what that rounding still costs in logits (docs/training.md)."""

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import param_shapes
from dgemma_jax.training import lora as lora_lib


def _half_ulp_bf16(x: np.ndarray) -> np.ndarray:
    """Half the bfloat16 spacing at |x| (8 significant bits: spacing 2^(e-8) for |x| in [2^(e-1), 2^e))."""
    _, e = np.frexp(x.astype(np.float64))
    return np.ldexp(1.0, e - 9)


def test_a_bf16_merge_rounds_once_from_float32():
    """merge into a bf16 base = round_to_bf16(W + (alpha/r) A @ B computed in float32): every merged
    weight lies within half a bf16 spacing of the float32 sum (the least error a bf16 kernel can
    have). A merge in the base dtype (A @ B and the sum in bf16) rounds twice and breaks that bound."""
    cfg = ModelConfig.preset("tiny-2layer").replace(dtype="bfloat16", param_dtype="bfloat16")
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.05, s.shape), s.dtype), param_shapes(cfg))
    shapes = jax.eval_shape(lambda p: lora_lib.init_lora(cfg, p, jax.random.key(1), 4, ("attention", "mlp")), params)
    # trained-looking adapters: A as init_lora draws it, B random (the update about 10% of the kernel's size)
    lora = jax.tree_util.tree_map_with_path(
        lambda k, s: jnp.asarray(rng.normal(0, 0.3 if jax.tree_util.keystr(k).endswith("['b']")
                                            else 1 / np.sqrt(s.shape[-2]), s.shape), jnp.float32), shapes)
    alpha, rank = 8.0, 4
    leaves = lora_lib._lora_leaves(lora)

    def base_dtype_merge(path, w):  # the defect the issue describes, for contrast
        p = lora_lib.path_str(path)
        if p not in leaves:
            return w
        a, b = leaves[p]["a"].astype(w.dtype), leaves[p]["b"].astype(w.dtype)
        return w + lora_lib.delta(cfg, p, w.shape, a, b, alpha / rank)

    @jax.jit
    def run(params):
        exact = {p: lora_lib._get(params, p).astype(jnp.float32)
                 + lora_lib.delta(cfg, p, lora_lib._get(params, p).shape, ab["a"], ab["b"], alpha / rank)
                 for p, ab in leaves.items()}
        return (exact, lora_lib.merge(cfg, params, lora, alpha, rank),
                jax.tree_util.tree_map_with_path(base_dtype_merge, params))

    exact, merged, naive = jax.device_get(run(params))
    worst, worst_naive = 0.0, 0.0
    for p, x in exact.items():
        bound = _half_ulp_bf16(x)
        got = lora_lib._get(merged, p)
        assert got.dtype == jnp.bfloat16
        worst = max(worst, float((np.abs(got.astype(np.float64) - x) / bound).max()))
        worst_naive = max(worst_naive, float((np.abs(lora_lib._get(naive, p).astype(np.float64) - x) / bound).max()))
    assert worst <= 1.0, worst              # rounded once, to nearest
    assert worst_naive > 1.5, worst_naive   # the bound tells the two merges apart
