"""The Gemma 4 vision tower and its projection into the text model (the image path of DiffusionGemma).

    pixels [N, P, 3 p^2] in [0, 1], positions [N, P, 2] (x, y; padding patches at (-1, -1))
    -> patch embedding: (2 (x - 0.5)) W_in + x_table[x] + y_table[y]      (0 position term on padding)
    -> encoder layers (bidirectional over the real patches of one image; pre/post norms around attention and MLP)
    -> pooler: mean of each k x k block of patches (divisor k^2), times sqrt(D_v) in float32,
               then (h - std_bias) * std_scale when `standardize`; soft tokens row-major over the pooled grid
    -> `MultimodalEmbedder`: RMSNorm without scale, then a linear map into the text width.

Attention in the tower: q and k are RMS-normed (learned scales), v is RMS-normed without scale, no 1/sqrt(H)
scaling, axial 2D RoPE (the first half of each head rotates with the patch's x, the second half with its y,
each half NeoX-style with theta `rope_theta`). With `use_clipped_linears` every linear clamps its input and
its output to learned bounds, stored per linear as `<name>_clip` = [input_min, input_max, output_min, output_max].

Shapes: N images, P patches per image (padded), S = P // k^2 soft tokens per image, D_v tower width,
D text width, Nh/K/H heads / kv heads / head dim, F MLP width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.model.attention import attend
from dgemma_jax.model.layers import (apply_rope, dtype_of, gelu_tanh, ones_param, param, project, rms_normalize,
                                     rope_inv_freq)

# logical axis names of the tower's parameters (mapped to mesh axes in dgemma_jax/axis_rules.py)
V_EMBED, V_HEADS, V_KV_HEADS, V_MLP = "vision_embed", "vision_heads", "vision_kv_heads", "vision_mlp"


def _unbounded(key, shape, dtype):
    """The clamp bounds of a linear that clips nothing: [-inf, inf, -inf, inf]."""
    del key
    return jnp.broadcast_to(jnp.asarray([-jnp.inf, jnp.inf, -jnp.inf, jnp.inf], dtype), shape)


class _Norm(nn.Module):
    """Gemma RMSNorm with the tower's epsilon: the weight multiplies directly; float32 math."""

    cfg: ModelConfig
    axis_name: str = V_EMBED
    with_scale: bool = True

    @nn.compact
    def __call__(self, x):
        y = rms_normalize(x, self.cfg.vision.rms_norm_eps)
        if self.with_scale:
            y = y * ones_param(self, "scale", (x.shape[-1],), (self.axis_name,), self.cfg).astype(jnp.float32)
        return y.astype(x.dtype)


class _Clipped:
    """A linear (einsum) with the optional input/output clamps of transformers' `Gemma4ClippableLinear`."""

    def __init__(self, module: nn.Module, name: str, shape, axes, eq: str):
        cfg = module.cfg
        self.eq = eq
        self.w = param(module, name, shape, axes, cfg)
        self.clip = (param(module, name + "_clip", (4,), (None,), cfg, init=_unbounded)
                     if cfg.vision.use_clipped_linears else None)

    def __call__(self, x):
        if self.clip is None:
            return project(self.eq, x, self.w)
        c = self.clip.astype(x.dtype)
        y = project(self.eq, jnp.clip(x, c[0], c[1]), self.w)
        return jnp.clip(y, c[2], c[3])


