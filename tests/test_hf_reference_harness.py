"""Checks of the Hugging Face reference harness (tests/reference/hf_reference.py) against HF's own forward.

These do not touch the JAX model: they make sure the pass-by-pass driver, the randomised weights and the saved
checkpoint are what the JAX comparisons assume.
"""

import json
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.ref
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

try:
    from tests.reference import hf_reference as R
except ModuleNotFoundError:  # not installed: run from the repository root
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.reference import hf_reference as R

from safetensors.numpy import load_file  # noqa: E402

PRESET = "tiny-2layer"  # W = 8, C = 16, V = 128
N_PROMPT = 20  # longer than the sliding window


@pytest.fixture(scope="module")
def model():
    return R.build_preset(PRESET, seed=0)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    return R.save_reference(model, tmp_path_factory.mktemp("hf_ref") / PRESET)


@pytest.fixture(scope="module")
def inputs(model):
    rng = np.random.default_rng(123)
    V = model.config.text_config.vocab_size
    C = model.config.canvas_length
    return rng.integers(0, V, size=N_PROMPT), rng.integers(0, V, size=C), rng.integers(0, V, size=C)


def _t(x):
    return torch.as_tensor(np.asarray(x))[None]


def test_denoiser_matches_hf_forward(model, inputs):
    ids, canvas, canvas2 = inputs
    enc, cache = R.encoder_logits(model, ids)
    V = model.config.text_config.vocab_size
    assert enc.shape == (N_PROMPT, V) and enc.dtype == np.float32
    dec = R.denoiser_logits(model, cache, canvas)
    assert dec.shape == (len(canvas), V) and dec.dtype == np.float32
    with torch.no_grad():
        # (1) top-level forward on the harness's cache, default positions and masks
        ref = model(decoder_input_ids=_t(canvas), past_key_values=cache).logits[0].numpy()
        np.testing.assert_array_equal(dec, ref)
        # with self-conditioning logits
        sc = dec / 0.7
        dec_sc = R.denoiser_logits(model, cache, canvas, sc_logits=sc)
        ref_sc = model(
            decoder_input_ids=_t(canvas), past_key_values=cache, self_conditioning_logits=_t(sc)
        ).logits[0].numpy()
        np.testing.assert_array_equal(dec_sc, ref_sc)
        assert np.abs(dec_sc - dec).max() > 1e-2  # self-conditioning does something
        # the all-in-one forward (encoder via the 2-D mask path, then decoder) on a fresh cache
        out = model(input_ids=_t(ids), decoder_input_ids=_t(canvas), past_key_values=R.new_cache(model))
        np.testing.assert_allclose(out.logits[0].numpy(), dec, rtol=0, atol=1e-5)
        enc_ref = R._softcap(model, model.lm_head(out.encoder_last_hidden_state))[0].numpy()
        np.testing.assert_allclose(enc_ref, enc, rtol=0, atol=1e-5)
    # commit pass == encoder over the concatenation
    app, cache = R.encoder_append(model, cache, canvas)
    enc_all, cache_all = R.encoder_logits(model, np.concatenate([ids, canvas]))
    np.testing.assert_allclose(app, enc_all[N_PROMPT:], rtol=0, atol=1e-5)
    d1 = R.denoiser_logits(model, cache, canvas2)
    d2 = R.denoiser_logits(model, cache_all, canvas2)
    np.testing.assert_allclose(d1, d2, rtol=0, atol=1e-5)
    # logits are O(1): not saturated at the softcap, top-2 gaps varied
    s = np.sort(np.concatenate([enc, dec]), axis=-1)
    gaps = s[:, -1] - s[:, -2]
    assert np.abs(s).max() < 25.0
    assert 1.0 < s.std() < 10.0
    assert gaps.min() < 0.5 < gaps.max()


def test_eager_matches_sdpa(model, inputs):
    ids, canvas, _ = inputs
    eager = R.build_preset(PRESET, seed=0, attn_implementation="eager", experts_implementation="eager")
    a, ca = R.encoder_logits(model, ids)
    b, cb = R.encoder_logits(eager, ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4)
    np.testing.assert_allclose(
        R.denoiser_logits(model, ca, canvas), R.denoiser_logits(eager, cb, canvas), rtol=0, atol=1e-4
    )


def test_save_load_round_trip(model, saved, inputs):
    ids, canvas, _ = inputs
    assert sorted(os.listdir(saved)) == ["config.json", "generation_config.json", "model.safetensors"]
    loaded = R.load_reference(saved)
    e0, c0 = R.encoder_logits(model, ids)
    e1, c1 = R.encoder_logits(loaded, ids)
    np.testing.assert_array_equal(e0, e1)
    d0 = R.denoiser_logits(model, c0, canvas)
    d1 = R.denoiser_logits(loaded, c1, canvas)
    np.testing.assert_array_equal(d0, d1)
    np.testing.assert_array_equal(
        R.denoiser_logits(model, c0, canvas, sc_logits=d0), R.denoiser_logits(loaded, c1, canvas, sc_logits=d1)
    )
    gc = loaded.generation_config
    assert (gc.max_denoising_steps, gc.t_min, gc.t_max, gc.stability_threshold) == (48, 0.4, 0.8, 1)
    assert gc.sampler_config.entropy_bound == 0.1
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["canvas_length"] == 16
    assert cfg["text_config"]["per_layer_config"] == {"1": {"head_dim": 32, "num_key_value_heads": 1}}


