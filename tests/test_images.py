"""Image preprocessing, the image prompt layout and image chat turns against transformers' Gemma 4.

The reference: transformers 5.23's `Gemma4ImageProcessorPil` (the processor that runs without torchvision),
`Gemma4Processor`'s placeholder expansion and `mm_token_type_ids`, and `apply_chat_template` with the
project's Gemma 4 test template (tests/test_chat_template.py; the checkpoints' own template is not
shipped with transformers). Its values come from tests/golden/images.npz by default (inputs hashed and
checked) and, under the `ref` marker, from transformers run now; every comparison runs against both.
`python -m tests.golden.make_golden images` rewrites the file from the live run.

Pixel tolerance: live, 0 (both sides resize with the same Pillow bicubic and rescale with the same float64
multiply, so the arrays are bit-equal; measured: max |difference| 0.0 on every case). From the golden
file the budget-70 cases are compared through the reference's pixels stored as uint8 (lossless: checked
when recording) with a tolerance of one uint8 step, 1/255, so that a different Pillow version's bicubic
rounding does not fail the default tier; the other budgets are compared through a hash of the reference's
float32 bytes (bit-equal). Positions and soft-token counts must be exactly equal everywhere.
"""

import io
import json
import struct
import zlib

import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from dgemma_jax.io.chat import chat_images, render_chat  # noqa: E402
from dgemma_jax.io.images import (  # noqa: E402
    BOI_TOKEN, BOI_TOKEN_ID, EOI_TOKEN, EOI_TOKEN_ID, IMAGE_TOKEN, IMAGE_TOKEN_ID, SOFT_TOKEN_BUDGETS, ImageSettings,
    ImageTokenIds, encode_with_images, expand_image_ids, expand_image_text, load_image, mm_token_type_ids,
    preprocess_images, resized_size, soft_token_count)

U8_BUDGET = 70          # the budget whose reference pixels are stored (as a uint8 PNG) in the golden file
NO_U8 = ("tiny_noise", "rgba_array")  # stored as a hash only: noise does not compress; rgba gives the same pixels
PIXEL_ATOL_GOLDEN = 1 / 255 + 1e-7
RESULTS = {}


# ---------------------------------------------------------------------------------------------
# Test images (deterministic; made with numpy and Pillow's built-in bitmap font)


