"""Drive the Hugging Face DiffusionGemma reference pass by pass (CPU, float32), numpy in / numpy out.

This module is the only place in dgemma_jax that imports torch / transformers (the optional ``[ref]`` extra,
pinned to transformers 5.23.0 and torch 2.13.0).  It is never imported by ``import dgemma_jax``.

What it offers (see ``/work/shared/spec/hf_reference_api.md`` for the semantics it mirrors):

* ``tiny_text_config_kwargs(name)`` – ``DiffusionGemmaTextConfig`` kwargs for small named presets
  (``"tiny-2layer"``, ``"tiny-6layer"``, ``"bench"``).
* ``build_reference_model(text_kwargs, canvas_length, seed, randomize=True)`` – a float32 eval-mode
  ``DiffusionGemmaForBlockDiffusion`` with deterministic random weights in which every norm / scale / layer
  scalar is moved away from its init value, and the encoder and decoder ``layer_scalar`` copies differ.
* ``save_reference(model, path)`` – ``save_pretrained`` (safetensors) + ``generation_config.json``.
* ``load_reference(path)`` – ``from_pretrained`` back, float32 eval mode.
* ``encoder_logits`` / ``encoder_append`` – causal encoder passes that fill a ``DynamicCache`` and return
  ``softcap(lm_head(last_hidden_state))`` (HF has no encoder-logits output).
* ``denoiser_logits`` – one decoder (denoising) pass over a canvas; the cache is checked to be untouched.
* ``deterministic_generate`` – an HF ``generate()`` run made deterministic (argmax everywhere, every token
  accepted, no adaptive stop, no EOS) with caller-chosen start canvases.

Conventions: ``B`` batch, ``T``/``n`` new tokens, ``S`` tokens already in the cache (its cumulative length),
``C`` canvas length, ``V`` vocab size.  Token ids are integer arrays; logits are float32 arrays.  Functions accept
a single unpadded row (1-D ids, the main use) and return 1-D-batch-free shapes ``[n, V]``; they also accept a
batch ``[B, n]`` (with an optional left-padding ``attention_mask`` for the first encoder call) and then return
``[B, n, V]``.  The padding handling is exactly what ``generate()`` does: one shared position row
``arange(S, S + n)`` for every batch row, and a 2-D boolean mask over all tokens seen so far, kept on the cache
object as the attribute ``dgemma_attention_mask``.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import numpy as np
import torch
from transformers import (
    DiffusionGemmaConfig,
    DiffusionGemmaForBlockDiffusion,
    DiffusionGemmaTextConfig,
    DynamicCache,
    Gemma4VisionConfig,
)
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    DiffusionGemmaGenerationConfig,
    EntropyBoundSamplerConfig,
)

__all__ = [
    "PRESETS",
    "DEFAULT_CANVAS_LENGTH",
    "tiny_text_config_kwargs",
    "tiny_vision_config",
    "make_config",
    "build_reference_model",
    "build_preset",
    "release_like_generation_config",
    "save_reference",
    "load_reference",
    "numpy_checkpoint",
    "new_cache",
    "cache_lengths",
    "encoder_logits",
    "encoder_append",
    "decoder_mask_mapping",
    "denoiser_logits",
    "deterministic_generate",
]

# ----------------------------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------------------------

# RoPE exactly like the release: sliding layers "default" theta 1e4, full layers "proportional" theta 1e6 with
# partial_rotary_factor 0.25 (computed on the full global head_dim).
_RELEASE_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-2layer": dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=8,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "tiny-6layer": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        sliding_window=16,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
    ),
    "bench": dict(
        vocab_size=32768,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        global_head_dim=128,
        num_global_key_value_heads=1,
        sliding_window=256,
        num_experts=16,
        top_k_experts=4,
        moe_intermediate_size=256,
    ),
}

DEFAULT_CANVAS_LENGTH = {"tiny-2layer": 16, "tiny-6layer": 16, "bench": 256}

# Fields shared by every preset (release values where they matter).
_COMMON_TEXT_KWARGS = dict(
    hidden_activation="gelu_pytorch_tanh",
    rms_norm_eps=1e-6,
    max_position_embeddings=262_144,
    use_bidirectional_attention="vision",
    attention_bias=False,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
    tie_word_embeddings=True,
)


def tiny_text_config_kwargs(name: str) -> dict[str, Any]:
    """kwargs for ``DiffusionGemmaTextConfig(**kwargs)`` for the named preset.

    ``global_head_dim`` / ``num_global_key_value_heads`` are init-only kwargs that the config turns into
    ``per_layer_config`` for the full-attention layers.  A fresh deep copy is returned on every call.
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    kw = dict(_COMMON_TEXT_KWARGS)
    kw.update(copy.deepcopy(PRESETS[name]))
    kw["rope_parameters"] = copy.deepcopy(_RELEASE_ROPE)
    return kw


