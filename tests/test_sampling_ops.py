"""Unit tests of the pure sampler functions (dgemma_jax.sampling), JAX only."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax.sampling import (
    SamplerConfig,
    apply_temperature,
    entropy_bound_accept,
    init_history,
    push_history,
    renoise,
    sample_step_stats,
    sanitize_logits,
    stop_decision,
    temperature,
    tokens_per_forward,
    truncate_at_eos,
    uniform_tokens,
)

F32 = np.float32


def _entropy_f64(logits):
    """Reference entropy of softmax(logits) in float64, 0 log 0 = 0."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    return -plogp.sum(-1)


# jit once per shape: eager op-by-op dispatch of the chunked scan is slow
_stats = jax.jit(sample_step_stats, static_argnames=("chunk_size",))
_accept = jax.jit(entropy_bound_accept)


def _np_gumbel(shape, seed=0):
    """Gumbel noise from NumPy (keeps threefry out of most compiled tests)."""
    return jnp.asarray(np.random.default_rng(seed).gumbel(size=shape).astype(np.float32))


# ----------------------------------------------------------------- temperature


def test_temperature_endpoints_and_schedule():
    cfg = SamplerConfig()
    n = cfg.max_denoising_steps
    assert float(temperature(cfg, 0)) == F32(0.8)
    assert float(temperature(cfg, n - 1)) == pytest.approx(0.4 + 0.4 / n, abs=1e-7)
    steps = jnp.arange(n, dtype=jnp.int32)
    temps = np.asarray(temperature(cfg, steps))
    assert temps.dtype == np.float32 and temps.shape == (n,)
    expected = 0.4 + 0.4 * (n - np.arange(n)) / n
    np.testing.assert_allclose(temps, expected, rtol=0, atol=1e-7)
    assert np.all(np.diff(temps) < 0)
    assert temps.min() > cfg.t_min  # t_min itself is never reached

    cfg7 = SamplerConfig(max_denoising_steps=7, t_min=0.1, t_max=1.5)
    traced = jax.jit(lambda s: temperature(cfg7, s))
    for s in range(7):
        assert float(traced(jnp.int32(s))) == pytest.approx(0.1 + 1.4 * (7 - s) / 7, abs=1e-6)


def test_apply_temperature_divides_in_float32():
    cfg = SamplerConfig(max_denoising_steps=5)
    logits = jax.random.normal(jax.random.key(0), (2, 3, 11), jnp.bfloat16)
    for step in range(5):
        out = apply_temperature(logits, cfg, jnp.int32(step))
        assert out.dtype == jnp.float32
        expected = np.asarray(logits, np.float32) / np.asarray(temperature(cfg, step))
        # XLA rewrites x / scalar as x * (1 / scalar): at most 1 ulp from IEEE division
        np.testing.assert_array_max_ulp(np.asarray(out), expected, maxulp=1)


# --------------------------------------------------------------------- entropy


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_entropy_uniform_onehot_and_exact_zeros(chunk_size):
    v = 50
    uniform_row = jnp.zeros((v,))
    onehot_row = jnp.full((v,), -jnp.inf).at[17].set(3.0)
    near_onehot = jnp.zeros((v,)).at[4].set(200.0)
    # exact zeros: 10 tokens share the mass, the rest are -inf
    sparse_row = jnp.full((v,), -jnp.inf).at[20:30].set(1.25)
    # exact zeros that cover a whole chunk when chunk_size=16 (ids 0..19)
    masked_prefix = jnp.concatenate([jnp.full((20,), -jnp.inf), jnp.linspace(-1, 1, v - 20)])
    z = jnp.stack([uniform_row, onehot_row, near_onehot, sparse_row, masked_prefix])[None]
    st = _stats(z, gumbel=_np_gumbel(z.shape, 1), chunk_size=chunk_size)
    h = np.asarray(st.entropy)[0]
    assert not np.any(np.isnan(h))
    assert h[0] == pytest.approx(math.log(v), abs=1e-6)
    assert h[1] == 0.0
    assert h[2] == pytest.approx(0.0, abs=1e-6)
    assert h[3] == pytest.approx(math.log(10), abs=1e-6)
    assert h[4] == pytest.approx(_entropy_f64(np.asarray(masked_prefix)[20:]), abs=1e-6)
    # zero-probability ids are never sampled, argmax is right
    sampled = np.asarray(st.sampled)[0]
    assert sampled[1] == 17 and 20 <= sampled[3] < 30 and sampled[4] >= 20
    assert list(np.asarray(st.argmax)[0, 1:4]) == [17, 4, 20]


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_entropy_and_argmax_match_float64_reference(chunk_size):
    scales = jnp.array([0.3, 1.0, 4.0, 30.0])[None, :, None, None]
    z = jax.random.normal(jax.random.key(2), (2, 1, 8, 50)) * scales
    z = z.reshape(2, 32, 50)
    st = _stats(z, gumbel=_np_gumbel(z.shape, 3), chunk_size=chunk_size)
    ref = _entropy_f64(np.asarray(z))
    h = np.asarray(st.entropy)
    assert h.dtype == np.float32 and h.shape == (2, 32)
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=2e-6)
    assert np.all(h >= 0)
    np.testing.assert_array_equal(np.asarray(st.argmax), np.asarray(z).argmax(-1))
    assert st.argmax.dtype == jnp.int32 and st.sampled.dtype == jnp.int32


