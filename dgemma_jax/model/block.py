"""One transformer layer of DiffusionGemma, in both modes (the block's equations: `model.transformer`).

Its own module so that the two drivers of the layers, the unrolled loop (`model.transformer`) and
the scan over the repeated layer group (`model.scanned`), both build it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.attention import Attention, join_tokens, split_tokens, token_positions
from dgemma_jax.model.cache import SLOT_AXIS, group_entry, group_rows, put_group_rows
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
        denoising pass after the committing pass would; the projections and the feed-forward part,
        the layer's weights, run once over both (`_joint`). Returns (xc, xd, cache_k, cache_v)."""
        context_end = starts + num_new

        def attend(qkv_c, pc, qkv_d, pd):
            yc, k, v = self.attn.encode_attend(qkv_c, pc, starts, num_new, cache_k, cache_v, None, group)
            return yc, self.attn.denoise_attend(qkv_d, pd, context_end, group_entry(k, group),
                                                group_entry(v, group)), k, v

        return self._joint(xc, xd, starts, context_end, xc.shape[0], attend)

    def commit_rows_denoise(self, xc, xd, rows, starts, num_new, context_end, cache_k, cache_v, group=None):
        """`commit_denoise` for a server's slots: `encode` of xc [G K, T, D] into rows `rows` [G, K] of
        the cache (the N rows in G groups of N / G, `model.cache.group_rows`; starts, num_new [G K]) and
        `denoise` of every row's canvas xd [N, L, D] at context_end [N] against the cache they leave.

        The K rows of each group are read out of the layer's cache, written, and their new slots put
        back in place (a sliding layer's ring: the whole row) before the canvases attend to it; the
        projections and the feed-forward part run once over both, each group's commit tokens beside
        its own rows' canvases (so on a mesh whose data axis splits the slots no row leaves its
        group's devices). Returns (xc, xd, cache_k, cache_v)."""
        width = xc.shape[1]

        def attend(qkv_c, pc, qkv_d, pd):
            sub_k = group_rows(group_entry(cache_k, group), rows)
            sub_v = group_rows(group_entry(cache_v, group), rows)
            yc, sub_k, sub_v = self.attn.encode_attend(qkv_c, pc, starts, num_new, sub_k, sub_v)
            ring = self.attn.is_ring(sub_k.shape[SLOT_AXIS])   # its whole row goes back: the new slots may wrap
            k = put_group_rows(cache_k, sub_k, rows, starts, width, ring, group)
            v = put_group_rows(cache_v, sub_v, rows, starts, width, ring, group)
            return yc, self.attn.denoise_attend(qkv_d, pd, context_end, group_entry(k, group),
                                                group_entry(v, group)), k, v

        return self._joint(xc, xd, starts, context_end, rows.shape[0], attend)

    def _joint(self, xc, xd, starts, context_end, groups: int, attend):
        """A layer over the commit's tokens xc [B_c, T, D] at starts and the canvases' xd [B_d, L, D] at
        context_end, in G row groups: their q/k/v projections, output projection and feed-forward part
        each once over both sets of tokens, joined per group (`attention.join_tokens`: every row stays
        where it lies on a mesh), each token with its own mode's layer scalar; `attend`(qkv_c,
        positions_c, qkv_d, positions_d) -> (yc, yd, cache_k, cache_v) writes the commit and attends
        (the canvases after the commit). Returns (xc, xd, cache_k, cache_v)."""
        pc, pd = token_positions(starts, xc.shape[1]), token_positions(context_end, xd.shape[1])
        qkv_c, qkv_d = self.attn.joint_qkv([(self.pre_attn_norm(xc), pc), (self.pre_attn_norm(xd), pd)], groups)
        yc, yd, cache_k, cache_v = attend(qkv_c, pc, qkv_d, pd)
        ac, ad = self.attn.joint_out([yc, yd], groups)
        x1 = [xc + self.post_attn_norm(ac), xd + self.post_attn_norm(ad)]
        shapes = [x.shape[:2] for x in x1]
        scalar = jnp.concatenate([jnp.broadcast_to(self.encoder_scalar, ((shapes[0][0] // groups) * shapes[0][1],)),
                                  jnp.broadcast_to(self.decoder_scalar, ((shapes[1][0] // groups) * shapes[1][1],))])
        yc, yd = split_tokens(self._ffw(join_tokens(x1, groups), scalar[:, None]), shapes, groups)
        return yc, yd, cache_k, cache_v
