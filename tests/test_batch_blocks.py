"""Batch invariance from batched programs (`Engine(batch_invariant=N)`, issue 46): the rows that get the
same shapes alone (prompt-width bucket, cache length) run together in blocks of exactly N rows, so a
batch of N such prompts is one program call, and a prompt's tokens still do not depend on the rest
of the call (alone, in any batch, at any position; the fused program and the step driver alike).
The random 12-layer model of tests/test_batch_invariance.py checks the same in the slow tier."""

import numpy as np
import pytest

from dgemma_jax.engine import Engine
from dgemma_jax.pipeline import DiffusionGemma, load_checkpoint
from dgemma_jax.sampling.generate import collect

# four prompts of the 16-token bucket, two of the 24-token one
PROMPTS = ["s3=", "s904215=", "s31415926535=", "s55012=", "s8877665544332211=", "s99887766554433221="]
SEEDS = [3, 1, 4, 1, 5, 9]


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(None)


def _encode(tok, prompts):
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, x in enumerate(ids):
        tokens[r, :len(x)] = x
    return tokens, np.array([len(x) for x in ids], np.int32)


def test_rows_of_one_shape_run_as_one_block_and_keep_their_alone_tokens(bundled):
    cfg, params, sampler, tok = bundled
    eng = Engine(cfg, params, sampler, batch_invariant=4)
    calls = []
    program = eng.fused_program

    def counted(*a, **k):
        fn = program(*a, **k)

        def call(*x, **y):
            calls.append(y["prompt_tokens"].shape)
            return fn(*x, **y)
        return call

    eng.fused_program = counted
    tokens, lengths = _encode(tok, PROMPTS)
    out = np.asarray(eng.generate(tokens, lengths, rng=SEEDS, max_new_tokens=16).tokens)
    # the four 16-bucket prompts in one call of 4 rows, the two others in one block filled to 4 rows
    assert sorted(calls) == [(4, 16), (4, 24)], calls
    alone = [np.asarray(eng.generate(tokens[i:i + 1, :lengths[i]], lengths[i:i + 1], rng=[SEEDS[i]],
                                     max_new_tokens=16).tokens)[0] for i in range(len(PROMPTS))]
    assert len({a.tobytes() for a in alone}) == len(PROMPTS)
    order = [5, 2, 0, 4, 1, 3]
    moved = np.asarray(eng.generate(tokens[order], lengths[order], rng=[SEEDS[i] for i in order],
                                    max_new_tokens=16).tokens)
    short = [i for i in order if i < 4]   # the step driver over one block (its programs: one shape)
    stepped, _, _ = collect(eng.steps(tokens[short, :16], lengths[short], rng=[SEEDS[i] for i in short],
                                      max_new_tokens=16), len(short), 16, sampler.canvas_length, sampler.pad_id)
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(out[i], alone[i], err_msg=f"prompt {i} in the batch")
        np.testing.assert_array_equal(moved[order.index(i)], alone[i], err_msg=f"prompt {i} reordered")
    for r, i in enumerate(short):
        np.testing.assert_array_equal(stepped[r], alone[i], err_msg=f"prompt {i}, step driver")


def test_the_switch_reaches_the_engine_and_a_bad_value_is_refused(bundled):
    cfg, params, sampler, tok = bundled
    gemma = DiffusionGemma(cfg, params, tok, sampler, batch_invariant=8)
    assert gemma.engine.batch_invariant is True and gemma.engine.invariant_block == 8
    assert Engine(cfg, params, sampler).invariant_block == 1   # the default: row by row
    for bad in (-1, 2.5, "8"):
        with pytest.raises(ValueError, match="batch_invariant must be True, False or a block size"):
            Engine(cfg, params, sampler, batch_invariant=bad)