def test_argmax_ties_go_to_lowest_id_across_chunks():
    # chunks of 16 over 50 ids: [0,16) [16,32) [32,48) and the slid tail [34,50)
    z = jnp.zeros((1, 2, 50)).at[0, 0, 3].set(1.0).at[0, 0, 40].set(1.0)
    z = z.at[0, 1, 47].set(2.0).at[0, 1, 49].set(2.0)
    for cs in (None, 16):
        st = _stats(z, gumbel=jnp.zeros_like(z), chunk_size=cs)
        assert np.asarray(st.argmax).tolist() == [[3, 47]]
        assert np.asarray(st.sampled).tolist() == [[3, 47]]


# -------------------------------------------------------------------- sampling


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_gumbel_max_frequencies_match_softmax(chunk_size):
    logits = jnp.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2], jnp.float32)
    n = 20_000
    z = jnp.broadcast_to(logits, (1, n, logits.shape[0]))
    st = _stats(z, jax.random.key(42), chunk_size=chunk_size)
    ids = np.asarray(st.sampled)[0]
    assert ids.min() >= 0 and ids.max() < 8
    counts = np.bincount(ids, minlength=8)
    p = np.asarray(jax.nn.softmax(logits), np.float64)
    expected = p * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 7 degrees of freedom: P(chi2 > 35) ~ 1e-5
    assert chi2 < 35.0, (counts, expected)
    assert np.all(np.asarray(st.argmax) == 0)


def test_explicit_noise_paths_agree_and_are_chunk_independent():
    z = jax.random.normal(jax.random.key(5), (3, 6, 50)) * 2.0
    u = jax.random.uniform(jax.random.key(6), z.shape, minval=1e-6, maxval=1 - 1e-6)
    g = -jnp.log(-jnp.log(u))
    ref = np.asarray(jnp.argmax((z - z.max(-1, keepdims=True)) + g, -1))
    for cs in (None, 16):
        by_g = _stats(z, gumbel=g, chunk_size=cs)
        by_u = _stats(z, uniform=u, chunk_size=cs)
        np.testing.assert_array_equal(np.asarray(by_g.sampled), ref)
        np.testing.assert_array_equal(np.asarray(by_u.sampled), ref)
    # a huge noise on one id forces the sample there
    forced = jnp.zeros_like(z).at[:, :, 37].set(1e6)
    assert np.all(np.asarray(_stats(z, gumbel=forced, chunk_size=16).sampled) == 37)


def test_tiny_temperature_sample_equals_argmax():
    cfg = SamplerConfig(t_min=1e-7, t_max=1e-6)
    raw = jax.random.normal(jax.random.key(11), (4, 64, 50)) * 3.0
    z = apply_temperature(raw, cfg, 0)  # |z| up to ~1e7
    for cs in (None, 16):
        st = _stats(z, gumbel=_np_gumbel(z.shape, 12), chunk_size=cs)
        np.testing.assert_array_equal(np.asarray(st.sampled), np.asarray(st.argmax))
        assert float(jnp.max(st.entropy)) < 1e-6


