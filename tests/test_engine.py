"""The compiled engine: while_loop vs Python drivers, multi-canvas generation, infilling, batching."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.engine.drivers import collect
from dgemma_jax.engine.inputs import prepare_inputs
from dgemma_jax.model.cache import layer_slots
from dgemma_jax.sampling import SamplerConfig
from dgemma_jax.sampling.loop import Canvas, denoise_canvas, init_state, loop_running, row_keys

# one sliding and one global layer: every kind of layer the engine handles (more add compile time only)
CFG = ModelConfig.preset("tiny-6layer", num_layers=2, layer_types=("sliding", "global"))


@pytest.fixture(scope="module")
def params():
    return init_params(CFG, 0)


def _prompts(b=3, p=20, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randint(3, CFG.vocab_size, (b, p)).astype(np.int32), np.array([20, 13, 5][:b], np.int32)


def _sampler(**kw):
    base = dict(canvas_length=16, max_denoising_steps=6, eos_ids=(1,))
    base.update(kw)
    return SamplerConfig(**base)


def _python_loop(params, sampler, cache, keys, canvas, pinned):
    """Reference driver: the engine's jitted step called from a host loop."""
    step = Engine(CFG, params, sampler).programs.denoise_step
    state = init_state(CFG, sampler, canvas)
    seed = canvas if pinned is not None else None
    trajectory = []
    while bool(loop_running(state, sampler)):
        state = step(params, cache=cache, context_end=cache.lengths, keys=keys, state=state, seed=seed, pinned=pinned)
        trajectory.append(state)
    return state, trajectory


@functools.lru_cache(maxsize=None)
def _canvas_loop(sampler):
    return jax.jit(functools.partial(denoise_canvas, config=CFG, sampler=sampler))


def _denoise_canvas(params, sampler, cache, keys, canvas, pinned=None):
    """The canvas's `lax.while_loop` (`loop.denoise_canvas`, what the fused generate runs per canvas)
    from a given start canvas, under a jit of ours: its final LoopState."""
    start = Canvas(init_state(CFG, sampler, canvas), keys, canvas if pinned is not None else None, pinned)
    return _canvas_loop(sampler)(params, cache=cache, canvas=start).state


@pytest.mark.parametrize("early_stop", [False, True])
def test_while_loop_equals_python_loop(params, early_stop):
    sampler = _sampler()
    tokens, lengths = _prompts()
    eng = Engine(CFG, params, sampler)
    cache = eng.programs.prefill(params, tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
                               cache=eng.new_cache(3, 40))
    keys = row_keys(jax.random.key(3), 3)
    canvas = jax.random.randint(jax.random.key(4), (3, 16), 0, CFG.vocab_size, jnp.int32)
    pinned = None
    if early_stop:
        # Row 0 fully pinned: stable at step 2 with zero free entropy -> stops early while the others run on.
        pinned = jnp.zeros((3, 16), bool).at[0].set(True).at[1, :8].set(True)
    fused = _denoise_canvas(params, sampler, cache, keys, canvas, pinned)
    ref, _ = _python_loop(params, sampler, cache, keys, canvas, pinned)
    np.testing.assert_array_equal(np.asarray(fused.argmax), np.asarray(ref.argmax))
    np.testing.assert_array_equal(np.asarray(fused.steps), np.asarray(ref.steps))
    steps = np.asarray(fused.steps)
    if early_stop:
        assert steps[0] == 2 and steps[1] == steps[2] == sampler.max_denoising_steps
    else:
        assert (steps == sampler.max_denoising_steps).all()


def test_pinned_positions_never_change(params):
    sampler = _sampler(max_denoising_steps=8)
    tokens, lengths = _prompts()
    eng = Engine(CFG, params, sampler)
    cache = eng.programs.prefill(params, tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
                               cache=eng.new_cache(3, 40))
    keys = row_keys(jax.random.key(0), 3)
    seed = jax.random.randint(jax.random.key(9), (3, 16), 0, CFG.vocab_size, jnp.int32)
    pinned = jax.random.bernoulli(jax.random.key(10), 0.4, (3, 16))
    _, traj = _python_loop(params, sampler, cache, keys, seed, pinned)
    pin = np.asarray(pinned)
    for st in traj:
        np.testing.assert_array_equal(np.asarray(st.canvas)[pin], np.asarray(seed)[pin])
        np.testing.assert_array_equal(np.asarray(st.argmax)[pin], np.asarray(seed)[pin])
    # the free positions do move
    assert (np.asarray(traj[-1].argmax)[~pin] != np.asarray(seed)[~pin]).any()


