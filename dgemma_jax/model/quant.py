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
benchmarks/results/quant_quality.json, quantizing it too (one scale per vocabulary row) adds logit
error for ~V*D bytes, a small share of a MoE's bytes (3% of the 26B). `embedding=True` quantizes it.

Quantized parameters keep the float kernel's logical axes (the scale's size-1 axes are replicated),
so `parallel.Shardings.for_params` places them on any mesh; checkpoints store them as they are
(`io.model_dir.save_model` records the quantization, `load_model` reads it back).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.layers import (INT4_VALUES, QUANT_SCALE, QUANT_VALUES, dequantize, is_int4, is_quantized,
                                     itemsize)

QUANT_MODES = ("int8", "int4")

# (kernels by "/"-joined parameter path, the axes their matmul contracts)
KERNELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    (r"(^|/)attn/(q|k|v)$", (0,)),                           # [D, N|K, H]: x D -> heads
    (r"(^|/)attn/o$", (0, 1)),                               # [N, H, D]
    (r"(^|/)(dense_mlp|sc_mlp)/(gate_up|down)$", (0,)),      # [D, 2, F], [F, D]
    (r"(^|/)moe/(gate_up|down)$", (1,)),                     # [E, D, 2F], [E, F, D]: per expert
)
# the tied embedding as the head [V, D] contracts D: one scale per vocabulary row
EMBEDDING: tuple[str, tuple[int, ...]] = (r"^embedding$", (1,))
# the vision tower's projections and its projection into the text model (`model.vision`)
VISION_KERNELS: tuple[tuple[str, tuple[int, ...]], ...] = (
    (r"^vision_tower/layers_\d+/attention/(q|k|v)$", (0,)),   # [C, N, H]
    (r"^vision_tower/layers_\d+/attention/o$", (0, 1)),       # [N, H, C]
    (r"^vision_tower/layers_\d+/mlp/(gate|up|down)$", (0,)),  # [C, F], [F, C]
    (r"^embed_vision/projection$", (0,)),                     # [C, D]
)
QMAX = 127.0
INT4_QMAX = 7.0  # symmetric: q in [-7, 7] (int4's -8 left unused, as int8's -128)
INT4_GROUP = 128  # the largest group size; an axis it does not divide takes gcd(size, 128)


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def contracted_axes(path: str, embedding: bool, vision: bool = False) -> tuple[int, ...] | None:
    """The contracted axes of the kernel at `path` if it is quantized, else None."""
    for pattern, axes in KERNELS + ((EMBEDDING,) if embedding else ()) + (VISION_KERNELS if vision else ()):
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


def int4_group(size: int) -> int:
    """The group size along a contracted axis of `size`: gcd(size, 128) (the 26B: 128 for its 2816-wide
    hidden axis, 64 for the experts' 704 and the dense MLP's 2112)."""
    return math.gcd(size, int(INT4_GROUP))


