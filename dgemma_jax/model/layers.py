"""Small building blocks: RMSNorm, rotary embeddings, the gated GELU MLP, parameter helpers, and
the unmerged LoRA projection every adapted kernel goes through (`project`).

Shapes use single letters: B batch, T tokens, D model width, N query heads, K kv heads,
H head dim, F MLP hidden, V vocab.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.per_group import PerGroup

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(name: str):
    return DTYPES[name]


def param(module: nn.Module, name: str, shape, axes: tuple, cfg: ModelConfig, init=None):
    """Declare a parameter with logical axis names (mapped to mesh axes in `dgemma_jax.parallel`).

    A kernel the parameters hold quantized (an int8 or int4 pair, see `model.quant`) is returned as
    that pair, untouched: the matmul that reads it (`project`, the MoE dispatch, the tied head)
    dequantizes or casts it there."""
    if module.has_variable("params", name):
        stored = module.get_variable("params", name)
        if is_quantized(stored) or isinstance(stored, PerGroup):
            # an int8 pair, or a scanned layer's per-group kernel (`model.per_group.PerGroup`): as stored
            if kernel_shape(stored) != tuple(shape):
                kind = "quantized kernel" if is_quantized(stored) else "per-group kernel"
                raise ValueError(f"{kind} {name!r} of {module.name!r} has shape {kernel_shape(stored)}; "
                                 f"the model expects {tuple(shape)}")
            return stored
    init = init or nn.initializers.normal(0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype_of(cfg.param_dtype))


# ---------------------------------------------------------------------------- quantized kernels
# A weight-only int8 kernel is the pair {"int8": q, "scale": s}: q int8 laid out like the float
# kernel, s float32 of the same rank with size 1 on the axes the kernel's matmul contracts (one
# symmetric scale per output channel, and per expert). W ~= q * s.
# A weight-only int4 kernel is the pair {"int4": q, "scale": s}: q int4 laid out like the float
# kernel, s float32 of the same rank whose last contracted axis holds one scale per group of
# consecutive weights (its size is that axis's size / the group size) and whose other axes have the
# kernel's sizes. W ~= q * s with each scale repeated over its group. `model.quant` builds both.
QUANT_VALUES, INT4_VALUES, QUANT_SCALE = "int8", "int4", "scale"


def is_quantized(w) -> bool:
    """Whether `w` is a quantized kernel, int8 {"int8", "scale"} or int4 {"int4", "scale"} (else a plain array)."""
    # a dict, or FrozenDict in setup()
    return isinstance(w, Mapping) and set(w) in ({QUANT_VALUES, QUANT_SCALE}, {INT4_VALUES, QUANT_SCALE})


def is_int4(w) -> bool:
    """Whether `w` is an int4 kernel {"int4", "scale"} (group-wise scales along the contracted axis)."""
    return is_quantized(w) and INT4_VALUES in w


def quant_values(w) -> jax.Array:
    """The integer values of a quantized kernel (int8 or int4)."""
    return w[INT4_VALUES] if INT4_VALUES in w else w[QUANT_VALUES]


def itemsize(dtype) -> float:
    """Bytes per element as memory holds them: 0.5 for the 4-bit types (numpy's itemsize says 1)."""
    dtype = np.dtype(dtype)
    return 0.5 if dtype in (np.dtype(jnp.int4), np.dtype(jnp.uint4)) else dtype.itemsize


def kernel_shape(w) -> tuple:
    """The logical shape of a kernel, float or quantized."""
    return tuple((quant_values(w) if is_quantized(w) else w).shape)


def dequantize(w, dtype=jnp.float32) -> jax.Array:
    """A kernel as a float array of `dtype` (quantized: q * s in float32, each scale repeated over the
    weights it covers: its channel for int8, its group for int4)."""
    if not is_quantized(w):
        return w.astype(dtype)
    q = quant_values(w)
    s = w[QUANT_SCALE].astype(jnp.float32)
    for axis, (n, m) in enumerate(zip(q.shape, s.shape)):
        if m not in (1, n):
            s = jnp.repeat(s, n // m, axis=axis)
    return (q.astype(jnp.float32) * s).astype(dtype)


def output_scale(eq: str, scale: jax.Array) -> jax.Array:
    """An int8 kernel's scale [kernel rank, 1 on contracted axes] laid out to broadcast against the
    output of the einsum `eq` ("<x>,<kernel>-><out>"; an ellipsis only at the start of x and out)."""
    lhs, out = eq.replace(" ", "").split("->")
    ws = lhs.split(",")[1]
    if "." in ws or ("." in out and not out.startswith("...")):
        raise ValueError(f"int8 kernel einsum {eq!r}: the kernel must be spelled out and an ellipsis lead the output")
    out = out.removeprefix("...")
    contracted = tuple(i for i, c in enumerate(ws) if c not in out)
    kept = "".join(c for c in ws if c in out)
    s = jnp.squeeze(scale, contracted) if contracted else scale
    order = [c for c in out if c in kept]  # the kept axes in output order
    s = jnp.transpose(s, [kept.index(c) for c in order])
    return s.reshape([s.shape[order.index(c)] if c in kept else 1 for c in out])


def ones_param(module: nn.Module, name: str, shape, axes: tuple, cfg: ModelConfig):
    return param(module, name, shape, axes, cfg, init=nn.initializers.ones)


# ---------------------------------------------------------------------------- LoRA, unmerged
LORA_COLLECTION = "lora"


def adapter(module: nn.Module, name: str):
    """The LoRA pair {"a": A, "b": B} of kernel `name` from the "lora" variable collection, or None.

    The pair is laid out like the kernel (see `training.lora.forward_adapters`): A [*batch, *in, r],
    B [*batch, r, *out] with the scale alpha / r already folded into B. Serving several adapters at
    once (`model.api.with_adapters`) stacks them, A [N, *in, r] and B [N, r, *out], and adds "rows":
    each batch row's adapter index [B] (index 0 all zeros: the base model).
    """
    if module.has_variable(LORA_COLLECTION, name):
        return module.get_variable(LORA_COLLECTION, name)
    return None


def low_rank(eq: str, x: jax.Array, ab) -> jax.Array:
    """The float32 LoRA term (x A) B of the einsum `eq` ("<x>,<kernel>-><out>") over a kernel whose
    axes are ordered batch, in, out: A carries the batch and in axes plus a rank axis, B the batch,
    rank and out axes. With "rows" (stacked adapters, one per row of x's leading axis) row b runs
    (x[b] A[rows[b]]) B[rows[b]]. Returns float32 laid out like the einsum's output."""
    a, b = ab["a"], ab["b"]
    lhs, out = eq.replace(" ", "").split("->")
    xs, ws = lhs.split(",")
    free = iter(c for c in "rstuvwxyzabcdefghijklmnopq" if c not in eq)
    r, rl = next(free), ""
    rows = ab.get("rows")
    if rows is not None:  # one adapter per row: A [N, ...], B [N, ...] gathered by rows [B] (x's leading axis)
        if rows.shape[0] != x.shape[0]:
            raise ValueError(f"per-row LoRA adapters: {rows.shape[0]} row indices for a batch of {x.shape[0]} rows "
                             "(a pass over some of the rows takes their indices: model.api.take_rows)")
        a, b = a[rows], b[rows]
        if xs.startswith("..."):
            rl = next(free)
            xs, out = rl + xs, rl + out
        else:
            rl = xs[0]
    nb = a.ndim + b.ndim - 2 - len(ws) - 2 * bool(rl)
    nin = a.ndim - 1 - nb - bool(rl)
    if nb < 0 or nin < 1 or b.ndim - 1 - nb - bool(rl) < 1 or (rl and nb):
        raise ValueError(f"LoRA pair A {a.shape} / B {b.shape} does not fit kernel subscripts {ws!r} of {eq!r}"
                         + (" (per-row adapters need a kernel without expert axes)" if rl and nb else ""))
    bl, il, ol = ws[:nb], ws[nb:nb + nin], ws[nb + nin:]
    hs = "".join(c for c in out if c not in ol) + r
    f32 = jnp.float32
    h = jnp.einsum(f"{xs},{rl}{bl}{il}{r}->{hs}", x.astype(f32), a.astype(f32), preferred_element_type=f32)
    return jnp.einsum(f"{hs},{rl}{bl}{r}{ol}->{out}", h, b.astype(f32), preferred_element_type=f32)


def project(eq: str, x: jax.Array, w: jax.Array, ab=None) -> jax.Array:
    """einsum(eq, x, w) in x's dtype, plus the unmerged LoRA term (x A) B when `ab` is given.

    An int8 kernel (`is_quantized`) is read as int8 (HBM holds one byte per weight), cast exactly to
    x's dtype inside the matmul and scaled per output channel in float32. The matmul's result is in
    x's dtype, as a float kernel's is: where the contracted axis is split over chips, that result is
    what the chips all-reduce (a float32 result doubled the bytes on the inter-chip links). An int4
    kernel (`is_int4`) is dequantized to x's dtype right before the matmul (its scales vary along the
    contracted axis, so they cannot move to the output); XLA may fuse that into the matmul's operand.

    The base kernel is read in its own dtype (cast to the activation dtype as always); the adapter
    term is computed in float32 and added before the result is cast back, so an adapter update the
    base dtype could not represent (bf16 rounds away deltas under half an ulp of W) still reaches
    the output.
    """
    if is_int4(w):  # group-wise scales along the contracted axis: the kernel in x's dtype, then as a float one
        w = dequantize(w, x.dtype)
    elif is_quantized(w):  # int8 values cast exactly to x's dtype; the per-channel scale on the output
        y = jnp.einsum(eq, x, w[QUANT_VALUES].astype(x.dtype)).astype(jnp.float32)
        y = y * output_scale(eq, w[QUANT_SCALE].astype(jnp.float32))
        if ab is not None:
            y = y + low_rank(eq, x, ab)
        return y.astype(x.dtype)
    y = jnp.einsum(eq, x, w.astype(x.dtype))
    if ab is None:
        return y
    return (y.astype(jnp.float32) + low_rank(eq, x, ab)).astype(y.dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x * (mean(x^2) + eps)^-1/2 over the last axis, computed in float32, returned as float32."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """Gemma 4 RMSNorm: the weight multiplies directly (not 1 + w); math in float32."""

    cfg: ModelConfig
    with_scale: bool = True
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.cfg.rms_norm_eps)
        if self.with_scale:
            w = ones_param(self, "scale", (x.shape[-1],), (self.axis_name,), self.cfg)
            y = y * w.astype(jnp.float32)
        return y.astype(x.dtype)


# ---------------------------------------------------------------------------- rotary embeddings
def rope_inv_freq(head_dim: int, theta: float, proportion: float = 1.0) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] in float32.

    Proportional RoPE (global layers) rotates only `int(proportion * head_dim / 2)` pairs with
    frequencies theta^(-2i/head_dim) (the exponent uses the FULL head_dim); the other pairs get
    frequency 0, i.e. pass through unrotated. `proportion=1` is standard RoPE.
    """
    n_rot = int(proportion * head_dim // 2)
    exps = np.arange(0, 2 * n_rot, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (1.0 / np.power(np.float32(theta), exps, dtype=np.float32)).astype(np.float32)
    return np.concatenate([inv, np.zeros(head_dim // 2 - n_rot, np.float32)])


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Half-split (NeoX) rotary embedding: dim i rotates with dim i + H/2.

    x: [B, T, heads, H]; positions: [B, T] int.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# ---------------------------------------------------------------------------- MLP
def gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


# the dense MLP's kernels and their logical axes (`GatedMLP`); the MoE's shard_map reads these to
# run the dense MLP beside the experts (`moe.expert_parallel`)
GATED_MLP_AXES = {"gate_up": ("embed", None, "mlp"), "down": ("mlp", "embed")}


def gated_mlp(x: jax.Array, gate_up, down, ab_gate_up=None, ab_down=None) -> jax.Array:
    """down(gelu_tanh(x Wg) * (x Wu)) with gate_up [D, 2, F], down [F, D] (plain or int8 kernels,
    optional LoRA pairs). On F columns of the kernels only, the result is that slice's partial sum."""
    with jax.named_scope("dense_mlp"):
        h = project("...d,dcf->...cf", x, gate_up, ab_gate_up)
        h = gelu_tanh(h[..., 0, :]) * h[..., 1, :]
        return project("...f,fd->...d", h, down, ab_down)


class GatedMLP(nn.Module):
    """down(gelu_tanh(x Wg) * (x Wu)); gate and up stored stacked as [D, 2, F].

    `__call__(x)` runs it; `__call__(x, kernels_only=True)` returns its kernels {"gate_up", "down"}
    and its LoRA pairs (name -> pair, or None) for a caller that runs `gated_mlp` itself."""

    cfg: ModelConfig
    hidden: int

    @nn.compact
    def __call__(self, x: jax.Array, kernels_only: bool = False):
        d = x.shape[-1]
        kernels = {"gate_up": param(self, "gate_up", (d, 2, self.hidden), GATED_MLP_AXES["gate_up"], self.cfg),
                   "down": param(self, "down", (self.hidden, d), GATED_MLP_AXES["down"], self.cfg)}
        adapters = {k: ab for k in kernels if (ab := adapter(self, k)) is not None} or None
        if kernels_only:
            return kernels, adapters
        adapters = adapters or {}
        return gated_mlp(x, kernels["gate_up"], kernels["down"], adapters.get("gate_up"), adapters.get("down"))


def softcap(logits: jax.Array, cap: float) -> jax.Array:
    """cap * tanh(logits / cap) in float32."""
    logits = logits.astype(jnp.float32)
    return cap * jnp.tanh(logits / cap)
