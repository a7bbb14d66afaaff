"""Images through the server: OpenAI `image_url` chat parts (data URLs, allowed local files), the
scheduler's image-aware prefill chunks, and a 400 for every bad image. A tiny checkpoint with a
vision tower and a Gemma-like tokenizer that has the image markers, random weights."""

import base64
import concurrent.futures as cf
import io
import os
import threading
import types

import numpy as np
import pytest

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.io.chat import chat_images, render_chat
from dgemma_jax.io.images import prompt_with_images
from dgemma_jax.io.model_dir import save_model
from dgemma_jax.io.tokenizer import load_tokenizer
from dgemma_jax.model.cache import rewind_ok
from dgemma_jax.pipeline import DiffusionGemma, load_checkpoint
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.serving.images import resolve_image_parts
from dgemma_jax.serving.scheduler import Request, Scheduler
from tests.helpers.gemma_tokenizer import MARKERS, gemma_like_tokenizer_json

MARKS = {**MARKERS, 113: "<|image>", 114: "<image|>"}
SOFT = 70          # the smallest soft-token budget: an image is at most 70 + 2 prompt tokens
MAX_TOKENS = 32    # two canvases of 16


def _png(w, h, seed=0, mode="RGB", **save):
    from PIL import Image
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode) if mode != "I;16" else \
        Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    buf = io.BytesIO()
    img.save(buf, format=save.pop("format", "PNG"), **save)
    return buf.getvalue()


def _data_url(raw, media="image/png"):
    return f"data:{media};base64," + base64.b64encode(raw).decode()


def _part(url):
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("vision_ckpt")
    gemma_like_tokenizer_json(path / "tokenizer.json", MARKS)
    vocab = load_tokenizer(str(path / "tokenizer.json")).vocab_size    # 371: every id the model draws decodes
    cfg = ModelConfig.preset("tiny-2layer").replace(
        vocab_size=vocab, vision=VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                                            num_kv_heads=2, head_dim=8, position_embedding_size=64),
        image_token_id=110, boi_token_id=113, eoi_token_id=114)
    sampler = SamplerConfig.for_model(cfg).replace(max_denoising_steps=4)
    save_model(path / "model", cfg, dg.init_params(cfg, 3), sampler, tokenizer_file=str(path / "tokenizer.json"))
    return path / "model"


@pytest.fixture(scope="module")
def loaded(ckpt):
    return load_checkpoint(str(ckpt))


def _prompt(loaded, messages):
    cfg, _, _, tok = loaded
    text = render_chat(messages, add_generation_prompt=True)
    tokens, _, batch = prompt_with_images(cfg, tok, text, chat_images(messages), SOFT, add_bos=False)
    return tokens[0].tolist(), batch


def _run(sch, ids, batch, seed, sampler, max_tokens=MAX_TOKENS):
    done, out = threading.Event(), {}

    def on(ev):
        if ev.finish_reason is not None:
            out["ev"] = ev
            done.set()
    sch.submit(Request(ids, max_tokens, sampler, seed, on_event=on, images=batch))
    assert done.wait(300)
    return out["ev"]


# ------------------------------------------------------------------ the scheduler, no HTTP
def test_chunks_never_cut_an_image_and_an_image_longer_than_a_chunk_is_refused(loaded):
    cfg, params, sampler, tok = loaded
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x" * 30}, {"type": "image", "image": _png(40, 40)},
                                          {"type": "text", "text": "what is it?"}]}]
    ids, batch = _prompt(loaded, msgs)
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=256, prefill_chunk=80)
    b = ids.index(113)
    e = ids.index(114) + 1
    assert b < 80 < e, (b, e)                     # one 80-token chunk would cut the image
    chunks = sch.plan_chunks(ids, batch)
    assert [(s, t) for s, t, _, _ in chunks][0] == (0, b) and chunks[0][3] is None
    assert chunks[1][0] == b and chunks[1][1] >= e and len(chunks[1][3]) == 1
    assert chunks[-1][1] == len(ids)
    small = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=256, prefill_chunk=40)
    with pytest.raises(ValueError, match="--prefill-chunk"):
        small.plan_chunks(ids, batch)
    with pytest.raises(ValueError, match="image tokens but no images"):
        sch.plan_chunks(ids, None)


