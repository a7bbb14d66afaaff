"""The end-to-end image parity case (tests/test_vision_e2e.py): pixels -> vision tower -> encoder -> denoiser.

Unlike tests/golden/image_prefill_case.py (drawn features fed to both sides), here each side computes
its own image features from the same preprocessed pixels: transformers through its encoder's
`pixel_values` / `image_position_ids` (its vision tower + embed_vision), ours through
`image_features_pass`.

Checkpoint: the preset's text model with the tiny vision tower of tests/reference/hf_reference.py, made
with `standardize=True` and image / boi / eoi ids V-1 / V-2 / V-3 written into config.json (the tiny
vocabularies are smaller than the released ids). transformers fixes config.json and the tensor list;
every text tensor is then drawn by `random_checkpoint` from SEED (norms and scales U[0.5, 1.5],
layer scalars U[0.3, 1.7]) and every vision tensor by `vision_tensor` below (norm weights and std_scale
U[0.5, 1.5], std_bias N(0, (0.3 sqrt(d))^2), position table N(0, 0.5^2), linears N(0, 1/fan_in)), each
from its own stream, so the golden variant rebuilds the checkpoint with numpy alone.

Images: RGB images made with Pillow (gradients, stripes, a disc, noise; numpy RandomState(5)) of
different sizes and aspect ratios, preprocessed by `dgemma_jax.io.images.preprocess_images` with
the checkpoint's patch size / pooling and a 70-soft-token budget (the processor's parity with
transformers is tests/test_images.py). Every image is longer than the sliding window W.
  row 0: text 3, image A, text W+2, image B, text 2, image C, text 3   (three images, one prompt)
  row 1: text W+5, no image                                            (batched with image rows)
  row 2: text 2, image D, text 4
  then a canvas [3, C] and self-conditioning logits [3, C, V] (std 3), a commit, a second turn
  "text 2, image E_i, text 3" per row (three images of one size) and a second canvas.
Reference outputs per row i (transformers, each row alone and unpadded, the generate() mask path):
  enc_i, den0, den1, committed, turn_i, den2   as in tests/golden/image_prefill_case.py.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib

import numpy as np

from tests.golden.image_prefill_case import set_image_token, special_ids
from tests.golden.parity_case import checkpoint_record, dims  # noqa: F401

PRESETS = ["tiny-2layer", "tiny-6layer"]
SEED = 2468
VISION_SEED = 97
MAX_SOFT_TOKENS = 70
OUTPUT_KEYS = ("den0", "den1", "committed", "den2")
VISION_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
# (width, height) of images A, B, C, D (the first turn) and E (the second turn, one per row)
SIZES = [(96, 64), (40, 120), (150, 50), (64, 64)]
TURN_SIZE = (80, 48)


def golden_name(preset: str) -> str:
    return f"vision_e2e_{preset}"


# ------------------------------------------------------------------ the checkpoint
def vision_tensor(name: str, shape, seed: int, vision_hidden: int) -> np.ndarray:
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode())])
    shape = tuple(int(s) for s in shape)
    if name.endswith("std_bias"):
        w = rng.standard_normal(shape) * 0.3 * math.sqrt(vision_hidden)
    elif name.endswith("position_embedding_table"):
        w = rng.standard_normal(shape) * 0.5
    elif len(shape) == 1:  # every norm weight and std_scale
        w = rng.random(shape) + 0.5
    elif len(shape) == 2:  # a linear [out, in]
        w = rng.standard_normal(shape) / math.sqrt(shape[1])
    else:
        raise ValueError(f"no distribution for vision tensor {name} {shape}")
    return np.asarray(w, np.float32)


def redraw_vision(path) -> None:
    """Replace the checkpoint's vision tensors by `vision_tensor` draws (VISION_SEED)."""
    from safetensors.numpy import load_file, save_file

    with open(os.path.join(path, "config.json")) as f:
        d = int(json.load(f)["vision_config"]["hidden_size"])
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    names = [k for k in tensors if k.startswith(VISION_PREFIXES)]
    assert any(k.endswith("std_bias") for k in names), "the tower is not standardized"
    for k in names:
        tensors[k] = vision_tensor(k, tensors[k].shape, VISION_SEED, d)
    save_file(tensors, f, metadata={"format": "pt"})


