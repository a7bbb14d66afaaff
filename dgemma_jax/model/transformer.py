"""The DiffusionGemma transformer: one set of weights, two modes.

Block (identical in both modes except for attention and the layer scalar)::

    x1 = x + post_attn_norm(attn(pre_attn_norm(x)))
    d  = post_dense_norm(dense_mlp(pre_dense_norm(x1)))
    m  = post_moe_norm(moe(route on x1, experts on pre_moe_norm(x1)))
    y  = (x1 + post_ffw_norm(d + m)) * layer_scalar          # encoder / decoder copy of the scalar

Encoder mode: embed * sqrt(D) (image placeholders: the given image features, unscaled) -> blocks
(causal, each image bidirectional within itself, writing the cache).
Denoiser mode: RMSNorm_noscale(embed * sqrt(D) + sc_mlp(sc_norm(soft))) -> blocks (bidirectional
over the canvas + read-only cache), where soft = softmax(previous tempered logits) @ E * sqrt(D)
(exactly zero at the first step). Logits: softcap(final_norm(h) @ E^T), float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model import masks
from dgemma_jax.model import layout, scanned
from dgemma_jax.model.cache import KVCache, group_rows, put_group_rows
from dgemma_jax.model.layers import (QUANT_SCALE, QUANT_VALUES, GatedMLP, RMSNorm, dtype_of, is_quantized,
                                     param, rms_normalize, softcap)
from dgemma_jax.model.block import Block
from dgemma_jax.model.vision import MultimodalEmbedder, VisionTower, compact_rows
from dgemma_jax.axis_rules import ACTIVATION_AXES
from dgemma_jax.runtime import Runtime


class Transformer(nn.Module):
    """Methods: `encode` (causal, writes the cache), `denoise` (bidirectional, reads it), `soft_embed`.

    cfg: the checkpoint's architecture; rt: how this program runs it (`dgemma_jax.runtime`)."""

    cfg: ModelConfig
    rt: Runtime

    def setup(self):
        cfg = self.cfg
        self.embedding = param(self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg,
                               init=nn.initializers.normal(1.0))
        methods = ["encode", "denoise", "commit_denoise"]
        block = nn.remat(Block, methods=methods, static_argnums=()) if self.rt.remat else Block
        self.blocks = [block(cfg, self.rt, i) for i in range(cfg.num_layers)]
        self.final_norm = RMSNorm(cfg)
        self.sc_norm = RMSNorm(cfg)
        self.sc_mlp = GatedMLP(cfg, cfg.intermediate_size)
        if cfg.vision is not None:  # a text-only model has neither (its parameter tree is unchanged)
            self.vision_tower = VisionTower(cfg)
            self.embed_vision = MultimodalEmbedder(cfg)

    # -------------------------------------------------------------- pieces
    def _embed(self, tokens):
        dt = dtype_of(self.cfg.dtype)
        scale = jnp.asarray(self.cfg.embed_scale, jnp.float32).astype(dt)
        e = self.embedding
        if is_quantized(e):  # int8 rows times their row's scale
            rows = jnp.take(e[QUANT_VALUES], tokens, axis=0).astype(jnp.float32)
            return (rows * jnp.take(e[QUANT_SCALE][:, 0], tokens, axis=0)[..., None]).astype(dt) * scale
        return jnp.take(e, tokens, axis=0).astype(dt) * scale

    def _place_images(self, x, image_features, image_tokens):
        """x [B, T, D] with the k-th True of image_tokens (row-major) replaced by image_features[k].

        A cumulative count gives each placeholder its row (static shapes, no boolean indexing);
        rows past the end of image_features are clamped (`api.prefill` checks the count)."""
        b, t, d = x.shape
        flat = image_tokens.reshape(b * t).astype(bool)
        row = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, image_features.shape[0] - 1)
        feats = jnp.take(image_features, row, axis=0).astype(x.dtype).reshape(b, t, d)
        return self.rt.constrain(jnp.where(image_tokens.astype(bool)[..., None], feats, x), ACTIVATION_AXES)

    def logits(self, h):
        """Final norm -> tied head -> softcap, float32 [..., V]."""
        h = self.final_norm(h)
        e = self.embedding
        if is_quantized(e):  # one scale per vocabulary row: per output channel of the head
            out = jnp.einsum("...d,vd->...v", h, e[QUANT_VALUES].astype(h.dtype), preferred_element_type=jnp.float32)
            return softcap(out * e[QUANT_SCALE][:, 0].astype(jnp.float32), self.cfg.final_logit_softcap)
        out = jnp.einsum("...d,vd->...v", h, e.astype(h.dtype), preferred_element_type=jnp.float32)
        return softcap(out, self.cfg.final_logit_softcap)

    def soft_embed(self, sc_logits):
        """softmax_fp32(logits) @ E * sqrt(D): [B, L, V] -> [B, L, D] (activation dtype)."""
        dt = dtype_of(self.cfg.dtype)
        probs = jax.nn.softmax(sc_logits.astype(jnp.float32), axis=-1)
        e = self.embedding
        if is_quantized(e):  # the row scales fold into the probabilities (the contracted axis)
            w = dtype_of(self.cfg.param_dtype)
            probs = probs * e[QUANT_SCALE][:, 0].astype(jnp.float32)
            emb = jnp.einsum("blv,vd->bld", probs.astype(w), e[QUANT_VALUES].astype(w), preferred_element_type=jnp.float32)
        else:
            emb = jnp.einsum("blv,vd->bld", probs.astype(e.dtype), e, preferred_element_type=jnp.float32)
        return emb.astype(dt) * jnp.asarray(self.cfg.embed_scale, jnp.float32).astype(dt)

    # -------------------------------------------------------------- the layers
    def _denoise_layers(self, x, context_end, cache: KVCache):
        if scanned.scanning(self):
            return scanned.denoise_layers(self, x, context_end, cache)
        c = layout.unstack_cache(cache, self.cfg)
        for i, run in enumerate(scanned.unrolled_blocks(self, "denoise")):
            x = run(x, context_end, c.keys[i], c.values[i])
        return x

    def _writing_layers(self, method: str, hs: tuple, args: tuple, extra: tuple, cache: KVCache):
        """The layers of a pass that writes the cache (`encode`, `commit_denoise`): each block's `method`
        called as method(*hs, *args, cache_k, cache_v, *extra) -> (*hs, cache_k, cache_v); scanned
        where the runtime scans (`scanned.writing_layers`). Returns (hs, the cache in its layout)."""
        if scanned.scanning(self):
            return scanned.writing_layers(self, method, hs, args, extra, cache)
        c = layout.unstack_cache(cache, self.cfg)
        keys, values = list(c.keys), list(c.values)
        for i, run in enumerate(scanned.unrolled_blocks(self, method)):
            *hs, keys[i], values[i] = run(*hs, *args, keys[i], values[i], *extra)
        new = c.replace(keys=tuple(keys), values=tuple(values))
        return tuple(hs), (layout.stack_cache(new, self.cfg) if cache.groups else new)

    def image_features(self, pixel_values, position_ids):
        """Images -> text-width soft tokens, the valid ones of all images compacted to the front.

        pixel_values float [N, P, 3 p^2] rescaled to [0, 1]; position_ids int [N, P, 2] (x, y), padding
        patches at (-1, -1). Returns (features [N * S, D] in the activation dtype: the valid soft tokens of
        image 0, then image 1, ..., then zero rows; n_valid int32 scalar), S = P // pooling_kernel_size^2.
        """
        if self.cfg.vision is None:
            raise ValueError("this model has no vision tower (ModelConfig.vision is None)")
        soft, valid = self.vision_tower(pixel_values, position_ids)
        return compact_rows(self.embed_vision(soft), valid)

    # -------------------------------------------------------------- modes
    def encode(self, tokens, starts, num_new, cache: KVCache, logits_mode: str = "all", image_features=None,
               image_tokens=None):
        """Causal pass over tokens [B, T] written at cache slots starts[b] + t (t < num_new[b]).

        Returns (logits or hidden, new cache, in the layout it was given). logits_mode: "all"
        [B,T,V], "last" [B,V] at each row's last valid token, "none" (no head; returns None).

        Images (both or neither): image_features [N, D], the projected soft tokens of every image in
        row-major order (trailing unused rows allowed); image_tokens [B, T] bool, True on the image
        placeholders. The k-th placeholder in row-major [B, T] order takes row k in place of its
        embedding (no sqrt(D) scale), and each run of consecutive placeholders (one image) attends to
        itself bidirectionally on every layer, beyond the sliding window too. Positions are unchanged.
        """
        x = self._embed(tokens)
        span = None
        if image_features is not None:
            x = self._place_images(x, image_features, image_tokens)
            span = masks.image_spans(image_tokens, starts)
        (x,), new_cache = self._writing_layers("encode", (x,), (starts, num_new), (span,), cache)
        new_cache = new_cache.replace(lengths=(starts + num_new).astype(jnp.int32))
        if logits_mode == "none":
            return None, new_cache
        if logits_mode == "last":
            idx = jnp.clip(num_new - 1, 0, tokens.shape[1] - 1)
            x = jnp.take_along_axis(x, idx[:, None, None], axis=1)[:, 0]
        return self.logits(x), new_cache

    def denoise(self, canvas, context_end, cache: KVCache, soft_embedding=None):
        """Bidirectional pass over canvas [B, L] at positions context_end[b] + j.

        soft_embedding: [B, L, D] self-conditioning input (None = exactly zero). Returns [B, L, V].
        """
        return self.logits(self._denoise_trunk(canvas, context_end, cache, soft_embedding))

    def denoise_features(self, canvas, context_end, cache: KVCache, soft_embedding=None):
        """The denoiser up to the final norm: [B, L, D] (the head is applied by the fused sampler)."""
        return self.final_norm(self._denoise_trunk(canvas, context_end, cache, soft_embedding))

    def commit_denoise_features(self, tokens, num_new, canvas, cache: KVCache, soft_embedding=None):
        """`encode` of tokens [B, T] (no head) and then `denoise_features` of the next canvas [B, L] at
        positions cache.lengths + num_new on, as ONE pass over the layers (`Block.commit_denoise`:
        each layer's weights read once for both). Returns (the canvas's [B, L, D] up to the final
        norm, the new cache): what the two passes give, in one."""
        starts = cache.lengths
        (_, x), new_cache = self._writing_layers("commit_denoise",
                                                 (self._embed(tokens), self._denoise_input(canvas, soft_embedding)),
                                                 (starts, num_new), (), cache)
        return self.final_norm(x), new_cache.replace(lengths=(starts + num_new).astype(jnp.int32))

    def commit_rows_denoise_features(self, tokens, rows, num_new, canvas, cache: KVCache, soft_embedding=None):
        """`encode` of tokens [G K, T] (no head) into rows `rows` [G, K] of the cache (its N rows in G
        groups of N / G consecutive rows: row g N / G + rows[g, k]; num_new [G K] each writes, 0 for
        none) and `denoise_features` of every row's canvas [N, L] after its committed tokens, as ONE
        pass over the layers (`Block.commit_rows_denoise`). Returns (the canvases' [N, L, D] up to the
        final norm, the new cache): what a commit of those rows and then a denoising pass give."""
        starts = group_rows(cache.lengths, rows)
        lengths = put_group_rows(cache.lengths, (starts + num_new).astype(cache.lengths.dtype), rows, starts,
                                 tokens.shape[1], False)
        (_, x), new_cache = self._writing_layers(
            "commit_rows_denoise", (self._embed(tokens), self._denoise_input(canvas, soft_embedding)),
            (rows, starts, num_new, lengths), (), cache)
        return self.final_norm(x), new_cache.replace(lengths=lengths)

    def _denoise_input(self, canvas, soft_embedding=None):
        e = self._embed(canvas)
        if soft_embedding is None:
            sc = jnp.zeros_like(e)
        else:
            sc = self.sc_mlp(self.sc_norm(soft_embedding.astype(e.dtype)))
        return rms_normalize(e + sc, self.cfg.rms_norm_eps).astype(e.dtype)

    def _denoise_trunk(self, canvas, context_end, cache: KVCache, soft_embedding=None):
        return self._denoise_layers(self._denoise_input(canvas, soft_embedding), context_end, cache)

    def init_all(self, tokens, cache: KVCache):
        """Touches every parameter (used only by `init_params`)."""
        n = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        _, cache = self.encode(tokens, cache.lengths, n, cache, "none")
        soft = self.soft_embed(jnp.zeros(tokens.shape + (self.cfg.vocab_size,), jnp.float32))
        out = self.denoise(tokens, cache.lengths, cache, soft)
        if self.cfg.vision is not None:
            k = self.cfg.vision.pooling_kernel_size
            pixels = jnp.zeros((1, k * k, self.cfg.vision.patch_dim), jnp.float32)
            pos = jnp.stack(jnp.meshgrid(jnp.arange(k), jnp.arange(k)), -1).reshape(1, k * k, 2)
            self.image_features(pixels, pos)
        return out
