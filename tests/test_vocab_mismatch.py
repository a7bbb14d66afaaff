"""A checkpoint whose vocabulary is larger than its tokenizer's (a model trained with a padded or preset
vocab_size, or paired with the wrong tokenizer) can emit ids the tokenizer has no text for. Loading
warns; every path that turns generated ids into text writes such an id as U+FFFD instead of raising
(the server's worker used to die on the first one)."""

import threading

import numpy as np
import pytest

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig
from dgemma_jax.errors import DgemmaWarning
from dgemma_jax.io.model_dir import save_model
from dgemma_jax.io.tokenizer import REPLACEMENT, load_tokenizer
from dgemma_jax.pipeline import DiffusionGemma, load_checkpoint
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.serving.scheduler import Request, Scheduler
from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

EXTRA = 4000  # ids past the tokenizer's: with random weights most generated ids are among them


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab_ckpt")
    gemma_like_tokenizer_json(path / "tokenizer.json")
    n = load_tokenizer(str(path / "tokenizer.json")).vocab_size
    cfg = ModelConfig.preset("tiny-2layer").replace(vocab_size=n + EXTRA)
    sampler = SamplerConfig.for_model(cfg).replace(max_denoising_steps=3)
    save_model(path / "model", cfg, dg.init_params(cfg, 0), sampler, tokenizer_file=str(path / "tokenizer.json"))
    return path / "model"


@pytest.fixture(scope="module")
def loaded(ckpt):
    with pytest.warns(DgemmaWarning, match=r"vocab_size is \d+ but its tokenizer has \d+ ids.*U\+FFFD"):
        return load_checkpoint(str(ckpt))


def test_decode_generated_writes_unknown_ids_as_the_replacement_character(loaded):
    cfg, _, _, tok = loaded
    n = tok.vocab_size
    hi = tok.encode("hi")
    there = tok.encode(" there")
    assert tok.decode_generated(hi + there) == tok.decode(hi + there) == "hi there"
    assert tok.decode_generated([n + 5] + hi + [n, cfg.vocab_size - 1] + there + [-1]) == \
        f"{REPLACEMENT}hi{REPLACEMENT}{REPLACEMENT} there{REPLACEMENT}"
    assert tok.decode_generated(np.asarray([tok.bos_id, *hi, n + 1]), skip_special=True) == f"hi{REPLACEMENT}"
    with pytest.raises(ValueError, match="outside the vocabulary"):  # decode itself stays strict
        tok.decode(hi + [n])


def test_a_matching_tokenizer_loads_without_the_warning(tmp_path):
    gemma_like_tokenizer_json(tmp_path / "tokenizer.json")
    n = load_tokenizer(str(tmp_path / "tokenizer.json")).vocab_size
    cfg = ModelConfig.preset("tiny-2layer").replace(vocab_size=n)
    save_model(tmp_path / "model", cfg, dg.init_params(cfg, 0), SamplerConfig.for_model(cfg),
               tokenizer_file=str(tmp_path / "tokenizer.json"))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", DgemmaWarning)
        load_checkpoint(str(tmp_path / "model"))


def test_the_pipeline_and_the_server_worker_decode_out_of_range_ids(loaded):
    cfg, params, sampler, tok = loaded
    prompt = tok.encode("hello", add_bos=True)
    text = DiffusionGemma(cfg, params, tok, sampler).generate("hello", max_new_tokens=sampler.canvas_length)
    assert REPLACEMENT in text

    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, context=64)
    sch.start()
    done, out = threading.Event(), {}

    def on(ev):
        if ev.finish_reason is not None:
            out["ev"] = ev
            done.set()
    try:
        sch.submit(Request(prompt, sampler.canvas_length, sampler, 0, on_event=on))
        assert done.wait(300), "the worker never finished the request"
    finally:
        sch.stop()
    ev = out["ev"]
    assert any(t >= tok.vocab_size for t in ev.token_ids)
    assert REPLACEMENT in ev.text
