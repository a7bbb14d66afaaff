"""Parity of dgemma_jax.sampling with the Hugging Face reference sampler.

Reference: transformers 5.23.0, models/diffusion_gemma/generation_diffusion_gemma.py
(LinearTemperatureScheduleLogitsProcessor, EntropyBoundSampler,
StableAndConfidentStoppingCriteria, DiffusionGemmaGenerationMixin._denoising_step,
_finalize_canvas, _compute_tokens_per_forward). The random draws cannot be shared
between torch and JAX, so the sampled and noise tokens are drawn in JAX and
injected into HF (patching `torch.multinomial` and `EntropyBoundSampler.initialize_canvas`).

Every test runs twice with the same comparisons: against the reference's values stored in
tests/golden/sampling.npz (default tier, no torch; each value's inputs are hashed and checked)
and against transformers run now (marker `ref`, skipped without torch). The golden file is
written by `python -m tests.golden.make_golden sampling`, which runs this module's live tests
with DGEMMA_GOLDEN_RECORD set.
"""

import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from dgemma_jax.sampling import (
    SamplerConfig,
    apply_temperature,
    entropy_bound_accept,
    init_history,
    push_history,
    renoise,
    sample_step_stats,
    stop_decision,
    temperature,
    tokens_per_forward,
    truncate_at_eos,
    uniform_tokens,
)

from tests.golden.reference_source import GoldenReference, LiveReference, record_path

B, L, V = 3, 32, 50
torch = hf = EosTokenCriteria = LogitsProcessorList = StoppingCriteriaList = None  # set by the live source


@pytest.fixture(scope="module", params=["golden", pytest.param("live", marks=pytest.mark.ref)])
def ref(request):
    """The reference's values: `ref.value(key, compute, *inputs)` (tests/golden/reference_source.py)."""
    if request.param == "golden":
        yield GoldenReference("sampling")
        return
    global torch, hf, EosTokenCriteria, LogitsProcessorList, StoppingCriteriaList
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    hf = pytest.importorskip("transformers.models.diffusion_gemma.generation_diffusion_gemma")
    from transformers.generation import EosTokenCriteria, LogitsProcessorList, StoppingCriteriaList
    live = LiveReference(record_path())
    yield live
    live.flush()


_stats = jax.jit(sample_step_stats, static_argnames=("chunk_size",))
_accept = jax.jit(entropy_bound_accept)


def _t(x):
    return torch.from_numpy(np.array(x))


def _np(x):
    return np.asarray(x)


def _make_logits(seed=0):
    """[B, L, V] float32 softcapped logits whose entropies span ~0 to ~log V.

    Per-position scales run from 0.05 to 60 (log-spaced), row 2 is mostly
    near one-hot (so many positions get accepted), and some positions are
    exact copies of others (equal entropies) or have tied maxima.
    """
    rng = np.random.default_rng(seed)
    scales = np.geomspace(0.05, 60.0, L)[rng.permutation(L)]
    raw = rng.standard_normal((B, L, V)) * scales[None, :, None]
    raw[2, :24] = rng.standard_normal((24, V)) * 0.5
    raw[2, np.arange(24), rng.integers(0, V, 24)] += 25.0
    raw[0, 5] = raw[0, 9]
    raw[1, 3] = raw[1, 20]
    raw[1, 4] = raw[1, 20]
    raw[2, 30] = raw[2, 31]
    raw[1, 7, [4, 30]] = raw[1, 7].max() + 1.0  # tied argmax
    raw = 30.0 * np.tanh(raw / 30.0)
    return raw.astype(np.float32)


def _entropy_f64(z):
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(-1, keepdims=True)
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


def _hf_entropy(processed):
    return torch.distributions.Categorical(logits=processed).entropy()


def _hf_sampler(bound):
    return hf.EntropyBoundSampler(
        config=hf.EntropyBoundSamplerConfig(entropy_bound=float(bound)),
        canvas_length=L,
        vocab_size=V,
        max_denoising_steps=48,
    )


