"""Infill: the suffix pinned on the canvas after a middle of each candidate length and the driver that keeps
the most likely candidate (both engine/infill.py), and the library's `suffix=`."""

import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.engine import infill as lay
from dgemma_jax.sampling import SamplerConfig

CFG = ModelConfig.preset("tiny-2layer")


@pytest.fixture(scope="module")
def engine():
    sampler = SamplerConfig(canvas_length=8, max_denoising_steps=4, eos_ids=(1,))
    return Engine(CFG, init_params(CFG, 0), sampler)


def test_layout_puts_the_suffix_right_after_the_middle_and_eos_after_it():
    for middle in (0, 3, 5, 7, 12):
        seed, pinned = lay.layout(middle, [40, 41, 42], 8, eos_id=1)
        assert len(seed) % 8 == 0 and len(seed) >= middle + 3 + 1 and len(seed) - 8 < middle + 3 + 1
        assert not pinned[:middle].any() and pinned[middle:].all()
        assert seed[middle:middle + 3].tolist() == [40, 41, 42]
        assert (seed[middle + 3:] == 1).all()


def test_candidate_lengths():
    assert lay.candidate_lengths(5) == [0, 1, 2, 3, 4, 5]
    ks = lay.candidate_lengths(1000, limit=16)
    assert ks[0] == 0 and ks[-1] == 1000 and len(ks) == 16 and ks == sorted(set(ks))
    assert lay.candidate_lengths(9, limit=1) == [9]
    with pytest.raises(ValueError, match="budget"):
        lay.candidate_lengths(-1)
    assert lay.middle_of(np.array([5, 6, 1, 0, 40, 41]), 4, (1, 0)) == [5, 6]


def test_a_seed_spanning_two_canvases_holds_its_pins_in_both(engine):
    """canvas c of a [B, n L] seed is its columns [c L, (c + 1) L): pins in the second canvas hold too."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(3, CFG.vocab_size, (2, 6)).astype(np.int32)
    seed = rng.randint(3, CFG.vocab_size, (2, 16)).astype(np.int32)
    pinned = np.zeros((2, 16), bool)
    pinned[:, :8] = True            # canvas 0 fully held (no EOS in it: the row goes on)
    pinned[0, [9, 12]] = True
    pinned[1, [8, 15]] = True
    out = engine.generate(tokens, None, rng=[3, 4], max_new_tokens=24, seed_canvas=seed, pinned=pinned)
    got = np.asarray(out.tokens)
    np.testing.assert_array_equal(got[:, :16][pinned], seed[pinned])
    with pytest.raises(ValueError, match=r"seed_canvas must have shape \[2, n \* 8\] for n in 1..3"):
        engine.generate(tokens, None, max_new_tokens=24, seed_canvas=np.zeros((2, 12), np.int32))
    with pytest.raises(ValueError, match="n in 1..1"):
        engine.generate(tokens, None, max_new_tokens=8, seed_canvas=seed, pinned=pinned)


def test_infill_candidates_end_with_their_suffix_and_the_choice_is_the_best_score(engine):
    """Random weights: every candidate's output holds the suffix right after its middle (unless an EOS it
    wrote in the middle ended the row there), and the kept candidate has the highest score."""
    tokens = np.random.RandomState(1).randint(3, CFG.vocab_size, (1, 7)).astype(np.int32)
    suffix = [50, 51, 52]
    out = engine.infill(tokens, suffixes=[suffix], rng=5, max_new_tokens=10)
    ks = [k for k, _, _ in out.candidates[0]]
    assert ks == list(range(11))
    best = max(out.candidates[0], key=lambda c: c[1])
    assert out.lengths[0] == best[0] and out.middles[0] == best[2]
    for k, score, mid in out.candidates[0]:
        assert len(mid) <= k and 1 not in mid and 0 not in mid and np.isfinite(score) and score < 0
        seed, pinned = lay.layout(k, suffix, 8, 1)
        row = np.asarray(engine.generate(tokens, None, rng=5, max_new_tokens=len(seed), seed_canvas=seed[None],
                                         pinned=pinned[None]).tokens[0])
        if len(mid) == k:   # no EOS in the middle: the suffix follows it, then the EOS (truncated to pad)
            assert row[k:k + 3].tolist() == suffix and row[k + 3] == 1 and (row[k + 4:] == 0).all()
        assert row[:len(mid)].tolist() == mid


def test_infill_is_the_same_alone_and_in_a_batch(engine):
    rng = np.random.RandomState(2)
    tokens = rng.randint(3, CFG.vocab_size, (3, 9)).astype(np.int32)
    lengths = np.array([9, 4, 6], np.int32)
    suffixes = [[60, 61], [62], [63, 64, 65]]
    both = engine.infill(tokens, lengths, suffixes=suffixes, rng=[7, 8, 9], max_new_tokens=6)
    for i in (2, 0):
        alone = engine.infill(tokens[i:i + 1, :lengths[i]], suffixes=[suffixes[i]], rng=[7 + i], max_new_tokens=6)
        assert alone.middles[0] == both.middles[i] and alone.lengths[0] == both.lengths[i]


def test_infill_errors_name_the_problem(engine):
    tokens = np.full((1, 4), 5, np.int32)
    with pytest.raises(ValueError, match="suffix 0 is empty"):
        engine.infill(tokens, suffixes=[[]])
    with pytest.raises(ValueError, match="one suffix per prompt"):
        engine.infill(tokens, suffixes=[[5], [6]])
    with pytest.raises(ValueError, match="outside"):
        engine.infill(tokens, suffixes=[[CFG.vocab_size]])
    with pytest.raises(ValueError, match="middle_lengths"):
        engine.infill(tokens, suffixes=[[5]], max_new_tokens=4, middle_lengths=[5])


# ------------------------------------------------------------------ the bundled model (digit sorting)
# (prompt, cuts): prefix | middle | suffix of the sorted digits; the prefix ends on a canvas boundary (0 or 8
# digits), the layouts the model was trained on (other cuts: 88/100 in benchmarks/infill_digits.py)
CASES = [("s6596842182=", 0, 7), ("s31415926535=", 0, 10), ("s4716497287=", 8, 9), ("s822665544331=", 8, 10),
         ("s544659448=", 0, 5)]


def test_the_bundled_model_fills_the_middle_of_a_sorted_digit_string():
    """prefix + middle + suffix is the sorted string, so the suffix comes back once, unchanged, at the end
    (100 held-out cases: benchmarks/infill_digits.py)."""
    import dgemma_jax as dg

    model = dg.DiffusionGemma.from_pretrained()
    answers = ["".join(sorted(p[1:-1])) for p, _, _ in CASES]
    prompts = [p + a[:i] for (p, i, _), a in zip(CASES, answers)]
    suffixes = [a[j:] for (_, _, j), a in zip(CASES, answers)]
    middles = model.generate(prompts, suffix=suffixes, max_new_tokens=10, seed=0)
    for (p, i, j), a, mid in zip(CASES, answers, middles):
        assert mid == a[i:j], (p, a, mid)
    assert model.generate(prompts[0], suffix=suffixes[0], max_new_tokens=10, seed=0) == middles[0]
    with pytest.raises(ValueError, match="has no tokens"):
        model.generate(prompts[0], suffix="")