def int4_scale_shape(shape: tuple[int, ...], contracted: tuple[int, ...]) -> tuple[int, ...]:
    """The int4 scale's shape: the kernel's, with the last contracted axis counted in groups."""
    g = contracted[-1]
    return tuple(n // int4_group(n) if i == g else n for i, n in enumerate(shape))


def quantize_kernel_int4(w: jax.Array, contracted: tuple[int, ...]) -> dict:
    """A float kernel -> {"int4": q, "scale": s}: symmetric, one scale per group of `int4_group`
    consecutive weights along the last contracted axis (and per index of every other axis):
    s = max|W| over the group / 7 stored in bfloat16 (a float32 scale per 64 weights would add 12% to the
    int4 bytes), q = round(W / s) in [-7, 7] against that stored scale; an all-zero group gets s = 1, q = 0."""
    w32 = jnp.asarray(w, jnp.float32)
    g = contracted[-1]
    n = w32.shape[g]
    size = int4_group(n)
    grouped = w32.reshape(w32.shape[:g] + (n // size, size) + w32.shape[g + 1:])
    amax = jnp.max(jnp.abs(grouped), axis=g + 1, keepdims=True)
    scale = jnp.where(amax > 0, amax / INT4_QMAX, 1.0).astype(jnp.bfloat16).astype(jnp.float32)
    q = jnp.clip(jnp.round(grouped / scale), -INT4_QMAX, INT4_QMAX).reshape(w32.shape).astype(jnp.int4)
    return {INT4_VALUES: q, QUANT_SCALE: jnp.squeeze(scale, g + 1).astype(jnp.bfloat16)}


_quantize_jit = {"int8": jax.jit(quantize_kernel, static_argnums=1),
                 "int4": jax.jit(quantize_kernel_int4, static_argnums=1)}


def quantization_of(params) -> str | None:
    """"int4" when any kernel of `params` is an int4 pair (its embedding may be int8), "int8" when the
    quantized kernels are int8 pairs, else None."""
    found = set()

    def visit(x):
        if is_quantized(x):
            found.add("int4" if is_int4(x) else "int8")
        return x

    jax.tree.map(visit, params, is_leaf=is_quantized)
    return "int4" if "int4" in found else ("int8" if found else None)


def embedding_quantized(params) -> bool:
    return isinstance(params, dict) and is_quantized(params.get("embedding"))


def vision_quantized(params) -> bool:
    """Whether the parameters' vision tower (if any) holds quantized kernels."""
    tower = params.get("vision_tower") if isinstance(params, dict) else None
    return tower is not None and any(is_quantized(x) for x in jax.tree.leaves(tower, is_leaf=is_quantized))


def _int4_default(mode: str, flag: bool | None) -> bool:
    """The `embedding=` / `vision=` choice: None means on for int4 only, the mode for fitting one chip. int8
    leaves the tied embedding and the vision tower float (the 26B's int8 fits a v6e-1 with both float);
    int4 makes the embedding int8 (one scale per vocabulary row) and the tower int4 (a float tower, 1.15 GB
    on the 26B, is most of what a v5e-1 has left for the cache)."""
    return (mode == "int4") if flag is None else bool(flag)


def quantize_params(config: ModelConfig, params, mode: str = "int8", *, embedding: bool | None = None,
                    vision: bool | None = None):
    """Float parameters -> the same tree with every target kernel a quantized pair (module docstring).

    Args:
      config: the model. params: float parameters of `config` (not changed in place; arrays stay on
        the devices / shardings they were on).
      mode: "int8" (per-channel) or "int4" (group-wise).
      embedding: quantize the tied embedding / head too, in int8 (default: False for int8, see
        benchmarks/results/quant_quality.json; True for int4, whose point is fitting one chip).
      vision: quantize the vision tower's kernels too, in `mode` (default: False for int8, True for
        int4; nothing to do without a tower).
    Returns:
      the new parameter tree, each quantized kernel a {"int8" or "int4", "scale"} pair.
    Raises:
      ValueError for an unknown mode, parameters already quantized, or a tree that is not this config's.
    """
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    embedding = _int4_default(mode, embedding)
    vision = _int4_default(mode, vision)
    already = quantization_of(params)
    if already is not None:
        raise ValueError(f"these parameters are already quantized ({already} kernels); quantize the float "
                         "parameters once, or pass the quantized ones as they are")
    want = {_path(p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(param_shapes(config))[0]}
    have = {_path(p): tuple(np.shape(x)) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    if want != have:
        bad = sorted(set(want) ^ set(have)) or [k for k in want if want[k] != have[k]]
        raise ValueError(f"the parameters do not match {config.name}'s ({len(bad)} tensor(s) differ, e.g. {bad[0]!r}); "
                         "quantize the parameters of this config")

    def one(path, w):
        name = _path(path)
        axes = contracted_axes(name, embedding, vision)
        if axes is None:
            return w
        return _quantize_jit["int8" if re.search(EMBEDDING[0], name) else mode](w, axes)

    return jax.tree_util.tree_map_with_path(one, params)


def quantized_shapes(config: ModelConfig, mode: str = "int8", *, embedding: bool | None = None,
                     vision: bool | None = None):
    """The tree `quantize_params` returns for this config, as `jax.ShapeDtypeStruct`s (no arrays)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantization mode {mode!r}; choose one of {', '.join(QUANT_MODES)}")
    embedding = _int4_default(mode, embedding)
    vision = _int4_default(mode, vision)

    def one(path, s):
        axes = contracted_axes(_path(path), embedding, vision)
        if axes is None:
            return s
        if mode == "int4" and not re.search(EMBEDDING[0], _path(path)):
            return {INT4_VALUES: jax.ShapeDtypeStruct(s.shape, jnp.int4),
                    QUANT_SCALE: jax.ShapeDtypeStruct(int4_scale_shape(s.shape, axes), jnp.bfloat16)}
        scale = tuple(1 if i in axes else n for i, n in enumerate(s.shape))
        return {QUANT_VALUES: jax.ShapeDtypeStruct(s.shape, jnp.int8),
                QUANT_SCALE: jax.ShapeDtypeStruct(scale, jnp.float32)}

    return jax.tree_util.tree_map_with_path(one, param_shapes(config))


def dequantize_params(params):
    """Quantized pairs back to float32 kernels (q * s); other leaves unchanged (for checks and measurements)."""
    return jax.tree.map(lambda x: dequantize(x) if is_quantized(x) else x, params, is_leaf=is_quantized)


def param_bytes(params) -> int:
    """Bytes the parameter arrays hold (int8 / int4 values, scales and float leaves; int4 counts half a byte)."""
    return int(sum(math.prod(np.shape(x)) * itemsize(x.dtype) for x in jax.tree.leaves(params)))


# ---------------------------------------------------------------------------- choosing a mode
QUANTIZE_CHOICES = ("auto", "none") + QUANT_MODES
WEIGHT_SHARE = 0.9  # the share of accelerator memory the weights may take (the rest: cache, activations)


@functools.lru_cache(maxsize=64)
def weight_bytes(config: ModelConfig, mode: str | None = None) -> int:
    """Bytes of this config's parameters in its param dtype (mode None) or quantized (from shapes, no arrays;
    remembered per config and mode: tracing the 26B's shapes takes seconds)."""
    tree = param_shapes(config) if mode is None else quantized_shapes(config, mode)
    return int(sum(math.prod(x.shape) * itemsize(x.dtype) for x in jax.tree.leaves(tree)))


def device_bytes(devices) -> list[int | None]:
    """Each device's memory limit in bytes (None where the backend reports none, as the CPU)."""
    out = []
    for d in devices:
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - a backend without memory statistics
            stats = {}
        out.append(stats.get("bytes_limit"))
    return out


def mode_for(config: ModelConfig, quantize: str | None, saved: str | None, devices=None) -> str | None:
    """The mode to quantize parameters in, given what they already are (`saved`: "int8", "int4" or None
    for float): quantized parameters are kept as they are under None / "none" / "auto", and an explicit
    mode for them is a ValueError; float ones go through `resolve_quantize`."""
    if saved is not None:
        if quantize not in (None, "none", "auto"):
            raise ValueError(f"quantize={quantize!r}: the parameters are already quantized ({saved}); "
                             "pass them without quantize")
        return None
    return resolve_quantize(config, quantize, devices)


def resolve_quantize(config: ModelConfig, quantize: str | None, devices=None) -> str | None:
    """A `quantize` argument as a mode: None / "none" -> None (the param dtype), "int8" / "int4" as
    given, "auto" -> the first of none, int8, int4 whose weights fit `WEIGHT_SHARE` of the memory of
    `devices` (the devices the weights are split over: a mesh's, else the one device they go to);
    None on a backend that reports no memory (CPU). Raises a ValueError for another value, or when
    even int4 does not fit (with the sizes)."""
    if quantize is None or quantize == "none":
        return None
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"unknown quantize value {quantize!r}; choose one of {', '.join(QUANTIZE_CHOICES)}")
    if quantize != "auto":
        return quantize
    limits = device_bytes(list(devices) if devices is not None else jax.devices()[:1])
    if not limits or not all(limits):
        return None
    room = WEIGHT_SHARE * min(limits) * len(limits)
    sizes = {mode: weight_bytes(config, None if mode == "none" else mode) for mode in ("none", "int8", "int4")}
    for mode in ("none", "int8", "int4"):
        if sizes[mode] <= room:
            return None if mode == "none" else mode
    gib = {k: f"{v / 2**30:.1f}" for k, v in sizes.items()}
    raise ValueError(f"{config.name} needs {gib['none']} GiB of weights in {config.param_dtype}, {gib['int8']} GiB in "
                     f"int8 and {gib['int4']} GiB in int4, but {len(limits)} device(s) leave {room / 2**30:.1f} GiB "
                     "for weights; use more devices (--mesh) or a bigger accelerator")


# ---------------------------------------------------------------------------- one tensor at a time
def quantize_leaf(path: str, w, mode: str, embedding: bool | None = None, vision: bool | None = None):
    """One float parameter at its "/"-joined `path` -> as `quantize_params` would leave it (a quantized
    pair, or `w` itself when it is not a quantized kernel): what a loader calls per tensor, so the whole
    float model is never held. The pair stays on the devices of `w` (`Shardings.place_params` lays it out
    afterwards)."""
    axes = contracted_axes(path, _int4_default(mode, embedding), _int4_default(mode, vision))
    if axes is None:
        return w
    return _quantize_jit["int8" if re.search(EMBEDDING[0], path) else mode](w, axes)