def test_scheduler_equals_the_engine_and_a_cut_chunk_equals_one_chunk(loaded):
    cfg, params, sampler, tok = loaded
    msgs = [{"role": "user", "content": [{"type": "text", "text": "x" * 30}, {"type": "image", "image": _png(40, 40)},
                                          {"type": "text", "text": "what is it?"}]}]
    ids, batch = _prompt(loaded, msgs)
    eng = dg.Engine(cfg, params, sampler)
    out = eng.generate(np.asarray([ids], np.int32), None, rng=5, max_new_tokens=MAX_TOKENS, images=batch)
    want = tuple(int(t) for t in np.asarray(out.tokens)[0] if int(t) != sampler.pad_id)
    got = {}
    for chunk in (80, 512):
        sch = Scheduler.for_model(cfg, params, tok, sampler, slots=2, context=256, prefill_chunk=chunk)
        sch.start()
        try:
            got[chunk] = _run(sch, ids, batch, 5, sampler).token_ids
        finally:
            sch.stop()
    assert got[80] == got[512] == want


@pytest.mark.parametrize("window", ["ring", "whole row"])
def test_prefix_reuse_takes_an_image_from_the_cache_only_when_it_is_the_same_image(loaded, window):
    """A slot's row holding an image prompt and its answer (one canvas): the same prompt again reuses it
    all (but its last token); a prompt with another image of the same size (the same token ids) never
    reuses the image. With the model's own window its sliding layer's cache is a ring of window + canvas
    slots (model/cache.py), which lets a row be rewound only to canvas + 1 tokens before its end: the
    other image's prompt is prefilled whole. With a window as long as the context the ring holds the
    whole row, and that prompt reuses the text before the image's block. Either way the tokens equal a
    scheduler that prefills everything."""
    cfg, params, sampler, tok = loaded
    context, answer = 256, cfg.canvas_length
    if window == "whole row":
        cfg = cfg.replace(sliding_window=context)

    def msgs(seed):
        return [{"role": "user", "content": [{"type": "text", "text": "x" * 30},
                                             {"type": "image", "image": _png(40, 40, seed=seed)},
                                             {"type": "text", "text": "what is it?"}]}]
    same, same_batch = _prompt(loaded, msgs(0))
    other, other_batch = _prompt(loaded, msgs(1))
    assert same == other                             # only the pixels tell the two prompts apart
    begin = same.index(113)                          # the image's begin marker
    row = len(same) + answer                         # what the slot's row holds after a request
    assert rewind_ok(cfg, context, row, len(same) - 1)
    assert rewind_ok(cfg, context, row, begin) == (window == "whole row")
    runs = {}
    for reuse in (True, False):
        sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=context, prefix_reuse=reuse)
        sch.start()
        try:
            runs[reuse] = [_run(sch, same, same_batch, 5, sampler, answer),
                           _run(sch, same, same_batch, 6, sampler, answer),
                           _run(sch, other, other_batch, 7, sampler, answer)]
        finally:
            sch.stop()
    first, again, changed = runs[True]
    assert again.cached_tokens == len(same) - 1
    assert changed.cached_tokens == (begin if window == "whole row" else 0)
    assert all(ev.cached_tokens == 0 for ev in runs[False])
    assert [ev.token_ids for ev in runs[True]] == [ev.token_ids for ev in runs[False]]


