"""The encoder (prefill) pass with images: parity with transformers, the mask, the inputs' checks.

Parity (tests/golden/image_prefill_case.py): a batch of a row with two images (a short one that
ends up before the sliding window, one longer than the window), a text-only row and a row with two
short images, the image features given (drawn, not the vision tower's); then the denoiser on the
cache with and without self-conditioning, a committed canvas, a second turn carrying an image and
the denoiser after it. Each preset runs twice with the same comparisons and tolerances:
* "golden" (default tier, no torch): the reference's outputs from tests/golden/image_prefill_<preset>.npz
  (made by `python -m tests.golden.make_golden`; the inputs' hash is checked first);
* "live" (marker `ref`, skipped without torch/transformers): the reference run now.
"""

import numpy as np
import pytest

import jax.numpy as jnp

from dgemma_jax import ModelConfig, denoise, init_cache, init_params, load_hf, prefill
from dgemma_jax.model import masks
from tests.golden import image_prefill_case as case
from tests.golden import store
from tests.helpers import parity

SOURCES = parity.sources(case.PRESETS)
_compare = parity.compare_logits


@pytest.fixture(scope="module", params=SOURCES)
def models(request, tmp_path_factory):
    name, source = request.param
    path = tmp_path_factory.mktemp(name)
    if source == "golden":
        arrays, meta = store.load(case.golden_name(name))
        case.rebuild_checkpoint(arrays, path)
        inp = case.inputs(path)
        store.check_inputs(meta, *case.hash_items(path, inp))
        reference = {k: v for k, v in arrays.items() if k.startswith(("enc_", "turn_")) or k in case.OUTPUT_KEYS}
    else:
        pytest.importorskip("transformers")
        pytest.importorskip("torch")
        from tests.reference import hf_reference as ref

        ref.numpy_checkpoint(name, case.SEED, path)
        inp = case.inputs(path)
        reference = case.hf_outputs(ref.load_reference(path), inp)
    cfg, params = load_hf(path, dtype="float32")
    return f"{name}/{source}", cfg, params, inp, reference


def _batch(rows, marks):
    b, t = len(rows), max(len(r) for r in rows)
    tokens, image = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
    for i, (r, m) in enumerate(zip(rows, marks)):
        tokens[i, : len(r)], image[i, : len(r)] = r, m
    return tokens, image, np.array([len(r) for r in rows], np.int32)


def test_image_prefill_parity(models):
    """Encoder logits with images (right-padded batch vs each row alone in the reference), the
    denoiser reading that cache, a commit, a second turn with an image, the denoiser after it."""
    name, cfg, params, inp, hf = models
    tokens, image, lengths = _batch(inp["prompts"], inp["image_marks"])
    b, t = tokens.shape
    c = cfg.canvas_length
    turn, turn_image, _ = _batch(inp["turn"], inp["turn_marks"])
    cache = init_cache(cfg, b, t + c + turn.shape[1] + c)
    enc, cache = prefill(params, cfg, tokens, lengths, cache, image_features=inp["features"], image_tokens=image)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    den0 = denoise(params, cfg, inp["canvas"], cache)
    den1 = denoise(params, cfg, inp["canvas"], cache, self_conditioning=jnp.asarray(inp["sc_logits"]))
    _, cache = prefill(params, cfg, np.asarray(hf["committed"], np.int32), None, cache, logits="none")
    enc2, cache = prefill(params, cfg, turn, None, cache, image_features=inp["turn_features"],
                          image_tokens=turn_image)
    den2 = denoise(params, cfg, inp["canvas2"], cache, self_conditioning=jnp.asarray(hf["den0"], jnp.float32))

    worst = {}
    for i, p in enumerate(inp["prompts"]):
        worst[f"enc/row{i}"] = _compare(f"{name}/encoder/row{i}", enc[i, : len(p)], hf[f"enc_{i}"])
        worst[f"den0/row{i}"] = _compare(f"{name}/denoise/row{i}", den0[i], hf["den0"][i])
        worst[f"den1/row{i}"] = _compare(f"{name}/denoise_sc/row{i}", den1[i], hf["den1"][i])
        worst[f"turn/row{i}"] = _compare(f"{name}/turn2_encoder/row{i}", enc2[i], hf[f"turn_{i}"])
        worst[f"den2/row{i}"] = _compare(f"{name}/turn2_denoise/row{i}", den2[i], hf["den2"][i])
    print(f"{name}: max |dlogit| encoder {max(v for k, v in worst.items() if k[:3] in ('enc', 'tur')):.2e}, "
          f"denoiser {max(v for k, v in worst.items() if k.startswith('den')):.2e}")


