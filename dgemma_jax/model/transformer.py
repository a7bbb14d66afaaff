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
from dgemma_jax.model.attention import Attention
from dgemma_jax.model import layout
from dgemma_jax.model.cache import KVCache
from dgemma_jax.model.layers import (QUANT_SCALE, QUANT_VALUES, GatedMLP, RMSNorm, dtype_of, is_quantized, ones_param,
                                     param, rms_normalize, softcap)
from dgemma_jax.model.moe import MoE
from dgemma_jax.model.vision import MultimodalEmbedder, VisionTower, compact_rows
from dgemma_jax.parallel.rules import ACTIVATION_AXES
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


class Transformer(nn.Module):
    """Methods: `encode` (causal, writes the cache), `denoise` (bidirectional, reads it), `soft_embed`.

    cfg: the checkpoint's architecture; rt: how this program runs it (`dgemma_jax.runtime`)."""

    cfg: ModelConfig
    rt: Runtime

    def setup(self):
        cfg = self.cfg
        self.embedding = param(self, "embedding", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), cfg,
                               init=nn.initializers.normal(1.0))
        block = nn.remat(Block, methods=["encode", "denoise"], static_argnums=()) if self.rt.remat else Block
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

    # -------------------------------------------------------------- layer layout (model/layout.py)
    def _scanning(self) -> bool:
        """Scan the layer groups: the runtime says "scan", or "auto" and the parameters are stacked."""
        if self.rt.layers == "scan":
            return True
        if self.rt.layers == "unrolled":
            return False
        return layout.is_stacked(self.variables.get("params", {}))

    def _groups(self):
        """{collection: {"blocks_j": stacked}}: the parameters (and LoRA collection) of the scanned
        layers, stacked per group position (stacked here, a copy, when they were given unrolled);
        `layout.PER_GROUP` kernels as `layout.PerGroup`s, which the scan passes whole to its body."""
        out = {}
        for col, tree in self.variables.items():
            if not any(k == layout.GROUPS_KEY or k.startswith("blocks_") for k in tree):
                continue
            out[col] = layout.stack_layers(dict(tree), self.cfg)[layout.GROUPS_KEY]
        return out

    def _body_rt(self, plan):
        """The runtime of the scan body: its observer hears each traced kernel call once per group."""
        if self.rt.observer is None or plan.groups == 1:
            return self.rt
        return self.rt.replace(observer=_Repeated(self.rt.observer, plan.groups))

    def _block_fn(self, position: int, method: str, rt):
        cfg, remat = self.cfg, self.rt.remat

        def run(block_vars, *args):
            return Block(cfg, rt, position, parent=None).apply(block_vars, *args, method=method)

        return jax.checkpoint(run) if remat else run

    def _unrolled_blocks(self, method: str):
        """Per layer, a callable running it: the bound blocks, or (stacked parameters run unrolled,
        `Runtime(layers="unrolled")`) the blocks applied to their unstacked parameters (a copy)."""
        if not layout.is_stacked(self.variables.get("params", {})):
            return [getattr(blk, method) for blk in self.blocks]
        per_layer = {col: layout.unstack_layers(dict(t), self.cfg) if layout.is_stacked(t) else t
                     for col, t in self.variables.items()}
        out = []
        for i in range(self.cfg.num_layers):
            fn = self._block_fn(i, method, self.rt)
            block_vars = {col: t[f"blocks_{i}"] for col, t in per_layer.items() if f"blocks_{i}" in t}
            out.append(lambda *a, fn=fn, v=block_vars: fn(v, *a))
        return out

    def _scan_parts(self, cache: KVCache, method: str):
        """(layer plan, the cache stacked, one callable per group position running `method`)."""
        plan = layout.check_scannable(self.cfg)
        rt = self._body_rt(plan)
        return plan, layout.stack_cache(cache, self.cfg), [self._block_fn(j, method, rt) for j in range(plan.period)]

    def _encode_layers(self, x, starts, num_new, cache: KVCache, span=None):
        extra = () if span is None else (span,)  # image spans: the text-only program stays as before
        if not self._scanning():
            c = layout.unstack_cache(cache, self.cfg)
            keys, values = list(c.keys), list(c.values)
            for i, run in enumerate(self._unrolled_blocks("encode")):
                x, keys[i], values[i] = run(x, starts, num_new, keys[i], values[i], *extra)
            new = c.replace(keys=tuple(keys), values=tuple(values))
            return x, (layout.stack_cache(new, self.cfg) if cache.groups else new)
        plan, c, fns = self._scan_parts(cache, "encode")

        sliced, whole = layout.split_per_group(self._groups())

        def body(carry, xs):
            h, ks, vs = carry
            g, groups = xs
            groups = layout.join_per_group(groups, whole, g)
            ks, vs = list(ks), list(vs)
            for j in range(plan.period):  # each layer writes its tokens into entry g of the stacked caches
                block_vars = {col: t[f"blocks_{j}"] for col, t in groups.items()}
                h, ks[j], vs[j] = fns[j](block_vars, h, starts, num_new, ks[j], vs[j], span, g)
            return (h, tuple(ks), tuple(vs)), None

        p = plan.period
        with jax.named_scope(layout.LAYER_LOOP_SCOPE):
            (x, ks, vs), _ = jax.lax.scan(body, (x, c.keys[:p], c.values[:p]),
                                          (jnp.arange(plan.groups, dtype=jnp.int32), sliced))
        keys, values = list(ks) + list(c.keys[p:]), list(vs) + list(c.values[p:])
        for r, i in enumerate(plan.remainder):
            x, keys[p + r], values[p + r] = self.blocks[i].encode(x, starts, num_new, keys[p + r], values[p + r],
                                                                   *extra)
        new = c.replace(keys=tuple(keys), values=tuple(values))
        return x, (new if cache.groups else layout.unstack_cache(new, self.cfg))

    def _denoise_layers(self, x, context_end, cache: KVCache):
        if not self._scanning():
            c = layout.unstack_cache(cache, self.cfg)
            for i, run in enumerate(self._unrolled_blocks("denoise")):
                x = run(x, context_end, c.keys[i], c.values[i])
            return x
        plan, c, fns = self._scan_parts(cache, "denoise")

        sliced, whole = layout.split_per_group(self._groups())

        def body(h, xs):
            g, groups, ks, vs = xs
            groups = layout.join_per_group(groups, whole, g)
            for j in range(plan.period):
                block_vars = {col: t[f"blocks_{j}"] for col, t in groups.items()}
                h = fns[j](block_vars, h, context_end, ks[j], vs[j])
            return h, None

        p = plan.period
        with jax.named_scope(layout.LAYER_LOOP_SCOPE):
            x, _ = jax.lax.scan(body, x, (jnp.arange(plan.groups, dtype=jnp.int32), sliced, c.keys[:p], c.values[:p]))
        for r, i in enumerate(plan.remainder):
            x = self.blocks[i].denoise(x, context_end, c.keys[p + r], c.values[p + r])
        return x

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
        x, new_cache = self._encode_layers(x, starts, num_new, cache, span)
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

    def _denoise_trunk(self, canvas, context_end, cache: KVCache, soft_embedding=None):
        e = self._embed(canvas)
        if soft_embedding is None:
            sc = jnp.zeros_like(e)
        else:
            sc = self.sc_mlp(self.sc_norm(soft_embedding.astype(e.dtype)))
        x = rms_normalize(e + sc, self.cfg.rms_norm_eps).astype(e.dtype)
        return self._denoise_layers(x, context_end, cache)

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


class _Repeated:
    """An observer wrapper: a kernel call traced once in a scan body runs `times` times."""

    def __init__(self, observer, times: int):
        self.observer, self.times = observer, times

    def kernel_call(self, name: str, flops: float) -> None:
        self.observer.kernel_call(name, flops * self.times)