class VisionLayer(nn.Module):
    """One encoder layer: x + post(attn(pre(x))), then + post(mlp(pre(x)))."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, pos, key_valid):
        a = _Attention(self.cfg, name="attention")(_Norm(self.cfg, name="pre_attn_norm")(x), pos, key_valid)
        x = x + _Norm(self.cfg, name="post_attn_norm")(a)
        m = _MLP(self.cfg, name="mlp")(_Norm(self.cfg, name="pre_ffw_norm")(x))
        return x + _Norm(self.cfg, name="post_ffw_norm")(m)


class _Attention(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x, pos, key_valid):
        v = self.cfg.vision
        d, n, kh, h = v.hidden_size, v.num_heads, v.num_kv_heads, v.head_dim
        q = _Clipped(self, "q", (d, n, h), (V_EMBED, V_HEADS, "head_dim"), "npd,dkh->npkh")(x)
        k = _Clipped(self, "k", (d, kh, h), (V_EMBED, V_KV_HEADS, "head_dim"), "npd,dkh->npkh")(x)
        val = _Clipped(self, "v", (d, kh, h), (V_EMBED, V_KV_HEADS, "head_dim"), "npd,dkh->npkh")(x)
        o = _Clipped(self, "o", (n, h, d), (V_HEADS, "head_dim", V_EMBED), "npkh,khd->npd")
        q = _rope_2d(_Norm(self.cfg, "head_dim", name="q_norm")(q), pos, v)
        k = _rope_2d(_Norm(self.cfg, "head_dim", name="k_norm")(k), pos, v)
        val = rms_normalize(val, v.rms_norm_eps).astype(x.dtype)
        # keys and values as `attend` takes them, [N, K, P, H]; no 1/sqrt(H): the q/k norms take that role
        out = attend(q, [(k.transpose(0, 2, 1, 3), val.transpose(0, 2, 1, 3), key_valid[:, None, :])])
        return o(out)


class _MLP(nn.Module):
    cfg: ModelConfig

    @nn.compact
    def __call__(self, x):
        v = self.cfg.vision
        d, f = v.hidden_size, v.intermediate_size
        gate = _Clipped(self, "gate", (d, f), (V_EMBED, V_MLP), "...d,df->...f")(x)
        up = _Clipped(self, "up", (d, f), (V_EMBED, V_MLP), "...d,df->...f")(x)
        return _Clipped(self, "down", (f, d), (V_MLP, V_EMBED), "...f,fd->...d")(gelu_tanh(gate) * up)


def _rope_2d(x, pos, v: VisionConfig):
    """Axial RoPE of x [N, P, heads, H]: dims [0, H/2) rotate with pos[..., 0] (x), [H/2, H) with pos[..., 1] (y),
    each half split NeoX-style with frequencies theta^(-2i / (H/2))."""
    half = v.head_dim // 2
    inv = rope_inv_freq(half, v.rope_theta)
    xs, ys = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([apply_rope(xs, pos[..., 0], inv), apply_rope(ys, pos[..., 1], inv)], axis=-1)


class VisionTower(nn.Module):
    """pixels [N, P, 3 p^2] in [0, 1], positions [N, P, 2] -> (soft tokens [N, S, D_v] float32, valid [N, S])."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, pixel_values, position_ids):
        v = self.cfg.vision
        dt = dtype_of(self.cfg.dtype)
        n_img, p, _ = pixel_values.shape
        kk = v.pooling_kernel_size
        if p % (kk * kk):
            raise ValueError(f"{p} patches per image do not pool into whole {kk}x{kk} blocks: the patch count must "
                             f"be a multiple of pooling_kernel_size^2 = {kk * kk}")
        s = p // (kk * kk)
        pos = position_ids.astype(jnp.int32)
        padding = jnp.all(pos == -1, axis=-1)  # [N, P]
        # patch embedding
        w_in = param(self, "input_proj", (v.patch_dim, v.hidden_size), (None, V_EMBED), self.cfg)
        table = param(self, "position_table", (2, v.position_embedding_size, v.hidden_size), (None, None, V_EMBED),
                      self.cfg, init=nn.initializers.ones)
        x = project("npc,cd->npd", (2.0 * (pixel_values.astype(jnp.float32) - 0.5)).astype(dt), w_in)
        safe = jnp.maximum(pos, 0)
        pe = jnp.take(table[0], safe[..., 0], axis=0) + jnp.take(table[1], safe[..., 1], axis=0)
        x = x + jnp.where(padding[..., None], 0, pe).astype(dt)
        # encoder
        key_valid = ~padding
        for i in range(v.num_layers):
            x = VisionLayer(self.cfg, name=f"layers_{i}")(x, pos, key_valid)
        # pooler: k x k blocks of the patch grid, row-major; a block that receives no patch is not a soft token
        h = jnp.where(padding[..., None], 0, x).astype(jnp.float32)
        if s != p:
            width = (jnp.max(safe[..., 0], axis=-1, keepdims=True) + 1) // kk  # pooled grid width per image
            block = safe[..., 0] // kk + width * (safe[..., 1] // kk)  # [N, P]
            onehot = jax.nn.one_hot(block, s, dtype=jnp.float32)  # [N, P, S]; a block >= S matches nothing
            h = jnp.einsum("nps,npd->nsd", onehot, h, precision=jax.lax.Precision.HIGHEST) / float(kk * kk)
            valid = jnp.any(onehot > 0, axis=1)
        else:
            valid = ~padding
        h = h * math.sqrt(v.hidden_size)
        if v.standardize:
            bias = param(self, "std_bias", (v.hidden_size,), (V_EMBED,), self.cfg, init=nn.initializers.zeros)
            scale = ones_param(self, "std_scale", (v.hidden_size,), (V_EMBED,), self.cfg)
            h = (h - bias.astype(jnp.float32)) * scale.astype(jnp.float32)
        return h, valid


class MultimodalEmbedder(nn.Module):
    """Soft tokens [..., D_v] -> text embeddings [..., D]: RMSNorm without scale, then a linear map."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self, soft):
        v = self.cfg.vision
        w = param(self, "projection", (v.hidden_size, self.cfg.hidden_size), (V_EMBED, "embed"), self.cfg)
        x = rms_normalize(soft, v.rms_norm_eps).astype(dtype_of(self.cfg.dtype))
        return project("...c,cd->...d", x, w)


def compact_rows(features, valid):
    """features [N, S, D], valid [N, S] -> ([N*S, D] with the valid rows first in row-major order and zeros
    after them, the number of valid rows). Static shapes: a cumsum gives each valid row its slot."""
    n, s, d = features.shape
    flat_valid = valid.reshape(n * s)
    slot = jnp.where(flat_valid, jnp.cumsum(flat_valid.astype(jnp.int32)) - 1, n * s)  # n*s: dropped
    out = jnp.zeros((n * s, d), features.dtype).at[slot].set(features.reshape(n * s, d), mode="drop")
    return out, jnp.sum(flat_valid.astype(jnp.int32))


def soft_tokens_per_image(vision: VisionConfig, num_patches: int) -> int:
    """S, the soft-token slots per image for `num_patches` (padded) patches."""
    return num_patches // (vision.pooling_kernel_size ** 2)


__all__ = ["VisionTower", "MultimodalEmbedder", "VisionLayer", "compact_rows", "soft_tokens_per_image",
           "V_EMBED", "V_HEADS", "V_KV_HEADS", "V_MLP"]
