"""Shape buckets: prompts of nearby lengths reuse one compiled program, and the padding stays invisible.

The padded programs sum in another order than the exact ones, so in general their tokens agree only
up to float rounding (benchmarks/prompt_buckets.py measures it at the bench config). At these tiny
widths and seeds they are equal, which a padding that leaked into the cache or the attention would
break at once."""

import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.engine.inputs import bucket_length, prepare_inputs
from dgemma_jax.sampling import SamplerConfig

CFG = ModelConfig.preset("tiny-2layer")
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=4, eos_ids=(1,))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 3)


def test_bucket_lengths():
    assert [bucket_length(n) for n in (1, 16, 17, 24, 25, 33, 49, 100, 512, 513, 769, 5000)] == [
        16, 16, 24, 24, 32, 48, 64, 128, 512, 768, 1024, 6144]
    prev = 0
    for n in range(1, 5000):
        b = bucket_length(n)
        assert b >= n and b >= prev and bucket_length(b) == b  # covers n, monotone, a fixed point
        assert n <= 16 or (b - n) * 3 < b  # padding is under a third of the bucket
        prev = b


def _batch(width, seed):
    rs = np.random.RandomState(seed)
    tokens = rs.randint(3, CFG.vocab_size, (2, width)).astype(np.int32)
    return tokens, np.array([width, max(1, width - 4)], np.int32)


def test_nearby_prompt_lengths_share_one_program_and_the_tokens(params):
    widths = (9, 11, 14)  # one bucket (16); the exact engine compiles each width separately
    outs, together = {}, {}
    for bucket in (True, False):
        # row by row (batch_invariant=1, the default off a CPU's float32): each row runs alone, so the
        # exact engine compiles one program per distinct row length (w and w - 4: six), the bucketed
        # one a single program for all of them
        eng = Engine(CFG, params, SAMPLER, bucket=bucket, batch_invariant=1)
        before = eng.fused_program(32)._cache_size()
        outs[bucket] = [eng.generate(*_batch(w, w), rng=w, max_new_tokens=32) for w in widths]
        compiled = eng.fused_program(32)._cache_size() - before
        assert compiled == (1 if bucket else 2 * len(widths)), (bucket, compiled)
        # the default on a CPU runs the two rows as one program, as wide as the wider row's bucket
        # (exact: its own width), its cache in whole key blocks
        eng = Engine(CFG, params, SAMPLER, bucket=bucket)
        before = eng.fused_program(32)._cache_size()
        together[bucket] = [eng.generate(*_batch(w, w), rng=w, max_new_tokens=32) for w in widths]
        assert eng.fused_program(32)._cache_size() - before == (1 if bucket else len(widths)), bucket
    for w, a, b in zip(widths, together[True], together[False]):
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=f"default, width {w}")
    for w, a, b in zip(widths, outs[True], outs[False]):
        np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens), err_msg=f"width {w}")
        np.testing.assert_array_equal(np.asarray(a.steps), np.asarray(b.steps))
        assert a.cache.max_length == 16 + 16 and b.cache.max_length == w + 16  # bucketed context + 1 canvas


def test_streamed_canvases_through_the_shared_bucketing_match_the_exact_shapes(params):
    tokens, lengths = _batch(11, 0)
    ref = Engine(CFG, params, SAMPLER, bucket=False).generate(tokens, lengths, rng=5, max_new_tokens=32)
    events = list(Engine(CFG, params, SAMPLER).stream(tokens, lengths, rng=5, max_new_tokens=32))
    np.testing.assert_array_equal(np.concatenate([np.asarray(e.tokens) for e in events], 1), np.asarray(ref.tokens))


def test_buckets_respect_the_positions_and_an_explicit_cache_length():
    cfg = CFG.replace(max_position_embeddings=40)
    tokens = np.full((1, 20), 5, np.int32)
    out, lengths, cache_length, _, _ = prepare_inputs(cfg, SAMPLER, tokens, None, 16, bucket=True)
    assert out.shape == (1, 24) and (np.asarray(out[:, 20:]) == cfg.pad_id).all()  # padded, not truncated
    assert lengths.tolist() == [20] and cache_length == 24
    # two canvases: the cache holds the bucketed context and the first canvas
    assert prepare_inputs(cfg, SAMPLER, np.full((1, 2), 5, np.int32), None, 32, bucket=True)[2] == 16 + 16
    # a given cache length is the caller's: kept as it is
    assert prepare_inputs(cfg, SAMPLER, tokens, None, 16, cache_length=21, bucket=True)[2] == 21
    # near the end of the positions, the buckets (96) are capped at max_position_embeddings (81)
    cfg = CFG.replace(max_position_embeddings=81)
    out, _, cache_length, _, _ = prepare_inputs(cfg, SAMPLER, np.full((1, 65), 5, np.int32), None, 16, bucket=True)
    assert out.shape == (1, 81) and cache_length == 81
    with pytest.raises(ValueError, match="max_position_embeddings"):  # 66 + a canvas of 16 > 81: still an error
        prepare_inputs(cfg, SAMPLER, np.full((1, 66), 5, np.int32), None, 16, bucket=True)
