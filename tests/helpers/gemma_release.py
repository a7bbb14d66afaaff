"""A small DiffusionGemma checkpoint laid out as Google's gemma library stores the release.

Written from Google's code, not from our converter: every name and shape below is the one the gemma
library's flax modules create (google-deepmind/gemma, read for this fixture):

- `gemma/gm/nn/gemma4/_modules.py`: `Embedder` (`input_embedding` [V, D]; `mm_input_projection` =
  Einsum (vision d_model, D) -> `embedder/mm_input_projection/w`; `mm_pre_projection_norm` has no scale),
  `Attention` (`q_einsum` (N, D, H), `kv_einsum` (2, K, D, H) or, k_eq_v on global layers, `k_einsum`
  (K, D, H), `attn_vec_einsum` (N, H, D), `query_norm`/`key_norm` scale [H], `value_norm` without scale),
  `Block` (`pre_attention_norm`, `post_attention_norm`, `skip_scale` [1]; with MoE: `pre_ffw2_norm`,
  `mlp2` = FeedForward, `post_ffw2_norm`, `pre_ffw_norm`, `mlp` = MoERagged, `post_ffw1_norm`,
  `post_ffw_norm`), `FeedForward` (`gating_einsum` (2, F, D), `linear` (F, D), built with
  `nn.share_scope`).
- `gemma/gm/nn/gemma4/_moe.py` `MoERagged`: `router_logits/w` (D, E), `gating_einsum/w` (E, 2, I, D),
  `linear/w` (E, I, D) (`_Weight` modules keep their `w`), `per_expert_scale` [E], `router_scale` [D].
- `gemma/gm/nn/gemma4/_layers.py`: `Einsum` stores its weight as `w`; `RMSNorm` as `scale`.
- `gemma/diffusion/_transformer.py` `SelfConditioning` (attribute `self_conditioner` in
  `gemma/diffusion/_models.py`): `pre_norm/scale` [D], `ffw` = FeedForward(D, hidden_dim = config
  hidden_dim), `post_norm` without scale.
- `gemma/gm/nn/gemma4/vision/_encoder.py`, `_layers.py`, `_transformer.py`, `_modules.py`, `_norms.py`:
  `vision_encoder/entry/input_projection/w` (patch*patch*3, d), `entry/pos_emb` (P, 2, d) float32,
  `transformer/stacked_layers/block/...` (an nn.scan: leading axis = vision layers) with
  `pre_attention_norm`, `attn/{q_einsum,kv_einsum,attn_vec_einsum}/w`, `attn/{query,key}_norm/scale`,
  `post_attention_norm`, `pre_ffw_norm`, `mlp/{gating_einsum,linear}/w` (no share_scope there),
  `post_ffw_norm`; `standardize/{scale,bias}` [d]. Multimodal weights are kept in float32 (the
  `initialize_param_with_dtype` exclude list in `_transformer.py`), the text weights in bfloat16.

On disk (the NESTED layout, how `gm.ckpts.save_params` / the hackable-diffusion adapter's
`PyTreeCheckpointer().save` write `model.init()['params']`): the FeedForward weights that
`nn.share_scope` hoists to bare names in memory (`mlp2/gating_einsum`) carry the Einsum's `w` leaf
(`mlp2/gating_einsum/w`): gemma `gm/ckpts/_checkpoint.py` `_reconcile_tree` ("When the checkpoint stores
{'w': array}") and `diffusion/hackable_diffusion_adapter/hd/gemma_checkpointer_test.py`
(`test_remap_keeps_w_for_mlp_and_strips_w_for_mlp2`). The self-conditioner's `ffw` is read the same way
by Tunix's DiffusionGemma loader (`self_conditioner/ffw/gating_einsum` + leaf).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)

# the text model: the `tiny-6layer` preset's sizes (5 sliding layers then 1 global, k_eq_v on global)
TEXT = dict(V=256, D=64, N=4, H=16, K=2, H_GLOBAL=32, K_GLOBAL=1, F=96, E=8, I=32, LAYERS=6, GLOBAL=(5,))
# a small vision encoder: d_model, heads, head dim, ffw hidden, scan layers, patch, position table
VISION = dict(d=24, heads=2, hd=12, ffw=40, layers=2, patch=4, pos=16)


def release_layout(on_disk_w: bool = True) -> list[tuple[str, tuple, np.dtype]]:
    """[(gemma name, shape, dtype)] of the release's NESTED tree. `on_disk_w=False` spells the
    share_scope FeedForward weights bare (`mlp2/gating_einsum`), as `model.init()` holds them."""
    t = TEXT
    d_, n_, f_, e_, i_ = t["D"], t["N"], t["F"], t["E"], t["I"]
    w = "/w" if on_disk_w else ""
    rows = [("embedder/input_embedding", (t["V"], d_), BF16),
            ("final_norm/scale", (d_,), BF16)]
    for i in range(t["LAYERS"]):
        glob = i in t["GLOBAL"]
        h = t["H_GLOBAL"] if glob else t["H"]
        k = t["K_GLOBAL"] if glob else t["K"]
        p = f"layer_{i}/"
        rows += [
            (p + "pre_attention_norm/scale", (d_,), BF16),
            (p + "post_attention_norm/scale", (d_,), BF16),
            (p + "skip_scale", (1,), BF16),
            (p + "attn/q_einsum/w", (n_, d_, h), BF16),
            (p + "attn/k_einsum/w", (k, d_, h), BF16) if glob else (p + "attn/kv_einsum/w", (2, k, d_, h), BF16),
            (p + "attn/attn_vec_einsum/w", (n_, h, d_), BF16),
            (p + "attn/query_norm/scale", (h,), BF16),
            (p + "attn/key_norm/scale", (h,), BF16),
            (p + "pre_ffw2_norm/scale", (d_,), BF16),
            (p + "mlp2/gating_einsum" + w, (2, f_, d_), BF16),
            (p + "mlp2/linear" + w, (f_, d_), BF16),
            (p + "post_ffw2_norm/scale", (d_,), BF16),
            (p + "pre_ffw_norm/scale", (d_,), BF16),
            (p + "mlp/router_logits/w", (d_, e_), BF16),
            (p + "mlp/router_scale", (d_,), BF16),
            (p + "mlp/per_expert_scale", (e_,), BF16),
            (p + "mlp/gating_einsum/w", (e_, 2, i_, d_), BF16),
            (p + "mlp/linear/w", (e_, i_, d_), BF16),
            (p + "post_ffw1_norm/scale", (d_,), BF16),
            (p + "post_ffw_norm/scale", (d_,), BF16),
        ]
    rows += [("self_conditioner/pre_norm/scale", (d_,), BF16),
             ("self_conditioner/ffw/gating_einsum" + w, (2, f_, d_), BF16),
             ("self_conditioner/ffw/linear" + w, (f_, d_), BF16)]
    rows += vision_layout()
    return rows


def vision_layout() -> list[tuple[str, tuple, np.dtype]]:
    v, d_ = VISION, TEXT["D"]
    L, d, nh, hd, f = v["layers"], v["d"], v["heads"], v["hd"], v["ffw"]
    b = "vision_encoder/transformer/stacked_layers/block/"
    return [
        ("embedder/mm_input_projection/w", (d, d_), F32),
        ("vision_encoder/entry/input_projection/w", (v["patch"] * v["patch"] * 3, d), F32),
        ("vision_encoder/entry/pos_emb", (v["pos"], 2, d), F32),
        (b + "pre_attention_norm/scale", (L, d), F32),
        (b + "attn/q_einsum/w", (L, nh, d, hd), F32),
        (b + "attn/kv_einsum/w", (L, 2, nh, d, hd), F32),
        (b + "attn/attn_vec_einsum/w", (L, nh, hd, d), F32),
        (b + "attn/query_norm/scale", (L, hd), F32),
        (b + "attn/key_norm/scale", (L, hd), F32),
        (b + "post_attention_norm/scale", (L, d), F32),
        (b + "pre_ffw_norm/scale", (L, d), F32),
        (b + "mlp/gating_einsum/w", (L, 2, f, d), F32),
        (b + "mlp/linear/w", (L, f, d), F32),
        (b + "post_ffw_norm/scale", (L, d), F32),
        ("vision_encoder/standardize/scale", (d,), F32),
        ("vision_encoder/standardize/bias", (d,), F32),
    ]


def random_values(rows, seed: int = 0) -> dict[str, np.ndarray]:
    """{name: array} with distinct random values (exact in bfloat16), so any misplaced axis shows."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32).astype(dt) for name, shape, dt in rows}


def nest(flat: dict[str, np.ndarray]) -> dict:
    """{'a/b/c': x} -> {'a': {'b': {'c': x}}}: the nested dict Google's checkpointers save."""
    out: dict = {}
    for name, x in flat.items():
        node = out
        *path, leaf = name.split("/")
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = x
    return out