def test_images_change_the_pass(models):
    """The case is sensitive: the same tokens without the image inputs (placeholder embeddings,
    plain causal mask) are far from the reference on the image rows and identical on the text row."""
    name, cfg, params, inp, hf = models
    tokens, _, lengths = _batch(inp["prompts"], inp["image_marks"])
    enc, _ = prefill(params, cfg, tokens, lengths, init_cache(cfg, *tokens.shape))
    for i, p in enumerate(inp["prompts"]):
        d = float(np.abs(np.asarray(enc[i, : len(p)]) - hf[f"enc_{i}"]).max())
        if inp["image_marks"][i].any():
            assert d > 0.1, f"{name} row {i}: the images made no difference ({d:.2e})"
        else:
            assert d <= parity.TOL


# ------------------------------------------------------------------ the mask, without a model
def test_image_spans_and_mask():
    img = np.array([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0],
                    [1, 1, 0, 0, 0, 0, 0, 0, 1, 1],
                    [0] * 10], bool)
    starts = jnp.array([0, 5, 3], jnp.int32)
    lo, hi = masks.image_spans(jnp.asarray(img), starts)
    want_lo = np.where(img, [[0, 1, 1, 0, 0, 5, 5, 5, 0, 0], [5, 5, 0, 0, 0, 0, 0, 0, 13, 13], [0] * 10], 0)
    want_hi = np.where(img, [[0, 3, 3, 0, 0, 8, 8, 8, 0, 0], [7, 7, 0, 0, 0, 0, 0, 0, 15, 15], [0] * 10], 0)
    np.testing.assert_array_equal(np.asarray(lo), want_lo)
    np.testing.assert_array_equal(np.asarray(hi), want_hi)

    # window 2, an image of 4 tokens at positions 1..4, valid end 7 of 8 slots
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    marks = jnp.asarray(np.array([[0, 1, 1, 1, 1, 0, 0, 0]], bool))
    span = masks.image_spans(marks, jnp.zeros((1,), jnp.int32))
    m = np.asarray(masks.causal_mask(pos, pos, jnp.array([7]), 2, span))[0].astype(int)
    want = np.array([[1, 0, 0, 0, 0, 0, 0, 0],
                     [1, 1, 1, 1, 1, 0, 0, 0],   # image tokens: the whole image, plus the causal window
                     [0, 1, 1, 1, 1, 0, 0, 0],
                     [0, 1, 1, 1, 1, 0, 0, 0],
                     [0, 1, 1, 1, 1, 0, 0, 0],
                     [0, 0, 0, 0, 1, 1, 0, 0],   # text after the image: causal and windowed only
                     [0, 0, 0, 0, 0, 1, 1, 0],
                     [0, 0, 0, 0, 0, 0, 0, 0]])  # nothing at or past the valid end is visible
    want[7] = 0
    np.testing.assert_array_equal(m[:7], want[:7])
    assert not m[:, 7].any()
    text_only = np.asarray(masks.causal_mask(pos, pos, jnp.array([7]), 2))
    no_images = masks.image_spans(jnp.zeros((1, 8), bool), jnp.zeros((1,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(masks.causal_mask(pos, pos, jnp.array([7]), 2, no_images)), text_only)


# ------------------------------------------------------------------ the text path, the checks
@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny-2layer", dtype="float32", param_dtype="float32")
    return cfg, init_params(cfg, 0)


def test_text_only_path_unchanged(tiny):
    """Without images the pass is today's; with image inputs that mark no token it gives the same."""
    cfg, params = tiny
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (2, 12)).astype(np.int32)
    lengths = np.array([12, 7], np.int32)
    ref, ref_cache = prefill(params, cfg, tokens, lengths, init_cache(cfg, 2, 16))
    feats = rng.randn(4, cfg.hidden_size).astype(np.float32)
    got, cache = prefill(params, cfg, tokens, lengths, init_cache(cfg, 2, 16), image_features=feats,
                         image_tokens=np.zeros((2, 12), bool))
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=0, atol=1e-6)
    for k, k_ref in zip(cache.keys, ref_cache.keys):
        np.testing.assert_allclose(np.asarray(k), np.asarray(k_ref), rtol=0, atol=1e-6)