# ------------------------------------------------------------------ the image parts
def test_image_url_parts_resolve_with_clear_errors(tmp_path):
    raw = _png(8, 8)
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "a.png").write_bytes(raw)
    (tmp_path / "b.png").write_bytes(raw)
    os.symlink(tmp_path / "b.png", tmp_path / "ok" / "link.png")
    allowed = [str(tmp_path / "ok")]

    def one(url, dirs=allowed):
        return resolve_image_parts([{"role": "user", "content": [_part(url)]}], dirs)[0]["content"][0]

    assert one(_data_url(raw)) == {"type": "image", "image": raw}
    assert one(str(tmp_path / "ok" / "a.png"))["path"] == os.path.realpath(tmp_path / "ok" / "a.png")
    assert one("file://" + str(tmp_path / "ok" / "a.png"))["path"].endswith("a.png")
    bad = {
        "data:image/png;base64,@@@not base64": "base64 is invalid",
        "data:text/plain;base64,aGVsbG8=": "media type is 'text/plain'",
        "data:image/png,rawbytes": "not base64-encoded",
        "https://example.com/cat.png": "does not fetch URLs",
        str(tmp_path / "b.png"): "outside the directories",
        str(tmp_path / "ok" / "link.png"): "outside the directories",      # a symlink out of the allowed dir
        str(tmp_path / "ok" / ".." / "b.png"): "outside the directories",
        str(tmp_path / "ok" / "missing.png"): "no image file",
        "ok/a.png": "must be absolute",
        "": "empty",
    }
    for url, msg in bad.items():
        with pytest.raises(ValueError, match=msg):
            one(url)
    with pytest.raises(ValueError, match="--allowed-image-dir"):
        one(str(tmp_path / "ok" / "a.png"), dirs=())
    with pytest.raises(ValueError, match="image_url"):
        resolve_image_parts([{"role": "user", "content": [{"type": "image", "path": "/etc/passwd"}]}], allowed)


def test_a_text_only_checkpoint_refuses_images_with_400():
    from fastapi.testclient import TestClient

    from dgemma_jax.serving.metrics import Metrics
    from dgemma_jax.serving.server import create_app
    tok = types.SimpleNamespace(has_chat_template=True, vocab_size=384)
    sch = types.SimpleNamespace(tokenizer=tok, engine=types.SimpleNamespace(
        config=types.SimpleNamespace(vocab_size=384, vision=None), sampler=None), stop=lambda: None,
        context=256, max_queue=8, metrics=Metrics(lambda: {}))
    client = TestClient(create_app(sch, "text-only"))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, _part(_data_url(_png(8, 8)))]}]})
    assert r.status_code == 400 and "text-only checkpoint" in r.json()["error"]["message"]


# ------------------------------------------------------------------ a real server
@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    from tests.helpers.serve import ServerProcess
    allowed = tmp_path_factory.mktemp("allowed")
    srv = ServerProcess("--checkpoint", str(ckpt), "--slots", "2", "--context", "256", "--max-steps", "4",
                        "--max-soft-tokens", str(SOFT), "--allowed-image-dir", str(allowed))
    srv.allowed = allowed
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_a_data_url_image_chat_equals_the_library(ckpt, client, server):
    raw = _png(40, 30, seed=1)
    lib = DiffusionGemma.from_pretrained(str(ckpt))
    want = lib.chat([{"role": "user", "content": [{"type": "image", "image": raw}, {"type": "text", "text": "what?"}]}],
                    max_new_tokens=MAX_TOKENS, seed=7, max_soft_tokens=SOFT)
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=[
        {"role": "user", "content": [_part(_data_url(raw)), {"type": "text", "text": "what?"}]}],
        seed=7, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want and r.usage.completion_tokens > 1
    # the same file from the allowed directory gives the same answer
    (server.allowed / "img.png").write_bytes(raw)
    r2 = client.chat.completions.create(model=r.model, messages=[{"role": "user", "content": [
        _part("file://" + str(server.allowed / "img.png")), {"type": "text", "text": "what?"}]}],
        seed=7, max_tokens=MAX_TOKENS)
    assert r2.choices[0].message.content == want