def tiny_vision_config() -> Gemma4VisionConfig:
    """A 1-layer, width-16 Gemma4 vision tower (``vision_config=None`` would build the full 768x16 one)."""
    return Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=64,
    )


def make_config(
    text_kwargs: dict[str, Any], canvas_length: int, attn_implementation: str = "sdpa"
) -> DiffusionGemmaConfig:
    """Top-level ``DiffusionGemmaConfig`` (text config from ``text_kwargs``, tiny vision tower)."""
    text_config = DiffusionGemmaTextConfig(**copy.deepcopy(text_kwargs))
    config = DiffusionGemmaConfig(
        text_config=text_config,
        vision_config=tiny_vision_config(),
        canvas_length=int(canvas_length),
        tie_word_embeddings=True,
    )
    config._attn_implementation = attn_implementation
    return config


def release_like_generation_config(vocab_size: int) -> DiffusionGemmaGenerationConfig:
    """The released ``generation_config`` values (EOS ids outside the vocab are dropped)."""
    eos = [i for i in (1, 106, 50) if i < vocab_size]
    return DiffusionGemmaGenerationConfig(
        max_new_tokens=256,
        max_denoising_steps=48,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1),
        t_min=0.4,
        t_max=0.8,
        stability_threshold=1,
        confidence_threshold=0.005,
        eos_token_id=eos,
        pad_token_id=0,
        bos_token_id=2,
    )


# ----------------------------------------------------------------------------------------------------------------
# Model construction
# ----------------------------------------------------------------------------------------------------------------


def _is_norm_or_scale(name: str, p: torch.Tensor) -> bool:
    return p.ndim == 1 and (
        "norm" in name.rsplit(".", 2)[-2] or name.endswith("router.scale") or name.endswith("per_expert_scale")
    )


@torch.no_grad()
def _randomize_(
    model: DiffusionGemmaForBlockDiffusion,
    seed: int,
    proj_gain: float,
    embed_rms: float,
    router_std: float,
) -> None:
    gen = torch.Generator().manual_seed(int(seed) + 1_000_003)
    text_config = model.config.text_config
    H = text_config.hidden_size

    def normal_(p: torch.Tensor, std: float) -> None:
        p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(std).to(p.dtype))

    def uniform_(p: torch.Tensor, lo: float, hi: float) -> None:
        p.copy_((torch.rand(p.shape, generator=gen, dtype=torch.float64) * (hi - lo) + lo).to(p.dtype))

    # named_parameters() de-duplicates tied parameters, so every text weight is visited exactly once (under its
    # encoder name); the decoder / lm_head share the same tensor.  Vision parameters keep their seeded HF init.
    for name, p in model.named_parameters():
        if ".vision_tower." in name or ".embed_vision." in name:
            continue
        if _is_norm_or_scale(name, p):
            uniform_(p, 0.5, 1.5)  # all 7 per-layer norms, q/k norm, final norm, SC pre_norm, router scales
        elif name.endswith("embed_tokens.weight"):
            normal_(p, embed_rms / math.sqrt(H))  # E*sqrt(H) has rms ~embed_rms; tied head logits std ~embed_rms
        elif name.endswith("router.proj.weight"):
            normal_(p, router_std)  # router input has unit norm -> expert scores with std ~router_std
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
            normal_(p, proj_gain / math.sqrt(p.shape[-1]))
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            normal_(p, proj_gain / math.sqrt(p.shape[-1]))
        elif p.ndim == 2 and name.endswith(".weight"):  # nn.Linear [out, in]
            normal_(p, proj_gain / math.sqrt(p.shape[1]))
        else:
            raise AssertionError(f"unhandled parameter {name} {tuple(p.shape)}")

    # layer_scalar is a buffer (never tied): the encoder copy and the decoder copy are drawn independently.
    enc_layers = model.model.encoder.language_model.layers
    dec_layers = model.model.decoder.layers
    for layer in enc_layers:
        uniform_(layer.layer_scalar, 0.3, 1.7)
    for layer in dec_layers:
        uniform_(layer.layer_scalar, 0.3, 1.7)