def test_features_replace_placeholders_unscaled(tiny):
    """An image token's embedding is its feature row itself (no sqrt(D)): the pass equals one whose
    embedding table row (of the placeholder id) holds that feature / sqrt(D), except for that row's
    own logit (the head is tied)."""
    cfg, params = tiny
    feats = np.random.RandomState(1).randn(3, cfg.hidden_size).astype(np.float32)
    marks = np.array([[False, True]])
    got, _ = prefill(params, cfg, np.array([[5, 0]], np.int32), None, init_cache(cfg, 1, 2),
                     image_features=feats, image_tokens=marks)
    e = np.array(params["embedding"])
    e[0] = feats[0] / np.float32(cfg.embed_scale)
    want, _ = prefill(dict(params, embedding=jnp.asarray(e)), cfg, np.array([[5, 0]], np.int32), None,
                      init_cache(cfg, 1, 2))
    np.testing.assert_allclose(np.asarray(got)[..., 1:], np.asarray(want)[..., 1:], rtol=0, atol=1e-4)
    placeholder, _ = prefill(params, cfg, np.array([[5, 0]], np.int32))
    assert np.abs(np.asarray(got)[0, 1, 1:] - np.asarray(placeholder)[0, 1, 1:]).max() > 1e-2


def test_bfloat16_activations_take_float32_features():
    cfg = ModelConfig.preset("tiny-2layer", dtype="bfloat16", param_dtype="bfloat16")
    params = init_params(cfg, 0)
    marks = np.zeros((1, 6), bool)
    marks[0, 1:4] = True
    out, cache = prefill(params, cfg, np.arange(6, dtype=np.int32)[None], None, init_cache(cfg, 1, 6),
                         image_features=np.ones((3, cfg.hidden_size), np.float32), image_tokens=marks)
    assert out.dtype == jnp.float32 and bool(jnp.isfinite(out).all())
    assert cache.keys[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("change, message", [
    (dict(image_features=None), "go together"),
    (dict(image_tokens=None), "go together"),
    (dict(image_features=np.zeros((4,), np.float32)), "num_soft_tokens, hidden_size"),
    (dict(image_features=np.zeros((4, 3), np.float32)), "num_soft_tokens, hidden_size"),
    (dict(image_features=np.zeros((0, 64), np.float32)), "no rows"),
    (dict(image_features=np.zeros((4, 64), np.int32)), "floating point"),
    (dict(image_tokens=np.zeros((2, 5), bool)), "shape of tokens"),
    (dict(image_tokens=np.zeros((2, 6), np.int32)), "bool mask"),
    (dict(image_tokens=np.eye(2, 6, 4, dtype=bool)), "marks padding"),
    (dict(image_tokens=np.ones((2, 6), bool), lengths=None), "only 4 rows"),
])
def test_bad_image_inputs(tiny, change, message):
    cfg, params = tiny
    assert cfg.hidden_size == 64
    kw = dict(image_features=np.zeros((4, 64), np.float32), image_tokens=np.zeros((2, 6), bool),
              lengths=np.array([6, 4], np.int32))
    kw.update(change)
    lengths = kw.pop("lengths")
    with pytest.raises(ValueError, match=message):
        prefill(params, cfg, np.zeros((2, 6), np.int32), lengths, init_cache(cfg, 2, 8), **kw)
