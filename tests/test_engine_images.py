"""Images through the engine, the pipeline, the chat session and the command line, and the errors.

A tiny text model (tiny-2layer widened to the tokenizer's 373 tokens) with a small random vision tower
(patch 4, pooling 2) and the Gemma-style byte tokenizer of tests/helpers/gemma_tokenizer.py holding
the image markers (<|image|> 110, <|image> 113, <image|> 114), saved as a Hugging Face directory. The
images are small Pillow-made PNGs; the per-image budget is 70 soft tokens.
"""

import copy

import numpy as np
import pytest

from dgemma_jax import ModelConfig, save_hf
from dgemma_jax.config import VisionConfig
from dgemma_jax.io.images import prompt_with_images
from dgemma_jax.io.prompts import common_prefix
from dgemma_jax.model.cache import rewind_ok
from tests.reference.random_params import random_params
from tests.test_cli import _one_line_error, dgemma
from tests.test_images import IMAGE_MARKERS

SOFT = 70
GEN = {"max_denoising_steps": 4, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
       "confidence_threshold": 0.005, "sampler_config": {"entropy_bound": 0.1}, "eos_token_id": [1, 106],
       "pad_token_id": 0}


def _png(path, size, seed, mode="RGB"):
    from PIL import Image

    rng = np.random.RandomState(seed)
    w, h = size
    a = rng.randint(0, 256, (h, w, 3)).astype(np.uint8)
    a[: h // 2] //= 3
    img = Image.fromarray(a, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    img.save(path)
    return str(path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

    vision = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                          head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=64,
                          standardize=True)
    cfg = ModelConfig.preset("tiny-2layer", vocab_size=373, vision=vision, image_token_id=110, boi_token_id=113,
                             eoi_token_id=114, eos_ids=(1, 106))
    path = tmp_path_factory.mktemp("vision_ckpt")
    save_hf(random_params(cfg, 0), cfg, path, generation_config=GEN)
    gemma_like_tokenizer_json(path / "tokenizer.json", markers=IMAGE_MARKERS)
    images = path / "images"
    images.mkdir()
    pngs = [_png(images / f"{i}.png", size, i) for i, size in enumerate([(40, 24), (16, 48), (30, 30)])]
    return path, pngs


@pytest.fixture(scope="module")
def model(ckpt):
    from dgemma_jax.pipeline import DiffusionGemma

    return DiffusionGemma.from_pretrained(str(ckpt[0]))


def _prompt(model, text, images):
    return prompt_with_images(model.config, model.tokenizer, text, images, SOFT)


def test_generate_with_images_is_deterministic_and_the_drivers_agree(model, ckpt):
    from dgemma_jax.engine.drivers import CanvasEvent, collect

    engine, c = model.engine, model.sampler.canvas_length
    tokens, lengths, batch = _prompt(model, "a <|image|> b <|image|> c", ckpt[1][:2])
    assert len(batch) == 2 and (tokens == model.config.image_token_id).sum() == sum(batch.soft_tokens)
    kw = dict(rng=5, max_new_tokens=2 * c, images=batch)
    a = np.asarray(engine.generate(tokens, lengths, **kw).tokens)
    b = np.asarray(engine.generate(tokens, lengths, **kw).tokens)
    np.testing.assert_array_equal(a, b)
    streamed, _, _ = collect(list(engine.stream(tokens, lengths, **kw)), 1, 2 * c, c, model.sampler.pad_id)
    np.testing.assert_array_equal(np.asarray(streamed), a)
    events = [e for e in engine.steps(tokens, lengths, **kw) if isinstance(e, CanvasEvent)]
    stepped, _, _ = collect(events, 1, 2 * c, c, model.sampler.pad_id)
    np.testing.assert_array_equal(np.asarray(stepped), a)
    # the pipeline call is the same program with the same inputs
    text = model.generate("a <|image|> b <|image|> c", images=ckpt[1][:2], seed=5, max_new_tokens=2 * c,
                          max_soft_tokens=SOFT)
    assert text == model.tokenizer.decode(a[0], skip_special=True)


def test_an_image_changes_the_output(model, ckpt):
    from PIL import Image

    engine, c = model.engine, model.sampler.canvas_length
    pixels = np.asarray(Image.open(ckpt[1][0]).convert("RGB"))
    outs = []
    for img in pixels, 255 - pixels:  # the same size, so the same prompt tokens
        tokens, lengths, batch = _prompt(model, "x <|image|> y", [img])
        outs.append((tokens, np.asarray(engine.generate(tokens, lengths, rng=1, max_new_tokens=2 * c,
                                                        images=batch).tokens)))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    assert not np.array_equal(outs[0][1], outs[1][1])


def test_the_cache_after_generate_is_a_fresh_prefill_of_prompt_and_images(model, ckpt):
    """generate's cache holds the prompt (images included) and the committed canvases as a fresh prefill of
    those tokens with the same images would: the denoiser reads both the same."""
    from dgemma_jax import denoise, init_cache, prefill
    from dgemma_jax.model.api import image_features_pass

    cfg, params, c = model.config, model.params, model.sampler.canvas_length
    tokens, lengths, batch = _prompt(model, "q <|image|> r", [ckpt[1][1]])
    out = model.engine.generate(tokens, lengths, rng=2, max_new_tokens=3 * c, cache_length=tokens.shape[1] + 3 * c,
                                images=batch)
    committed = int(np.asarray(out.cache.lengths)[0])
    p = tokens.shape[1]
    assert committed > p
    ids = np.concatenate([tokens[0], np.asarray(out.tokens)[0, : committed - p]])[None].astype(np.int32)
    feats, _ = image_features_pass(params, cfg, batch.pixel_values, batch.position_ids)
    _, fresh = prefill(params, cfg, ids, None, init_cache(cfg, 1, out.cache.max_length), image_features=feats,
                       image_tokens=ids == cfg.image_token_id)
    canvas = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, c)).astype(np.int32)
    np.testing.assert_allclose(np.asarray(denoise(params, cfg, canvas, out.cache)),
                               np.asarray(denoise(params, cfg, canvas, fresh)), atol=2e-4, rtol=0)