def test_fixed_point_seed_stops_early(params):
    """A seeded canvas that is already a fixed point (every position held) stops at the first
    possible step (2: stability needs one previous argmax) instead of running the budget."""
    sampler = _sampler(max_denoising_steps=20)
    tokens, lengths = _prompts(1)
    eng = Engine(CFG, params, sampler)
    seed = np.random.RandomState(1).randint(3, CFG.vocab_size, (1, 16)).astype(np.int32)
    out = eng.generate(tokens, lengths, rng=0, max_new_tokens=16, seed_canvas=seed,
                       pinned=np.ones((1, 16), bool))
    assert int(out.steps[0, 0]) == 2
    np.testing.assert_array_equal(np.asarray(out.tokens), seed)


def _eos_sampler(params, tokens, lengths):
    """Pick an EOS id that occurs in row 0's first canvas (not first position) but nowhere in rows 1-2."""
    sampler = _sampler(eos_ids=(1,))
    out = Engine(CFG, params, sampler).generate(tokens, lengths, rng=5, max_new_tokens=48)
    toks = np.asarray(out.tokens)
    for cand in toks[0, 4:16]:
        if cand not in toks[1:, :] and cand not in toks[0, :4]:
            return _sampler(eos_ids=(int(cand),)), int(cand)
    pytest.skip("no EOS candidate in this draw")


def test_fused_equals_per_canvas_with_eos_and_exact_length(params):
    tokens, lengths = _prompts()
    sampler, eos = _eos_sampler(params, tokens, lengths)
    eng = Engine(CFG, params, sampler)
    max_new = 40  # 3 canvases of 16, trimmed to 40
    fused = eng.generate(tokens, lengths, rng=5, max_new_tokens=max_new)
    toks, steps, finished = collect(eng.stream(tokens, lengths, rng=5, max_new_tokens=max_new), 3, max_new, 16, 0)
    assert fused.tokens.shape == (3, max_new)
    np.testing.assert_array_equal(np.asarray(fused.tokens), toks)
    np.testing.assert_array_equal(np.asarray(fused.steps), steps)
    np.testing.assert_array_equal(np.asarray(fused.finished), finished)
    # row 0 ends at its first EOS inside canvas 0: pad after it, no more canvases for it
    row0 = toks[0]
    first = int(np.argmax(row0 == eos))
    assert row0[first] == eos and (row0[first + 1:] == sampler.pad_id).all()
    assert finished[0] and steps[0, 1] == 0 and steps[0, 2] == 0
    # the other rows ran all 3 canvases with real commits in between
    assert (steps[1:] > 0).all()
    assert int(fused.num_canvases) == 3
    # per-step driver gives the same tokens too
    ev_toks, ev_steps, _ = collect(eng.steps(tokens, lengths, rng=5, max_new_tokens=max_new), 3, max_new, 16, 0)
    np.testing.assert_array_equal(ev_toks, toks)
    np.testing.assert_array_equal(ev_steps, steps)


def test_commit_changes_next_canvas(params):
    """Canvas 2 depends on canvas 1 through the commit (the cache really grows between canvases)."""
    tokens, lengths = _prompts()
    eng = Engine(CFG, params, _sampler())
    out = eng.generate(tokens, lengths, rng=1, max_new_tokens=32)
    lens = np.asarray(out.cache.lengths)
    np.testing.assert_array_equal(lens, lengths + 16)