class _Divisor:
    """`scores / T` returns T: reads the reference's own temperature tensor out of its processor."""

    def __truediv__(self, temperature):
        return temperature


# ----------------------------------------------------------------- temperature


@pytest.mark.parametrize("n_steps", [7, 48])
def test_temperature_schedule_matches_hf(ref, n_steps):
    cfg = SamplerConfig(max_denoising_steps=n_steps)
    raw = _make_logits(1)

    def compute():
        proc = hf.LinearTemperatureScheduleLogitsProcessor(
            t_min=cfg.t_min, t_max=cfg.t_max, max_denoising_steps=n_steps
        )
        temps, zs = [], []
        for cur_step in range(n_steps, 0, -1):  # HF counts the remaining steps
            cur = torch.tensor(cur_step, dtype=torch.int32)  # as in _denoising_step
            t = proc(None, _Divisor(), cur)
            assert t.dtype == torch.float32 and t.ndim == 0
            temps.append(t.numpy())
            zs.append(proc(None, _t(raw), cur).numpy())
        return {"temperature": np.stack(temps), "z": np.stack(zs)}

    hf_out = ref.value(f"temperature/{n_steps}", compute, raw, cfg.t_min, cfg.t_max, n_steps)
    steps = jnp.arange(n_steps, dtype=jnp.int32)
    ours_t = _np(jax.jit(lambda s: temperature(cfg, s))(steps))
    for step in range(n_steps):
        # x / T == 1 exactly iff T_hf == T_ours (IEEE division): the same float32 temperature
        assert ours_t[step] == hf_out["temperature"][step], (step, ours_t[step])
        ours_z = _np(apply_temperature(jnp.asarray(raw), cfg, jnp.int32(step)))
        # XLA turns x / T into x * (1 / T): at most 1 ulp apart
        np.testing.assert_array_max_ulp(ours_z, hf_out["z"][step], maxulp=1)
    assert ours_t[0] == np.float32(cfg.t_max)


# ------------------------------------------------------------ entropy, argmax


