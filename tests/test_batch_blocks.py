"""Batch invariance from batched programs (`Engine(batch_invariant=True)`, the default, and
`batch_invariant=N`; issue 46): the rows of a call run as one block of exactly their number (True) or
in blocks of exactly N rows, whatever their prompt lengths, so a batch of mixed-length prompts is one
program call, and a prompt's tokens still do not depend on the rest of the call (alone, in any batch,
at any position; the fused program and the step driver alike) nor on the setting (True or N). What
makes a row's bits independent of its block's size, widest prompt and longest cache: the prefill runs
in canvas-length chunks, and attention runs over fixed key blocks (`Runtime.attn_fixed_blocks`), where
the blocks past a row's keys add exact zeros. The random 12-layer model of
tests/test_batch_invariance.py checks the same in the slow tier."""

import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.engine.engine import rows_share_programs
from dgemma_jax.engine.drivers import collect
from dgemma_jax.model.attention import attend
from dgemma_jax.pipeline import DiffusionGemma, load_checkpoint
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import SamplerConfig

# four prompts of the 16-token bucket, one of the 24-token one, one of the 64-token one (its cache is
# longer: 128 slots against 64 for the others alone)
PROMPTS = ["s3=", "s904215=", "s31415926535=", "s55012=", "s8877665544332211=", "s" + "9876543210" * 6 + "="]
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


def _counting(eng):
    """The engine's fused program wrapped to record each call's (prompt shape, cache length)."""
    calls, program = [], eng.fused_program

    def counted(*a, **k):
        fn = program(*a, **k)

        def call(*x, **y):
            calls.append((y["prompt_tokens"].shape, y["cache"].max_length))
            return fn(*x, **y)
        return call

    eng.fused_program = counted
    return calls


def test_mixed_length_prompts_run_as_one_block_and_keep_their_alone_tokens(bundled):
    cfg, params, sampler, tok = bundled
    tokens, lengths = _encode(tok, PROMPTS)
    eng = Engine(cfg, params, sampler)    # the default: the call's rows as one block
    calls = _counting(eng)
    out = np.asarray(eng.generate(tokens, lengths, rng=SEEDS, max_new_tokens=16).tokens)
    # the three buckets' prompts in one call of their six rows
    assert calls == [((6, 64), 128)], calls
    calls.clear()
    alone = [np.asarray(eng.generate(tokens[i:i + 1, :lengths[i]], lengths[i:i + 1], rng=[SEEDS[i]],
                                     max_new_tokens=16).tokens)[0] for i in range(len(PROMPTS))]
    # alone, a prompt is one row, and a short one gets a narrower prompt and a shorter cache
    assert {c[0][0] for c in calls} == {1}, calls
    assert {c[0][1] for c in calls} == {16, 24, 64} and {c[1] for c in calls} == {64, 128}, calls
    assert len({a.tobytes() for a in alone}) == len(PROMPTS)
    order = [5, 2, 0, 4, 1, 3]
    moved = np.asarray(eng.generate(tokens[order], lengths[order], rng=[SEEDS[i] for i in order],
                                    max_new_tokens=16).tokens)
    two = [0, 5]   # the shortest and the longest prompt together, the step driver
    stepped, _, _ = collect(eng.steps(tokens[two], lengths[two], rng=[SEEDS[i] for i in two], max_new_tokens=16),
                            len(two), 16, sampler.canvas_length, sampler.pad_id)
    # blocks of 8 rows (two copies fill the block): one call, the same tokens (its every batch shape
    # and position: tests/test_batch_invariance.py)
    eight = Engine(cfg, params, sampler, batch_invariant=8)
    calls = _counting(eight)
    blocks = np.asarray(eight.generate(tokens, lengths, rng=SEEDS, max_new_tokens=16).tokens)
    assert calls == [((8, 64), 128)], calls
    for i in range(len(PROMPTS)):
        np.testing.assert_array_equal(out[i], alone[i], err_msg=f"prompt {i} in the batch")
        np.testing.assert_array_equal(moved[order.index(i)], alone[i], err_msg=f"prompt {i} reordered")
        np.testing.assert_array_equal(blocks[i], alone[i], err_msg=f"prompt {i} in a block of 8")
    for r, i in enumerate(two):
        np.testing.assert_array_equal(stepped[r], alone[i], err_msg=f"prompt {i}, step driver")