def _session(model, **kw):
    from dgemma_jax.chat_session import ChatSession

    return ChatSession(model.engine, model.tokenizer, context=kw.pop("context", 512), max_new_tokens=32, seed=3,
                       max_soft_tokens=SOFT, **kw)


def test_chat_session_reuses_the_first_image_and_matches_a_fresh_session(model, ckpt):
    session = _session(model, system="be brief")
    first = session.send("what is this", images=[ckpt[1][0]])
    held = list(session.cached_ids)
    second = session.send("and this one", images=[ckpt[1][2]])
    image = model.config.image_token_id
    first_image_end = max(i for i, t in enumerate(second.prompt_ids[: len(first.prompt_ids)]) if t == image)
    # the sliding layers' ring caches hold the window before the shared prefix's end only within
    # canvas_length + 1 tokens of the row's end (model/cache.py); further back the turn prefills again
    shared = min(common_prefix(held, second.prompt_ids), len(second.prompt_ids) - 1)
    if rewind_ok(model.config, first.cache_length, len(held), shared):
        assert second.reused > first_image_end  # the first image stays in the reused cache prefix
    else:
        assert second.reused == 0
    assert second.reused + second.prefilled == len(second.prompt_ids)
    fresh = _session(model, system="be brief")
    fresh.messages = copy.deepcopy(session.messages[:-2])  # the history up to the second question
    fresh.turns = 1  # the same seed as the second turn
    again = fresh.send("and this one", images=[ckpt[1][2]])
    assert again.reused == 0 and again.prompt_ids == second.prompt_ids
    np.testing.assert_array_equal(again.tokens, second.tokens)
    assert again.answer == second.answer


# ------------------------------------------------------------------ bad input: one clear error, nothing kept
def _state(session):
    return copy.deepcopy(session.messages), session.cache, list(session.cached_ids), session.turns


def test_a_refused_chat_turn_leaves_the_history_and_cache_alone(model, ckpt, tmp_path):
    session = _session(model, context=160)
    session.send("hi", images=[ckpt[1][1]])
    before = _state(session)
    bad = tmp_path / "notes.txt"
    bad.write_text("not an image")
    big = _png(tmp_path / "big.png", (64, 64), 9)
    for images, message in [([str(bad)], "notes.txt"), ([str(tmp_path / "missing.png")], "missing.png"),
                            ([big, big], r"KV cache holds 160 tokens")]:
        with pytest.raises(ValueError, match=message):
            session.send("more", images=images)
        after = _state(session)
        assert after[0] == before[0] and after[1] is before[1] and after[2:] == before[2:]