def test_row_independent_of_batch(params):
    tokens, lengths = _prompts()
    eng = Engine(CFG, params, _sampler())
    keys = jax.random.split(jax.random.key(42), 3)
    batch = eng.generate(tokens, lengths, rng=keys, max_new_tokens=32, cache_length=52)
    for i in range(3):
        # the row alone (same padded width, so one compilation serves all three)
        alone_tokens = np.zeros_like(tokens[:1])
        alone_tokens[0, : lengths[i]] = tokens[i, : lengths[i]]
        alone = eng.generate(alone_tokens, lengths[i:i + 1], rng=keys[i:i + 1], max_new_tokens=32,
                             cache_length=52)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(batch.tokens)[i])


def test_capacity_errors_before_compiling():
    sampler = _sampler()
    tokens, lengths = _prompts()
    with pytest.raises(ValueError, match="raise cache_length to >= 52"):
        prepare_inputs(CFG, sampler, tokens, lengths, max_new_tokens=40, cache_length=30)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        prepare_inputs(CFG.replace(max_position_embeddings=40), sampler, tokens, lengths, max_new_tokens=40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        prepare_inputs(CFG, sampler, tokens, lengths, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt length"):
        prepare_inputs(CFG, sampler, tokens, np.array([21, 3, 3]), max_new_tokens=8)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        prepare_inputs(CFG, _sampler(eos_ids=(999,)), tokens, lengths, max_new_tokens=8)
    with pytest.raises(ValueError, match="seed_canvas"):
        prepare_inputs(CFG, sampler, tokens, lengths, max_new_tokens=8, pinned=np.ones((3, 16), bool))
    for empty in (np.zeros((0, 3), np.int32), np.zeros((2, 0), np.int32)):
        with pytest.raises(ValueError, match="at least one prompt of at least one token"):
            prepare_inputs(CFG, sampler, empty, None, max_new_tokens=8)


def test_denoise_step_aot_compiles(params):
    """The separately jitted pieces lower and compile ahead of time from shapes alone."""
    from dgemma_jax import cache_shape, param_shapes

    sampler = _sampler()
    ps = param_shapes(CFG)
    cache = cache_shape(CFG, 2, 64)
    keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), 2))
    state = jax.eval_shape(lambda: init_state(CFG, sampler, jnp.zeros((2, 16), jnp.int32)))
    step = Engine(CFG, init_params(CFG, 0), sampler).programs.denoise_step
    compiled = step.lower(ps, cache=cache, context_end=cache.lengths, keys=keys, state=state).compile()
    assert compiled.memory_analysis() is not None


def test_a_huge_stability_threshold_runs_like_one_past_the_budget(params):
    # "Never stop on stability" written as 10**9 must not carry a [B, 10**9, L] history through
    # the loop: it decides exactly like S = N + 1, with an N-row history.
    tokens, lengths = _prompts()
    pinned = jnp.zeros((3, 16), bool).at[0].set(True)  # row 0 stable from step 1 with zero entropy
    canvas = jax.random.randint(jax.random.key(4), (3, 16), 0, CFG.vocab_size, jnp.int32)
    keys = row_keys(jax.random.key(3), 3)
    out = {}
    for s in (2, 7, 10**9):
        sampler = _sampler(stability_threshold=s)
        eng = Engine(CFG, params, sampler)
        cache = eng.programs.prefill(params, tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
                                   cache=eng.new_cache(3, 40))
        out[s] = _denoise_canvas(params, sampler, cache, keys, canvas, pinned)
    assert out[2].history.shape == (3, 2, 16)
    assert out[7].history.shape == out[10**9].history.shape == (3, 6, 16)
    assert np.asarray(out[2].steps)[0] == 3  # S below the budget still stops the pinned row early
    np.testing.assert_array_equal(np.asarray(out[10**9].steps), [6, 6, 6])
    for f in ("argmax", "steps", "history"):
        np.testing.assert_array_equal(np.asarray(getattr(out[10**9], f)), np.asarray(getattr(out[7], f)))


def test_max_new_tokens_zero_is_an_error_not_a_canvas(params):
    eng = Engine(CFG, params, _sampler())
    tokens, lengths = _prompts(1)
    for call in (eng.generate, eng.stream):
        with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
            out = call(tokens, lengths, rng=0, max_new_tokens=0)
            list(out) if call is eng.stream else out