def test_fixed_key_blocks_make_masked_keys_past_a_row_change_no_bit():
    """A query's attention over fixed key blocks is bitwise the same with 64 keys or with 192 (the
    last 128 masked); one softmax over all keys (not fixed blocks) is not what makes that hold."""
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(2, 8, 4, 16), jnp.float32)
    k = jnp.asarray(rng.randn(2, 2, 192, 16), jnp.float32)   # [B, K, S, H]
    v = jnp.asarray(rng.randn(2, 2, 192, 16), jnp.float32)
    seen = jnp.asarray(np.arange(192)[None, None, :] < np.array([40, 64])[:, None, None])
    short = attend(q, [(k[:, :, :64], v[:, :, :64], seen[..., :64])], 64, fixed_blocks=True)
    long = attend(q, [(k, v, seen)], 64, fixed_blocks=True)
    np.testing.assert_array_equal(np.asarray(short), np.asarray(long))
    np.testing.assert_allclose(np.asarray(attend(q, [(k, v, seen)], None)), np.asarray(long), atol=1e-5)


def test_the_switch_reaches_the_engine_and_a_bad_value_is_refused(bundled):
    cfg, params, sampler, tok = bundled
    gemma = DiffusionGemma(cfg, params, tok, sampler, batch_invariant=4)
    assert gemma.engine.batch_invariant is True and gemma.engine.invariant_block == 4
    eng = Engine(cfg, params, sampler)
    assert eng.invariant_block is None and eng.gen_runtime.attn_fixed_blocks   # the default: a call's rows
    assert eng.prefill_chunk == sampler.canvas_length
    assert rows_share_programs(cfg, Runtime()) and not rows_share_programs(cfg, Runtime(platform="tpu"))
    one = Engine(cfg, params, sampler, batch_invariant=1)      # row by row: each row's own shapes
    assert one.invariant_block == 1 and one.gen_runtime == one.runtime and one.prefill_chunk is None
    eng = Engine(cfg, params, sampler, batch_invariant=8)
    assert eng.invariant_block == 8 and eng.gen_runtime.attn_fixed_blocks
    assert eng.prefill_chunk == sampler.canvas_length
    off = Engine(cfg, params, sampler, batch_invariant=False)
    assert off.prefill_chunk is None and off.gen_runtime == off.runtime and off.invariant_block is None
    for bad in (-1, 2.5, "8"):
        with pytest.raises(ValueError, match="batch_invariant must be True, False or a block size"):
            Engine(cfg, params, sampler, batch_invariant=bad)


def test_bfloat16_runs_row_by_row_and_keeps_its_alone_tokens():
    """With bfloat16 activations a row's numbers changed with the row count of a shared program on
    XLA:CPU (benchmarks/results/batch_invariance_configs.json: 5 of 6 rows), so the default runs such
    a model row by row, each prompt its own program: a batch's rows get their alone tokens."""
    cfg = ModelConfig.preset("tiny-2layer", dtype="bfloat16", param_dtype="bfloat16")
    assert not rows_share_programs(cfg, Runtime())
    eng = Engine(cfg, init_params(cfg, 0), SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,)))
    assert eng.invariant_block == 1 and eng.prefill_chunk is None and not eng.gen_runtime.attn_fixed_blocks
    rng = np.random.default_rng(1)
    lengths = np.array([3, 20, 9], np.int32)
    tokens = np.zeros((3, 20), np.int32)
    for r, n in enumerate(lengths):
        tokens[r, :n] = rng.integers(3, cfg.vocab_size, n)
    both = np.asarray(eng.generate(tokens, lengths, rng=[1, 2, 3], max_new_tokens=16).tokens)
    alone = [np.asarray(eng.generate(tokens[i:i + 1, :n], lengths[i:i + 1], rng=[i + 1],
                                     max_new_tokens=16).tokens)[0] for i, n in enumerate(lengths)]
    assert len({a.tobytes() for a in alone}) == 3
    for i in range(3):
        np.testing.assert_array_equal(both[i], alone[i], err_msg=f"prompt {i}")


def test_a_long_call_runs_in_blocks_of_at_most_the_row_limit(bundled, monkeypatch):
    """The default runs a call's rows together up to `INVARIANT_MAX_ROWS` a program (memory stays
    bounded for a long list): with the limit at 2, three prompts run as a block of 2 and one of 1,
    each with its alone tokens."""
    from dgemma_jax.engine import engine as engine_lib

    cfg, params, sampler, tok = bundled
    monkeypatch.setattr(engine_lib, "INVARIANT_MAX_ROWS", 2)
    eng = Engine(cfg, params, sampler)
    calls = _counting(eng)
    idx = [0, 3, 1]   # three prompts of the 16-token bucket
    tokens, lengths = _encode(tok, [PROMPTS[i] for i in idx])
    out = np.asarray(eng.generate(tokens, lengths, rng=[SEEDS[i] for i in idx], max_new_tokens=16).tokens)
    assert [c[0][0] for c in calls] == [2, 1], calls
    for r, i in enumerate(idx):
        one, n = _encode(tok, [PROMPTS[i]])
        np.testing.assert_array_equal(out[r], np.asarray(eng.generate(one, n, rng=[SEEDS[i]],
                                                                      max_new_tokens=16).tokens)[0])
