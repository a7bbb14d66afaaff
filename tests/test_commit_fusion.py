"""A canvas's commit and the next canvas's first step in one pass over the layers
(`Block.commit_denoise`, `loop.commit_and_step`, `generate.commit_and_first_step`), and
`generate_fused` running it (`Runtime.commit_pass`): the same tokens, cache and steps as the
commit's own causal pass followed by the step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.model.cache import init_cache
from dgemma_jax.model.quant import quantize_params
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import SamplerConfig
from dgemma_jax.sampling import generate as gen
from dgemma_jax.sampling.loop import denoise_step, row_keys

# a sliding and a global layer; the window (8) shorter than the prompts, so the sliding layer's cache
# is a ring that the commit wraps round
TWO = ModelConfig.preset("tiny-6layer", num_layers=2, layer_types=("sliding", "global"), sliding_window=8)
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=6, eos_ids=(1,))


def _prompts(cfg, b=3, p=20):
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, cfg.vocab_size, (b, p)).astype(np.int32)
    return jnp.asarray(tokens), jnp.asarray(np.array([p, p - 7, 5][:b], np.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "rt"))
def _separate(params, cache, tokens, active, canvas, cfg, rt):
    cache = gen.commit(params, cfg, cache, tokens, active, rt)
    state = denoise_step(params, cfg, SAMPLER, cache, cache.lengths, canvas.keys, canvas.state, runtime=rt)
    return state, cache


@functools.partial(jax.jit, static_argnames=("cfg", "rt"))
def _fused(params, cache, tokens, active, canvas, cfg, rt):
    return gen.commit_and_first_step(params, cfg, SAMPLER, cache, tokens, active, canvas, rt)


@functools.partial(jax.jit, static_argnames=("cfg", "rt"))
def _prefill(params, tokens, lengths, cache, cfg, rt):
    return gen.prefill(params, cfg, tokens, lengths, cache, rt)


# the layers unrolled with int8 weights; scanned (the 6-layer model: one group of five sliding layers
# and a global one) with float weights
CASES = {"unrolled_int8": (TWO, "unrolled", "int8"),
         "scan": (ModelConfig.preset("tiny-6layer", sliding_window=8), "scan", None)}


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_gives_what_the_commit_and_then_the_step_give(case):
    """Rows 0 and 2 commit a canvas (row 0's prompt and canvas wrap round the sliding layer's ring),
    row 1 commits nothing: the fused pass leaves the cache as the causal pass leaves it (row 1's
    untouched, every bit) and its step decides as the step after it."""
    cfg, layers, quant = CASES[case]
    rt = Runtime(layers=layers)
    params = init_params(cfg, 0)
    if quant:
        params = quantize_params(cfg, params, quant)
    tokens, lengths = _prompts(cfg)
    cache = _prefill(params, tokens, lengths, init_cache(cfg, 3, 64, layers=layers), cfg, rt)
    keys = row_keys(jax.random.key(1), 3)
    settled = jax.random.randint(jax.random.key(2), (3, 16), 3, cfg.vocab_size)
    active = jnp.array([True, False, True])
    canvas = gen.canvas_start(cfg, SAMPLER, keys, 1)
    s_state, s_cache = _separate(params, cache, settled, active, canvas, cfg, rt)
    f_state, f_cache = _fused(params, cache, settled, active, canvas, cfg, rt)
    np.testing.assert_array_equal(f_cache.lengths, [36, 13, 21])
    np.testing.assert_array_equal(f_cache.lengths, s_cache.lengths)
    for old, sep, fus in zip(jax.tree.leaves(cache), jax.tree.leaves(s_cache), jax.tree.leaves(f_cache)):
        np.testing.assert_allclose(np.asarray(fus, np.float32), np.asarray(sep, np.float32), rtol=1e-5, atol=1e-5)
        if old.ndim > 1:   # row 1 wrote nothing
            row = old.ndim - 4
            np.testing.assert_array_equal(np.take(np.asarray(fus), 1, axis=row), np.take(np.asarray(old), 1, axis=row))
    np.testing.assert_array_equal(f_state.argmax, s_state.argmax)
    np.testing.assert_array_equal(f_state.canvas, s_state.canvas)
    np.testing.assert_array_equal(f_state.done, s_state.done)
    # the soft embedding sums probabilities x the table: float32 last-bit differences of the joined
    # projections come out ~1e-4 relative in it
    np.testing.assert_allclose(np.asarray(f_state.soft, np.float32), np.asarray(s_state.soft, np.float32),
                               rtol=2e-4, atol=1e-3)


def _generate(params, cfg, rt, max_new):
    sampler = SamplerConfig(canvas_length=16, max_denoising_steps=6, eos_ids=(1,))
    tokens, lengths = _prompts(cfg)
    f = jax.jit(functools.partial(gen.generate_fused, config=cfg, sampler=sampler, max_new_tokens=max_new, runtime=rt))
    return f(params, prompt_tokens=tokens, prompt_lengths=lengths, cache=init_cache(cfg, 3, 96, layers=rt.layers),
             keys=row_keys(jax.random.key(3), 3))


def test_generate_with_the_fused_commit_gives_the_separate_passes_tokens():
    """`generate_fused` over three canvases with each commit in the next canvas's first pass gives the
    tokens, steps and cache of the commits run as their own passes (the last canvas uncommitted)."""
    params = init_params(TWO, 0)
    sep = _generate(params, TWO, Runtime(commit_pass="separate"), 48)
    fus = _generate(params, TWO, Runtime(commit_pass="fused"), 48)
    np.testing.assert_array_equal(fus.tokens, sep.tokens)
    np.testing.assert_array_equal(fus.steps, sep.steps)
    assert not fus.finished.any() and int(fus.num_canvases) == int(sep.num_canvases) == 3
    np.testing.assert_array_equal(fus.cache.lengths, [20 + 32, 13 + 32, 5 + 32])
    np.testing.assert_array_equal(fus.cache.lengths, sep.cache.lengths)
    for a, b in zip(jax.tree.leaves(fus.cache), jax.tree.leaves(sep.cache)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-5, atol=1e-5)


def test_the_commit_pass_choice():
    assert not Runtime(platform="cpu").fuse_commit()
    assert Runtime(platform="tpu").fuse_commit() and Runtime(platform="gpu").fuse_commit()
    assert Runtime(platform="cpu", commit_pass="fused").fuse_commit()
    assert not Runtime(platform="tpu", commit_pass="separate").fuse_commit()
    with pytest.raises(ValueError, match="commit_pass='both' is invalid.*fused"):
        Runtime(commit_pass="both")