def test_stream_yields_exactly_max_new_tokens(params):
    eng = Engine(CFG, params, _sampler(eos_ids=()))  # no EOS: every row runs every canvas
    tokens, _ = _prompts(2)
    lengths = np.array([20, 17], np.int32)   # two rows (their streams merged) of one width bucket: one shape
    for max_new in (5, 21):  # inside one canvas; a whole canvas then part of the next
        events = list(eng.stream(tokens, lengths, rng=2, max_new_tokens=max_new))
        assert sum(ev.tokens.shape[1] for ev in events) == max_new
        streamed = np.concatenate([ev.tokens for ev in events], axis=1)
        np.testing.assert_array_equal(streamed, np.asarray(eng.generate(tokens, lengths, rng=2,
                                                                         max_new_tokens=max_new).tokens))


def test_rng_seeds_beyond_int32_and_clear_errors_for_bad_rng(params):
    eng = Engine(CFG, params, _sampler())
    tokens, lengths = _prompts(1)
    big = eng.generate(tokens, lengths, rng=3_000_000_000, max_new_tokens=8)
    same = eng.generate(tokens, lengths, rng=jax.random.key(3_000_000_000), max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(big.tokens), np.asarray(same.tokens))
    np.testing.assert_array_equal(jax.random.key_data(row_keys(7, 2)), jax.random.key_data(row_keys(jax.random.key(7), 2)))
    for bad, what in ((None, "integer seed"), (1.5, "integer seed"), ("7", "integer seed"), (2**64, "64 bits")):
        with pytest.raises(ValueError, match=what):
            eng.generate(tokens, lengths, rng=bad, max_new_tokens=8)


def test_new_tokens_that_fit_the_positions_and_the_cache():
    from dgemma_jax.engine.inputs import new_tokens_that_fit

    s = _sampler()  # canvas 16
    room = CFG.max_position_embeddings
    assert new_tokens_that_fit(CFG, s, 20, 10**6) == (room - 20) // 16 * 16
    assert new_tokens_that_fit(CFG, s, 20, 40) == 40
    assert new_tokens_that_fit(CFG, s, 20, 10**6, cache_length=70) == 4 * 16  # 20 + 3 committed canvases <= 70
    tokens = np.full((1, 20), 5, np.int32)
    n = new_tokens_that_fit(CFG, s, 20, 10**6)
    prepare_inputs(CFG, s, tokens, None, n)  # fits
    with pytest.raises(ValueError, match="max_position_embeddings"):
        prepare_inputs(CFG, s, tokens, None, n + 16)


def test_every_64_bit_seed_gives_its_own_stream(params):
    # Engine.generate(rng=2**63) ended in an OverflowError, and seeds 0 and 2**32 gave the same
    # stream (jax.random.key keeps the low 32 bits without jax_enable_x64)
    from dgemma_jax.sampling.loop import seed_key

    data = lambda s: np.asarray(jax.random.key_data(seed_key(s))).tolist()
    assert data(0) != data(2**32) and data(2**63) != data(2**63 + 1) and data(2**64 - 1) == data(-1)
    for s in (0, 5, 2**31, 2**32 - 1):  # the seeds jax.random.key took whole keep their streams
        assert data(s) == np.asarray(jax.random.key_data(jax.random.key(s))).tolist()
    eng = Engine(CFG, params, _sampler())
    tokens, lengths = _prompts(1)
    outs = [np.asarray(eng.generate(tokens, lengths, rng=s, max_new_tokens=16).tokens) for s in (0, 2**32, 2**63, 2**64 - 1)]
    assert not np.array_equal(outs[0], outs[1])  # 2**32 is not seed 0 again
    with pytest.raises(ValueError,
                       match=r"seed 18446744073709551616 does not fit in 64 bits; use an integer in \[-2\*\*63, 2\*\*64\)"):
        eng.generate(tokens, lengths, rng=2**64, max_new_tokens=16)