def _smooth(rng, h, w, cells=8):
    """Photo-like: a bicubic-upsampled coarse random field plus fine grain."""
    coarse = Image.fromarray(rng.integers(0, 256, (cells, cells * w // h + 1, 3), dtype=np.uint8))
    base = np.asarray(coarse.resize((w, h), Image.Resampling.BICUBIC), np.int16)
    return np.clip(base + rng.integers(-3, 4, (h, w, 3)), 0, 255).astype(np.uint8)


def _text_image():
    img = Image.new("RGB", (700, 210), (250, 248, 240))
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default_imagefont()  # Pillow's bitmap font: the same pixels on every install
    for i, line in enumerate(["DiffusionGemma reads images.", "The quick brown fox jumps over the lazy dog",
                              "0123456789 !@#$%^&*() ABC xyz", "Gemma 4 image processor, patch 16, pooling 3"]):
        draw.text((12, 12 + 48 * i), line, fill=(20 + 40 * i, 10, 60), font=font)
    draw.rectangle((600, 150, 690, 200), outline=(200, 0, 0), width=3)
    return img


def _gradient(h, w):
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([255 * x / (w - 1), 255 * y / (h - 1), 255 * (x + y) / (h + w - 2)], -1).round().astype(np.uint8)


def _stripes(h, w):
    x = np.arange(w)
    row = np.stack([(x * 7) % 256, 255 * ((x // 13) % 2), (x * x) % 251], -1).astype(np.uint8)
    return np.repeat(row[None], h, 0)


def _png_bytes(img, **kw):
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _rgba():
    rng = np.random.default_rng(4)
    rgb = _smooth(rng, 150, 200)
    y, x = np.mgrid[0:150, 0:200]
    alpha = np.clip(255 * (x / 199) * (1 - y / 300), 0, 255).astype(np.uint8)
    alpha[40:60, 50:150] = 0
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


def _palette_gif():
    img = Image.fromarray(_stripes(60, 90)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    buf = io.BytesIO()
    img.save(buf, format="GIF", transparency=3)
    return buf.getvalue()


def _exif_rotated_png():
    img = Image.fromarray(_gradient(90, 160))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    return _png_bytes(img, exif=exif)


def _cases():
    rng = np.random.default_rng(0)
    return {
        # name: (kind, data); kind "pil", "array" or "file" (the encoded bytes, read from a path)
        "photo": ("pil", Image.fromarray(_smooth(rng, 480, 640))),
        "text": ("pil", _text_image()),
        "gradient": ("array", _gradient(256, 256)),
        "tall": ("array", _smooth(rng, 900, 120, cells=4)),
        "wide": ("pil", Image.fromarray(_stripes(90, 1600))),
        "tiny_noise": ("array", rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)),
        "large": ("pil", Image.fromarray(_smooth(rng, 1536, 2048, cells=6))),
        "rgba": ("pil", _rgba()),
        "rgba_array": ("array", np.asarray(_rgba())),
        "rgba_file": ("file", _png_bytes(_rgba())),
        "gray": ("pil", Image.fromarray(_smooth(rng, 120, 160)[..., 0], "L")),
        "palette_gif_file": ("file", _palette_gif()),
        "exif_rotated_file": ("file", _exif_rotated_png()),
    }


CASES = _cases()
BUDGETS = {name: (70, 280) for name in CASES}
BUDGETS.update(photo=(70, 140, 280, 1120), tiny_noise=(70, 140, 280), gradient=(70, 280, 560))


def _input_items(kind, data):
    if kind == "pil":
        return [kind, data.mode, np.asarray(data), json.dumps(repr(data.info.get("transparency")))]
    if kind == "array":
        return [kind, data]
    return [kind, np.frombuffer(data, np.uint8)]


# ---------------------------------------------------------------------------------------------
# The reference, live or from the golden file


@pytest.fixture(scope="module", params=["golden", pytest.param("live", marks=pytest.mark.ref)])
def hf(request):
    from tests.golden.reference_source import GoldenReference, LiveReference, record_path

    if request.param == "golden":
        yield GoldenReference("images")
        return
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    live = LiveReference(record_path())
    yield live
    live.flush()


def _hf_processor():
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    return Gemma4ImageProcessorPil()


def _hf_image(kind, data, tmp_path):
    """What transformers' Gemma4Processor hands its image processor for this input."""
    if kind != "file":
        return data
    from transformers.image_utils import load_image as hf_load_image  # what fetch_images does with a path

    path = tmp_path / "image.bin"
    path.write_bytes(data)
    return hf_load_image(str(path))


def _reference_case(hf, name, budget, tmp_path):
    kind, data = CASES[name]

    def compute():
        out = _hf_processor()(_hf_image(kind, data, tmp_path), max_soft_tokens=budget)
        pv = np.asarray(out["pixel_values"])[0]
        n = int(out["num_soft_tokens_per_image"][0]) * 9
        rec = {"position_ids": np.asarray(out["image_position_ids"])[0].astype(np.int32),
               "soft_tokens": np.asarray(out["num_soft_tokens_per_image"], np.int64),
               "shape": np.asarray(pv.shape), "sha256": np.asarray(_sha(pv))}
        if budget == U8_BUDGET and name not in NO_U8:
            u8 = np.round(pv[:n].astype(np.float64) * 255).astype(np.uint8)
            assert np.array_equal(_from_u8(u8), pv[:n]) and not pv[n:].any(), "uint8 storage would not be lossless"
            image = _patches_to_image(u8, int(rec["position_ids"][:n, 0].max()) + 1)
            png = _png_bytes(Image.fromarray(image), optimize=True)
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), image)
            rec["pixels_png"] = np.frombuffer(png, np.uint8)
        return rec

    return hf.value(f"proc/{name}/{budget}", compute, *_input_items(kind, data), budget, "Gemma4ImageProcessorPil")


def _sha(a):
    import hashlib

    a = np.ascontiguousarray(a, np.float32)
    return hashlib.sha256(f"{a.shape}".encode() + a.tobytes()).hexdigest()


def _patches_to_image(patches, grid_w, p=16):
    """[n, p*p*3] row-major patches -> the [H, W, 3] image they were cut from."""
    gh = len(patches) // grid_w
    return patches.reshape(gh, grid_w, p, p, 3).transpose(0, 2, 1, 3, 4).reshape(gh * p, grid_w * p, 3)


def _reference_pixels(ref):
    """The reference's real patches, float32, from the stored PNG."""
    image = np.asarray(Image.open(io.BytesIO(ref["pixels_png"].tobytes())))
    gh, gw = image.shape[0] // 16, image.shape[1] // 16
    u8 = image.reshape(gh, 16, gw, 16, 3).transpose(0, 2, 1, 3, 4).reshape(gh * gw, 768)
    return _from_u8(u8)


def _from_u8(u8):
    return (u8.astype(np.float64) * (1 / 255)).astype(np.float32)


def _ours(kind, data, budget, tmp_path):
    if kind == "file":
        path = tmp_path / "ours.bin"
        path.write_bytes(data)
        by_path = preprocess_images(str(path), max_soft_tokens=budget)
        by_bytes = preprocess_images(data, max_soft_tokens=budget)
        assert np.array_equal(by_path.pixel_values, by_bytes.pixel_values)
        return by_path
    return preprocess_images(data, max_soft_tokens=budget)


PROC_CASES = [(name, b) for name in CASES for b in BUDGETS[name]]


@pytest.mark.parametrize("name,budget", PROC_CASES)
def test_processor_matches_transformers(hf, name, budget, tmp_path):
    kind, data = CASES[name]
    ref = _reference_case(hf, name, budget, tmp_path)
    ours = _ours(kind, data, budget, tmp_path)
    settings = ImageSettings(max_soft_tokens=budget)
    assert ours.pixel_values.shape == (1, settings.max_patches, 768) and ours.pixel_values.dtype == np.float32
    assert ours.position_ids.shape == (1, settings.max_patches, 2) and ours.position_ids.dtype == np.int32
    assert tuple(ref["shape"]) == ours.pixel_values.shape[1:]
    assert list(ours.soft_tokens) == [int(x) for x in ref["soft_tokens"]]
    assert np.array_equal(ours.position_ids[0], ref["position_ids"])
    n = ours.soft_tokens[0] * 9
    assert not ours.pixel_values[0, n:].any()
    if "pixels_png" in ref:
        diff = float(np.abs(ours.pixel_values[0, :n] - _reference_pixels(ref)).max())
        RESULTS[(hf.source, name, budget)] = diff
        print(f"{name}@{budget} ({hf.source}): max |pixel difference| {diff:.3g}")
        assert diff <= (PIXEL_ATOL_GOLDEN if hf.source == "golden" else 0.0)
    if hf.source == "live" or "pixels_png" not in ref:
        assert _sha(ours.pixel_values[0]) == str(ref["sha256"]), f"{name}@{budget}: pixel values are not bit-equal"
        RESULTS.setdefault((hf.source, name, budget), 0.0)
    # The soft-token count is what soft_token_count predicts from the size alone.
    h, w = load_image(data).shape[:2]
    assert soft_token_count(h, w, settings) == ours.soft_tokens[0]


@pytest.mark.parametrize("patch,kernel,budget", [(14, 2, 140), (8, 4, 70)])
def test_other_settings_match_transformers(hf, patch, kernel, budget):
    image = CASES["text"][1]

    def compute():
        out = _hf_processor()(image, patch_size=patch, pooling_kernel_size=kernel, max_soft_tokens=budget)
        return {"pixel_values": np.asarray(out["pixel_values"]), "position_ids": np.asarray(out["image_position_ids"]),
                "soft_tokens": np.asarray(out["num_soft_tokens_per_image"], np.int64)}

    ref = hf.value(f"settings/{patch}/{kernel}/{budget}", compute, *_input_items("pil", image), patch, kernel, budget)
    ours = preprocess_images(image, patch_size=patch, pooling_kernel_size=kernel, max_soft_tokens=budget)
    assert ours.pixel_values.shape == ref["pixel_values"].shape == (1, budget * kernel ** 2, patch * patch * 3)
    assert np.array_equal(ours.pixel_values, ref["pixel_values"])
    assert np.array_equal(ours.position_ids, ref["position_ids"])
    assert list(ours.soft_tokens) == ref["soft_tokens"].tolist()


def test_settings_from_the_checkpoint(hf, tmp_path):
    import os

    def compute():
        d = tmp_path / "saved"
        _hf_processor().save_pretrained(str(d))   # what a checkpoint's preprocessor_config.json holds
        return np.asarray((d / os.listdir(d)[0]).read_text())

    saved = str(hf.value("preprocessor_config_json", compute))
    (tmp_path / "preprocessor_config.json").write_text(saved)
    assert ImageSettings.from_dir(tmp_path) == ImageSettings() == ImageSettings(16, 3, 280)
    assert ImageSettings.from_dir(tmp_path / "preprocessor_config.json") == ImageSettings()
    cfg = json.loads(saved)
    (tmp_path / "processor_config.json").write_text(json.dumps(
        {"image_processor": dict(cfg, max_soft_tokens=560, patch_size=14), "image_seq_length": 560}))
    assert ImageSettings.from_dir(tmp_path) == ImageSettings(14, 3, 560)   # processor_config.json is read first
    assert ImageSettings.from_dir(tmp_path / "nothing_here") == ImageSettings()
    for bad, match in [(dict(resample=2), "resample=2"), (dict(do_normalize=True, image_mean=[0.5] * 3), "normal"),
                       (dict(max_soft_tokens=300), "soft-token budget"), (dict(do_resize=False), "do_resize")]:
        (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": dict(cfg, **bad)}))
        with pytest.raises(ValueError, match=match):
            ImageSettings.from_dir(tmp_path)


def test_several_images_in_one_batch(hf, tmp_path):
    names = ["photo", "text", "tall"]
    batch = preprocess_images([CASES[n][1] for n in names], max_soft_tokens=70)
    assert batch.pixel_values.shape == (3, 630, 768) and len(batch) == 3
    for i, n in enumerate(names):
        ref = _reference_case(hf, n, 70, tmp_path)
        assert batch.soft_tokens[i] == int(ref["soft_tokens"][0])
        assert np.array_equal(batch.position_ids[i], ref["position_ids"])
        assert np.array_equal(batch.pixel_values[i, :batch.soft_tokens[i] * 9], _reference_pixels(ref))


# ---------------------------------------------------------------------------------------------
# Prompt layout and image chat turns


IMAGE_MARKERS = {105: "<|turn>", 106: "<turn|>", 107: "<|think|>", 108: "<|channel>", 109: "<channel|>",
                 110: "<|image|>", 111: "<|audio|>", 112: "<|video|>", 113: "<|image>", 114: "<image|>",
                 115: "<|audio>", 116: "<audio|>"}

CHATS = {
    "one_image": [{"role": "user", "content": [{"type": "image", "image": "photo"},
                                               {"type": "text", "text": " What is in this picture? "}]}],
    "two_images_multi_turn": [
        {"role": "system", "content": "You compare pictures."},
        {"role": "user", "content": [{"type": "text", "text": "First:"}, {"type": "image", "image": "tall"},
                                     {"type": "text", "text": "Second:"}, {"type": "image", "image": "tiny_noise"},
                                     {"type": "text", "text": "Which is taller?"}]},
        {"role": "assistant", "content": "The first one."},
        {"role": "user", "content": [{"type": "image", "image": "wide"}, {"type": "text", "text": "And this?"}]},
    ],
}


@pytest.fixture(scope="module")
def tok_json(hf, tmp_path_factory):
    """The tokenizer.json transformers was given (live: made now; golden: the recorded one)."""
    d = tmp_path_factory.mktemp(f"gemma4_image_tok_{hf.source}")
    if hf.source == "golden":
        text = str(hf.value("tokenizer_json", None))
    else:
        from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

        gemma_like_tokenizer_json(d / "made.json", markers=IMAGE_MARKERS)
        made = (d / "made.json").read_text()
        text = str(hf.value("tokenizer_json", lambda: np.asarray(made)))
    (d / "tokenizer.json").write_text(text)
    return d


def _hf_processor_with_tokenizer(tok_dir):
    """transformers' Gemma4Processor text side (its video processor needs torchvision, so the processor is
    assembled without running __init__'s class checks; the methods used are its own)."""
    import transformers
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", extra_special_tokens={"image_token": IMAGE_TOKEN, "boi_token": BOI_TOKEN,
                                                 "eoi_token": EOI_TOKEN})
    from tests.test_chat_template import GEMMA4_TEXT_TEMPLATE

    tok.chat_template = GEMMA4_TEXT_TEMPLATE
    proc = object.__new__(Gemma4Processor)
    proc.tokenizer, proc.image_processor = tok, _hf_processor()
    proc.image_token, proc.boi_token, proc.eoi_token = tok.image_token, tok.boi_token, tok.eoi_token
    proc.image_token_id = tok.image_token_id
    proc.video_token = proc.audio_token = None
    return proc


def _reference_layout(proc, text, images, budget):
    """Gemma4Processor's steps for one prompt: images, replacement strings, expanded text, ids, types."""
    processed, replacements = proc._process_images([images], max_soft_tokens=budget)
    expanded, _ = proc.get_text_with_replacements([text], replacements)
    ids = proc.tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return {"text": np.asarray(expanded[0]), "input_ids": np.asarray(ids[0], np.int64),
            "mm_token_type_ids": np.asarray(proc.create_mm_token_type_ids(ids)[0], np.int64),
            "soft_tokens": np.asarray(processed["num_soft_tokens_per_image"], np.int64)}


def _chat_with_images(name):
    return [dict(m, content=[dict(p, image=CASES[p["image"]][1]) if p.get("type") == "image" else p
                             for p in m["content"]]) if isinstance(m["content"], list) else m
            for m in CHATS[name]]


@pytest.mark.parametrize("name", sorted(CHATS))
@pytest.mark.parametrize("budget", [70, 280])
def test_chat_layout_matches_transformers(hf, tok_json, name, budget):
    from dgemma_jax.io.tokenizer import load_tokenizer

    messages = CHATS[name]   # image parts name their CASES entry: the hashed inputs stay small
    image_names = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
                   if p.get("type") == "image"]
    tok_text = (tok_json / "tokenizer.json").read_text()

    def render():
        proc = _hf_processor_with_tokenizer(tok_json)
        return np.asarray(proc.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

    hf_text = str(hf.value(f"chat/{name}", render, json.dumps(messages, sort_keys=True), tok_text,
                           "GEMMA4_TEXT_TEMPLATE"))
    rendered = render_chat(messages)
    assert rendered == hf_text
    assert rendered.count(IMAGE_TOKEN) == len(image_names)

    with_images = _chat_with_images(name)
    images = chat_images(with_images)
    assert [id(x) for x in images] == [id(CASES[n][1]) for n in image_names]
    assert render_chat(with_images) == rendered

    def layout():
        proc = _hf_processor_with_tokenizer(tok_json)
        return _reference_layout(proc, rendered, [_hf_image(*CASES[n], None) for n in image_names], budget)

    items = [rendered, tok_text, budget] + [_input_items(*CASES[n]) for n in image_names]
    ref = hf.value(f"layout/{name}/{budget}", layout, *items)
    tok = load_tokenizer(tok_json)
    ours = encode_with_images(tok, rendered, images, max_soft_tokens=budget)
    assert list(ours["images"].soft_tokens) == ref["soft_tokens"].tolist()
    assert expand_image_text(rendered, ours["images"]) == str(ref["text"])
    assert ours["input_ids"].tolist() == ref["input_ids"].tolist()
    assert ours["mm_token_type_ids"].tolist() == ref["mm_token_type_ids"].tolist()
    assert ours["input_ids"].dtype == np.int32 and ours["mm_token_type_ids"].dtype == np.int32
    # The id-level expansion gives the same as expanding the text and encoding it.
    token_ids = ImageTokenIds.from_tokenizer(tok)
    assert token_ids == ImageTokenIds(110, 113, 114)
    ids2, types2 = expand_image_ids(tok.encode(rendered), ours["images"], token_ids)
    assert ids2.tolist() == ref["input_ids"].tolist() and types2.tolist() == ref["mm_token_type_ids"].tolist()
    assert int(types2.sum()) == sum(ours["images"].soft_tokens)


def test_layout_with_the_released_ids():
    ids, types = expand_image_ids([2, 10, IMAGE_TOKEN_ID, 11, IMAGE_TOKEN_ID], [3, 1])
    assert ids.tolist() == [2, 10, BOI_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, IMAGE_TOKEN_ID, EOI_TOKEN_ID, 11,
                            BOI_TOKEN_ID, IMAGE_TOKEN_ID, EOI_TOKEN_ID]
    assert types.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0]
    assert mm_token_type_ids(np.array([[1, IMAGE_TOKEN_ID], [BOI_TOKEN_ID, EOI_TOKEN_ID]])).tolist() == [[0, 1], [0, 0]]
    assert expand_image_text("a<|image|>b", [2]) == "a<|image><|image|><|image|><image|>b"
    assert expand_image_text("no images", []) == "no images"
    # DiffusionGemmaConfig's defaults (tests/test_config.py reads them from transformers).
    assert (IMAGE_TOKEN_ID, BOI_TOKEN_ID, EOI_TOKEN_ID) == (258880, 255999, 258882)
    with pytest.raises(ValueError, match="2 image placeholder.*1 image"):
        expand_image_ids([IMAGE_TOKEN_ID, IMAGE_TOKEN_ID], [3])
    with pytest.raises(ValueError, match="1 image placeholder.*2 image"):
        expand_image_text("<|image|>", [1, 2])
    with pytest.raises(ValueError, match="already contain an expanded image"):
        expand_image_ids([BOI_TOKEN_ID, IMAGE_TOKEN_ID, EOI_TOKEN_ID], [1])
    with pytest.raises(ValueError, match="1-D"):
        expand_image_ids([[IMAGE_TOKEN_ID]], [1])


def test_chat_images_errors_and_system_images():
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]\[1\].*without its image"):
        chat_images([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image"}]}])
    sys_img = [{"role": "system", "content": [{"type": "text", "text": "s"}, {"type": "image", "image": "a"}]},
               {"role": "user", "content": [{"type": "image", "path": "b.png"}, {"type": "text", "text": "q"}]}]
    # a leading system message renders its text only, so its image has no placeholder and is not listed
    assert chat_images(sys_img) == ["b.png"]
    assert render_chat(sys_img).count(IMAGE_TOKEN) == 1
    assert chat_images([{"role": "user", "content": "plain text"}]) == []


# ---------------------------------------------------------------------------------------------
# Sizes and settings


def test_resized_size_rules():
    s = ImageSettings(max_soft_tokens=70)
    assert resized_size(48, 64, s) == (336, 432)          # up-scaled: a tiny image still gets ~63 tokens
    assert soft_token_count(48, 64, s) == 63
    assert resized_size(1, 10000, s) == (48, 70 * 48)     # a side that rounds to 0 gets one block
    assert resized_size(10000, 1, s) == (70 * 48, 48)
    for budget in SOFT_TOKEN_BUDGETS:
        s = ImageSettings(max_soft_tokens=budget)
        for h, w in [(1, 1), (3, 7), (480, 640), (4000, 30), (768, 768)]:
            rh, rw = resized_size(h, w, s)
            assert rh % 48 == 0 and rw % 48 == 0 and (rh // 16) * (rw // 16) <= s.max_patches
    assert ImageSettings().max_patches == 2520 and ImageSettings().patch_dim == 768
    other = preprocess_images(np.zeros((64, 64, 3), np.uint8), patch_size=14, pooling_kernel_size=2,
                              max_soft_tokens=140)
    assert other.pixel_values.shape == (1, 560, 14 * 14 * 3) and other.soft_tokens == (121,)


# ---------------------------------------------------------------------------------------------
# Bad input: one ValueError each, naming the problem and the fix


def _png_header_only(w, h):
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


def _animated(fmt):
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:])
    return buf.getvalue()


def _bad(image, match, **kw):
    with pytest.raises(ValueError, match=match) as e:
        preprocess_images(image, **kw)
    assert e.value.__cause__ is None  # one message, not a chain of library tracebacks
    return str(e.value)


def test_bad_files(tmp_path):
    (tmp_path / "notes.txt").write_text("not an image at all")
    _bad(str(tmp_path / "notes.txt"), "not an image Pillow can read.*pass a PNG")
    _bad(b"\x00\x01garbage", "not an image Pillow can read")
    _bad(str(tmp_path / "missing.png"), "no image file at.*check the path")
    _bad(str(tmp_path), "is not a file")
    _bad(b"", "bytes are empty")
    _bad("https://example.com/cat.png", "is a URL: download")
    _bad("data:image/png;base64," + "A" * 500, "data URI: decode")
    truncated = _png_bytes(Image.fromarray(_gradient(64, 64)))[:200]
    _bad(truncated, "truncated or damaged|could not be decoded")
    _bad(_png_header_only(30000, 30000), "too large to decode safely.*downscale")   # Pillow's own bomb limit
    _bad(_png_header_only(5000, 4000), r"20000000 pixels.*max_pixels=1000000.*downscale", max_pixels=1_000_000)
    _bad(_animated("GIF"), r"animated \(2 frames\).*seek")
    _bad(_animated("PNG"), r"animated \(2 frames\).*seek")
    gif = Image.open(io.BytesIO(_animated("GIF")))
    _bad(gif, "animated")
    gif.seek(1)
    assert preprocess_images(gif.convert("RGB"), max_soft_tokens=70).soft_tokens == (64,)  # the fix works


def test_bad_modes_and_arrays():
    sixteen = Image.fromarray(np.full((20, 30), 40000, np.uint16))
    assert sixteen.mode.startswith("I")
    _bad(sixteen, r"mode 'I;16'.*clip every value above 255.*8-bit RGB")
    _bad(_png_bytes(sixteen), r"mode 'I.*clip")
    _bad(Image.new("I", (4, 4)), "mode 'I'")
    _bad(Image.new("F", (4, 4)), "mode 'F'")
    _bad(Image.new("LAB", (4, 4)), "mode 'LAB'.*does not convert")
    _bad(Image.new("RGB", (0, 5)), r"empty \(0x5")
    _bad(np.zeros((0, 4, 3), np.uint8), "empty")
    _bad(np.zeros((4, 4, 3), np.float32), "must be uint8.*astype")
    _bad(np.zeros((3, 4, 4, 3), np.uint8), "HxWx3")
    _bad(np.zeros((4, 4, 2), np.uint8), "HxWx3")
    _bad(3.5, "cannot read an image from a float")
    _bad([], "no images given")
    for budget in (0, 100, 281, 2240, 280.0, "280"):
        _bad(np.zeros((8, 8, 3), np.uint8), "not a Gemma 4 soft-token budget.*70, 140, 280, 560, 1120",
             max_soft_tokens=budget)
    with pytest.raises(ValueError, match="patch_size must be a positive int"):
        ImageSettings(patch_size=0)


def test_conversions_that_are_not_errors():
    """CMYK, palette-with-transparency and 1-bit images are converted as the reference converts them."""
    cmyk = Image.new("CMYK", (40, 30), (0, 255, 255, 0))      # Pillow's formula: pure red
    assert load_image(cmyk)[0, 0].tolist() == [255, 0, 0]
    bits = Image.new("1", (40, 30), 1)
    assert load_image(bits)[0, 0].tolist() == [255, 255, 255]
    gif = Image.open(io.BytesIO(_palette_gif()))
    assert gif.info.get("transparency") is not None
    rgb = load_image(gif)   # a PIL image: the transparent colour composited onto white
    assert (rgb == 255).all(axis=-1).any()
    assert load_image(np.zeros((5, 6), np.uint8)).shape == (5, 6, 3)
    frames = [Image.fromarray(_gradient(40, 60)), Image.new("RGB", (30, 20))]
    buf = io.BytesIO()
    frames[0].save(buf, format="MPO", save_all=True, append_images=frames[1:])
    mpo = Image.open(io.BytesIO(buf.getvalue()))
    assert mpo.format == "MPO" and mpo.n_frames == 2
    assert load_image(buf.getvalue()).shape == (40, 60, 3)   # a camera MPO JPEG: its primary image, no error
    assert load_image(_exif_rotated_png()).shape == (160, 90, 3)      # a file's EXIF orientation is applied
    assert load_image(Image.open(io.BytesIO(_exif_rotated_png()))).shape == (90, 160, 3)  # a PIL image's is not
    rgba = _rgba()
    assert np.array_equal(load_image(rgba), load_image(np.asarray(rgba)))        # onto white, both ways
    assert not np.array_equal(load_image(rgba), load_image(_png_bytes(rgba)))    # a file's alpha is dropped
    assert np.array_equal(load_image(_png_bytes(rgba)), np.asarray(rgba)[..., :3])
    assert load_image(np.zeros((5, 6, 1), np.uint8)).shape == (5, 6, 3)


def test_report():
    if RESULTS:
        worst = max(RESULTS.values())
        print(f"pixel max |difference| over {len(RESULTS)} case(s) and sources: {worst:.3g}")