@pytest.mark.parametrize("chunk_size", [None, 16])
def test_entropy_and_argmax_match_hf(ref, chunk_size):
    raw = _make_logits(2)
    all_hf, moderate_count = [], 0
    for scale in (0.4, 0.8, 2.0):  # different temperatures
        z = raw / np.float32(scale)
        hf_out = ref.value(f"entropy_argmax/{scale}",
                           lambda: {"entropy": _hf_entropy(_t(z)).numpy(), "argmax": torch.argmax(_t(z), dim=-1).numpy()},
                           z)
        hf_h = hf_out["entropy"]
        st = _stats(jnp.asarray(z), gumbel=jnp.zeros_like(z), chunk_size=chunk_size)
        ours = _np(st.entropy)
        # torch computes -sum(p * (z - logsumexp(z))): the float32 cancellation
        # in z - logsumexp costs it up to ~eps * |z| (3.5e-6 at |z| = 75). Ours
        # works relative to the row max and is within 5e-7 of float64.
        np.testing.assert_allclose(ours, _entropy_f64(z), rtol=0, atol=5e-7)
        tol = 1e-6 + np.finfo(np.float32).eps * np.abs(z).max(-1)
        assert np.all(np.abs(ours - hf_h) <= tol), np.abs(ours - hf_h).max()
        moderate = np.abs(z).max(-1) <= 8.0  # where torch itself is accurate
        moderate_count += moderate.sum()
        np.testing.assert_allclose(ours[moderate], hf_h[moderate], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(_np(st.argmax), hf_out["argmax"])
        all_hf.append(hf_h)
    all_hf = np.concatenate(all_hf)
    assert all_hf.min() < 1e-4 and all_hf.max() > 3.0  # the range is covered
    assert moderate_count > 10
    assert _np(st.argmax)[1, 7] == 4  # the tie went to the lower id, in both


def _assert_same_up_to_ties(ours, hf_mask, h):
    """Masks must agree exactly, except that among positions with *exactly*
    equal entropies only the number accepted has to agree: HF ranks them with
    torch.sort(stable=False), whose order among equal keys is an artifact of
    the sort algorithm (not stable on CPU for rows > 16, different on CUDA);
    we rank them by position (stable)."""
    ours, hf_mask, h = np.asarray(ours), np.asarray(hf_mask), np.asarray(h)
    assert ours.shape == hf_mask.shape
    straddling = 0
    for row in range(h.shape[0]):
        for value in np.unique(h[row]):
            idx = h[row] == value
            assert ours[row, idx].sum() == hf_mask[row, idx].sum(), (row, value)
            if idx.sum() == 1:
                assert ours[row, idx][0] == hf_mask[row, idx][0]
            elif 0 < hf_mask[row, idx].sum() < idx.sum():
                straddling += 1
    return straddling


# ------------------------------------------------------------------ acceptance


@pytest.mark.parametrize("bound", [1e-4, 0.1, 0.5, 2.0, 10.0])
def test_acceptance_mask_matches_hf(ref, bound):
    raw = _make_logits(3)
    cfg = SamplerConfig()
    counts = []
    for step in (0, 20, 47):
        z = _np(apply_temperature(jnp.asarray(raw), cfg, jnp.int32(step)))

        def compute():
            sampler = _hf_sampler(bound)
            canvas = torch.zeros((B, L), dtype=torch.long)
            sampler.accept_canvas(canvas, canvas + 1, _t(z), torch.tensor(48 - step))
            return {"mask": sampler.accepted_token_mask.numpy(), "entropy": _hf_entropy(_t(z)).numpy()}

        hf_out = ref.value(f"acceptance/{bound}/{step}", compute, z, bound, step)
        hf_mask, hf_h = hf_out["mask"], hf_out["entropy"]
        st = _stats(jnp.asarray(z), gumbel=jnp.zeros_like(z))
        # same entropies in: the rule itself must agree bit for bit
        _assert_same_up_to_ties(_accept(jnp.asarray(hf_h), bound), hf_mask, hf_h)
        # our own entropies (differ from torch's by ulps) on this data
        _assert_same_up_to_ties(_accept(st.entropy, bound), hf_mask, hf_h)
        counts.append(hf_mask.sum(-1))
    counts = np.concatenate(counts)
    assert counts.min() >= 1
    if bound >= 0.5:
        assert counts.max() > L // 2  # rows where many tokens get accepted


class _FixedEntropy:
    """Stands in for torch.distributions.Categorical: returns set entropies."""

    value = None

    def __init__(self, logits=None, probs=None, **kwargs):
        pass

    def entropy(self):
        return _FixedEntropy.value


def _hf_mask_for_entropies(monkeypatch, h, bound):
    monkeypatch.setattr(torch.distributions, "Categorical", _FixedEntropy)
    _FixedEntropy.value = _t(h)
    sampler = _hf_sampler(bound)
    canvas = torch.zeros(h.shape, dtype=torch.long)
    sampler.accept_canvas(canvas, canvas + 1, torch.zeros(h.shape + (2,)), torch.tensor(1))
    mask = sampler.accepted_token_mask.numpy()
    monkeypatch.undo()
    return mask


def test_acceptance_ties_match_hf(ref, monkeypatch):
    rng = np.random.default_rng(4)
    # dyadic values: every partial sum is exact, so only the order matters
    h = rng.choice(np.float32([0.0, 0.125, 0.25, 0.5, 1.0]), size=(6, L)).astype(np.float32)
    h[5] = 0.25  # a row of identical entropies
    straddling = 0
    for bound in (1 / 64, 0.125, 0.25, 0.5, 1.0, 2.0, 3.75):
        hf_mask = ref.value(f"ties/{bound}", lambda: _hf_mask_for_entropies(monkeypatch, h, bound), h, bound)
        ours = _np(_accept(jnp.asarray(h), bound))
        straddling += _assert_same_up_to_ties(ours, hf_mask, h)
    assert straddling > 5  # ties across the cut-off were exercised
    # 16 of the equal entropies fit under 3.75 (15 * 0.25); we take the lowest ids
    assert hf_mask[5].sum() == 16
    assert np.flatnonzero(ours[5]).tolist() == list(range(16))


def test_acceptance_rounding_at_the_boundary_matches_hf(ref, monkeypatch):
    """Bounds equal to HF's own float32 `cumsum - h` values: exact boundary hits."""
    rng = np.random.default_rng(5)
    h = rng.uniform(0.0, 0.05, size=(4, 256)).astype(np.float32)

    def below():
        hs, _ = torch.sort(_t(h), dim=-1)
        return (torch.cumsum(hs, dim=-1) - hs).numpy()

    below = ref.value("boundary/below", below, h)
    for k in (3, 17, 100, 200, 255):
        for row in range(4):
            bound = float(below[row, k])
            hf_mask = ref.value(f"boundary/{k}/{row}", lambda: _hf_mask_for_entropies(monkeypatch, h, bound),
                                h, bound)
            ours = _np(_accept(jnp.asarray(h), bound))
            assert len(np.unique(h[row])) == h.shape[1]  # no ties: exact equality
            np.testing.assert_array_equal(ours, hf_mask, err_msg=f"k={k} row={row}")
            assert hf_mask[row].sum() >= k + 1


# ------------------------------------------------------------------- renoising


def test_renoised_canvas_matches_hf(ref):
    raw = _make_logits(6)
    cfg = SamplerConfig(max_denoising_steps=10)
    key = jax.random.key(0)
    for step in range(0, 10, 3):
        k_sample, k_noise, key = jax.random.split(key, 3)
        z = apply_temperature(jnp.asarray(raw), cfg, jnp.int32(step))
        st = _stats(z, k_sample)
        noise = uniform_tokens(k_noise, (B, L), V)
        accept = _accept(st.entropy, cfg.entropy_bound)
        ours = _np(renoise(st.sampled, accept, noise))

        def compute():
            sampler = _hf_sampler(cfg.entropy_bound)
            sampler.initialize_canvas = lambda batch_size, device, _n=noise: _t(_n).long()
            current = torch.full((B, L), 7, dtype=torch.long)
            accepted = sampler.accept_canvas(current, _t(st.sampled).long(), _t(z), torch.tensor(10 - step))
            return sampler.renoise_canvas(accepted, torch.tensor(10 - step)).numpy()

        hf_canvas = ref.value(f"renoise/{step}", compute, _np(z), _np(st.sampled), _np(noise), step)
        np.testing.assert_array_equal(ours, hf_canvas)
        assert 0 < _np(accept).sum() < B * L


# -------------------------------------------------------------------- stopping


@pytest.mark.parametrize("stability", [1, 2])
def test_stop_decisions_match_hf_over_steps(ref, stability):
    rng = np.random.default_rng(7)
    cfg = SamplerConfig(canvas_length=L, stability_threshold=stability)
    c0 = rng.integers(0, V, (B, L))
    c1 = c0.copy()
    c1[:, 5] = (c1[:, 5] + 1) % V
    # per step, per row: which argmax canvas, and the logit margin (entropy level)
    plan = [
        ((c0, c0, c0), (2.0, 30.0, 2.0)),
        ((c0, c0, c1), (30.0, 30.0, 30.0)),
        ((c0, c1, c0), (30.0, 30.0, 30.0)),
        ((c0, c1, c0), (30.0, 6.0, 30.0)),
        ((c0, c1, c0), (30.0, 30.0, 30.0)),
        ((c1, c1, c0), (30.0, 30.0, 30.0)),
        ((c1, c1, c0), (30.0, 30.0, 5.0)),
        ((c1, c1, c0), (30.0, 30.0, 30.0)),
    ]
    steps = []
    for canvases, margins in plan:
        argmax = np.stack([c[i] for i, c in enumerate(canvases)])
        logits = rng.standard_normal((B, L, V)).astype(np.float32)
        np.put_along_axis(logits, argmax[..., None], np.float32(margins)[:, None, None], axis=-1)
        steps.append((argmax, logits))

    def compute():
        crit = hf.StableAndConfidentStoppingCriteria(
            stability_threshold=stability, confidence_threshold=cfg.confidence_threshold
        )
        return np.stack([crit(_t(a), _t(lg)).numpy() for a, lg in steps])

    hf_stops = ref.value(f"stop/{stability}", compute, steps, stability, cfg.confidence_threshold)
    hist = init_history(B, cfg)
    decisions = []
    for (argmax, logits), hf_stop in zip(steps, hf_stops):
        h = _stats(jnp.asarray(logits), gumbel=jnp.zeros_like(logits)).entropy
        mean_h = jnp.mean(h, axis=-1)
        assert np.all(np.abs(_np(mean_h) - cfg.confidence_threshold) > 1e-4)
        ours = _np(stop_decision(jnp.asarray(argmax, jnp.int32), hist, mean_h, cfg.confidence_threshold))
        hist = push_history(hist, jnp.asarray(argmax, jnp.int32))
        np.testing.assert_array_equal(ours, hf_stop)
        decisions.append(ours)
    decisions = np.stack(decisions)
    assert decisions.any() and not decisions.all()
    assert not decisions[0].any()  # step 1 is never stable


# -------------------------------------------------------- one full denoising step


def _hf_step(monkeypatch, raw, canvas, argmax, sc, finished, cur_step, sampler, procs, crit,
             sampled, noise):
    fake_self = types.SimpleNamespace(
        config=types.SimpleNamespace(text_config=types.SimpleNamespace(vocab_size=V)),
        model=types.SimpleNamespace(
            decoder=types.SimpleNamespace(embed_tokens=types.SimpleNamespace(weight=torch.zeros(1)))
        ),
    )
    monkeypatch.setattr(
        torch, "multinomial", lambda probs, num_samples: _t(sampled).long().reshape(-1, 1)
    )
    sampler.initialize_canvas = lambda batch_size, device: _t(noise).long()
    out = hf.DiffusionGemmaGenerationMixin._denoising_step(
        fake_self,
        decoder_forward=lambda **kw: types.SimpleNamespace(logits=_t(raw)),
        current_canvas=canvas,
        argmax_canvas=argmax,
        input_ids=None,
        decoder_position_ids=None,
        self_conditioning_logits=sc,
        mask_mapping=None,
        past_key_values=None,
        finished_denoising=finished,
        cur_step=cur_step,
        sampler=sampler,
        logits_processor=procs,
        diffusion_stopping_criteria=crit,
    )
    monkeypatch.undo()
    return out


class _HFSteps:
    """HF's `_denoising_step` state carried across steps (live only)."""

    def __init__(self, canvas, cfg, n_steps, stability, bound):
        self.sampler = _hf_sampler(bound)
        self.procs = LogitsProcessorList([hf.LinearTemperatureScheduleLogitsProcessor(
            t_min=cfg.t_min, t_max=cfg.t_max, max_denoising_steps=n_steps)])
        self.crit = hf.StableAndConfidentStoppingCriteria(stability, cfg.confidence_threshold)
        self.crit.reset()
        self.canvas, self.argmax = _t(canvas).long(), _t(canvas).long()
        self.sc, self.fin = None, torch.zeros(B, dtype=torch.bool)

    def step(self, monkeypatch, raw, cur_step, sampled, noise):
        self.canvas, self.argmax, self.sc, self.fin = _hf_step(
            monkeypatch, raw, self.canvas, self.argmax, self.sc, self.fin, cur_step,
            self.sampler, self.procs, self.crit, sampled, noise)
        # copies: HF updates `finished` in place at the next step
        return {"canvas": self.canvas.numpy().copy(), "argmax": self.argmax.numpy().copy(),
                "sc": self.sc.numpy().copy(), "finished": self.fin.numpy().copy()}


@pytest.mark.parametrize("stability, bound", [(1, 0.1), (2, 1.0)])
def test_denoising_steps_compose_like_hf(ref, monkeypatch, stability, bound):
    """Our functions, chained as the loop will chain them, reproduce HF's
    `_denoising_step` (canvas, argmax, finished flags, SC logits) over a run
    in which rows stop at different steps."""
    n_steps = 8
    cfg = SamplerConfig(
        canvas_length=L, max_denoising_steps=n_steps, entropy_bound=bound,
        stability_threshold=stability,
    )
    rng = np.random.default_rng(8)
    target = rng.integers(0, V, (B, L))
    ramp = np.array([[0.0, 10, 25, 28, 28, 28, 28, 28],  # row 0 settles early
                     [0.0, 2, 5, 10, 15, 22, 28, 28],  # row 1 late
                     [0.0, 1, 2, 3, 4, 5, 6, 7]], np.float32)  # row 2 never confident

    key = jax.random.key(3)
    canvas = uniform_tokens(jax.random.fold_in(key, 99), (B, L), V)
    start0 = _np(canvas)
    hf_state = [None]
    argmax, sc = canvas, None
    fin = jnp.zeros((B,), bool)
    hist = init_history(B, cfg)
    finished_at = {}
    for step in range(n_steps):
        raw = rng.standard_normal((B, L, V)).astype(np.float32) * 2.0
        np.put_along_axis(raw, target[..., None], ramp[:, step][:, None, None], axis=-1)
        raw = 30.0 * np.tanh(raw / 30.0)
        k_s, k_n = jax.random.split(jax.random.fold_in(key, step))

        # ours
        z = apply_temperature(jnp.asarray(raw), cfg, jnp.int32(step))
        st = _stats(z, k_s)
        noise = uniform_tokens(k_n, (B, L), V)
        accept = _accept(st.entropy, cfg.entropy_bound)
        new_canvas = renoise(st.sampled, accept, noise)
        # loop-level freezing of finished rows (as HF does)
        new_canvas = jnp.where(fin[:, None], canvas, new_canvas)
        argmax = jnp.where(fin[:, None], argmax, st.argmax)
        z = jnp.where(fin[:, None, None], sc, z) if sc is not None else z
        stop = stop_decision(argmax, hist, jnp.mean(st.entropy, -1), cfg.confidence_threshold)
        hist = push_history(hist, argmax)
        fin = fin | stop
        canvas, sc = new_canvas, z

        # HF (its state carries over the steps; the golden file holds every step's result)
        def compute(raw=raw, sampled=_np(st.sampled), noise=_np(noise), step=step):
            if hf_state[0] is None:
                hf_state[0] = _HFSteps(start0, cfg, n_steps, stability, bound)
            return hf_state[0].step(monkeypatch, raw, n_steps - step, sampled, noise)

        hf_out = ref.value(f"compose/{stability}/{bound}/{step}", compute, start0, raw, _np(st.sampled), _np(noise),
                           step, stability, bound)

        np.testing.assert_array_equal(_np(canvas), hf_out["canvas"])
        np.testing.assert_array_equal(_np(argmax), hf_out["argmax"])
        np.testing.assert_array_equal(_np(fin), hf_out["finished"])
        np.testing.assert_array_max_ulp(_np(sc), hf_out["sc"], maxulp=1)
        for r in np.flatnonzero(_np(fin)):
            finished_at.setdefault(int(r), step)
        if bool(hf_out["finished"].all()):
            break
    assert finished_at.get(0) is not None and finished_at.get(2) is None
    assert finished_at[0] < finished_at.get(1, n_steps)


# ------------------------------------------------------------------ EOS, metric


def test_eos_truncation_matches_hf_finalize_canvas(ref):
    rng = np.random.default_rng(9)
    eos = [1, 106, 50]
    cfg = SamplerConfig(eos_ids=tuple(eos), pad_id=0, canvas_length=8)
    b, c = 6, cfg.canvas_length
    prompt = rng.integers(200, 300, (b, 5))
    canvases = []
    for _ in range(4):
        canvas = rng.integers(2, 120, (b, c))  # no eos by chance (ids 1, 50, 106 excluded below)
        canvas[np.isin(canvas, eos)] = 7
        # hand-placed eos: first position, last position, several, none
        canvas[0, 0] = 1
        canvas[1, c - 1] = rng.choice(eos)
        if rng.random() < 0.5:
            canvas[2, 3], canvas[2, 5] = 106, 50
        canvas[4, rng.integers(0, c)] = rng.choice(eos) if rng.random() < 0.3 else 9
        canvases.append(canvas)

    def compute():
        gen_cfg = hf.DiffusionGemmaGenerationConfig(eos_token_id=eos, pad_token_id=0)
        criteria = StoppingCriteriaList([EosTokenCriteria(eos)])
        eos_tensor = torch.tensor(eos)
        hf_ids = _t(prompt).long()
        hf_done = torch.zeros(b, dtype=torch.bool)
        ids, done = [], []
        for canvas in canvases:
            hf_ids, hf_done = hf.DiffusionGemmaGenerationMixin._finalize_canvas(
                input_ids=torch.cat([hf_ids, _t(canvas).long()], dim=-1),
                finished_sequences=hf_done,
                generation_config=gen_cfg,
                stopping_criteria=criteria,
                canvas_length=c,
                eos_tensor=eos_tensor,
            )
            ids.append(hf_ids.numpy().copy()), done.append(hf_done.numpy().copy())
        return dict({f"ids_{i}": x for i, x in enumerate(ids)}, done=np.stack(done))

    hf_out = ref.value("eos", compute, prompt, canvases, eos)
    ours_seq, done = [prompt], jnp.zeros((b,), bool)
    for i, canvas in enumerate(canvases):
        out, has_eos = truncate_at_eos(jnp.asarray(canvas, jnp.int32), cfg.eos_ids, cfg.pad_id,
                                       finished=done)
        done = done | has_eos
        ours_seq.append(_np(out))
        np.testing.assert_array_equal(np.concatenate(ours_seq, -1), hf_out[f"ids_{i}"])
        np.testing.assert_array_equal(_np(done), hf_out["done"][i])
    assert _np(done)[0] and _np(done)[1] and not _np(done)[3]


def test_tokens_per_forward_matches_hf(ref):
    rng = np.random.default_rng(10)
    seqs = rng.integers(0, 5, (4, 3 + 16))  # plenty of pad (0) tokens
    passes = rng.integers(1, 40, (4,)).astype(np.int32)
    hf_out = ref.value("tokens_per_forward", lambda: {
        "pad": hf.DiffusionGemmaGenerationMixin._compute_tokens_per_forward(_t(seqs), _t(passes), 3, 0).numpy(),
        "nopad": hf.DiffusionGemmaGenerationMixin._compute_tokens_per_forward(_t(seqs), _t(passes), 3, None).numpy(),
    }, seqs, passes)
    hf_tpf, hf_nopad = hf_out["pad"], hf_out["nopad"]
    np.testing.assert_array_equal(tokens_per_forward(seqs, passes, pad_id=0, prompt_length=3), hf_tpf)
    ours_j = tokens_per_forward(jnp.asarray(seqs), jnp.asarray(passes), pad_id=0, prompt_length=3)
    np.testing.assert_array_equal(_np(ours_j), hf_tpf)
    np.testing.assert_allclose(tokens_per_forward(seqs, passes, pad_id=None, prompt_length=3),
                               hf_nopad, rtol=1e-7)