def test_saved_tensors(model, saved):
    sd = load_file(os.path.join(saved, "model.safetensors"))
    n_layers = model.config.text_config.num_hidden_layers
    assert "lm_head.weight" not in sd
    text = {k: v for k, v in sd.items() if ".vision_tower." not in k and ".embed_vision." not in k}
    # only the decoder copies of tied text weights, plus the encoder's layer_scalar buffers
    enc_keys = sorted(k for k in text if k.startswith("model.encoder."))
    assert enc_keys == [f"model.encoder.language_model.layers.{i}.layer_scalar" for i in range(n_layers)]
    for i in range(n_layers):
        e = sd[f"model.encoder.language_model.layers.{i}.layer_scalar"]
        d = sd[f"model.decoder.layers.{i}.layer_scalar"]
        assert e.shape == d.shape == (1,)
        assert abs(float(e[0]) - float(d[0])) > 1e-3, i
        assert abs(float(e[0]) - 1.0) > 1e-3 and abs(float(d[0]) - 1.0) > 1e-3
    norm_like = [k for k in text if "norm" in k.rsplit(".", 2)[-2] or k.endswith(("router.scale", "per_expert_scale"))]
    # 7 layer norms + q_norm + k_norm + router.scale + per_expert_scale per layer, final norm, SC pre_norm
    assert len(norm_like) == 11 * n_layers + 2
    for k in norm_like:
        assert np.all(text[k] != 1.0), k
        assert 0.5 <= text[k].min() and text[k].max() <= 1.5, k
    # global layer (1): no v_proj; sliding layer (0): v_proj present
    assert "model.decoder.layers.0.self_attn.v_proj.weight" in sd
    assert "model.decoder.layers.1.self_attn.v_proj.weight" not in sd
    assert sd["model.decoder.layers.1.self_attn.q_proj.weight"].shape == (4 * 32, 64)


def test_cache_lengths(model, inputs):
    ids, canvas, _ = inputs
    W = model.config.text_config.sliding_window
    _, cache = R.encoder_logits(model, ids)
    lengths = R.cache_lengths(cache)
    assert [x["sliding"] for x in lengths] == [True, False]
    for x in lengths:
        assert x["seq_length"] == N_PROMPT
        assert x["stored"] == (min(N_PROMPT, W - 1) if x["sliding"] else N_PROMPT)
    R.denoiser_logits(model, cache, canvas)  # asserts internally that nothing changed
    assert R.cache_lengths(cache) == lengths
    _, cache = R.encoder_append(model, cache, canvas)
    n = N_PROMPT + len(canvas)
    assert [(x["seq_length"], x["stored"]) for x in R.cache_lengths(cache)] == [(n, W - 1), (n, n)]


def test_left_padding_matches_single_row(model):
    rng = np.random.default_rng(7)
    V, C = model.config.text_config.vocab_size, model.config.canvas_length
    a, b = rng.integers(0, V, size=14), rng.integers(0, V, size=9)
    ids = np.stack([a, np.r_[np.zeros(5, np.int64), b]])
    mask = np.stack([np.ones(14, bool), np.r_[np.zeros(5, bool), np.ones(9, bool)]])
    canvas = rng.integers(0, V, size=(2, C))
    enc, cache = R.encoder_logits(model, ids, attention_mask=mask)
    dec = R.denoiser_logits(model, cache, canvas)
    app, cache = R.encoder_append(model, cache, canvas)
    dec2 = R.denoiser_logits(model, cache, canvas, sc_logits=dec)
    for row, (x, pad) in enumerate([(a, 0), (b, 5)]):
        e1, c1 = R.encoder_logits(model, x)
        d1 = R.denoiser_logits(model, c1, canvas[row])
        a1, c1 = R.encoder_append(model, c1, canvas[row])
        d2 = R.denoiser_logits(model, c1, canvas[row], sc_logits=dec[row])
        np.testing.assert_allclose(enc[row, pad:], e1, rtol=0, atol=1e-4)
        np.testing.assert_allclose(dec[row], d1, rtol=0, atol=1e-4)
        np.testing.assert_allclose(app[row], a1, rtol=0, atol=1e-4)
        np.testing.assert_allclose(dec2[row], d2, rtol=0, atol=1e-4)


def test_deterministic_generate_replays(model):
    rng = np.random.default_rng(3)
    V, C = model.config.text_config.vocab_size, model.config.canvas_length
    prompt = rng.integers(3, V, size=11)
    steps, K = 2, 2
    g = R.deterministic_generate(model, prompt, C, K, num_steps=steps)
    assert g["sequences"].shape == (11 + K * C,)
    # replay with explicit passes: canvas_{s+1} = argmax(raw_s), sc_{s+1} = raw_s / T_s
    _, cache = R.encoder_logits(model, prompt)
    seq = [prompt]
    for k in range(K):
        canvas, sc = g["start_canvases"][0, k], None
        for s, cur in enumerate(range(steps, 0, -1)):
            raw = R.denoiser_logits(model, cache, canvas, sc_logits=sc)
            temp = 1e-6 + (2e-6 - 1e-6) * (cur / steps)
            canvas = raw.argmax(-1)
            np.testing.assert_array_equal(canvas, g["argmax_canvases"][0, k, s])
            sc = (torch.from_numpy(raw) / temp).numpy()
        seq.append(canvas)
        _, cache = R.encoder_append(model, cache, canvas)
    np.testing.assert_array_equal(np.concatenate(seq), g["sequences"])
