"""The image prefill parity case (tests/test_image_prefill.py): inputs, the reference's outputs, the record.

Weights: `random_checkpoint` draws from SEED for the preset (as tests/golden/parity_case.py). The
tiny presets' vocabularies are smaller than the released image token ids, so the reference is told
to use in-vocabulary ids: image token V-1, boi V-2, eoi V-3 (boi / eoi are ordinary text tokens).

The image features are inputs, not the vision tower's output: the soft tokens are drawn here
(N(0, 1.5^2), the text embeddings' scale) and handed to the reference's encoder as its image
encoder output (`mm_encoder_outputs`), so this case checks the text side of the image path
(placement, the bidirectional-within-image mask, the cache the denoiser reads) independently of
the vision tower.

Inputs (numpy RandomState(11), in this order), with W the sliding window:
  row 0: text 3, [boi img x5 eoi], text W+4, [boi img x(W+5) eoi], text 3  -- a short image that
         ends up before the sliding window, then one longer than the window;
  row 1: text W+3, no image (batched with the image rows);
  row 2: text 2, [boi img x3 eoi], text 2, [boi img x7 eoi], text 5;
  features: one row per placeholder, row-major over (row, position), then 3 unused rows;
  a canvas [3, C] and self-conditioning logits [3, C, V] (std 3), a second canvas [3, C];
  turn 2 (a later pass with an image): text 2, [boi img x6 eoi], text 3 per row, and its features.
Reference outputs per row i (transformers, pass by pass, each row alone and unpadded):
  enc_i      encoder logits of prompt i, images bidirectional (the generate() mask)   [len_i, V]
  den0, den1 denoiser logits on the canvas without / with the self-conditioning logits [3, C, V]
  committed  argmax of den1, committed by a causal (text) pass                        [3, C]
  turn_i     encoder logits of turn 2 (after the commit)                              [len, V]
  den2       denoiser logits on the second canvas after turn 2, self-conditioned on den0
Turn 2 gives the reference's mask builder block ids over every position seen so far (zeros for the
cached ones): generate() passes ids for the new tokens only, which its mask builder indexes by
absolute position, so its blocks are misplaced whenever the cache is not empty.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tests.golden.parity_case import checkpoint_record, dims, hash_items, rebuild_checkpoint  # noqa: F401

PRESETS = ["tiny-2layer", "tiny-6layer"]
SEED = 4321
OUTPUT_KEYS = ("den0", "den1", "committed", "den2")
EXTRA_FEATURE_ROWS = 3
FEATURE_STD = 1.5


def special_ids(vocab: int) -> tuple[int, int, int]:
    """(image, boi, eoi) token ids for a vocabulary of this size."""
    return vocab - 1, vocab - 2, vocab - 3


def _row(rng, layout, vocab):
    """Token ids and image flags of one row: layout items are ("t", n) text or ("i", n) an image."""
    image, boi, eoi = special_ids(vocab)
    ids, marks = [], []
    for kind, n in layout:
        if kind == "t":
            ids += list(rng.randint(3, vocab - 3, n))
            marks += [False] * n
        else:
            ids += [boi] + [image] * n + [eoi]
            marks += [False] + [True] * n + [False]
    return np.asarray(ids, np.int32), np.asarray(marks, bool)


def hidden_size(path) -> int:
    with open(os.path.join(path, "config.json")) as f:
        return int(json.load(f)["text_config"]["hidden_size"])


def golden_name(preset: str) -> str:
    return f"image_prefill_{preset}"


def inputs(path) -> dict:
    w, v, c = dims(path)
    d = hidden_size(path)
    rng = np.random.RandomState(11)
    layouts = [
        [("t", 3), ("i", 5), ("t", w + 4), ("i", w + 5), ("t", 3)],
        [("t", w + 3)],
        [("t", 2), ("i", 3), ("t", 2), ("i", 7), ("t", 5)],
    ]
    rows = [_row(rng, lay, v) for lay in layouts]
    n_img = sum(int(m.sum()) for _, m in rows)
    features = (rng.randn(n_img + EXTRA_FEATURE_ROWS, d) * FEATURE_STD).astype(np.float32)
    canvas = rng.randint(0, v, (3, c)).astype(np.int32)
    sc_logits = (rng.randn(3, c, v) * 3.0).astype(np.float32)
    canvas2 = rng.randint(0, v, (3, c)).astype(np.int32)
    turn = [_row(rng, [("t", 2), ("i", 6), ("t", 3)], v) for _ in range(3)]
    turn_features = (rng.randn(3 * 6, d) * FEATURE_STD).astype(np.float32)
    return {"prompts": [r[0] for r in rows], "image_marks": [r[1] for r in rows], "features": features,
            "canvas": canvas, "sc_logits": sc_logits, "canvas2": canvas2,
            "turn": [r[0] for r in turn], "turn_marks": [r[1] for r in turn], "turn_features": turn_features}


def row_features(features: np.ndarray, marks: list, i: int) -> np.ndarray:
    """The feature rows of row i's placeholders (row-major order over the batch)."""
    lo = sum(int(m.sum()) for m in marks[:i])
    return features[lo: lo + int(marks[i].sum())]


