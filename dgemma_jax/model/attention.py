"""Gemma 4 attention in the two DiffusionGemma modes.

* `encode` (causal): project the new tokens, write their K/V into the cache at each row's end,
  attend causally (sliding layers: itself + window-1 previous tokens) over the cache; the tokens
  of one image (when the pass carries images) also see each other in both directions. A sliding
  layer's cache is a ring (model/cache.py): its new tokens attend to the ring as it was before the
  pass (the earlier tokens) and to their own keys, two key sets under one softmax, so a pass longer
  than the ring needs no more slots.
* `denoise` (bidirectional): the canvas attends to the read-only committed context in the cache
  plus the whole canvas. The two key sets share one softmax without being concatenated (the cache
  is never copied); on TPU one fused kernel (model/flash.py) attends to both.

No 1/sqrt(H) scaling and no logit softcap: the q/k RMSNorms take that role. Global layers have no
V projection: K = rope(k_norm(x Wk)), V = v_norm(x Wk).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model import flash, masks
from dgemma_jax.model.cache import HEAD_AXIS, group_entry, ring_limit, slot_positions, window_slice, write_tokens
from dgemma_jax.model.layout import LAYER_AXIS
from dgemma_jax.model.layers import RMSNorm, adapter, apply_rope, param, project, rms_normalize, rope_inv_freq
from dgemma_jax.axis_rules import CACHE_AXES
from dgemma_jax.runtime import Runtime

_NEG = -1e30


def attend(q: jax.Array, parts: list[tuple[jax.Array, jax.Array, jax.Array | None]],
           key_block: int | None = None, fixed_blocks: bool = False) -> jax.Array:
    """Softmax attention of q [B, T, N, H] over several key/value sets sharing one softmax.

    parts: (k [B, K, S, H], v [B, K, S, H] (the cache's layout), mask [B, T or 1, S] bool or None). Query head n reads
    kv head n // (N / K). Scores and the softmax are float32; fully masked rows give zeros.
    key_block: a part with more keys than this is attended block by block (see `_attend_blocks`).
    fixed_blocks: attend block by block even when every part fits one block (`Runtime.attn_fixed_blocks`):
    a query's result then depends only on the blocks holding keys it sees, not on how many fully
    masked blocks follow (each adds exact zeros), so a longer cache changes none of its bits.
    """
    if key_block is not None and (fixed_blocks or any(k.shape[2] > key_block for k, _, _ in parts)):
        return _attend_blocks(q, parts, key_block)
    b, t, n, h = q.shape
    kh = parts[0][0].shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)
    scores = [_scores(qg, k, mask) for k, _, mask in parts]
    m = scores[0].max(-1, keepdims=True)
    for s in scores[1:]:
        m = jnp.maximum(m, s.max(-1, keepdims=True))
    # a row with every key masked keeps m >= NEG / 10, so its exp(NEG - m) terms are exactly 0
    m = jax.lax.stop_gradient(jnp.maximum(m, 0.1 * _NEG))
    num = jnp.zeros((b, kh, t, n // kh, h), jnp.float32)
    den = jnp.zeros((b, kh, t, n // kh), jnp.float32)
    for s, (k, v, mask) in zip(scores, parts):
        p_num, p_den = _weighted(s, m, v)
        num, den = num + p_num, den + p_den
    return _finish(num, den, q)


def _scores(qg, k, mask):
    # scores laid out [B, K, T, G, S]: the natural output order of the batched matmul (batch B, K;
    # free T, G of q; free S of k), so no score-sized transposes are needed
    s = jnp.einsum("btkgh,bksh->bktgs", qg, k, preferred_element_type=jnp.float32)
    return s if mask is None else jnp.where(mask[:, None, :, None, :], s, _NEG)


def _weighted(s, m, v):
    """exp(s - m) times v, and its row sums (as a matrix-vector product: a second plain reduction
    over the score tile is several times slower on XLA:CPU)."""
    p = jnp.exp(s - m)
    den = jnp.einsum("bktgs,s->bktg", p, jnp.ones((p.shape[-1],), jnp.float32))
    num = jnp.einsum("bktgs,bksh->bktgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return num, den


def _finish(num, den, q):
    b, t, n, h = q.shape
    out = num / jnp.maximum(den, 1e-30)[..., None]
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h).astype(q.dtype)


def _attend_blocks(q, parts, key_block):
    """`attend` over key blocks of at most `key_block` keys: each block's softmax statistics (its
    max, exp-sum and weighted values) are computed on their own and merged by log-sum-exp, so one
    block's scores are the largest score array alive, and a block that no query sees is skipped.
    Same result as one softmax, up to rounding."""
    b, t, n, h = q.shape
    kh = parts[0][0].shape[1]
    qg = q.reshape(b, t, kh, n // kh, h)

    def block_stats(k, v, mask):
        s = _scores(qg, k, mask)
        m = jax.lax.stop_gradient(jnp.maximum(s.max(-1, keepdims=True), 0.1 * _NEG))
        return (m, *_weighted(s, m, v))

    def empty(k, v, mask):  # what a fully masked block gives, without reading its keys
        return (jnp.full((b, kh, t, n // kh, 1), 0.1 * _NEG, jnp.float32),
                jnp.zeros((b, kh, t, n // kh, h), jnp.float32), jnp.zeros((b, kh, t, n // kh), jnp.float32))

    stats = []
    for k, v, mask in parts:
        for lo in range(0, k.shape[2], key_block):
            hi = min(lo + key_block, k.shape[2])
            blk = (k[:, :, lo:hi], v[:, :, lo:hi], None if mask is None else mask[..., lo:hi])
            if mask is None:
                stats.append(block_stats(*blk))
            else:  # blocks no query sees (the unused end of a long cache) are skipped at run time
                stats.append(jax.lax.cond(jnp.any(blk[2]), block_stats, empty, *blk))
    top = stats[0][0]
    for m, _, _ in stats[1:]:
        top = jnp.maximum(top, m)
    num = jnp.zeros((b, kh, t, n // kh, h), jnp.float32)
    den = jnp.zeros((b, kh, t, n // kh), jnp.float32)
    for m, p_num, p_den in stats:
        scale = jnp.exp(m - top)  # a fully masked block has m = NEG / 10: scale 0 unless all are
        num, den = num + p_num * scale, den + p_den * scale[..., 0]
    return _finish(num, den, q)


def token_positions(starts: jax.Array, t: int) -> jax.Array:
    """[B, T] int32 positions starts[b] + t of a pass's tokens."""
    return starts[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]


def join_tokens(parts, groups: int) -> jax.Array:
    """Token sets [B_i, T_i, ...] joined per row group: [G, sum_i (B_i / G) T_i, ...], group g holding
    its rows of every part side by side (rows stay in their group: on a mesh splitting the batch in G,
    on their devices). Every B_i must be divisible by G."""
    return jnp.concatenate([p.reshape((groups, -1) + p.shape[2:]) for p in parts], axis=1)


def split_tokens(x: jax.Array, shapes, groups: int) -> list:
    """`join_tokens` undone: the parts [B_i, T_i, ...] of x [G, T', ...], shapes [(B_i, T_i), ...]."""
    out, at = [], 0
    for b, t in shapes:
        n = (b // groups) * t
        out.append(x[:, at:at + n].reshape((b, t) + x.shape[2:]))
        at += n
    return out


class Attention(nn.Module):
    cfg: ModelConfig
    rt: Runtime
    layer: int

    def setup(self):
        cfg, i = self.cfg, self.layer
        d, n = cfg.hidden_size, cfg.num_heads
        self.head_dim = cfg.layer_head_dim(i)
        self.kv_heads = cfg.layer_kv_heads(i)
        self.is_global = cfg.is_global(i)
        self.window = None if self.is_global else cfg.sliding_window
        self.inv_freq = (rope_inv_freq(self.head_dim, cfg.rope_theta_global, cfg.global_rope_proportion)
                         if self.is_global else rope_inv_freq(self.head_dim, cfg.rope_theta_local))
        self.q = param(self, "q", (d, n, self.head_dim), ("embed", "heads", "head_dim"), cfg)
        self.k = param(self, "k", (d, self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), cfg)
        if not self.is_global:
            self.v = param(self, "v", (d, self.kv_heads, self.head_dim), ("embed", "kv_heads", "head_dim"), cfg)
        self.o = param(self, "o", (n, self.head_dim, d), ("heads", "head_dim", "embed"), cfg)
        self.q_norm = RMSNorm(cfg, axis_name="head_dim")
        self.k_norm = RMSNorm(cfg, axis_name="head_dim")

    def _qkv(self, x, positions):
        """q [B, T, N, H] and k, v in the cache's order [B, K, T, H] (model/cache.py) of tokens x [B, T, D]
        at `positions` [B, T]."""
        q, k, v = self._qkv_tokens(x, positions)
        return q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def _qkv_tokens(self, x, positions):
        dt = x.dtype
        with jax.named_scope("qkv_proj"):
            q = project("btd,dnh->btnh", x, self.q, adapter(self, "q"))
            k_raw = project("btd,dkh->btkh", x, self.k, adapter(self, "k"))
            v_raw = k_raw if self.is_global else project("btd,dkh->btkh", x, self.v, adapter(self, "v"))
        q = apply_rope(self.q_norm(q), positions, self.inv_freq)
        k = apply_rope(self.k_norm(k_raw), positions, self.inv_freq)
        v = rms_normalize(v_raw, self.cfg.rms_norm_eps).astype(dt)
        return q, k, v

    def joint_qkv(self, parts, groups: int):
        """`_qkv` of several token sets [(x [B_i, T_i, D], positions [B_i, T_i]), ...] with each weight
        read once: their tokens joined per row group (`join_tokens`: G groups, every B_i divisible by
        G) through one projection each, then split back. Returns [(q, k, v) of each part]."""
        x = join_tokens([p[0] for p in parts], groups)
        pos = join_tokens([p[1] for p in parts], groups)
        shapes = [p[0].shape[:2] for p in parts]
        q, k, v = (split_tokens(a, shapes, groups) for a in self._qkv_tokens(x, pos))
        return [(qi, ki.transpose(0, 2, 1, 3), vi.transpose(0, 2, 1, 3)) for qi, ki, vi in zip(q, k, v)]

    def joint_out(self, ys, groups: int):
        """`_out` of several attention outputs [B_i, T_i, N, H] with the output weight read once."""
        shapes = [y.shape[:2] for y in ys]
        return split_tokens(self._out(join_tokens(ys, groups)), shapes, groups)

    def _replicate(self, k, v, cache_k):
        """k, v [B, K, T, H] -> [B, K r, T, H] when the cache stores each kv head r times (its head
        count says so, see model/cache.py): the keys then line up head for head with the cache."""
        r = cache_k.shape[HEAD_AXIS] // self.kv_heads
        if r == 1:
            return k, v
        k, v = jnp.repeat(k, r, axis=1), jnp.repeat(v, r, axis=1)
        return self.rt.constrain(k, CACHE_AXES), self.rt.constrain(v, CACHE_AXES)

    def _out(self, y):
        with jax.named_scope("o_proj"):
            return project("btnh,nhd->btd", y, self.o, adapter(self, "o"))

    def encode(self, x, starts, num_new, cache_k, cache_v, image_span=None, group=None):
        """x: [B, T, D] new tokens at positions starts[b] + t; returns (out, cache_k, cache_v).

        image_span: None (text only) or (lo, hi) [B, T] from `masks.image_spans`: an image's tokens
        also see each other bidirectionally. Every key of such an image lies in this pass (its K/V
        are written before attending, or, on a sliding layer, attended as this pass's own keys).
        group: the caches are stacked [G, B, K, S, H] (a scanned program) and this layer's is entry
        `group`: written in place and read through slices, never copied out whole."""
        positions = token_positions(starts, x.shape[1])
        y, cache_k, cache_v = self.encode_attend(self._qkv(x, positions), positions, starts, num_new, cache_k,
                                                 cache_v, image_span, group)
        return self._out(y), cache_k, cache_v

    def encode_attend(self, qkv, positions, starts, num_new, cache_k, cache_v, image_span=None, group=None):
        """`encode` from its tokens' (q, k, v) (`_qkv`) at `positions`: (the attention's output before
        the output projection [B, T, N, H], cache_k, cache_v)."""
        q, k, v = qkv
        t = q.shape[1]
        k, v = self._replicate(k, v, cache_k)
        layer_k, layer_v = group_entry(cache_k, group), group_entry(cache_v, group)
        ring = self.is_ring(layer_k.shape[2])
        axes = CACHE_AXES if group is None else (LAYER_AXIS,) + CACHE_AXES
        new_k = self.rt.constrain(write_tokens(cache_k, k, starts, num_new, group, ring), axes)
        new_v = self.rt.constrain(write_tokens(cache_v, v, starts, num_new, group, ring), axes)
        if ring:   # the ring before this pass (the earlier tokens) and this pass's own keys
            k, v = k.astype(cache_k.dtype), v.astype(cache_v.dtype)
            parts = [(layer_k, layer_v, slot_positions(starts, layer_k.shape[2])), (k, v, positions)]
        else:      # every position: the cache with this pass's keys written into it
            layer_k, layer_v = group_entry(new_k, group), group_entry(new_v, group)
            s = layer_k.shape[2]
            size = (self.window - 1 + t) if self.window is not None else s
            if size < s:  # sliding layer: only the last window-1 committed tokens + the new ones matter
                w0 = jnp.clip(starts - (self.window - 1), 0, s - size)
                layer_k, layer_v = window_slice(layer_k, w0, size), window_slice(layer_v, w0, size)
                k_pos = w0[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
            else:
                k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (q.shape[0], s))
            parts = [(layer_k, layer_v, k_pos)]
        valid_end = starts + num_new
        parts = [(pk, pv, masks.causal_mask(positions, k_pos, valid_end, self.window, image_span))
                 for pk, pv, k_pos in parts]
        y = attend(q, parts, self.rt.attn_key_block, fixed_blocks=self.rt.attn_fixed_blocks)
        return y, new_k, new_v

    def denoise(self, x, context_end, cache_k, cache_v):
        """x: [B, L, D] canvas at positions context_end[b] + j; the cache is only read (a sliding
        layer's ring whole: each slot's position comes from context_end, `cache.slot_positions`)."""
        positions = token_positions(context_end, x.shape[1])
        return self._out(self.denoise_attend(self._qkv(x, positions), positions, context_end, cache_k, cache_v))

    def denoise_attend(self, qkv, positions, context_end, cache_k, cache_v):
        """`denoise` from the canvas's (q, k, v) (`_qkv`) at `positions`: the attention's output before
        the output projection [B, L, N, H]."""
        q, k, v = qkv
        b, l = q.shape[:2]
        k, v = self._replicate(k, v, cache_k)
        s = cache_k.shape[2]
        kernel = self._kernel_wanted()
        keys, vals = cache_k, cache_v
        if self.window is not None and not self.is_ring(s):   # every position (ring=False): a window slice
            size = self.window - 1
            if kernel:  # one more (always masked) slot: a whole number of kernel tiles
                size = self.window
            w0 = jnp.clip(context_end - size, 0, s - size)
            keys, vals = window_slice(cache_k, w0, size), window_slice(cache_v, w0, size)
            k_pos = w0[:, None] + jnp.arange(size, dtype=jnp.int32)[None, :]
        elif self.window is not None:
            k_pos = slot_positions(context_end, s)
        else:
            k_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None, :], (b, s))
        ctx_mask = masks.denoise_context_mask(positions, k_pos, context_end, self.window,
                                              self.cfg.denoise_window)
        n, h = q.shape[2:]
        if kernel and flash.supported(l * (n // keys.shape[1]), l, keys.shape[2], h):
            # canvas and cache under one softmax in the fused kernel
            y = flash.head_parallel(self.rt, flash.denoise_attention, q, k, v, keys, vals, ctx_mask[:, 0])
            if y is not None:
                return y
        return attend(q, [(keys, vals, ctx_mask), (k, v, None)], self.rt.attn_key_block,
                      fixed_blocks=self.rt.attn_fixed_blocks)

    def is_ring(self, slots: int) -> bool:
        """Whether this layer's cache of `slots` slots is a sliding layer's ring (model/cache.py); a
        sliding layer holding more slots keeps every position (ring=False)."""
        return self.window is not None and slots <= ring_limit(self.cfg)

    def _kernel_wanted(self) -> bool:
        """Whether the canvas should attend to the cache through `model.flash` (`Runtime.attn_kernel`):
        the runtime asks for it and the layer's cache mask is the same for every query (global layers,
        "block" sliding windows). The shapes are checked where it is called."""
        if self.window is not None and self.cfg.denoise_window != "block":
            return False
        return self.rt.use_kernel()
