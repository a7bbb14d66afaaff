"""One transformer layer of DiffusionGemma, in both modes (the block's equations: `model.transformer`).

Its own module so that the two drivers of the layers, the unrolled loop (`model.transformer`) and
the scan over the repeated layer group (`model.scanned`), both build it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.attention import Attention
from dgemma_jax.model.cache import SLOT_AXIS, group_entry, group_rows, put_group_rows, ring_limit
from dgemma_jax.model.layers import GatedMLP, RMSNorm, ones_param
from dgemma_jax.model.moe import MoE
from dgemma_jax.axis_rules import ACTIVATION_AXES
from dgemma_jax.runtime import Runtime


class Block(nn.Module):
    cfg: ModelConfig
    rt: Runtime
    layer: int

    def setup(self):
        cfg = self.cfg
        self.attn = Attention(cfg, self.rt, self.layer)
        self.pre_attn_norm = RMSNorm(cfg)
        self.post_attn_norm = RMSNorm(cfg)
        self.pre_dense_norm = RMSNorm(cfg)
        self.post_dense_norm = RMSNorm(cfg)
        self.pre_moe_norm = RMSNorm(cfg)
        self.post_moe_norm = RMSNorm(cfg)
        self.post_ffw_norm = RMSNorm(cfg)
        self.dense_mlp = GatedMLP(cfg, cfg.intermediate_size)
        self.moe = MoE(cfg, self.rt)
        self.encoder_scalar = ones_param(self, "encoder_scalar", (1,), (None,), cfg)
        self.decoder_scalar = ones_param(self, "decoder_scalar", (1,), (None,), cfg)

    def _ffw(self, x1, scalar):
        xd = self.pre_dense_norm(x1)
        kernels, adapters = self.dense_mlp(xd, kernels_only=True)
        if adapters is None:  # offered to the experts' per-shard body: one all-reduce for both where the mesh allows
            m, d = self.moe(x1, self.pre_moe_norm(x1), dense=(xd, kernels))
        else:
            m, d = self.moe(x1, self.pre_moe_norm(x1)), None
        if d is None:
            d = self.dense_mlp(xd)
        d, m = self.post_dense_norm(d), self.post_moe_norm(m)
        y = x1 + self.post_ffw_norm(d + m)
        y = (y.astype(jnp.float32) * scalar.astype(jnp.float32)).astype(x1.dtype)
        return self.rt.constrain(y, ACTIVATION_AXES)

    def encode(self, x, starts, num_new, cache_k, cache_v, image_span=None, group=None):
        a, cache_k, cache_v = self.attn.encode(self.pre_attn_norm(x), starts, num_new, cache_k, cache_v, image_span,
                                               group)
        x1 = x + self.post_attn_norm(a)
        return self._ffw(x1, self.encoder_scalar), cache_k, cache_v

    def denoise(self, x, context_end, cache_k, cache_v):
        a = self.attn.denoise(self.pre_attn_norm(x), context_end, cache_k, cache_v)
        x1 = x + self.post_attn_norm(a)
        return self._ffw(x1, self.decoder_scalar)

    def commit_denoise(self, xc, xd, starts, num_new, cache_k, cache_v, group=None):
        """`encode` of xc [B, T, D] (the causal pass writing a row's settled canvas) and `denoise` of xd
        [B, L, D] (the row's next canvas, after it: positions starts + num_new on) in one layer.

        The canvas attends to the cache with this layer's new tokens written into it, exactly as a
        denoising pass after the committing pass would; the feed-forward part, which reads most of the
        layer's weights, runs once over both (`_joined_ffw`). Returns (xc, xd, cache_k, cache_v)."""
        a, cache_k, cache_v = self.attn.encode(self.pre_attn_norm(xc), starts, num_new, cache_k, cache_v, None, group)
        ad = self.attn.denoise(self.pre_attn_norm(xd), starts + num_new, group_entry(cache_k, group),
                               group_entry(cache_v, group))
        return (*self._joined_ffw(xc + self.post_attn_norm(a), xd + self.post_attn_norm(ad)), cache_k, cache_v)

    def commit_rows_denoise(self, xc, xd, rows, starts, num_new, context_end, cache_k, cache_v, group=None):
        """`commit_denoise` for a server's slots: `encode` of xc [G K, T, D] into rows `rows` [G, K] of
        the cache (the N rows in G groups of N / G, `model.cache.group_rows`; starts, num_new [G K]) and
        `denoise` of every row's canvas xd [N, L, D] at context_end [N] against the cache they leave.

        The K rows of each group are read out of the layer's cache, written, and their new slots put
        back in place (a sliding layer's ring: the whole row) before the canvases attend to it; the
        feed-forward part runs once over both, each group's commit tokens beside its own rows' canvases
        (so on a mesh whose data axis splits the slots no row leaves its group's devices). Returns
        (xc, xd, cache_k, cache_v)."""
        g, k = rows.shape
        sub_k = group_rows(group_entry(cache_k, group), rows)
        sub_v = group_rows(group_entry(cache_v, group), rows)
        a, sub_k, sub_v = self.attn.encode(self.pre_attn_norm(xc), starts, num_new, sub_k, sub_v)
        whole = self.attn.window is not None and sub_k.shape[SLOT_AXIS] <= ring_limit(self.cfg)   # a ring
        cache_k = put_group_rows(cache_k, sub_k, rows, starts, xc.shape[1], whole, group)
        cache_v = put_group_rows(cache_v, sub_v, rows, starts, xc.shape[1], whole, group)
        ad = self.attn.denoise(self.pre_attn_norm(xd), context_end, group_entry(cache_k, group),
                               group_entry(cache_v, group))
        xc1, xd1 = xc + self.post_attn_norm(a), xd + self.post_attn_norm(ad)
        (t, d), (n, l) = xc.shape[1:], xd.shape[:2]
        yc, yd = self._joined_ffw(xc1.reshape(g, k * t, d), xd1.reshape(g, (n // g) * l, d))
        return yc.reshape(g * k, t, d), yd.reshape(n, l, d), cache_k, cache_v

    def _joined_ffw(self, xc, xd):
        """The feed-forward part once over the commit's tokens xc [B, T, D] and the canvases' xd [B, L, D],
        joined along the sequence axis (every batch row stays where it lies on a mesh), each token with
        its own mode's layer scalar: the layer's dense and expert weights read once for both."""
        t = xc.shape[1]
        scalar = jnp.concatenate([jnp.broadcast_to(self.encoder_scalar, (t,)),
                                  jnp.broadcast_to(self.decoder_scalar, (xd.shape[1],))])[:, None]
        y = self._ffw(jnp.concatenate([xc, xd], axis=1), scalar)
        return y[:, :t], y[:, t:]
