"""One pass to load a checkpoint: `load_checkpoint` resolves the location, detects the format and reads
each metadata file once into a `CheckpointSource` that the config, weight, sampler and tokenizer readers
are handed (issue 46)."""

import builtins
import collections
import os
import warnings

import numpy as np
import pytest

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.io.formats import CheckpointSource
from dgemma_jax.io.hf import save_hf
from dgemma_jax.io.model_dir import open_checkpoint, save_model
from dgemma_jax.model.quant import quantize_params
from dgemma_jax.pipeline import load_checkpoint
from dgemma_jax.sampling.config import SamplerConfig
from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json

CFG = ModelConfig.preset("tiny-2layer")
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=3, eos_ids=(1,))
HF_META = ("config.json", "generation_config.json", "tokenizer_config.json")
OURS_META = ("dgemma_model.json", "chars.json")


@pytest.fixture(scope="module")
def params():
    return dg.init_params(CFG, 0)


def _hf_dir(path, params):
    """A Hugging Face layout: config.json + model.safetensors (save_hf, which transformers reads), a
    generation_config.json, a tokenizer.json and a tokenizer_config.json."""
    save_hf(params, CFG, path, generation_config={"eos_token_id": [1], "max_denoising_steps": 3})
    gemma_like_tokenizer_json(path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text('{"bos_token": "<bos>", "eos_token": "<eos>"}')
    return path


def _ours_dir(path, params, quantize=None):
    tok = path.parent / f"{path.name}_chars.json"
    CharTokenizer("0123456789+-=").save(tok)
    os.rename(tok, path.parent / "chars.json") if not (path.parent / "chars.json").exists() else os.remove(tok)
    p = quantize_params(CFG, params, quantize) if quantize else params
    save_model(path, CFG, p, sampler=SAMPLER, tokenizer_file=str(path.parent / "chars.json"))
    return path


def _opens_during(fn, directory):
    """(fn's result, {file name under `directory`: times opened through Python's open})."""
    directory = os.path.abspath(directory)
    counts = collections.Counter()
    real_open = builtins.open

    def counting_open(file, *a, **k):
        if isinstance(file, (str, os.PathLike)):
            full = os.path.abspath(os.fspath(file))
            if os.path.dirname(full) == directory:
                counts[os.path.basename(full)] += 1
        return real_open(file, *a, **k)

    builtins.open = counting_open
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tiny tokenizers cover fewer ids than the model's vocab
            out = fn()
    finally:
        builtins.open = real_open
    return out, counts


def test_a_hugging_face_load_opens_each_metadata_file_once(tmp_path, params):
    path = _hf_dir(tmp_path / "hf", params)
    (cfg, loaded, sampler, tok), counts = _opens_during(lambda: load_checkpoint(str(path)), path)
    assert {n: counts[n] for n in HF_META} == {n: 1 for n in HF_META}, counts
    assert cfg.num_layers == CFG.num_layers and sampler.max_denoising_steps == 3 and tok.bos_id == 2
    np.testing.assert_array_equal(np.asarray(loaded["embedding"]), np.asarray(params["embedding"]))


def test_an_own_format_load_opens_each_metadata_file_once(tmp_path, params):
    path = _ours_dir(tmp_path / "ours", params)
    (cfg, loaded, sampler, tok), counts = _opens_during(lambda: load_checkpoint(str(path)), path)
    assert {n: counts[n] for n in OURS_META} == {n: 1 for n in OURS_META}, counts
    assert cfg == CFG and sampler == SAMPLER and tok.encode("12") == CharTokenizer("0123456789+-=").encode("12")
    # a quantized one too: its quantization is read from the same single read of the metadata
    qpath = _ours_dir(tmp_path / "q", params, "int8")
    (qcfg, qparams, _, _), counts = _opens_during(lambda: load_checkpoint(str(qpath)), qpath)
    assert counts["dgemma_model.json"] == 1
    assert dg.model.quant.quantization_of(qparams) == "int8"


def test_the_source_holds_what_a_load_needs(tmp_path, params):
    hf = open_checkpoint(str(_hf_dir(tmp_path / "hf", params)))
    ours = open_checkpoint(str(_ours_dir(tmp_path / "q", params, "int8")))
    assert isinstance(hf, CheckpointSource) and (hf.format, ours.format) == ("hf", "dgemma")
    assert hf.config.vision is None and hf.declared.vision is not None  # save_hf's text-only tower stub
    assert hf.config.name == CFG.name  # a preset's config keeps its name
    assert (hf.quantized, ours.quantized) == (None, "int8") and ours.sampler == SAMPLER
    assert hf.tensors is not None and "model.decoder.embed_tokens.weight" in hf.tensors.keys()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_checkpoint(str(tmp_path / "missing"))