def test_engine_refuses_mismatched_images(model, ckpt):
    import dataclasses

    engine = model.engine
    tokens, lengths, batch = _prompt(model, "a <|image|> b <|image|> c", ckpt[1][:2])
    with pytest.raises(ValueError, match="image tokens but no images"):
        engine.generate(tokens, lengths, max_new_tokens=16)
    with pytest.raises(ValueError, match=r"2 run\(s\) of image tokens .* 1 image\(s\)"):
        engine.generate(tokens, lengths, max_new_tokens=16, images=batch.select([0]))
    swapped = dataclasses.replace(batch, soft_tokens=tuple(reversed(batch.soft_tokens)))
    if swapped.soft_tokens != batch.soft_tokens:
        with pytest.raises(ValueError, match="soft tokens"):
            engine.generate(tokens, lengths, max_new_tokens=16, images=swapped)
    with pytest.raises(ValueError, match=r"2 image placeholder\(s\) .* but 1 image\(s\)"):
        _prompt(model, "a <|image|> b <|image|> c", ckpt[1][:1])
    with pytest.raises(ValueError, match="beyond the model's max_position_embeddings|KV cache holds"):
        engine.generate(tokens, lengths, max_new_tokens=16, cache_length=tokens.shape[1] - 5, images=batch)


def test_zero_size_and_text_only_checkpoint(model):
    from dgemma_jax.pipeline import DiffusionGemma

    with pytest.raises(ValueError, match="empty|no pixels|zero"):
        _prompt(model, "x", [np.zeros((0, 4, 3), np.uint8)])
    bundled = DiffusionGemma.from_pretrained()
    with pytest.raises(ValueError, match="text-only checkpoint"):
        bundled.generate("12+3=", images=[np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(ValueError, match="text-only checkpoint"):
        bundled.engine.generate(np.array([[3, 4]], np.int32), None, max_new_tokens=16, images=object())


# ------------------------------------------------------------------ the command line
def test_cli_generate_with_an_image_equals_the_library(model, ckpt):
    path, pngs = ckpt
    c = model.sampler.canvas_length
    r = dgemma("generate", "--checkpoint", str(path), "--prompt", "look <|image|> here", "--image", pngs[0],
               "--max-soft-tokens", str(SOFT), "--seed", "4", "--max-new-tokens", str(2 * c), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    want = model.generate("look <|image|> here", images=[pngs[0]], seed=4, max_new_tokens=2 * c, max_soft_tokens=SOFT)
    assert r.stdout.rstrip("\n") == want


def test_cli_chat_with_image_lines_equals_the_library(model, ckpt):
    path, pngs = ckpt
    r = dgemma("chat", "--checkpoint", str(path), "--max-new-tokens", "32", "--context", "512", "--seed", "3",
               "--max-soft-tokens", str(SOFT), "--quiet",
               stdin=f"/image {path}/missing.png\n/image {pngs[0]}\nwhat is this\n/image {pngs[2]}\nand this one\n")
    assert r.returncode == 0, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("dgemma: error:")]
    assert len(errors) == 1 and "missing.png" in errors[0] and "Traceback" not in r.stderr  # refused, chat goes on
    session = _session(model)
    want = [session.send("what is this", images=[pngs[0]]).answer,
            session.send("and this one", images=[pngs[2]]).answer]
    assert r.stdout == "".join(f"{a}\n" for a in want)  # (random answers: control characters, no splitlines)


def test_cli_refuses_bad_images_with_one_line(ckpt, tmp_path):
    from PIL import Image

    path, pngs = ckpt
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    deep = tmp_path / "deep.png"
    Image.fromarray(np.full((8, 8), 40000, np.uint16)).save(deep)
    anim = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (8, 8), (i * 60, 0, 0)) for i in range(3)]
    frames[0].save(anim, save_all=True, append_images=frames[1:])
    cmyk = _png(tmp_path / "cmyk.jpg", (24, 24), 3, mode="CMYK")
    base = ["generate", "--checkpoint", str(path), "--prompt", "x", "--max-new-tokens", "16", "--quiet",
            "--max-soft-tokens", str(SOFT)]
    for bad, words in [(text, "notes.txt"), (tmp_path / "missing.png", "missing.png"), (deep, "16-bit|bit"),
                       (anim, "frames|animated")]:
        line = _one_line_error(dgemma(*base, "--image", str(bad)))
        assert "--image" in line, line
        import re

        assert re.search(words, line), line
    r = dgemma(*base, "--image", cmyk)
    assert r.returncode == 0, r.stderr[-2000:]
    # the bundled text model, named: (without --checkpoint a picture goes to the bundled image model)
    line = _one_line_error(dgemma("generate", "--checkpoint", "bundled", "--prompt", "1+2=", "--image", pngs[0]))
    assert "text-only checkpoint" in line
