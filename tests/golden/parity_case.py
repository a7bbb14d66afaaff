"""The model parity case (tests/test_parity_hf.py): inputs, the reference's outputs, the golden record.

Weights: `random_checkpoint` draws, from SEED and the tensor list transformers saves for the preset.
Inputs (numpy RandomState(7), in this order): two prompts of lengths 2W+5 and W+3 (longer than the
sliding window W), a canvas [2, C], self-conditioning logits [2, C, V] (std 3), a second canvas [2, C].
Reference outputs per row i (transformers, pass by pass through tests.reference.hf_reference):
  enc_i   (a) encoder logits of prompt i                         [len_i, V]
  den0    (b) denoiser logits on the canvas, no self-conditioning [2, C, V]
  den1    (c) the same with the given self-conditioning logits   [2, C, V]
  committed   argmax of den1, committed by a causal pass           [2, C]
  den2    (d) denoiser logits on the second canvas after that commit, self-conditioned on den0
"""

from __future__ import annotations

import json
import os

import numpy as np

PRESETS = ["tiny-2layer", "tiny-6layer"]
SEED = 1234
OUTPUT_KEYS = ("enc_0", "enc_1", "den0", "den1", "committed", "den2")


def golden_name(preset: str) -> str:
    return f"parity_{preset}"


def checkpoint_record(info: dict) -> dict:
    return {"config_json": np.asarray(info["config_json"]),
            "generation_config_json": np.asarray(info["generation_config_json"]),
            "spec_json": np.asarray(json.dumps([[k, list(s)] for k, s in info["spec"]])),
            "weights_seed": np.asarray(int(info["seed"]))}


def rebuild_checkpoint(arrays: dict, path) -> str:
    """The checkpoint a golden record describes, rebuilt with numpy into `path` (no torch)."""
    from tests.reference.random_checkpoint import write_checkpoint

    spec = [(k, tuple(s)) for k, s in json.loads(str(arrays["spec_json"]))]
    return write_checkpoint(path, str(arrays["config_json"]), str(arrays["generation_config_json"]), spec,
                            int(arrays["weights_seed"]))


def dims(path) -> tuple[int, int, int]:
    """(sliding window W, vocab V, canvas length C) from the checkpoint's config.json."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    t = cfg["text_config"]
    return int(t["sliding_window"]), int(t["vocab_size"]), int(cfg["canvas_length"])


def inputs(path) -> dict:
    w, v, c = dims(path)
    rng = np.random.RandomState(7)
    prompts = [rng.randint(3, v, n) for n in (w * 2 + 5, w + 3)]
    canvas = rng.randint(0, v, (2, c)).astype(np.int32)
    sc_logits = (rng.randn(2, c, v) * 3.0).astype(np.float32)
    canvas2 = rng.randint(0, v, (2, c)).astype(np.int32)
    return {"prompts": prompts, "canvas": canvas, "sc_logits": sc_logits, "canvas2": canvas2}


def hash_items(path, inp: dict) -> tuple:
    """What the golden's inputs_sha256 covers: config.json, every weight, every input."""
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as f:
        config_json = f.read()
    return config_json, load_file(os.path.join(path, "model.safetensors")), inp


def hf_outputs(hf_model, inp: dict) -> dict:
    """The reference's outputs (needs torch + transformers)."""
    from tests.reference import hf_reference as ref

    out = {}
    den0, den1, den2, committed = [], [], [], []
    for i, p in enumerate(inp["prompts"]):
        enc, cache = ref.encoder_logits(hf_model, p)
        out[f"enc_{i}"] = enc
        d0 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i])
        d1 = ref.denoiser_logits(hf_model, cache, inp["canvas"][i], sc_logits=inp["sc_logits"][i])
        com = d1.argmax(-1).astype(np.int32)
        _, cache = ref.encoder_append(hf_model, cache, com)
        d2 = ref.denoiser_logits(hf_model, cache, inp["canvas2"][i], sc_logits=d0)
        den0.append(d0), den1.append(d1), den2.append(d2), committed.append(com)
    out.update(den0=np.stack(den0), den1=np.stack(den1), den2=np.stack(den2), committed=np.stack(committed))
    return out