def test_sample_step_stats_requires_exactly_one_noise_source():
    z = jnp.zeros((1, 2, 5))
    with pytest.raises(ValueError):
        sample_step_stats(z)
    with pytest.raises(ValueError):
        _stats(z, jax.random.key(0), gumbel=jnp.zeros_like(z))


def test_sample_step_stats_jits_and_keeps_memory_small():
    b, l, v = 1, 16, 262_144
    z = jax.ShapeDtypeStruct((b, l, v), jnp.float32)
    full = b * l * v * 4
    fn = jax.jit(lambda z, k: _stats(z, k))
    stats = fn.lower(z, jax.random.key(0)).compile().memory_analysis()
    if stats is None:  # backend without memory analysis
        pytest.skip("no memory analysis on this backend")
    assert stats.temp_size_in_bytes <= full  # at most one [B, L, V] f32 temp


# ------------------------------------------------------------------ acceptance


def test_entropy_bound_accept_hand_example_with_ties():
    # sorted (stable): id1 0.0, id0 .25, id2 .25, id4 .25, id5 .5, id3 1.0
    # strictly-lower sums:  0,      0,     .25,   .5,    .75,    1.25
    h = jnp.array([[0.25, 0.0, 0.25, 1.0, 0.25, 0.5]])
    assert np.asarray(_accept(h, 0.5)).tolist() == [
        [True, True, True, False, True, False]  # 0.5 <= 0.5: non-strict
    ]
    # ties: with bound .25 only the two lowest-index copies of .25 fit
    assert np.asarray(_accept(h, 0.25)).tolist() == [
        [True, True, True, False, False, False]
    ]
    assert np.asarray(_accept(h, 0.2)).tolist() == [
        [True, True, False, False, False, False]
    ]
    # reversed tie order in position space gives the mirrored answer
    h2 = jnp.array([[0.25, 0.25, 0.25, 0.0]])
    assert np.asarray(_accept(h2, 0.25)).tolist() == [[True, True, False, True]]


def test_entropy_bound_accept_always_takes_the_minimum_and_a_prefix():
    h = jax.random.uniform(jax.random.key(7), (5, 40), minval=0.0, maxval=3.0)
    h = h.at[2].set(4.0)  # all entropies equal and large
    one = np.asarray(_accept(h, 1e-9))
    assert one.sum(-1).tolist() == [1] * 5
    np.testing.assert_array_equal(one.argmax(-1), np.asarray(h).argmin(-1))
    assert np.asarray(_accept(h, 1e9)).all()
    hn = np.asarray(h, np.float64)
    for bound in (0.1, 1.0, 7.5):
        acc = np.asarray(_accept(h, bound))
        for row in range(5):
            order = np.argsort(hn[row], kind="stable")
            k = acc[row].sum()
            assert set(np.flatnonzero(acc[row])) == set(order[:k])  # lowest k
            below = np.cumsum(hn[row][order]) - hn[row][order]
            assert k == max(1, int((below <= bound + 1e-6).sum()))


def test_renoise_and_uniform_tokens():
    sampled = jnp.array([[5, 6, 7, 8]], jnp.int32)
    accept = jnp.array([[True, False, True, False]])
    noise = jnp.array([[100, 101, 102, 103]], jnp.int32)
    assert np.asarray(renoise(sampled, accept, noise)).tolist() == [[5, 101, 7, 103]]
    toks = uniform_tokens(jax.random.key(0), (4, 1000), 7)
    t = np.asarray(toks)
    assert toks.dtype == jnp.int32 and t.shape == (4, 1000)
    assert t.min() == 0 and t.max() == 6 and len(np.unique(t)) == 7


# -------------------------------------------------------------------- stopping


def test_stop_decision_with_threshold_one():
    cfg = SamplerConfig(canvas_length=4, confidence_threshold=0.01)
    hist = init_history(2, cfg)
    assert hist.shape == (2, 1, 4) and np.all(np.asarray(hist) == -1)
    a = jnp.array([[1, 2, 3, 4], [0, 0, 0, 0]], jnp.int32)
    low = jnp.array([0.001, 0.001], jnp.float32)
    # step 1: never stable, even if confident and even for a canvas of zeros
    assert np.asarray(stop_decision(a, hist, low, cfg.confidence_threshold)).tolist() == [False, False]
    hist = push_history(hist, a)
    np.testing.assert_array_equal(np.asarray(hist)[:, 0], np.asarray(a))
    assert np.asarray(stop_decision(a, hist, low, cfg.confidence_threshold)).tolist() == [True, True]
    # strict comparison: mean entropy == threshold is not confident
    at = jnp.array([0.01, 0.0099], jnp.float32)
    assert np.asarray(stop_decision(a, hist, at, cfg.confidence_threshold)).tolist() == [False, True]
    # one changed position breaks stability for that row only
    b = a.at[1, 2].set(9)
    assert np.asarray(stop_decision(b, hist, low, cfg.confidence_threshold)).tolist() == [True, False]