def test_a_canvas_length_the_model_was_not_trained_for_is_warned(params):
    # the engine ran any canvas length without a word, though the model only saw its config's
    import warnings

    from dgemma_jax.errors import DgemmaWarning

    with pytest.warns(DgemmaWarning, match="canvas length 8 is not the 16 this model was trained with .* use a "
                                           "canvas length of 16"):
        Engine(CFG, params, _sampler(canvas_length=8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DgemmaWarning)
        Engine(CFG, params, _sampler())  # the trained length: no warning


def test_a_cache_passed_in_is_donated_only_when_asked(params):
    """A caller's cache stays usable after `generate(cache=...)` (it was donated by default, so the
    caller's handle raised "Array has been deleted"); `donate_cache=True` gives it to the program, and
    `Engine(donate=False)` never donates. The tokens are the same every way."""
    tokens = np.asarray([[5, 6, 7, 8]], np.int32)
    sampler = SamplerConfig(canvas_length=CFG.canvas_length, max_denoising_steps=4, eos_ids=(), pad_id=0)
    results = []
    for donate, donate_cache, deleted in ((True, False, False), (False, False, False), (False, True, False),
                                          (True, True, True)):
        eng = Engine(CFG, params, sampler, donate=donate)
        cache = eng.new_cache(1, 64)
        out = eng.generate(tokens, rng=3, max_new_tokens=CFG.canvas_length, cache=cache, donate_cache=donate_cache)
        results.append(np.asarray(out.tokens))
        if deleted:
            with pytest.raises(RuntimeError, match="deleted|donated"):
                np.asarray(cache.keys[0])
            continue
        # every layer's entry still there: 64 slots a global layer, the ring a sliding one (model/cache.py)
        assert [np.asarray(k).shape[2] for k in cache.keys] == [layer_slots(CFG, i, 64) for i in range(CFG.num_layers)]
        assert cache.max_length == 64 and int(np.asarray(cache.lengths)[0]) == 0
        again = eng.generate(tokens, rng=3, max_new_tokens=CFG.canvas_length, cache=cache)   # reusable
        np.testing.assert_array_equal(np.asarray(again.tokens), results[-1])
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_generate_fused_runs_inside_the_callers_jit(params):
    """The exported traceable pieces: `dg.generate_fused` under the caller's own jax.jit, with keys from
    `dg.row_keys`, gives the engine's tokens; `dg.generate` (host checks) says to use it when traced."""
    import dgemma_jax as dg

    sampler = _sampler()
    tokens, lengths = _prompts()
    keys = dg.row_keys(7, 3)

    @jax.jit
    def mine(params, tokens, lengths, keys):
        cache = dg.init_cache(CFG, tokens.shape[0], 64)
        out = dg.generate_fused(params, CFG, sampler, tokens, lengths, cache, keys, max_new_tokens=32)
        return out.tokens, out.steps

    got, steps = mine(params, tokens, lengths, keys)
    want = Engine(CFG, params, sampler, bucket=False).generate(tokens, lengths, rng=keys, max_new_tokens=32,
                                                               cache_length=64)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(steps), np.asarray(want.steps))
    assert {"generate_fused", "row_keys", "init_state", "denoise_step", "initial_canvas"} <= set(dg.__all__)

    with pytest.raises(ValueError, match="cannot be traced.*generate_fused") as e:
        jax.jit(lambda p, t: dg.generate(p, CFG, t, None, sampler).tokens)(params, tokens)
    assert "\n" not in str(e.value)


def test_an_own_step_loop_from_the_exported_pieces_matches_the_denoise_canvas(params):
    import dgemma_jax as dg

    sampler = _sampler()
    tokens, lengths = _prompts()
    _, cache = dg.prefill(params, CFG, tokens, lengths, dg.init_cache(CFG, 3, 64), logits="none")
    keys = dg.row_keys(5, 3)
    canvas = dg.initial_canvas(keys, sampler.canvas_length, CFG.vocab_size)
    state = dg.init_state(CFG, sampler, canvas)
    step = jax.jit(functools.partial(dg.denoise_step, config=CFG, sampler=sampler))
    while not bool(state.done.all()):
        state = step(params, cache=cache, context_end=cache.lengths, keys=keys, state=state)
    ref = _denoise_canvas(params, sampler, cache, keys, canvas)
    np.testing.assert_array_equal(np.asarray(state.argmax), np.asarray(ref.argmax))
    np.testing.assert_array_equal(np.asarray(state.steps), np.asarray(ref.steps))