def _check_ties(model: DiffusionGemmaForBlockDiffusion) -> None:
    enc = model.model.encoder.language_model
    dec = model.model.decoder
    assert enc.embed_tokens.weight is dec.embed_tokens.weight
    assert model.lm_head.weight is dec.embed_tokens.weight
    assert enc.norm.weight is dec.norm.weight
    for le, ld in zip(enc.layers, dec.layers):
        assert le.input_layernorm.weight is ld.input_layernorm.weight
        assert le.experts.gate_up_proj is ld.experts.gate_up_proj
        assert le.router.per_expert_scale is ld.router.per_expert_scale
        assert le.layer_scalar is not ld.layer_scalar


def build_reference_model(
    text_kwargs: dict[str, Any],
    canvas_length: int,
    seed: int = 0,
    randomize: bool = True,
    *,
    attn_implementation: str = "sdpa",
    experts_implementation: str | None = None,
    proj_gain: float = 1.0,
    embed_rms: float = 1.5,
    router_std: float = 1.0,
) -> DiffusionGemmaForBlockDiffusion:
    """Build a float32, eval-mode ``DiffusionGemmaForBlockDiffusion`` with deterministic weights.

    Args:
      text_kwargs: ``DiffusionGemmaTextConfig`` kwargs (e.g. ``tiny_text_config_kwargs("tiny-2layer")``).
      canvas_length: ``config.canvas_length`` (C).
      seed: seeds both torch's global RNG (HF init, incl. the tiny vision tower) and the randomisation.
      randomize: if True, every text weight is redrawn:
        * all norm weights (7 per layer, q_norm, k_norm, final norm, self-conditioning pre_norm), router.scale and
          router.per_expert_scale ~ U[0.5, 1.5];
        * encoder and decoder ``layer_scalar`` copies ~ U[0.3, 1.7], drawn independently (they differ);
        * Linear / expert weights ~ N(0, (proj_gain / sqrt(fan_in))^2) (0.125 at H=64, 0.044 at H=512);
        * embedding ~ N(0, (embed_rms / sqrt(H))^2) so that the tied-head logits have std ~embed_rms (no softcap
          saturation, varied top-2 gaps).  With the tied head the own-token logit is boosted ~sqrt(H)-fold: at
          embed_rms 3 the encoder argmax is the input token 100% of the time; at the default 1.5 it is 78-94%;
        * ``router.proj`` ~ N(0, router_std^2): its input has unit norm, so expert scores have std ~router_std,
          which keeps top-k routing decisions away from near-ties.
        If False, HF's own init is kept (norms/scales 1, std 0.02).
      attn_implementation: "sdpa" (default; the CPU default, and the one that works with padding inside
        ``generate()``) or "eager" (works with padding in this harness, which never passes int64 shape carriers).
      experts_implementation: None keeps HF's CPU default ("grouped_mm"); "eager" selects the python loop.

    Returns: the model, with a release-like ``generation_config`` attached.
    """
    config = make_config(text_kwargs, canvas_length, attn_implementation=attn_implementation)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    torch.manual_seed(int(seed))
    model = DiffusionGemmaForBlockDiffusion(config)
    model = model.to(torch.float32).eval()
    if randomize:
        _randomize_(model, seed, proj_gain=proj_gain, embed_rms=embed_rms, router_std=router_std)
    _check_ties(model)
    model.generation_config = release_like_generation_config(config.text_config.vocab_size)
    return model


def build_preset(name: str, seed: int = 0, canvas_length: int | None = None, **kwargs) -> DiffusionGemmaForBlockDiffusion:
    """``build_reference_model(tiny_text_config_kwargs(name), canvas_length or DEFAULT_CANVAS_LENGTH[name], seed)``."""
    if canvas_length is None:
        canvas_length = DEFAULT_CANVAS_LENGTH[name]
    return build_reference_model(tiny_text_config_kwargs(name), canvas_length, seed, **kwargs)


