"""Batch invariance (issue 36): a prompt with its seed gives the same tokens whatever else is in the call.

A random 12-layer model (tiny width; the compiles of two prompt buckets take most of the time, so the
module is in the slow tier), prompts of different lengths (in two prompt-width buckets), each alone,
in batches of 2, 3, 5 and 8 at different positions, and reordered: the fused `Engine.generate`, the
step-by-step driver `Engine.steps` and `DiffusionGemma.generate` all give every prompt exactly the
tokens it gets alone, float32 and int8 alike, with the default (a call's rows as one block of their
number: a batch of 3 and of 8 against 1-row programs alone) and in blocks of 8 rows
(`batch_invariant=8`: every batch size above, one program shape; issue 46).
Before the fix a row's key was `split(seed, B)[i]` (its
list index) and the rows shared one batched program whose shapes (batch, prompt width, cache length)
and MoE dispatch depended on the other prompts.
"""

import string

import jax
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine.drivers import collect
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.model.quant import quantization_of
from dgemma_jax.pipeline import DiffusionGemma
from dgemma_jax.sampling import SamplerConfig

TOK = CharTokenizer(string.printable[:95])
CFG = ModelConfig.preset("tiny-6layer", num_layers=12, layer_types=(), vocab_size=TOK.vocab_size)
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=5, eos_ids=(1,))
NEW = 24  # two canvases (the second cut to 8 tokens): the commit between them is exercised
TEXTS = ["ab", "hello world", "a longer prompt!", "the quick brown fox", "over the lazy dog",
         "x=1+2", "0123456789abcdef", "JAX and Flax!"]
SEEDS = [11, 22, 33, 44, 55, 66, 77, 88]
# (prompt indices) of each batch: sizes 2, 3, 5, 8, the prompts at different positions, and reordered
BATCHES = [(3, 0), (1, 6, 2), (4, 0, 7, 2, 5), tuple(range(8)), (5, 2, 7, 0, 3, 6, 1, 4)]


def _ids(idx):
    ids = [TOK.encode(TEXTS[i], add_bos=True) for i in idx]
    tokens = np.zeros((len(ids), max(len(x) for x in ids)), np.int32)
    for r, x in enumerate(ids):
        tokens[r, :len(x)] = x
    return tokens, np.array([len(x) for x in ids], np.int32), [SEEDS[i] for i in idx]


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


@pytest.fixture(scope="module", params=["float32", "int8", "float32-blocks8"])
def gemma(request, params):
    """The default (a call's rows in one block of their number) in float32 and int8, and blocks of 8
    rows (`batch_invariant=8`): the prompts of both buckets in one program call either way."""
    return DiffusionGemma(CFG, params, TOK, SAMPLER, quantize="int8" if request.param == "int8" else None,
                          batch_invariant=8 if request.param.endswith("blocks8") else True)


def test_a_prompt_gets_the_same_tokens_alone_in_any_batch_at_any_position(gemma):
    eng = gemma.engine
    alone = {}
    for i in range(len(TEXTS)):
        tokens, lengths, seeds = _ids([i])
        alone[i] = np.asarray(eng.generate(tokens, lengths, rng=seeds, max_new_tokens=NEW).tokens)[0]
    # the prompts really differ from each other (a constant output would pass everything below)
    assert len({a.tobytes() for a in alone.values()}) == len(TEXTS)
    # the default: two block sizes (3 and 8, reordered; int8 the 8) against the 1-row programs alone
    # (each batch size compiles its programs: the slow part); blocks of 8: every batch shape and position
    batches = (BATCHES[-1],) if quantization_of(eng.params) else (BATCHES[1], BATCHES[-1])
    for idx in BATCHES if eng.invariant_block else batches:
        tokens, lengths, seeds = _ids(idx)
        fused = np.asarray(eng.generate(tokens, lengths, rng=seeds, max_new_tokens=NEW).tokens)
        stepped, _, _ = collect(eng.steps(tokens, lengths, rng=seeds, max_new_tokens=NEW), len(idx), NEW,
                                SAMPLER.canvas_length, SAMPLER.pad_id)
        texts = gemma.generate([TEXTS[i] for i in idx], max_new_tokens=NEW, seed=seeds)
        for r, i in enumerate(idx):
            np.testing.assert_array_equal(fused[r], alone[i], err_msg=f"fused generate, prompt {i} in batch {idx}")
            np.testing.assert_array_equal(stepped[r], alone[i], err_msg=f"step driver, prompt {i} in batch {idx}")
            assert texts[r] == TOK.decode_generated(alone[i], skip_special=True), f"prompt {i} in batch {idx}"


def test_one_seed_for_a_batch_gives_every_row_that_seeds_stream(gemma):
    """rng=int for a batch: every row uses the seed's own stream (what the prompt gets alone with it)."""
    eng = gemma.engine
    tokens, lengths, _ = _ids((2, 6, 2))
    out = np.asarray(eng.generate(tokens, lengths, rng=5, max_new_tokens=NEW).tokens)
    for r in range(3):
        one, n, _ = _ids([(2, 6, 2)[r]])
        np.testing.assert_array_equal(out[r], np.asarray(eng.generate(one, n, rng=5, max_new_tokens=NEW).tokens)[0])
    np.testing.assert_array_equal(out[0], out[2])  # the same prompt twice with one seed: the same answer
    key = jax.random.key(5)  # a key is a seed's stream too
    np.testing.assert_array_equal(out, np.asarray(eng.generate(tokens, lengths, rng=key, max_new_tokens=NEW).tokens))


def test_diffusion_gemma_takes_the_batch_invariant_switch():
    """`DiffusionGemma(batch_invariant=)` and `from_pretrained(batch_invariant=)` reach the engine (there
    was no switch: the library's text API always ran each prompt as its own program)."""
    bundled = DiffusionGemma.from_pretrained(None, batch_invariant=False)
    assert bundled.engine.batch_invariant is False
    assert DiffusionGemma.from_pretrained(None).engine.batch_invariant is True
    fast = DiffusionGemma(bundled.config, bundled.params, bundled.tokenizer, batch_invariant=False)
    assert fast.engine.batch_invariant is False
    assert fast.generate(["s9350814272=", "s31415926535="]) == ["0122345789", "11233455569"]