def make_checkpoint(preset: str, path) -> dict:
    """The case's checkpoint (needs torch + transformers for config.json and the tensor list)."""
    from safetensors import safe_open

    from tests.reference import hf_reference as ref
    from tests.reference.random_checkpoint import write_checkpoint

    kw = ref.tiny_text_config_kwargs(preset)
    config = ref.make_config(kw, ref.DEFAULT_CANVAS_LENGTH[preset])
    config.vision_config.standardize = True
    image, boi, eoi = special_ids(int(kw["vocab_size"]))
    config.image_token_id, config.boi_token_id, config.eoi_token_id = image, boi, eoi
    import torch
    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).to(torch.float32).eval()
    model.generation_config = ref.release_like_generation_config(config.text_config.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_reference(model, tmp)
        with open(os.path.join(tmp, "config.json")) as f:
            config_json = f.read()
        with open(os.path.join(tmp, "generation_config.json")) as f:
            generation_config_json = f.read()
        with safe_open(os.path.join(tmp, "model.safetensors"), "np") as f:
            spec = [(k, tuple(int(d) for d in f.get_slice(k).get_shape())) for k in sorted(f.keys())]
    write_checkpoint(path, config_json, generation_config_json, spec, SEED)
    redraw_vision(path)
    return {"path": os.fspath(path), "config_json": config_json, "generation_config_json": generation_config_json,
            "spec": spec, "seed": SEED}


def rebuild_checkpoint(arrays: dict, path) -> str:
    """The golden record's checkpoint rebuilt with numpy into `path` (no torch)."""
    from tests.golden.parity_case import rebuild_checkpoint as rebuild_text

    rebuild_text(arrays, path)
    redraw_vision(path)
    return os.fspath(path)


def hash_items(path, inp: dict) -> tuple:
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as f:
        config_json = f.read()
    return config_json, load_file(os.path.join(path, "model.safetensors")), inp


# ------------------------------------------------------------------ the images and prompts
def pil_images(sizes, rng) -> list:
    """RGB Pillow images of the given (width, height): a gradient, stripes, a disc and noise."""
    from PIL import Image, ImageDraw

    out = []
    for w, h in sizes:
        y, x = np.mgrid[0:h, 0:w]
        base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1),
                         ((x // 7 + y // 5) % 2) * 200], -1).astype(np.int32)
        base += rng.randint(-30, 31, base.shape)
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
        draw = ImageDraw.Draw(img)
        cx, cy, r = rng.randint(0, w), rng.randint(0, h), rng.randint(4, max(5, min(w, h) // 2))
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=tuple(int(c) for c in rng.randint(0, 256, 3)))
        out.append(img)
    return out


def _row(rng, layout, vocab, soft):
    """ids and image marks of one row: ("t", n) text, ("i", k) image k (soft[k] tokens)."""
    image, boi, eoi = special_ids(vocab)
    ids, marks = [], []
    for kind, n in layout:
        if kind == "t":
            ids += list(rng.randint(3, vocab - 3, n))
            marks += [False] * n
        else:
            ids += [boi] + [image] * soft[n] + [eoi]
            marks += [False] + [True] * soft[n] + [False]
    return np.asarray(ids, np.int32), np.asarray(marks, bool)


def inputs(path) -> dict:
    from dgemma_jax.config import ModelConfig
    from dgemma_jax.io.images import preprocess_images, settings_for

    w, v, c = dims(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    settings = settings_for(cfg, MAX_SOFT_TOKENS)
    rng = np.random.RandomState(5)
    first = preprocess_images(pil_images(SIZES, rng), settings)
    turn_images = preprocess_images(pil_images([TURN_SIZE] * 3, rng), settings)
    soft = [int(n) for n in first.soft_tokens]
    layouts = [[("t", 3), ("i", 0), ("t", w + 2), ("i", 1), ("t", 2), ("i", 2), ("t", 3)],
               [("t", w + 5)],
               [("t", 2), ("i", 3), ("t", 4)]]
    rows = [_row(rng, lay, v, soft) for lay in layouts]
    tsoft = [int(n) for n in turn_images.soft_tokens]
    turn = [_row(rng, [("t", 2), ("i", i), ("t", 3)], v, tsoft) for i in range(3)]
    canvas = rng.randint(0, v, (3, c)).astype(np.int32)
    sc_logits = (rng.randn(3, c, v) * 3.0).astype(np.float32)
    canvas2 = rng.randint(0, v, (3, c)).astype(np.int32)
    return {"prompts": [r[0] for r in rows], "image_marks": [r[1] for r in rows],
            "pixel_values": np.asarray(first.pixel_values, np.float32),
            "position_ids": np.asarray(first.position_ids, np.int32), "soft_tokens": np.asarray(soft, np.int32),
            "row_images": [[0, 1, 2], [], [3]],
            "turn": [r[0] for r in turn], "turn_marks": [r[1] for r in turn],
            "turn_pixel_values": np.asarray(turn_images.pixel_values, np.float32),
            "turn_position_ids": np.asarray(turn_images.position_ids, np.int32),
            "turn_soft_tokens": np.asarray(tsoft, np.int32),
            "canvas": canvas, "sc_logits": sc_logits, "canvas2": canvas2}


# ------------------------------------------------------------------ the reference
def encoder_append_pixels(hf_model, cache, ids, marks, pixels, positions):
    """One causal encoder pass of one unpadded row, as generate() runs it, the image features computed by
    the reference's own vision tower from `pixels` [n, P, 3 p^2] / `positions` [n, P, 2] (None: no image).
    The masks come from `create_masks_for_generate` with mm_token_type_ids (see image_prefill_case)."""
    import torch

    with torch.no_grad():
        input_ids = torch.from_numpy(np.asarray(ids, np.int64))[None]
        n = input_ids.shape[1]
        s = cache.get_seq_length()
        full_mask = torch.ones((1, s + n), dtype=torch.bool)
        position_ids = torch.arange(s, s + n, dtype=torch.long)[None]
        mm = torch.zeros((1, s + n), dtype=torch.long)
        mm[0, s:] = torch.from_numpy(np.asarray(marks, bool)).long()
        mask_mapping = hf_model.model.encoder.create_masks_for_generate(
            config=hf_model.config, inputs_embeds=torch.empty((1, n, 0), dtype=hf_model.dtype),
            attention_mask=full_mask, past_key_values=cache, position_ids=position_ids, mm_token_type_ids=mm)
        kw = {}
        if pixels is not None and len(pixels):
            kw = dict(pixel_values=torch.from_numpy(np.asarray(pixels, np.float32)),
                      image_position_ids=torch.from_numpy(np.asarray(positions, np.int64)))
        out = hf_model.model.encoder(input_ids=input_ids, attention_mask=mask_mapping, past_key_values=cache,
                                     position_ids=position_ids, **kw)
        setattr(cache, "dgemma_attention_mask", full_mask)
        cap = hf_model.config.get_text_config().final_logit_softcapping
        logits = hf_model.lm_head(out.last_hidden_state).to(torch.float32)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    return logits[0].numpy().astype(np.float32), cache


def hf_outputs(hf_model, inp: dict) -> dict:
    """The reference's outputs (needs torch + transformers)."""
    from tests.reference import hf_reference as ref

    v = hf_model.config.get_text_config().vocab_size
    set_image_token(hf_model, special_ids(v)[0])
    out = {}
    den0, den1, den2, committed = [], [], [], []
    for i, p in enumerate(inp["prompts"]):
        sel = inp["row_images"][i]
        enc, cache = encoder_append_pixels(hf_model, ref.new_cache(hf_model), p, inp["image_marks"][i],
                                           inp["pixel_values"][sel], inp["position_ids"][sel])
        out[f"enc_{i}"] = enc
        d0 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i])
        d1 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i], sc_logits=inp["sc_logits"][i])
        com = d1.argmax(-1).astype(np.int32)
        _, cache = ref.encoder_append(hf_model, cache, com)
        out[f"turn_{i}"], cache = encoder_append_pixels(hf_model, cache, inp["turn"][i], inp["turn_marks"][i],
                                                        inp["turn_pixel_values"][i: i + 1],
                                                        inp["turn_position_ids"][i: i + 1])
        d2 = ref.denoiser_logits(hf_model, cache, inp["canvas2"][i], sc_logits=d0)
        den0.append(d0), den1.append(d1), den2.append(d2), committed.append(com)
    out.update(den0=np.stack(den0), den1=np.stack(den1), den2=np.stack(den2), committed=np.stack(committed))
    return out