def save_reference(model: DiffusionGemmaForBlockDiffusion, path: str | os.PathLike) -> str:
    """``save_pretrained`` into directory ``path`` (``config.json`` + ``model.safetensors``) and write
    ``generation_config.json``.  The file holds only the decoder copies of tied text weights (``model.decoder.*``)
    plus both ``layer_scalar`` copies (``model.encoder.language_model.layers.{i}.layer_scalar`` and
    ``model.decoder.layers.{i}.layer_scalar``), the vision tower, and no ``lm_head.weight``.  Returns ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    gc = model.generation_config
    if not isinstance(gc, DiffusionGemmaGenerationConfig) or gc.max_denoising_steps is None:
        gc = release_like_generation_config(model.config.text_config.vocab_size)
    gc.save_pretrained(path)
    return path


def load_reference(path: str | os.PathLike, attn_implementation: str = "sdpa") -> DiffusionGemmaForBlockDiffusion:
    """``from_pretrained(path)`` in float32 eval mode."""
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        os.fspath(path), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


def numpy_checkpoint(name: str, seed: int, path: str | os.PathLike, canvas_length: int | None = None) -> dict:
    """A preset's checkpoint whose weights are drawn with numpy (``random_checkpoint``), not torch.

    transformers builds and saves the preset (that fixes config.json and the tensor list); every tensor is
    then redrawn by ``random_checkpoint.random_state_dict(spec, seed)`` and written to ``path``, so the JAX
    side can rebuild the same checkpoint without torch from ``config_json``, ``generation_config_json``,
    ``spec`` and ``seed`` (what the golden files store).  Load it with ``load_reference(path)``.
    Returns ``{"path", "config_json", "generation_config_json", "spec": [(name, shape), ...], "seed"}``.
    """
    import tempfile

    from safetensors import safe_open

    from tests.reference.random_checkpoint import write_checkpoint

    model = build_preset(name, seed=0, canvas_length=canvas_length, randomize=False)
    with tempfile.TemporaryDirectory() as tmp:
        save_reference(model, tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            config_json = f.read()
        with open(os.path.join(tmp, "generation_config.json")) as f:
            generation_config_json = f.read()
        with safe_open(os.path.join(tmp, "model.safetensors"), "np") as f:
            spec = [(k, tuple(int(d) for d in f.get_slice(k).get_shape())) for k in sorted(f.keys())]
    write_checkpoint(path, config_json, generation_config_json, spec, seed)
    return {"path": os.fspath(path), "config_json": config_json, "generation_config_json": generation_config_json,
            "spec": spec, "seed": int(seed)}


# ----------------------------------------------------------------------------------------------------------------
# Pass-by-pass driving
# ----------------------------------------------------------------------------------------------------------------

_MASK_ATTR = "dgemma_attention_mask"


def new_cache(model: DiffusionGemmaForBlockDiffusion) -> DynamicCache:
    """An empty ``DynamicCache(config=text_config)`` (sliding layers keep the last W-1 K/V, full layers all)."""
    return DynamicCache(config=model.config.get_text_config(decoder=True))


def cache_lengths(cache: DynamicCache) -> list[dict[str, Any]]:
    """Per layer: ``{"sliding": bool, "seq_length": get_seq_length() (cumulative), "stored": K/V slots held}``."""
    out = []
    for layer in cache.layers:
        stored = 0 if not getattr(layer, "is_initialized", False) or layer.keys is None else int(layer.keys.shape[-2])
        out.append(
            {"sliding": bool(getattr(layer, "is_sliding", False)), "seq_length": int(layer.get_seq_length()),
             "stored": stored}
        )
    return out


def _as_batch(x: np.ndarray | torch.Tensor, ndim: int) -> tuple[torch.Tensor, bool]:
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x))  # a writable copy of an array
    if t.ndim == ndim - 1:
        return t.unsqueeze(0), True
    if t.ndim != ndim:
        raise ValueError(f"expected {ndim - 1}-D or {ndim}-D input, got shape {tuple(t.shape)}")
    return t, False


def _softcap(model: DiffusionGemmaForBlockDiffusion, logits: torch.Tensor) -> torch.Tensor:
    cap = model.config.text_config.final_logit_softcapping
    logits = logits.to(torch.float32)
    if cap is None:
        return logits
    return torch.tanh(logits / cap) * cap


def _cache_mask(cache: DynamicCache, batch: int) -> torch.Tensor:
    mask = getattr(cache, _MASK_ATTR, None)
    if mask is None:
        mask = torch.ones((batch, cache.get_seq_length()), dtype=torch.bool)
    if mask.shape[0] != batch:
        raise ValueError(f"cache was built for batch {mask.shape[0]}, got batch {batch}")
    return mask


@torch.no_grad()
def encoder_append(
    model: DiffusionGemmaForBlockDiffusion,
    cache: DynamicCache,
    ids: np.ndarray,
    attention_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, DynamicCache]:
    """Causal encoder pass over new tokens, appending their K/V to ``cache`` (in place).

    Args:
      ids: ``[n]`` int (one unpadded row) or ``[B, n]``.
      attention_mask: optional ``[n]`` / ``[B, n]`` bool for the new tokens (False = left padding); default all True.
    Positions are ``arange(S, S + n)`` with S = ``cache.get_seq_length()`` (shared by all rows, as generate does).
    Returns:
      (logits, cache): logits ``[n, V]`` (or ``[B, n, V]``) float32 = softcap(lm_head(last_hidden_state)) computed in
      fp32; rows at padded positions are garbage.  The cache is the same (mutated) object.
    """
    input_ids, squeeze = _as_batch(ids, 2)
    input_ids = input_ids.to(torch.long)
    B, n = input_ids.shape
    S = cache.get_seq_length()
    prev_mask = _cache_mask(cache, B)
    if attention_mask is None:
        new_mask = torch.ones((B, n), dtype=torch.bool)
    else:
        new_mask, _ = _as_batch(attention_mask, 2)
        new_mask = new_mask.to(torch.bool)
    full_mask = torch.cat([prev_mask, new_mask], dim=1)  # [B, S + n], as generate keeps it
    position_ids = torch.arange(S, S + n, dtype=torch.long).unsqueeze(0)

    # Same as generate(): the 4-D masks are prepared up front (a 0-width float tensor carries shape/dtype).
    dummy = torch.empty((B, n, 0), dtype=model.dtype)
    mask_mapping = model.model.encoder.create_masks_for_generate(
        config=model.config,
        inputs_embeds=dummy,
        attention_mask=full_mask,
        past_key_values=cache,
        position_ids=position_ids,
    )
    out = model.model.encoder(
        input_ids=input_ids,
        attention_mask=mask_mapping,
        past_key_values=cache,
        position_ids=position_ids,
    )
    assert out.past_key_values is cache
    setattr(cache, _MASK_ATTR, full_mask)
    logits = _softcap(model, model.lm_head(out.last_hidden_state))
    logits = logits.numpy().astype(np.float32)
    return (logits[0] if squeeze else logits), cache


def encoder_logits(
    model: DiffusionGemmaForBlockDiffusion, ids: np.ndarray, attention_mask: np.ndarray | None = None
) -> tuple[np.ndarray, DynamicCache]:
    """Prefill: causal encoder over ``ids`` (``[n]``, or ``[B, n]`` with optional left-pad ``attention_mask``) from an
    empty ``DynamicCache`` at positions ``0..n-1``.  Returns (logits ``[n, V]`` / ``[B, n, V]`` float32, cache)."""
    return encoder_append(model, new_cache(model), ids, attention_mask=attention_mask)


def _snapshot(cache: DynamicCache) -> list[tuple]:
    snap = []
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        snap.append(
            (
                int(layer.get_seq_length()),
                None if keys is None else tuple(keys.shape),
                None if keys is None else keys.data_ptr(),
                getattr(layer, "cumulative_length", None),
            )
        )
    return snap


def decoder_mask_mapping(model: DiffusionGemmaForBlockDiffusion, cache: DynamicCache, batch: int) -> dict:
    """The decoder's per-layer-type 4-D masks for the current cache, built as generate() builds them (but with a
    0-width float shape carrier, which avoids the eager/int64 crash).  ``{"full_attention": None, ...}`` when there
    is no padding."""
    C = model.config.canvas_length
    dec_mask = torch.nn.functional.pad(_cache_mask(cache, batch), (0, C), value=True)  # [B, S + C]
    return model.model.decoder.create_diffusion_decoder_attention_mask(
        config=model.config,
        inputs_embeds=torch.empty((batch, C, 0), dtype=model.dtype),
        past_key_values=cache,
        decoder_attention_mask=dec_mask,
    )


@torch.no_grad()
def denoiser_logits(
    model: DiffusionGemmaForBlockDiffusion,
    cache: DynamicCache,
    canvas: np.ndarray,
    sc_logits: np.ndarray | None = None,
    sc_mask: np.ndarray | None = None,
) -> np.ndarray:
    """One decoder (denoising) pass.

    Args:
      cache: filled by ``encoder_logits`` / ``encoder_append``; read only (asserted unchanged afterwards).
      canvas: ``[C]`` (or ``[B, C]``) int ids at positions ``S..S+C-1``.  C must equal ``config.canvas_length``
        when the cache carries padding (the mask builder uses it); otherwise any length works.
      sc_logits: None (first step: the self-conditioning signal is exactly zero) or ``[C, V]`` / ``[B, C, V]``
        float32 logits (generate() passes the temperature-scaled logits of the previous step).
      sc_mask: optional ``[B]`` bool; False rows get a zero self-conditioning signal.
    Returns:
      logits ``[C, V]`` (or ``[B, C, V]``) float32, softcapped, exactly ``model(...).logits``.
    """
    canvas_t, squeeze = _as_batch(canvas, 2)
    canvas_t = canvas_t.to(torch.long)
    B, C = canvas_t.shape
    S = cache.get_seq_length()
    sc = None
    if sc_logits is not None:
        sc, _ = _as_batch(np.asarray(sc_logits, dtype=np.float32), 3)
        if tuple(sc.shape[:2]) != (B, C):
            raise ValueError(f"sc_logits shape {tuple(sc.shape)} does not match canvas {(B, C)}")
    scm = None if sc_mask is None else torch.as_tensor(np.asarray(sc_mask)).to(torch.bool).reshape(B)

    prev_mask = _cache_mask(cache, B)
    if bool(prev_mask.all()):
        mask_mapping = {"full_attention": None, "sliding_attention": None}  # what HF itself does without padding
    else:
        if C != model.config.canvas_length:
            raise ValueError("with padding the canvas must be config.canvas_length long")
        mask_mapping = decoder_mask_mapping(model, cache, B)
    position_ids = torch.arange(S, S + C, dtype=torch.long).unsqueeze(0)

    before = _snapshot(cache)
    out = model(
        decoder_input_ids=canvas_t,
        past_key_values=cache,
        self_conditioning_logits=sc,
        self_conditioning_mask=scm,
        decoder_attention_mask=mask_mapping,
        decoder_position_ids=position_ids,
    )
    after = _snapshot(cache)
    assert before == after, f"decoder pass modified the cache: {before} -> {after}"
    logits = out.logits.to(torch.float32).numpy().astype(np.float32)
    return logits[0] if squeeze else logits


# ----------------------------------------------------------------------------------------------------------------
# Deterministic generate()
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def deterministic_generate(
    model: DiffusionGemmaForBlockDiffusion,
    prompt_ids: np.ndarray,
    canvas_length: int | None = None,
    num_canvases: int = 1,
    start_canvas: np.ndarray | None = None,
    *,
    num_steps: int = 4,
    attention_mask: np.ndarray | None = None,
    temperature: float = 1e-6,
    seed: int = 0,
) -> dict[str, Any]:
    """A deterministic HF ``generate()`` run (spec §7).

    Settings: ``t_min = temperature``, ``t_max = 2 * temperature`` (so multinomial == argmax), ``entropy_bound``
    1e9 (every token accepted every step, nothing renoised), ``stability_threshold = num_steps + 1`` (no adaptive
    stop: exactly ``num_steps`` decoder passes per canvas), EOS id = vocab_size (impossible), pad 0.

    The start canvas of every block is forced: ``generate()`` draws blocks 2.. from torch's RNG, so the decoder's
    ``forward`` is wrapped (instance attribute, which generate binds at call time) and the first call of block k
    (the one with ``self_conditioning_logits is None``) gets ``start_canvas[k]``.

    Args:
      prompt_ids: ``[L]`` or ``[B, L]`` int; ``attention_mask`` ``[B, L]`` bool for left padding.
      canvas_length: must equal ``model.config.canvas_length`` (checked) if given.
      start_canvas: ``[C]`` (same for every block), ``[K, C]`` (block k) or ``[B, K, C]``; default: drawn from
        ``np.random.default_rng(seed)``.
    Returns: dict with
      ``sequences`` ``[L + K*C]`` / ``[B, L + K*C]`` int64 (HF's output),
      ``start_canvases`` ``[B, K, C]`` int64 (what was used),
      ``argmax_canvases`` ``[B, K, num_steps, C]`` int64 (argmax of every decoder pass; with these settings the
      canvas fed to step s+1 equals the argmax of step s),
      ``num_decoder_calls`` int.
    """
    C = model.config.canvas_length
    if canvas_length is not None and int(canvas_length) != C:
        raise ValueError(f"canvas_length {canvas_length} != model.config.canvas_length {C}")
    V = model.config.text_config.vocab_size
    input_ids, squeeze = _as_batch(prompt_ids, 2)
    input_ids = input_ids.to(torch.long)
    B = input_ids.shape[0]
    K = int(num_canvases)

    if start_canvas is None:
        starts = np.random.default_rng(seed).integers(0, V, size=(B, K, C))
    else:
        sc = np.asarray(start_canvas)
        if sc.ndim == 1:
            starts = np.broadcast_to(sc, (B, K, C))
        elif sc.ndim == 2:
            starts = np.broadcast_to(sc[None], (B, K, C))
        else:
            starts = sc
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if starts.shape != (B, K, C):
        raise ValueError(f"start_canvas shape {starts.shape} != {(B, K, C)}")

    calls: list[np.ndarray] = []
    block = [0]
    original_forward = model.forward

    def wrapped_forward(*args, **kwargs):
        if kwargs.get("self_conditioning_logits") is None and kwargs.get("decoder_input_ids") is not None:
            k = block[0]
            kwargs["decoder_input_ids"] = torch.from_numpy(starts[:, k]).to(kwargs["decoder_input_ids"].device)
            block[0] += 1
        out = original_forward(*args, **kwargs)
        calls.append(out.logits.argmax(-1).numpy())
        return out

    gen_kwargs = dict(
        max_new_tokens=K * C,
        max_denoising_steps=int(num_steps),
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=1e9),
        t_min=float(temperature),
        t_max=2.0 * float(temperature),
        stability_threshold=int(num_steps) + 1,
        confidence_threshold=1e-3,
        eos_token_id=V,
        pad_token_id=0,
    )
    if attention_mask is not None:
        am, _ = _as_batch(attention_mask, 2)
        am = am.to(torch.bool)
        if not bool(am.all()) and model.config.text_config._attn_implementation == "eager":
            # generate() passes the int64 canvas as the mask builder's shape carrier; eager's mask then calls
            # torch.finfo(int64) and crashes (HF bug).  The pass-by-pass functions above are not affected.
            raise ValueError("HF generate() crashes with attn_implementation='eager' and padding; use 'sdpa'")
        gen_kwargs["attention_mask"] = am
    torch.manual_seed(int(seed))
    model.forward = wrapped_forward
    try:
        out = model.generate(input_ids, **gen_kwargs)
    finally:
        del model.forward
    seqs = out.sequences.numpy().astype(np.int64)
    assert block[0] == K, f"expected {K} blocks, saw {block[0]}"
    assert len(calls) == K * num_steps, f"expected {K * num_steps} decoder calls, saw {len(calls)}"
    argmax = np.stack(calls).reshape(K, num_steps, B, C).transpose(2, 0, 1, 3)
    return {
        "sequences": seqs[0] if squeeze else seqs,
        "start_canvases": starts,
        "argmax_canvases": argmax,
        "num_decoder_calls": len(calls),
    }