def hf_outputs(hf_model, inp: dict) -> dict:
    """The reference's outputs (needs torch + transformers)."""
    from tests.reference import hf_reference as ref

    v = hf_model.config.get_text_config().vocab_size
    set_image_token(hf_model, special_ids(v)[0])
    out = {}
    den0, den1, den2, committed = [], [], [], []
    for i, p in enumerate(inp["prompts"]):
        marks = inp["image_marks"][i]
        enc, cache = encoder_append_images(hf_model, ref.new_cache(hf_model), p, marks,
                                           row_features(inp["features"], inp["image_marks"], i))
        out[f"enc_{i}"] = enc
        d0 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i])
        d1 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i], sc_logits=inp["sc_logits"][i])
        com = d1.argmax(-1).astype(np.int32)
        _, cache = ref.encoder_append(hf_model, cache, com)
        tm = inp["turn_marks"][i]
        out[f"turn_{i}"], cache = encoder_append_images(hf_model, cache, inp["turn"][i], tm,
                                                        row_features(inp["turn_features"], inp["turn_marks"], i))
        d2 = ref.denoiser_logits(hf_model, cache, inp["canvas2"][i], sc_logits=d0)
        den0.append(d0), den1.append(d1), den2.append(d2), committed.append(com)
    out.update(den0=np.stack(den0), den1=np.stack(den1), den2=np.stack(den2), committed=np.stack(committed))
    return out


def set_image_token(hf_model, image_id: int) -> None:
    """Point the reference's placeholder lookup at an in-vocabulary image token id."""
    hf_model.config.image_token_id = int(image_id)
    hf_model.model.encoder.config.image_token_id = int(image_id)


def encoder_append_images(hf_model, cache, ids, marks, features):
    """One causal encoder pass of one unpadded row with images, as generate() runs it.

    ids [n] with image placeholders where marks [n] is True, features [marks.sum(), D]. The masks are
    built up front by the encoder's `create_masks_for_generate` with mm_token_type_ids (the image
    blocks bidirectional); its ids cover every position seen so far (zeros for the cached ones; see the
    module doc). The features enter as the image encoder's output. Returns (logits [n, V], cache).
    """
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

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
        image = BaseModelOutputWithPooling(pooler_output=torch.from_numpy(np.asarray(features, np.float32)))
        out = hf_model.model.encoder(input_ids=input_ids, attention_mask=mask_mapping, past_key_values=cache,
                                     position_ids=position_ids, mm_encoder_outputs={"image": image})
        setattr(cache, "dgemma_attention_mask", full_mask)
        cap = hf_model.config.get_text_config().final_logit_softcapping
        logits = hf_model.lm_head(out.last_hidden_state).to(torch.float32)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
    return logits[0].numpy().astype(np.float32), cache