def test_stop_decision_with_threshold_two():
    cfg = SamplerConfig(canvas_length=3, stability_threshold=2, confidence_threshold=0.5)
    hist = init_history(1, cfg)
    assert hist.shape == (1, 2, 3)
    x = jnp.array([[4, 5, 6]], jnp.int32)
    y = jnp.array([[4, 5, 7]], jnp.int32)
    low = jnp.array([0.1])
    decisions = []
    for canvas in (x, x, x, y, x, x, x):
        decisions.append(bool(stop_decision(canvas, hist, low, cfg.confidence_threshold)[0]))
        hist = push_history(hist, canvas)
    assert decisions == [False, False, True, False, False, False, True]
    # oldest first
    hist = push_history(push_history(init_history(1, cfg), x), y)
    np.testing.assert_array_equal(np.asarray(hist)[0], np.stack([x[0], y[0]]))


def test_stop_decision_under_jit():
    cfg = SamplerConfig(canvas_length=2)
    f = jax.jit(stop_decision)
    hist = push_history(init_history(1, cfg), jnp.array([[3, 4]]))
    assert bool(f(jnp.array([[3, 4]]), hist, jnp.array([0.0]), cfg.confidence_threshold)[0])
    assert not bool(f(jnp.array([[3, 4]]), hist, jnp.array([1.0]), cfg.confidence_threshold)[0])


# ------------------------------------------------------------------------- EOS


def test_truncate_at_eos_cases():
    eos = (1, 106, 50)
    tokens = jnp.array(
        [
            [1, 7, 8, 1, 9],  # eos first: everything after is pad, later eos too
            [7, 8, 9, 10, 106],  # eos last
            [7, 8, 9, 10, 11],  # no eos
            [7, 50, 8, 106, 1],  # several different eos ids
            [7, 8, 106, 0, 12],
        ],
        jnp.int32,
    )
    out, has_eos = truncate_at_eos(tokens, eos, 0)
    assert np.asarray(out).tolist() == [
        [1, 0, 0, 0, 0],
        [7, 8, 9, 10, 106],
        [7, 8, 9, 10, 11],
        [7, 50, 0, 0, 0],
        [7, 8, 106, 0, 0],
    ]
    assert np.asarray(has_eos).tolist() == [True, True, False, True, True]
    assert out.dtype == tokens.dtype
    # another pad id, only some eos ids
    out, has_eos = truncate_at_eos(tokens, (50,), 3)
    assert np.asarray(out)[3].tolist() == [7, 50, 3, 3, 3]
    assert np.asarray(has_eos).tolist() == [False, False, False, True, False]
    # no eos ids at all: identity
    out, has_eos = truncate_at_eos(tokens, (), 0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(tokens))
    assert not np.asarray(has_eos).any()
    # already finished rows become all pad
    out, _ = truncate_at_eos(tokens, eos, 0, finished=jnp.array([False, False, True, False, False]))
    assert np.asarray(out)[2].tolist() == [0] * 5
    assert np.asarray(out)[1].tolist() == [7, 8, 9, 10, 106]


def test_tokens_per_forward_numpy_and_jax():
    seqs = np.array([[5, 5, 3, 4, 0, 0], [5, 5, 1, 2, 3, 4], [5, 5, 0, 0, 0, 0]])
    passes = np.array([2, 8, 3])
    out = tokens_per_forward(seqs, passes, pad_id=0, prompt_length=2)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32
    np.testing.assert_allclose(out, [1.0, 0.5, 0.0])
    out_j = tokens_per_forward(jnp.asarray(seqs), jnp.asarray(passes), pad_id=0, prompt_length=2)
    assert isinstance(out_j, jax.Array)
    np.testing.assert_allclose(np.asarray(out_j), [1.0, 0.5, 0.0])
    np.testing.assert_allclose(tokens_per_forward(seqs, passes, pad_id=None), [3.0, 0.75, 2.0])


