"""Weight-only int8 for inference: half the bytes of bf16 weights (a quarter of float32) per pass.

    qparams = quantize_params(config, params)            # float params -> int8 kernels, explicit pytree
    engine = Engine(config, qparams, sampler)            # or Engine(config, params, quantize="int8")

Every matmul kernel the model streams per token, the expert kernels (moe gate_up [E, D, 2F], down
[E, F, D]), the attention projections (q, k, v, o), the dense MLP and the self-conditioning MLP
(gate_up, down), becomes the pair

    {"int8": q, "scale": s}      q int8 shaped like the kernel; s float32, same rank, size 1 on the
                                 axes the kernel's matmul contracts; W ~= q * s

with one symmetric scale per output channel (and per expert): s = max|W| over the contracted axes
/ 127, q = round(W / s) in [-127, 127]. The model reads the pair where the float kernel was (the
params' own structure says which kernels are int8; no flag, no global): `project`, the MoE
dispatch ("dense", "capacity", "ragged") and the tied head cast q exactly to the activation dtype
inside the matmul, accumulate in float32 and scale the output, so HBM holds one byte per weight.
Activations stay in the config's dtype, logits in float32. The router, the norms and the scalars
stay float (a few KB; the router's top-k choice is the most sensitive op of the block).

The tied embedding / head [V, D] stays float by default (`embedding=False`): measured in
benchmarks/results/int8_quality.json, quantizing it too (one scale per vocabulary row) adds logit
error for ~V*D bytes, a small share of a MoE's bytes (3% of the 26B). `embedding=True` quantizes it.

Quantized parameters keep the float kernel's logical axes (the scale's size-1 axes are replicated),
so `parallel.Shardings.for_params` places them on any mesh; checkpoints store them as they are
(`io.model_dir.save_model` records the quantization, `load_model` reads it back).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.layers import QUANT_SCALE, QUANT_VALUES, dequantize, is_quantized

QUANT_MODES = ("int8",)

# (kernels by "/"-joined parameter path, the axes their matmul contracts)
KERNELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    (r"(^|/)attn/(q|k|v)$", (0,)),                           # [D, N|K, H]: x D -> heads
    (r"(^|/)attn/o$", (0, 1)),                               # [N, H, D]
    (r"(^|/)(dense_mlp|sc_mlp)/(gate_up|down)$", (0,)),      # [D, 2, F], [F, D]
    (r"(^|/)moe/(gate_up|down)$", (1,)),                     # [E, D, 2F], [E, F, D]: per expert
)
# the tied embedding as the head [V, D] contracts D: one scale per vocabulary row
EMBEDDING: tuple[str, tuple[int, ...]] = (r"^embedding$", (1,))
QMAX = 127.0


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def contracted_axes(path: str, embedding: bool) -> tuple[int, ...] | None:
    """The contracted axes of the kernel at `path` if it is quantized, else None."""
    for pattern, axes in KERNELS + ((EMBEDDING,) if embedding else ()):
        if re.search(pattern, path):
            return axes
    return None


def quantize_kernel(w: jax.Array, contracted: tuple[int, ...]) -> dict:
    """A float kernel -> {"int8": q, "scale": s}: symmetric, one scale per channel of the axes not
    in `contracted` (s = max|W| / 127 over them; an all-zero channel gets s = 1 and q = 0)."""
    w32 = jnp.asarray(w, jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=contracted, keepdims=True)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    q = jnp.clip(jnp.round(w32 / scale), -QMAX, QMAX).astype(jnp.int8)
    return {QUANT_VALUES: q, QUANT_SCALE: scale.astype(jnp.float32)}


_quantize_jit = jax.jit(quantize_kernel, static_argnums=1)


def quantization_of(params) -> str | None:
    """"int8" when any kernel of `params` is an int8 pair, else None."""
    found = []

    def visit(x):
        found.append(is_quantized(x))
        return x

    jax.tree.map(visit, params, is_leaf=is_quantized)
    return "int8" if any(found) else None


def embedding_quantized(params) -> bool:
    return isinstance(params, dict) and is_quantized(params.get("embedding"))


def quantize_params(config: ModelConfig, params, mode: str = "int8", *, embedding: bool = False):
    """Float parameters -> the same tree with every target kernel an int8 pair (module docstring).

    mode: "int8" (the only one). embedding: quantize the tied embedding / head too (default False,
    see benchmarks/results/int8_quality.json). Params in, new params out (nothing is changed in
    place); arrays stay on the devices / shardings they were on. Raises a ValueError for an unknown
    mode, parameters already quantized, or a tree that is not this config's."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    if quantization_of(params) is not None:
        raise ValueError("these parameters are already quantized (int8 kernels); quantize the float parameters "
                         "once, or pass the quantized ones as they are")
    want = {_path(p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    have = {_path(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if want != have:
        bad = sorted(set(want) ^ set(have)) or [k for k in want if want[k] != have[k]]
        raise ValueError(f"the parameters do not match {config.name}'s ({len(bad)} tensor(s) differ, e.g. {bad[0]!r}); "
                         "quantize the parameters of this config")

    def one(path, w):
        axes = contracted_axes(_path(path), embedding)
        return w if axes is None else _quantize_jit(w, axes)

    return jax.tree_util.tree_map_with_path(one, params)


def quantized_shapes(config: ModelConfig, mode: str = "int8", *, embedding: bool = False):
    """The tree `quantize_params` returns for this config, as `jax.ShapeDtypeStruct`s (no arrays)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")

    def one(path, s):
        axes = contracted_axes(_path(path), embedding)
        if axes is None:
            return s
        scale = tuple(1 if i in axes else n for i, n in enumerate(s.shape))
        return {QUANT_VALUES: jax.ShapeDtypeStruct(s.shape, jnp.int8),
                QUANT_SCALE: jax.ShapeDtypeStruct(scale, jnp.float32)}

    return jax.tree_util.tree_map_with_path(one, param_shapes(config))


def dequantize_params(params):
    """int8 pairs back to float32 kernels (q * s); other leaves unchanged (for checks and measurements)."""
    return jax.tree.map(lambda x: dequantize(x) if is_quantized(x) else x, params, is_leaf=is_quantized)


def param_bytes(params) -> int:
    """Bytes the parameter arrays hold (int8 values, scales and float leaves)."""
    return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)))
