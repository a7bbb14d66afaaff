"""The project's real `Engine` replays transformers' own generate() run (tests/golden/trace.npz).

The golden trace is transformers' `DiffusionGemmaForBlockDiffusion.generate()` fed the draws the engine
makes for `rng` (see tests/golden/trace_case.py): a left-padded batch of 3 prompts of different lengths,
3 canvases, EOS in the second canvas of two rows, adaptive stops at different steps. Here the engine runs
the same prompts (right-padded with lengths, its own layout), the same checkpoint (rebuilt with numpy)
and the same `rng`, and must take every decision transformers took: the sampled/accepted/renoised canvas
and the argmax canvas after every step, the stop step of every row in every canvas, the EOS
truncation, the final tokens and the decoder passes per canvas. No torch needed.
"""

import json

import numpy as np
import pytest

from dgemma_jax import Runtime, load_hf
from dgemma_jax.engine import Engine
from dgemma_jax.engine.drivers import CanvasEvent, StepEvent
from tests.golden import parity_case, store
from tests.golden import trace_case as case


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    if Runtime().platform != "cpu":
        pytest.skip("the recorded draws are the CPU head's (the accelerator head samples with Gumbel noise)")
    arrays, meta = store.load("trace")
    path = tmp_path_factory.mktemp("trace_ckpt")
    parity_case.rebuild_checkpoint(arrays, path)
    cfg, params = load_hf(path, dtype="float32")
    rng, eos = int(arrays["rng"]), int(arrays["eos_id"])
    B, C, V = len(case.PROMPT_LENGTHS), cfg.canvas_length, cfg.vocab_size
    draws = case.all_draws(rng, B, C, V)
    store.check_inputs(meta, *case.hash_items(path, rng, eos, draws))
    tokens, lengths = case.right_padded(case.prompts(V))
    engine = Engine(cfg, params, case.sampler_config(C, eos))
    return dict(arrays=arrays, engine=engine, tokens=tokens, lengths=lengths, rng=rng, eos=eos, draws=draws,
                B=B, C=C)


def _expected(a, B):
    """From the reference record: rows still generating in canvas k, and each row's decoder passes."""
    ran, fin = a["ran"], a["finished"]
    K, N = ran.shape
    gen = a["sequences"][:, int(a["prompt_width"]):]
    eos = int(a["eos_id"])
    live = np.ones((K, B), bool)  # not finished by an EOS in an earlier canvas
    for k in range(1, K):
        live[k] = live[k - 1] & ~np.isin(gen[:, (k - 1) * gen.shape[1] // K:k * gen.shape[1] // K], eos).any(-1)
    passes = np.zeros((B, K), np.int32)
    for k in range(K):
        for s in range(N):
            if ran[k, s]:
                passes[:, k] += live[k] & (~fin[k, s - 1] if s else True)
    return live, passes


def test_trace_is_interesting(trace):
    """The recorded run covers what it claims: padding, several canvases, EOS, stops at different steps."""
    a, B = trace["arrays"], trace["B"]
    assert len(set(case.PROMPT_LENGTHS)) == B
    live, passes = _expected(a, B)
    assert live[-1].sum() == 1 and live[-1].any()   # an EOS ended some rows, one row ran to the end
    stops = [(k, b, int(np.argmax(a["finished"][k, :, b]))) for k in range(a["ran"].shape[0]) for b in range(B)
             if live[k, b] and a["finished"][k, :, b].any()]
    assert len({s for _, _, s in stops}) >= 2, stops  # adaptive stops at different steps
    assert (passes[live] < case.N).any() and (passes[live] == case.N).any()
    acc = a["accepted"][a["ran"]]
    assert 0 < acc.sum() < acc.size  # some tokens accepted, some renoised
    margins = json.loads(str(a["margins_json"]))
    assert all(margins[k] >= case.MIN_MARGINS[k] for k in case.MIN_MARGINS), margins


def test_engine_generate_replays_reference(trace):
    a, B, C = trace["arrays"], trace["B"], trace["C"]
    out = trace["engine"].generate(trace["tokens"], trace["lengths"],
                                   rng=case.row_keys_of(trace["rng"], B), max_new_tokens=case.K * C)
    hf_tokens = a["sequences"][:, int(a["prompt_width"]):]
    np.testing.assert_array_equal(np.asarray(out.tokens), hf_tokens)
    np.testing.assert_array_equal(np.asarray(out.finished), np.isin(hf_tokens, trace["eos"]).any(-1))
    live, passes = _expected(a, B)
    np.testing.assert_array_equal(np.asarray(out.steps), passes)
    np.testing.assert_allclose(out.tokens_per_forward(pad_id=0), a["tokens_per_forward"], rtol=1e-6)


def test_engine_steps_replay_reference(trace):
    """Step by step: the same canvases, argmax canvases, acceptance decisions and stop steps."""
    a, B = trace["arrays"], trace["B"]
    live, _ = _expected(a, B)
    N = case.N
    events = list(trace["engine"].steps(trace["tokens"], trace["lengths"],
                                        rng=case.row_keys_of(trace["rng"], len(trace["lengths"])),
                                        max_new_tokens=case.K * trace["C"]))
    steps_seen = {}
    for ev in events:
        if isinstance(ev, CanvasEvent):
            hf = a["sequences"][:, int(a["prompt_width"]):][:, ev.index * trace["C"]:(ev.index + 1) * trace["C"]]
            np.testing.assert_array_equal(ev.tokens[live[ev.index]], hf[live[ev.index]])
            continue
        assert isinstance(ev, StepEvent)
        k, s = ev.canvas_index, ev.step - 1
        rows = live[k]
        steps_seen[k] = steps_seen.get(k, 0) + 1
        assert a["ran"][k, s], (k, s)
        where = f"canvas {k} step {s}"
        np.testing.assert_array_equal(ev.argmax[rows], a["argmax"][k, s][rows], err_msg=where)
        np.testing.assert_array_equal(ev.canvas[rows], a["canvas"][k, s][rows], err_msg=where)
        # the acceptance decisions: accepted positions hold the reference's sample, the others our renoise draw
        # (rows that had already stopped are frozen on both sides)
        moving = rows & (~a["finished"][k, s - 1] if s else True)
        expect = np.where(a["accepted"][k, s], a["sampled"][k, s], trace["draws"][k]["noise"][s])
        np.testing.assert_array_equal(ev.canvas[moving], expect[moving], err_msg=where)
        # stop decisions (our `done` also marks the step budget's last step)
        np.testing.assert_array_equal(ev.done[rows], (a["finished"][k, s] | (s == N - 1))[rows], err_msg=where)
    # our loop ends when every still-generating row has stopped (the reference also waits for EOS-ended rows)
    for k, n in steps_seen.items():
        fin = a["finished"][k][:, live[k]].all(-1) if live[k].any() else np.ones(N, bool)
        expected = int(np.argmax(fin)) + 1 if fin.any() else N
        assert n == expected, (k, n, expected)
    assert sorted(steps_seen) == [k for k in range(case.K) if live[k].any()]