# -------------------------------------------------------------- NaN / Inf logits


def test_nonfinite_logits_are_safe_after_sanitize():
    v = 50
    base = jax.random.normal(jax.random.key(9), (6, v)) * 3.0
    rows = [
        base[0].at[3].set(jnp.nan).at[10].set(jnp.nan),
        base[1].at[5].set(jnp.inf),
        base[2].at[7].set(jnp.inf).at[30].set(jnp.inf),
        jnp.full((v,), jnp.nan),
        jnp.full((v,), -jnp.inf),
        base[5].at[:20].set(-jnp.inf).at[25].set(jnp.nan).at[33].set(3e38),
    ]
    raw = jnp.stack(rows)[None]
    z = sanitize_logits(raw)
    assert z.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(z)))
    # also after a temperature division
    z = apply_temperature(z, SamplerConfig(), 0)
    zb = jnp.broadcast_to(z, (20,) + z.shape[1:])  # 20 independent draws per row
    for cs in (None, 16):
        st = _stats(zb, gumbel=_np_gumbel(zb.shape, cs or 0), chunk_size=cs)
        ids = np.asarray(st.sampled)
        h = np.asarray(st.entropy)
        assert ids.min() >= 0 and ids.max() < v
        assert np.all(np.isfinite(h)) and np.all(h >= 0)
        assert not np.isin(ids[:, 0], [3, 10]).any()  # NaN ids are impossible
        assert np.all(ids[:, 1] == 5)
        assert np.isin(ids[:, 2], [7, 30]).all() and len(np.unique(ids[:, 2])) == 2
        assert np.all(ids[:, 5] == 33)
        assert len(np.unique(ids[:, 3])) > 5  # all-NaN row samples ~uniformly
        h = h[0]
        assert h[1] == pytest.approx(0.0, abs=1e-6)
        assert h[2] == pytest.approx(math.log(2), abs=1e-6)
        assert h[3] == pytest.approx(math.log(v), abs=1e-5)  # all-NaN row is uniform
        assert h[4] == pytest.approx(math.log(v), abs=1e-5)
        assert np.asarray(st.argmax)[0].tolist()[1:3] == [5, 7]
        assert bool(_accept(st.entropy, 0.1)[0, 1])


def test_sanitize_logits_values():
    x = jnp.array([jnp.nan, jnp.inf, -jnp.inf, 1.5, -2.0, 3e38], jnp.float32)
    y = np.asarray(sanitize_logits(x))
    assert np.all(np.isfinite(y))
    assert y[0] < -1e20 and y[1] > 1e20 and y[2] < -1e20 and y[5] > 1e20
    assert y[3] == 1.5 and y[4] == -2.0
    assert y[1] - y[2] < np.finfo(np.float32).max  # differences stay finite
    assert sanitize_logits(x.astype(jnp.bfloat16)).dtype == jnp.float32


# ---------------------------------------------------------------------- config


def test_sampler_config_defaults_and_hashable():
    cfg = SamplerConfig()
    assert (cfg.canvas_length, cfg.max_denoising_steps) == (256, 48)
    assert (cfg.t_max, cfg.t_min, cfg.entropy_bound) == (0.8, 0.4, 0.1)
    assert (cfg.confidence_threshold, cfg.stability_threshold) == (0.005, 1)
    assert cfg.eos_ids == (1, 106, 50) and cfg.pad_id == 0
    assert hash(cfg) == hash(SamplerConfig()) and cfg == SamplerConfig()
    c2 = cfg.replace(eos_ids=[7, 8], t_max=1)
    assert c2.eos_ids == (7, 8) and isinstance(c2.t_max, float) and hash(c2) != hash(cfg)
    with pytest.raises(Exception):
        cfg.t_min = 0.3  # frozen
    f = jax.jit(lambda x, c: x * c.t_max, static_argnums=1)
    assert float(f(jnp.float32(2.0), cfg)) == pytest.approx(1.6)


