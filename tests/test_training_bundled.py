"""The bundled checkpoint loads and reaches its stated accuracy with the real sampler."""

import os

import numpy as np
import pytest

from dgemma_jax.training import bundled

pytestmark = pytest.mark.skipif(not os.path.isdir(bundled.asset_path()),
                                reason="no bundled model (run scripts/train_bundled.py)")


def test_bundled_model_reaches_stated_accuracy():
    config, params, sampler, tok = bundled.load_bundled()
    meta = bundled.load_metadata()
    assert meta["eval"]["accuracy"] >= 0.95 and meta["eval"]["n"] >= 500
    ci = meta["ci_sample"]
    pairs = bundled.heldout_pairs(meta, ci["n"], ci["seed"])
    assert all(len(a) + 1 > config.canvas_length for _, a in pairs)          # multi-canvas answers
    from dgemma_jax.training.evaluate import evaluate_exact_match

    lay = meta["layout"]
    r = evaluate_exact_match(config, params, sampler, tok, pairs, prompt_width=lay["prompt_length"],
                             max_new_tokens=lay["num_canvases"] * lay["canvas_length"], batch_size=ci["n"],
                             seed=ci["seed"])
    # the same sample and rng as when the metadata was written; 2 examples of slack for float
    # differences between machines
    assert r["accuracy"] >= ci["accuracy"] - 0.02, (r["accuracy"], ci["accuracy"], r["samples"])
    assert r["accuracy"] >= 0.93
    assert 1.0 <= r["mean_steps_per_canvas"] <= sampler.max_denoising_steps


def test_bundled_tokenizer_roundtrip():
    _, _, sampler, tok = bundled.load_bundled()
    s = "s9504046258782031="
    assert tok.decode(tok.encode(s)) == s
    assert tok.decode(tok.encode("0123") + [tok.eos_id] + tok.encode("99")) == "0123"
    assert sampler.eos_ids == (tok.eos_id,)
    assert np.all(np.asarray(tok.encode("0")) >= 3)