def test_two_concurrent_requests_with_different_images(client):
    model = client.models.list().data[0].id
    imgs = [_png(40, 30, seed=2), _png(24, 60, seed=3)]

    def ask(raw):
        return client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
            _part(_data_url(raw)), {"type": "text", "text": "describe"}]}], seed=1, max_tokens=MAX_TOKENS)

    alone = [ask(raw).choices[0].message.content for raw in imgs]
    with cf.ThreadPoolExecutor(2) as ex:
        together = [f.result().choices[0].message.content for f in [ex.submit(ask, raw) for raw in imgs]]
    assert together == alone


def test_every_bad_image_is_a_400_and_leaves_no_slot_busy(client, server, tmp_path):
    import openai
    from PIL import Image
    model = client.models.list().data[0].id
    frames = [Image.new("RGB", (8, 8), c) for c in ("red", "blue")]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    big = io.BytesIO()
    Image.new("1", (10000, 9000)).save(big, format="PNG")
    outside = tmp_path / "x.png"
    outside.write_bytes(_png(8, 8))
    cases = {
        "base64 is invalid": _part("data:image/png;base64,!!!"),
        "media type": _part("data:text/plain;base64,aGVsbG8="),
        "does not fetch": _part("https://example.com/a.png"),
        "outside the directories": _part(str(outside)),
        "not an image": _part(_data_url(b"not a png at all")),
        "16-bit": _part(_data_url(_png(8, 8, mode="I;16"))),
        "animated": _part(_data_url(buf.getvalue(), "image/gif")),
        "more than the limit max_pixels": _part(_data_url(big.getvalue())),   # a decompression bomb
    }
    for msg, part in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
                part, {"type": "text", "text": "hi"}]}], max_tokens=MAX_TOKENS)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(openai.BadRequestError, match="system message"):
        client.chat.completions.create(model=model, messages=[
            {"role": "system", "content": [_part(_data_url(_png(8, 8)))]}, {"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="image tokens but no images"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "<|image|> hi"}])
    h = server.health()
    assert h["busy_slots"] == 0 and h["queued"] == 0 and h["status"] == "ok"
    ok = client.chat.completions.create(model=model, messages=[{"role": "user", "content": [
        _part(_data_url(_png(16, 16))), {"type": "text", "text": "hi"}]}], max_tokens=MAX_TOKENS)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_an_image_across_a_chunk_boundary_over_http(ckpt, loaded, client):
    """--prefill-chunk 64: a chunk that would cut the image ends before it, the answer is the one of
    a 512-token chunk; an image longer than a chunk is a 400 naming the flag."""
    import openai

    from tests.helpers.serve import ServerProcess
    raw = _png(100, 10, seed=4)                     # 52 soft tokens: 54 with its markers
    content = [{"type": "text", "text": "x" * 30}, {"type": "image", "image": raw}, {"type": "text", "text": "?"}]
    ids, _ = _prompt(loaded, [{"role": "user", "content": content}])
    b, e = ids.index(113), ids.index(114) + 1
    assert e - b <= 64 and b < 64 < e, (b, e)
    msgs = [{"role": "user", "content": [content[0], _part(_data_url(raw)), content[2]]}]
    want = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, seed=3,
                                          max_tokens=MAX_TOKENS)
    srv = ServerProcess("--checkpoint", str(ckpt), "--slots", "1", "--context", "256", "--max-steps", "4",
                        "--max-soft-tokens", str(SOFT), "--prefill-chunk", "64")
    try:
        small = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        got = small.chat.completions.create(model=want.model, messages=msgs, seed=3, max_tokens=MAX_TOKENS)
        assert got.choices[0].message.content == want.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match="--prefill-chunk 66"):
            small.chat.completions.create(model=want.model, messages=[{"role": "user", "content": [
                _part(_data_url(_png(40, 40)))]}], max_tokens=MAX_TOKENS)
        assert srv.health()["busy_slots"] == 0
    finally:
        srv.stop()