@pytest.mark.parametrize(
    "field, bad",
    [
        ("max_denoising_steps", 0),
        ("max_denoising_steps", 2.5),
        ("max_denoising_steps", 10**9),  # would bake a 4 GB temperature table into the program
        ("canvas_length", 0),
        ("t_min", 0.0),
        ("t_min", -0.1),
        ("t_max", 0.4),  # t_min == t_max
        ("t_max", 0.3),  # t_max < t_min
        ("entropy_bound", 0.0),
        ("entropy_bound", float("nan")),
        ("confidence_threshold", -1e-3),
        ("stability_threshold", 0),
        ("eos_ids", (1, -2)),
        ("eos_ids", (1, 2.0)),
        ("eos_ids", "1"),
        ("pad_id", -1),
    ],
)
def test_sampler_config_validation(field, bad):
    with pytest.raises(ValueError) as err:
        SamplerConfig(**{field: bad})
    msg = str(err.value)
    assert field in msg and repr(bad) in msg


def test_sampler_config_accepts_edge_values():
    cfg = SamplerConfig(confidence_threshold=0.0, eos_ids=[], max_denoising_steps=1)
    assert cfg.eos_ids == () and cfg.confidence_threshold == 0.0
    assert SamplerConfig(eos_ids=5).eos_ids == (5,)


def test_from_hf_generation_config():
    released = {
        "_from_model_config": False,
        "confidence_threshold": 0.007,
        "eos_token_id": [1, 106],
        "max_denoising_steps": 32,
        "max_new_tokens": 256,
        "pad_token_id": 3,
        "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.2},
        "stability_threshold": 2,
        "t_max": 0.9,
        "t_min": 0.3,
        "transformers_version": "5.23.0",
        "some_future_key": {"x": 1},
    }
    cfg = SamplerConfig.from_hf_generation_config(released)
    assert cfg == SamplerConfig(
        max_denoising_steps=32, t_min=0.3, t_max=0.9, entropy_bound=0.2,
        confidence_threshold=0.007, stability_threshold=2, eos_ids=(1, 106), pad_id=3,
    )
    single = SamplerConfig.from_hf_generation_config({"eos_token_id": 106, "pad_token_id": None})
    assert single.eos_ids == (106,) and single.pad_id == 0
    assert SamplerConfig.from_hf_generation_config({}) == SamplerConfig()
    assert SamplerConfig.from_hf_generation_config({}, canvas_length=32).canvas_length == 32
    with pytest.raises(ValueError, match="t_max"):
        SamplerConfig.from_hf_generation_config({"t_min": 0.9, "t_max": 0.8})


@pytest.mark.parametrize("threshold", [4, 5, 10**9])
def test_history_is_capped_at_the_step_budget(threshold):
    # Within N steps at most N - 1 earlier canvases exist, so any S >= N never fires; the history
    # keeps N rows instead of S (a [B, 10**9, L] buffer would not even allocate).
    n = 4
    cfg = SamplerConfig(canvas_length=3, max_denoising_steps=n, stability_threshold=threshold)
    assert cfg.history_length == n
    hist = init_history(2, cfg)
    assert hist.shape == (2, n, 3)
    x = jnp.array([[4, 5, 6], [7, 8, 9]], jnp.int32)
    for _ in range(n):  # the same canvas, fully confident, every step of the budget
        assert not np.asarray(stop_decision(x, hist, jnp.zeros((2,)), cfg.confidence_threshold)).any()
        hist = push_history(hist, x)


def test_history_below_the_budget_keeps_the_threshold():
    cfg = SamplerConfig(canvas_length=3, max_denoising_steps=4, stability_threshold=3)
    assert cfg.history_length == 3 and init_history(1, cfg).shape == (1, 3, 3)
    x = jnp.array([[4, 5, 6]], jnp.int32)
    hist, decisions = init_history(1, cfg), []
    for _ in range(4):
        decisions.append(bool(stop_decision(x, hist, jnp.zeros((1,)), cfg.confidence_threshold)[0]))
        hist = push_history(hist, x)
    assert decisions == [False, False, False, True]


def test_the_largest_step_budget_is_accepted():
    from dgemma_jax.sampling.config import MAX_DENOISING_STEPS
    from dgemma_jax.sampling.ops import temperature_table

    cfg = SamplerConfig(max_denoising_steps=MAX_DENOISING_STEPS)
    assert temperature_table(cfg).nbytes <= 256 * 1024
