"""Images end to end: pixels -> vision tower -> encoder -> denoiser, parity with transformers.

The case (tests/golden/vision_e2e_case.py): the tiny-2layer / tiny-6layer text models with the tiny,
standardized vision tower, every weight, norm and scale drawn; Pillow-made images of different sizes
and aspect ratios preprocessed by our processor; a batch of a row with three images, a text-only row
and a row with one image (every image longer than the sliding window); the denoiser on that cache with
and without self-conditioning, a commit, a second turn with an image per row and the denoiser after it.
The reference computes its own features from the pixel values (its vision tower) and runs its encoder
on the generate() mask path, each row alone; ours loads the same checkpoint with `load_hf` and runs
  * `prefill(..., image_features=image_features_pass(...), image_tokens=...)` (logits compared), and
  * the engine's path, `sampling.generate.prefill(..., images=(pixel_values, position_ids))`
    after `engine.inputs.check_images` (the cache it leaves is compared through the denoiser's logits).
Two sources, the same comparisons: "golden" (default tier, no torch) reads
tests/golden/vision_e2e_<preset>.npz; "live" (marker `ref`) runs transformers now.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dgemma_jax import denoise, init_cache, load_hf, prefill
from dgemma_jax.engine.inputs import check_images
from dgemma_jax.io.images import ImageBatch, settings_for
from dgemma_jax.model.api import image_features_pass
from dgemma_jax.sampling import generate as gen
from tests.golden import store
from tests.golden import vision_e2e_case as case
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

        case.make_checkpoint(name, path)
        inp = case.inputs(path)
        reference = case.hf_outputs(ref.load_reference(path), inp)
    cfg, params = load_hf(path, dtype="float32")
    assert cfg.vision is not None and cfg.vision.standardize
    return f"{name}/{source}", cfg, params, inp, reference


def _batch(rows, marks):
    b, t = len(rows), max(len(r) for r in rows)
    tokens, image = np.zeros((b, t), np.int32), np.zeros((b, t), bool)
    for i, (r, m) in enumerate(zip(rows, marks)):
        tokens[i, : len(r)], image[i, : len(r)] = r, m
    return tokens, image, np.array([len(r) for r in rows], np.int32)


def _features(params, cfg, pixels, positions):
    feats, n = jax.jit(image_features_pass, static_argnums=1)(params, cfg, pixels, positions)
    return feats, int(n)


def test_vision_e2e_parity(models):
    """Encoder logits of the image prompts (features from our tower), the denoiser on that cache with and
    without self-conditioning, a commit, a second turn with images, the denoiser after it."""
    name, cfg, params, inp, hf = models
    tokens, image, lengths = _batch(inp["prompts"], inp["image_marks"])
    b, t = tokens.shape
    c = cfg.canvas_length
    turn, turn_image, _ = _batch(inp["turn"], inp["turn_marks"])
    feats, n = _features(params, cfg, inp["pixel_values"], inp["position_ids"])
    assert n == int(inp["soft_tokens"].sum()) == int(image.sum())
    cache = init_cache(cfg, b, t + c + turn.shape[1] + c)
    enc, cache = prefill(params, cfg, tokens, lengths, cache, image_features=feats, image_tokens=image)
    den0 = denoise(params, cfg, inp["canvas"], cache)
    den1 = denoise(params, cfg, inp["canvas"], cache, self_conditioning=jnp.asarray(inp["sc_logits"]))
    _, cache = prefill(params, cfg, np.asarray(hf["committed"], np.int32), None, cache, logits="none")
    tfeats, _ = _features(params, cfg, inp["turn_pixel_values"], inp["turn_position_ids"])
    enc2, cache = prefill(params, cfg, turn, None, cache, image_features=tfeats, image_tokens=turn_image)
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


def test_vision_e2e_engine_prefill(models):
    """The engine's prefill (host check of ImageBatch inputs, then `sampling.generate.prefill` running the tower inside
    the program) leaves a cache the denoiser reads as the reference's; the second turn too."""
    name, cfg, params, inp, hf = models
    tokens, _, lengths = _batch(inp["prompts"], inp["image_marks"])
    b, t = tokens.shape
    c = cfg.canvas_length
    turn, _, _ = _batch(inp["turn"], inp["turn_marks"])
    images = ImageBatch(pixel_values=inp["pixel_values"], position_ids=inp["position_ids"],
                        soft_tokens=tuple(inp["soft_tokens"]), settings=settings_for(cfg, case.MAX_SOFT_TOKENS))
    checked = check_images(cfg, tokens, lengths, images)
    run = jax.jit(gen.prefill, static_argnums=1)
    cache = run(params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), init_cache(cfg, b, t + c + turn.shape[1] + c),
                None, checked)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for i in range(b):
        _compare(f"{name}/engine_denoise/row{i}", denoise(params, cfg, inp["canvas"], cache)[i], hf["den0"][i])
    cache = run(params, cfg, jnp.asarray(hf["committed"], jnp.int32), jnp.full((b,), c, jnp.int32), cache)
    turn_images = ImageBatch(pixel_values=inp["turn_pixel_values"], position_ids=inp["turn_position_ids"],
                             soft_tokens=tuple(inp["turn_soft_tokens"]),
                             settings=settings_for(cfg, case.MAX_SOFT_TOKENS))
    tl = np.full((b,), turn.shape[1], np.int32)
    cache = run(params, cfg, jnp.asarray(turn), jnp.asarray(tl), cache, None, check_images(cfg, turn, tl, turn_images))
    den2 = denoise(params, cfg, inp["canvas2"], cache, self_conditioning=jnp.asarray(hf["den0"], jnp.float32))
    for i in range(b):
        _compare(f"{name}/engine_turn2_denoise/row{i}", den2[i], hf["den2"][i])


def test_vision_e2e_images_matter(models):
    """The case is sensitive: zero pixels instead of the images move the image rows' logits far from the
    reference and leave the text row's unchanged."""
    name, cfg, params, inp, hf = models
    tokens, image, lengths = _batch(inp["prompts"], inp["image_marks"])
    feats, _ = _features(params, cfg, np.zeros_like(inp["pixel_values"]), inp["position_ids"])
    enc, _ = prefill(params, cfg, tokens, lengths, init_cache(cfg, *tokens.shape), image_features=feats,
                     image_tokens=image)
    for i, p in enumerate(inp["prompts"]):
        d = float(np.abs(np.asarray(enc[i, : len(p)]) - hf[f"enc_{i}"]).max())
        if inp["image_marks"][i].any():
            assert d > 0.1, f"{name} row {i}: the pixels made no difference ({d:.2e})"
        else:
            assert d <= parity.TOL
