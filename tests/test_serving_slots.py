"""Continuous batching below HTTP: per-row sampler knobs, row-local numerics, the scheduler."""

import dataclasses
import threading

import jax
import numpy as np
import pytest

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig
from dgemma_jax.pipeline import load_checkpoint
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import Canvas, RowKnobs, choice_keys, denoise_canvas, init_state, initial_canvas
from dgemma_jax.serving import text as text_lib
from dgemma_jax.io.prompts import common_prefix
from dgemma_jax.serving.chunks import content_keys
from dgemma_jax.serving.planner import Choice
from dgemma_jax.serving.scheduler import QueueFull, Request, Scheduler, ShuttingDown


@pytest.fixture(scope="module")
def bundled():
    return load_checkpoint(None)


def _config(name, **changes):
    return dataclasses.replace(ModelConfig.preset(name), **changes)


# ------------------------------------------------------------------ row-local numerics
@pytest.mark.parametrize("dispatch", ["capacity", "ragged"])
def test_a_rows_logits_do_not_depend_on_the_other_rows_at_a_fixed_shape(dispatch):
    """The server's premise: with the batch shape fixed, a row's denoiser logits are bit-identical
    whatever the other rows hold and whichever row it sits in (the MoE groups tokens of all rows,
    so this is not a given)."""
    cfg = _config("tiny-6layer", num_experts=16, top_k=4, canvas_length=64, hidden_size=128, vocab_size=512)
    rt = dg.Runtime(moe_dispatch=dispatch)
    params = dg.init_params(cfg, 0)
    n, ctx, l = 4, 40, cfg.canvas_length
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, cfg.vocab_size, (n, ctx)).astype(np.int32)
    lengths = np.array([ctx, ctx - 5, ctx - 11, ctx - 3], np.int32)
    canvas = rng.integers(0, cfg.vocab_size, (n, l)).astype(np.int32)
    f = jax.jit(lambda c, k: dg.denoise(params, cfg, c, k, runtime=rt))

    def run(perm, canv):
        cache = dg.init_cache(cfg, n, ctx + l)
        _, cache = dg.prefill(params, cfg, prompts[perm], lengths[perm], cache, logits="none", runtime=rt)
        return np.asarray(f(canv[perm], cache))

    base = run(np.arange(n), canvas)
    for trial in range(3):
        other = canvas.copy()
        other[1:] = rng.integers(0, cfg.vocab_size, (n - 1, l))
        np.testing.assert_array_equal(run(np.arange(n), other)[0], base[0])
    moved = run(np.array([2, 1, 0, 3]), canvas)   # row 0 now sits in slot 2
    np.testing.assert_array_equal(moved[2], base[0])


def test_a_prompt_chunk_goes_into_its_row_in_either_cache_layout():
    """`prefill_slot` writes row `slot` of a stacked (scanned) cache as of an unrolled one."""
    from dgemma_jax.model.layout import stack_cache, stack_layers, unstack_cache
    from dgemma_jax.sampling.slots import prefill_slot

    cfg = _config("tiny-6layer")
    params = dg.init_params(cfg, 4)
    tokens = np.random.default_rng(5).integers(3, cfg.vocab_size, (1, 8)).astype(np.int32)
    cache = dg.init_cache(cfg, 3, 32)
    args = (np.int32(1), tokens, np.array([6], np.int32), np.int32(0))
    run = jax.jit(prefill_slot, static_argnums=1, static_argnames="runtime")
    want = run(params, cfg, cache, *args)
    got = unstack_cache(run(stack_layers(params, cfg), cfg, stack_cache(cache, cfg), *args,
                            runtime=dg.Runtime(layers="scan")), cfg)
    assert np.asarray(got.lengths).tolist() == np.asarray(want.lengths).tolist() == [0, 6, 0]
    for g, w in zip(got.keys + got.values, want.keys + want.values):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5)


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
def test_committing_k_slots_equals_a_commit_over_every_row_and_leaves_the_rest(layers):
    """`commit_slots` writes K chosen rows as a commit over the whole batch would (same positions,
    same values), and nothing else; in both cache layouts."""
    from dgemma_jax.model.layout import stack_cache, stack_layers
    from dgemma_jax.sampling.generate import commit
    from dgemma_jax.sampling.slots import commit_slots

    cfg = _config("tiny-6layer")
    params = dg.init_params(cfg, 3)
    n, ctx, l = 4, 12, cfg.canvas_length
    rng = np.random.default_rng(1)
    prompts = rng.integers(3, cfg.vocab_size, (n, ctx)).astype(np.int32)
    lengths = np.array([12, 7, 10, 5], np.int32)
    cache = dg.init_cache(cfg, n, ctx + 2 * l)
    _, cache = dg.prefill(params, cfg, prompts, lengths, cache, logits="none")
    canvases = rng.integers(3, cfg.vocab_size, (n, l)).astype(np.int32)
    want = commit(params, cfg, cache, canvases, np.array([False, True, False, True]))
    run_params, got = params, cache
    if layers == "scan":
        run_params, got = stack_layers(params, cfg), stack_cache(cache, cfg)
    rt = dg.Runtime(layers=layers)
    got = jax.jit(commit_slots, static_argnums=1, static_argnames="runtime")(
        run_params, cfg, got, np.array([[3, 1]], np.int32), canvases[[3, 1]][None], np.array([[True, True]]),
        runtime=rt)
    if layers == "scan":
        from dgemma_jax.model.layout import unstack_cache
        got = unstack_cache(got, cfg)
    assert np.asarray(got.lengths).tolist() == [12, 7 + l, 10, 5 + l]
    for g, w, before in zip(got.keys + got.values, want.keys + want.values, cache.keys + cache.values):
        g, w, before = np.asarray(g), np.asarray(w), np.asarray(before)
        np.testing.assert_allclose(g[[1, 3]], w[[1, 3]], atol=2e-5)
        np.testing.assert_array_equal(g[[0, 2]], before[[0, 2]])
    # two groups of two rows (a mesh splitting the slots in two): row 1 of group 0 and row 1 of group 1
    two = jax.jit(commit_slots, static_argnums=1, static_argnames="runtime")(
        run_params, cfg, stack_cache(cache, cfg) if layers == "scan" else cache, np.array([[1], [1]], np.int32),
        canvases[[1, 3]].reshape(2, 1, l), np.array([[True], [True]]), runtime=rt)
    if layers == "scan":
        two = unstack_cache(two, cfg)
    assert np.asarray(two.lengths).tolist() == [12, 7 + l, 10, 5 + l]
    for g, w in zip(two.keys + two.values, got.keys + got.values):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_a_commit_writes_a_global_layers_new_slots_not_its_whole_row(monkeypatch):
    """`commit_slots` writes back into the slots' cache only the canvas's L new slots of a row of a
    global layer (the whole row only for a sliding layer's ring, whose L positions may wrap round its
    end): a whole 4,096-slot row per layer is what a write-back that takes another axis for the slots
    costs (found on the 26B's compiled tick when the cache's order changed). Traced, not run: the
    write-back's updates are recorded by their shapes."""
    from dgemma_jax.model.cache import SLOT_AXIS, ring_size
    from dgemma_jax.sampling.slots import commit_slots

    cfg = _config("tiny-6layer")
    n, l = 4, cfg.canvas_length
    length = ring_size(cfg, 1 << 20) + 2 * l        # longer than a sliding layer's ring
    params = dg.init_params(cfg, 3)
    cache = dg.cache_shape(cfg, n, length)
    seen = []
    real = jax.lax.dynamic_update_slice
    monkeypatch.setattr(jax.lax, "dynamic_update_slice",
                        lambda x, update, index: seen.append((x.shape, update.shape)) or real(x, update, index))
    jax.eval_shape(lambda c: commit_slots(params, cfg, c, np.array([[3, 1]], np.int32),
                                          np.zeros((1, 2, l), np.int32), np.array([[True, True]])), cache)
    writes = [(x, u) for x, u in seen if len(x) == 4]        # a group's [rows, kv heads, slots, head dim]
    whole = {x[SLOT_AXIS] for x, u in writes if u[SLOT_AXIS] == x[SLOT_AXIS]}
    assert {x[SLOT_AXIS] for x, u in writes} == {length, ring_size(cfg, length)}, writes
    assert all(u[SLOT_AXIS] == l for x, u in writes if x[SLOT_AXIS] == length), writes   # the global layer
    assert whole == {ring_size(cfg, length)}, writes                                       # the rings, whole


# ------------------------------------------------------------------ per-row knobs
def test_row_knobs_decide_each_row_exactly_as_its_own_sampler_config():
    cfg = _config("tiny-2layer")
    params = dg.init_params(cfg, 1)
    base = SamplerConfig(canvas_length=cfg.canvas_length, eos_ids=cfg.eos_ids, pad_id=cfg.pad_id,
                         max_denoising_steps=12)
    a = base.replace(t_max=1.5, t_min=0.3, entropy_bound=0.5, confidence_threshold=0.05)
    b = base.replace(max_denoising_steps=5, t_max=0.9, t_min=0.2, entropy_bound=2.0, confidence_threshold=0.2)
    n, ctx = 2, 12
    tokens = np.random.default_rng(2).integers(3, cfg.vocab_size, (n, ctx)).astype(np.int32)
    cache = dg.init_cache(cfg, n, ctx + cfg.canvas_length)
    _, cache = dg.prefill(params, cfg, tokens, None, cache, logits="none")
    keys = choice_keys(7, n)  # two distinct streams
    canvas = initial_canvas(keys, cfg.canvas_length, cfg.vocab_size)
    run = jax.jit(denoise_canvas, static_argnums=(1, 2))
    start = Canvas(init_state(cfg, base, canvas), keys)
    knobs = RowKnobs.from_samplers([a, b], base.max_denoising_steps)
    mixed = run(params, cfg, base, cache, start, knobs=knobs).state
    for row, own in enumerate((a, b)):
        alone = run(params, cfg, own, cache, Canvas(init_state(cfg, own, canvas), keys)).state
        for field in ("argmax", "canvas", "steps", "done"):
            np.testing.assert_array_equal(np.asarray(getattr(mixed, field))[row],
                                          np.asarray(getattr(alone, field))[row], err_msg=f"row {row} {field}")
    assert int(np.asarray(mixed.steps)[1]) <= 5  # row b's own budget held inside a 12-step loop


def test_row_knobs_refuse_a_budget_beyond_the_loop():
    with pytest.raises(ValueError, match="at most 4"):
        RowKnobs.from_samplers([SamplerConfig(max_denoising_steps=8)], 4)


# ------------------------------------------------------------------ scheduler
class _Collect:
    def __init__(self, expect):
        self.final, self.events, self.expect = {}, [], expect
        self.done = threading.Event()

    def __call__(self, ev):
        self.events.append(ev)
        if ev.finish_reason is not None:
            self.final[ev.index] = ev
            if len(self.final) == self.expect:
                self.done.set()


def _submit(sch, tok, sampler, prompt, seed, max_tokens=32, n=1, **kw):
    c = _Collect(n)
    req = Request(tok.encode(prompt, add_bos=True), max_tokens, sampler, seed, on_event=c, n=n, **kw)
    sch.submit(req)
    return c, req


@pytest.fixture(scope="module")
def scheduler(bundled):
    cfg, params, sampler, tok = bundled
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=4, max_steps=32, max_queue=16)
    sch.start()
    yield sch
    sch.stop()


def test_a_request_alone_equals_the_same_request_among_others(bundled, scheduler):
    cfg, params, sampler, tok = bundled
    alone, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11)
    assert alone.done.wait(120)
    others = ["s8877665544332211=", "s31415926535=", "s705182936="]
    crowd = [_submit(scheduler, tok, sampler, p, seed=100 + i, max_tokens=24 + 8 * i)[0]
             for i, p in enumerate(others)]
    # the request now lands in the fourth slot, its rounds shared with three other prompts
    again, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11)
    assert again.done.wait(120) and all(c.done.wait(120) for c in crowd)
    a, b = alone.final[0], again.final[0]
    assert a.token_ids == b.token_ids and a.steps == b.steps and a.text == "0122345789"
    assert [c.final[0].text for c in crowd] == ["1122334455667788", "11233455569", "012356789"]


def test_a_structured_request_in_the_slots_equals_itself_alone(bundled, scheduler):
    # a structured request (Request.grammar) runs in a slot beside plain and structured ones: the same
    # seed gives the same tokens as alone, every answer matches its pattern, and the plain requests
    # still give their own answers (a slot without pins steps exactly as without them)
    import re

    from dgemma_jax.engine.grammar import compile_grammar

    cfg, params, sampler, tok = bundled
    digits = compile_grammar(tok, cfg.vocab_size, sampler.eos_ids, regex=r"[0-9]{3,9}")
    pair = compile_grammar(tok, cfg.vocab_size, sampler.eos_ids, regex=r"[0-9]+=[0-9]+")
    alone, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11, max_tokens=24, grammar=digits)
    assert alone.done.wait(120)
    crowd = [_submit(scheduler, tok, sampler, "s8877665544332211=", seed=100, max_tokens=24)[0],
             _submit(scheduler, tok, sampler, "s31415926535=", seed=101, max_tokens=32, grammar=pair)[0],
             _submit(scheduler, tok, sampler, "s705182936=", seed=102, max_tokens=40)[0]]
    again, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11, max_tokens=24, grammar=digits)
    assert again.done.wait(120) and all(c.done.wait(120) for c in crowd)
    a, b = alone.final[0], again.final[0]
    assert a.token_ids == b.token_ids and a.text == b.text and re.fullmatch(r"[0-9]{3,9}", a.text), (a, b)
    assert a.finish_reason == b.finish_reason == "stop"
    assert re.fullmatch(r"[0-9]+=[0-9]+", crowd[1].final[0].text) or crowd[1].final[0].finish_reason == "length"
    assert crowd[0].final[0].text == "1122334455667788" and crowd[2].final[0].text == "012356789"
    # it shared its ticks with the others: they were running while it ran
    span = range(b.admitted_tick, b.tick + 1)
    assert all(c.final[0].admitted_tick <= b.tick and c.final[0].tick >= b.admitted_tick for c in crowd), \
        (span, [(c.final[0].admitted_tick, c.final[0].tick) for c in crowd])


def test_finished_slots_are_refilled_before_a_long_request_ends(bundled):
    cfg, params, sampler, tok = bundled
    # first come, first served: under the default policy the shorts would preempt the long one instead
    # (tests/test_serving_preemption.py)
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=2, max_steps=16, policy="fcfs")
    long, _ = _submit(sch, tok, sampler, "s8877665544332211=", seed=1)   # 17 tokens: 3 canvases
    shorts = [_submit(sch, tok, sampler, "s705182936=", seed=s, max_tokens=8)[0] for s in range(3)]  # 1 canvas
    sch.start()
    try:
        assert long.done.wait(120) and all(s.done.wait(120) for s in shorts)
    finally:
        sch.stop()
    end_long = long.final[0].tick
    assert long.final[0].canvases == 3 and long.final[0].text == "1122334455667788"
    admitted = [s.final[0].admitted_tick for s in shorts]
    finished = [s.final[0].tick for s in shorts]
    # one short request after another through the second slot, each admitted right after the one
    # before it ended (not when the long one's canvas ends) ...
    assert all(finished[i] < admitted[i + 1] <= finished[i] + 1 for i in range(2)), (admitted, finished)
    assert admitted[-1] < end_long                   # ... while the long one was still running
    assert all(s.final[0].finish_reason == "length" and s.final[0].canvases == 1 for s in shorts)


def test_per_request_sampler_settings_and_n_choices(bundled, scheduler):
    cfg, params, sampler, tok = bundled
    c, _ = _submit(scheduler, tok, sampler.replace(max_denoising_steps=3, t_max=1.0, t_min=0.5), "s9350814272=",
                   seed=5, n=3)
    assert c.done.wait(120)
    assert sorted(c.final) == [0, 1, 2]
    assert all(ev.steps <= 3 * ev.canvases for ev in c.final.values())
    keys = np.asarray(jax.random.key_data(choice_keys(5, 3)))  # the scheduler's keys of the 3 choices
    assert len({tuple(k) for k in keys}) == 3                     # three streams, not one repeated


def test_a_follow_up_prompt_reuses_its_slots_prompt_and_answer(bundled, scheduler):
    """Prefix reuse: a prompt that begins with an earlier request's prompt and answer (EOS included, as a
    chat template renders a finished turn) prefills only what follows, and gets the same tokens and
    steps as with reuse turned off."""
    cfg, params, sampler, tok = bundled
    first, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11)
    assert first.done.wait(120)
    p1, answer = tok.encode("s9350814272=", add_bos=True), list(first.final[0].token_ids)
    assert answer[-1] in sampler.eos_ids
    follow = p1 + answer + tok.encode("s31415926535=")
    runs = []
    for sch in (scheduler, Scheduler.for_model(cfg, params, tok, sampler, slots=4, max_steps=32,
                                               prefix_reuse=False)):
        if sch is not scheduler:
            sch.start()
        c = _Collect(1)
        sch.submit(Request(follow, 16, sampler, 4, on_event=c))
        assert c.done.wait(120)
        runs.append(c.final[0])
        if sch is not scheduler:
            sch.stop()
    reused, plain = runs
    assert reused.cached_tokens >= len(p1) + len(answer) and plain.cached_tokens == 0
    assert reused.token_ids == plain.token_ids and reused.steps == plain.steps


def test_stop_strings_cut_the_text(bundled, scheduler):
    cfg, params, sampler, tok = bundled
    c, _ = _submit(scheduler, tok, sampler, "s9350814272=", seed=11, stop=("45", "zz"))
    assert c.done.wait(120)
    assert c.final[0].text == "01223" and c.final[0].finish_reason == "stop"


def test_a_cancelled_request_frees_its_slot_at_the_next_tick(bundled, scheduler):
    cfg, params, sampler, tok = bundled
    c, req = _submit(scheduler, tok, sampler, "s8877665544332211=", seed=2)
    req.cancelled.set()
    assert c.done.wait(120)
    assert c.final[0].finish_reason == "cancelled" and c.final[0].canvases <= 1
    # cancelled in the middle of a canvas that would run 32 steps: it leaves at the very next tick
    slow = sampler.replace(max_denoising_steps=32, confidence_threshold=0.0)
    c, seen = _Collect(1), {}

    def listen(ev):
        c(ev)
        if ev.provisional is not None and ev.steps == 3:
            seen["tick"] = ev.tick
            mid.cancelled.set()
    mid = Request(tok.encode("s31415926535=", add_bos=True), 32, slow, 3, on_event=listen, provisional=True)
    scheduler.submit(mid)
    assert c.done.wait(120)
    final = c.final[0]
    assert final.finish_reason == "cancelled" and final.tick == seen["tick"] + 1
    assert max(ev.steps for ev in c.events if ev.provisional is not None) == 3   # no step after the cancel
    ok, _ = _submit(scheduler, tok, sampler, "s705182936=", seed=0)
    assert ok.done.wait(120) and ok.final[0].text == "012356789"
    assert scheduler.status()["busy_slots"] == 0


def test_limits_queue_and_shutdown(bundled):
    cfg, params, sampler, tok = bundled
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=1, max_queue=2, context=64)
    with pytest.raises(ValueError, match="context of 64 tokens"):
        sch.check_fits(20, 200)
    with pytest.raises(ValueError, match="shorten the prompt"):
        sch.check_fits(60, 8)
    c, _ = _submit(sch, tok, sampler, "s9350814272=", seed=0, n=2)   # queued before the worker runs
    with pytest.raises(QueueFull, match="limit 2"):
        _submit(sch, tok, sampler, "s9350814272=", seed=0)
    sch.start()
    sch.stop()   # drains: the accepted request still finishes
    assert c.done.is_set() and [c.final[i].text for i in (0, 1)] == ["0122345789"] * 2
    with pytest.raises(ShuttingDown):
        _submit(sch, tok, sampler, "s705182936=", seed=0)


# ------------------------------------------------------------------ text helpers
def test_stop_string_helpers():
    assert text_lib.cut_at_stop("abcdef", ("de", "b")) == ("a", True)
    assert text_lib.cut_at_stop("abc", ("x",)) == ("abc", False)
    assert text_lib.stream_safe("hello wor", ("world",)) == "hello "
    assert text_lib.stream_safe("hello", ("xy",)) == "hello"
    assert text_lib.delta("ab", "abcd") == "cd" and text_lib.delta("ab", "ax") == ""


def _prefill_into(sch, slot, ids, start=0):
    """Every prefill chunk of `ids` from `start` on into row `slot`, as the worker runs them."""
    req = Request(ids, 8, sch.default_sampler, 0, on_event=lambda ev: None)
    req.content = content_keys(ids, None)
    choice = Choice(req, 0, np.zeros(2, np.uint32), 1, slot=slot, chunks=sch.plan_chunks(ids, start=start))
    n = len(choice.chunks)
    while choice.chunks:
        sch._prefill_chunk(choice)
    return n


def test_a_long_prompt_goes_into_its_slot_in_chunks_equal_to_one_prefill(bundled):
    cfg, params, sampler, tok = bundled
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=3, context=64, prefill_chunk=8)
    assert sch.prefill_widths == (8, 8)
    sch.runner.cache = sch.engine.new_cache(3, 64)
    ids = np.asarray(tok.encode("s8877665544332211=", add_bos=True), np.int32)    # 19 tokens: chunks of 8, 8, 3
    assert _prefill_into(sch, 1, ids) == 3
    _, ref = dg.prefill(params, cfg, ids[None], None, dg.init_cache(cfg, 1, 64), logits="none")
    assert np.asarray(sch.runner.cache.lengths).tolist() == [0, 19, 0]
    for got, want in zip(sch.runner.cache.keys + sch.runner.cache.values, ref.keys + ref.values):
        np.testing.assert_allclose(np.asarray(got)[1, :, :19], np.asarray(want)[0, :, :19], atol=2e-5)
        assert not np.asarray(got)[[0, 2]].any()          # the other rows untouched


def test_a_prompt_continued_from_a_rows_prefix_equals_its_own_prefill(bundled):
    """Prefix reuse below the scheduler: a row holding prompt A, then prompt B (sharing A's first 11
    tokens) written from position 11 on, holds B's cache as a prefill of B alone would."""
    cfg, params, sampler, tok = bundled
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=2, context=64, prefill_chunk=8)
    sch.runner.cache = sch.engine.new_cache(2, 64)
    a = np.asarray(tok.encode("s8877665544332211=", add_bos=True), np.int32)
    b = np.asarray(tok.encode("s8877665543=", add_bos=True), np.int32)
    shared = common_prefix(content_keys(a, None), content_keys(b, None))
    assert shared == 11
    _prefill_into(sch, 0, a)
    assert _prefill_into(sch, 0, b, start=shared) == 1 and sch.plan.rows[0].tolist() == b.tolist()
    _, ref = dg.prefill(params, cfg, b[None], None, dg.init_cache(cfg, 1, 64), logits="none")
    assert int(np.asarray(sch.runner.cache.lengths)[0]) == len(b)
    for got, want in zip(sch.runner.cache.keys + sch.runner.cache.values, ref.keys + ref.values):
        np.testing.assert_allclose(np.asarray(got)[0, :, :len(b)], np.asarray(want)[0, :, :len(b)], atol=2e-5)


@pytest.mark.parametrize("mesh", ["expert=4", "data=2,expert=2"])
def test_slots_sharded_over_a_mesh(bundled, mesh):
    """`dgemma serve --mesh`: parameters and the slots' cache on a 4-device mesh (fake CPU devices). With a
    data axis the slots are split in two groups, each committing its own rows (`slots.slot_tick`)."""
    from dgemma_jax.parallel.mesh import make_mesh
    from dgemma_jax.parallel.shardings import Shardings

    cfg, params, sampler, tok = bundled
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (the suite runs with 8 fake CPU devices)")
    sh = Shardings(cfg, make_mesh(mesh, devices=jax.devices()[:4]), "serving")
    prompts = ["s9350814272=", "s31415926535=", "s8877665544332211=", "s705182936="]

    def finals(sch):
        """Every prompt's final event, all submitted before the server starts."""
        runs = [_submit(sch, tok, sampler, p, seed=i, max_tokens=24)[0] for i, p in enumerate(prompts)]
        sch.start()
        try:
            assert all(c.done.wait(300) for c in runs)
        finally:
            sch.stop()
        return [c.final[0] for c in runs]

    sch = Scheduler.for_model(cfg, sh.place_params(params), tok, sampler, slots=4, shardings=sh)
    got = finals(sch)
    assert [ev.text for ev in got] == ["".join(sorted(p[1:-1])) for p in prompts]
    assert len(sch.runner.cache.keys[0].sharding.device_set) == 4
    # the same requests on one device: the same tokens and denoising steps, choice by choice (with a
    # data axis each slot group commits its own rows; the commit must not change what a row computes)
    ref = finals(Scheduler.for_model(cfg, params, tok, sampler, slots=4))
    assert [(ev.token_ids, ev.steps) for ev in got] == [(ev.token_ids, ev.steps) for ev in ref]


def test_a_server_with_the_layers_scanned_gives_the_same_answers(bundled, scheduler):
    """`dgemma serve --layers scan` (Runtime(layers="scan")): the slot programs on the stacked layers and
    cache give the unrolled server's tokens and steps, for requests sharing ticks and a follow-up that
    reuses a slot's prefix."""
    from dgemma_jax.cli import build_parser
    from dgemma_jax.cli_run import runtime_for

    cfg, params, sampler, tok = bundled
    args = build_parser().parse_args(["serve", "--layers", "scan"])
    assert runtime_for(args).layers == "scan"
    scanned = Scheduler.for_model(cfg, params, tok, sampler, slots=4, max_steps=32, max_queue=16,
                                  runtime=runtime_for(args))
    assert scanned.engine.runtime.layers == "scan"
    scanned.start()
    try:
        prompts = ["s9350814272=", "s8877665544332211=", "s31415926535=", "s9350814272=0122345789s4213="]
        got = []
        for sch in (scheduler, scanned):
            runs = [_submit(sch, tok, sampler, p, seed=40 + i)[0] for i, p in enumerate(prompts[:3])]
            assert all(c.done.wait(120) for c in runs)
            follow, _ = _submit(sch, tok, sampler, prompts[3], seed=50)
            assert follow.done.wait(120)
            got.append([(c.final[0].token_ids, c.final[0].steps) for c in runs + [follow]])
        assert got[0] == got[1]
        assert got[1][0][0] and tok.decode(got[1][0][0]) == "0122345789"
    finally:
        scanned.stop()


def _transposed(params):
    """A Format per parameter leaf: arrays of 2+ dims in the reverse of the default (row-major) layout."""
    from jax.experimental.layout import Format, Layout

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda a: Format(Layout(major_to_minor=tuple(range(a.ndim))[::-1]) if a.ndim >= 2 else None,
                                         getattr(a, "sharding", device)), params)


def test_a_server_with_its_weights_in_other_layouts_gives_the_same_answers(bundled, scheduler):
    """`dgemma serve --param-layouts`: the engine's weights moved to other memory layouts (`Engine.place_params`)
    before the server compiles: its programs compile for them (no relayout at the call: the compiled
    tick takes the weights' layouts), and the answers, tokens and steps are the reference server's.
    With "compiler" the tick compiles first with its weights' layouts left to the compiler
    (`Engine.compile_in_compiler_layouts`) and the weights move to what it chose: from the reversed
    layouts back to the row-major ones XLA:CPU picks."""
    cfg, params, sampler, tok = bundled
    prompts = ["s9350814272=", "s8877665544332211=", "s31415926535="]

    def answers(sch):
        runs = [_submit(sch, tok, sampler, p, seed=i, max_tokens=16 + 8 * i)[0] for i, p in enumerate(prompts)]
        assert all(c.done.wait(120) for c in runs)
        return [(c.final[0].token_ids, c.final[0].steps, c.final[0].text) for c in runs]

    ref = answers(scheduler)
    assert [t for _, _, t in ref] == ["0122345789", "1122334455667788", "11233455569"]
    for mode in ("default", "compiler"):
        sch = Scheduler.for_model(cfg, params, tok, sampler, slots=4, max_steps=32, max_queue=16, param_layouts=mode)
        assert sch.runner.param_layouts == mode
        sch.engine.place_params(_transposed(sch.engine.params))
        moved = [a for a in jax.tree.leaves(sch.engine.params) if a.ndim >= 2]
        assert moved and all(a.format.layout.major_to_minor == tuple(range(a.ndim))[::-1] for a in moved)
        sch.start()
        try:
            assert answers(sch) == ref
            want = (lambda nd: tuple(range(nd))[::-1]) if mode == "default" else (lambda nd: tuple(range(nd)))
            assert all(a.format.layout.major_to_minor == want(a.ndim) for a in jax.tree.leaves(sch.engine.params)
                       if a.ndim >= 2), mode
            if mode == "default":   # the tick was compiled for the weights' layouts as they came
                tick = sch.runner.compile_tick(sch._tick_args())
                # (a parameter the tick never reads has no layout: the last layer's encoder scalar,
                # which scales only the commit's output of that layer)
                took = [f.layout.major_to_minor for f in jax.tree.leaves(tick.input_formats[0][0])
                        if f.layout is not None and len(f.layout.major_to_minor) >= 2]
                assert took and all(m == tuple(range(len(m)))[::-1] for m in took)
        finally:
            sch.stop()
    with pytest.raises(ValueError, match="param_layouts='tiled' is invalid"):
        Scheduler.for_model(cfg, params, tok, sampler, slots=2, param_layouts="tiled")
    assert Scheduler.for_model(cfg, params, tok, sampler, slots=2).runner.param_layouts == "default"   # auto, CPU
    from dgemma_jax.engine.placement import resolve_param_layouts
    assert resolve_param_layouts("auto", "tpu", adapter_rows=False) == "compiler"
    assert resolve_param_layouts("auto", "tpu", adapter_rows=True) == "default"   # LoRA rows: as placed
    with pytest.raises(ValueError, match="adapter rows"):
        resolve_param_layouts("compiler", "tpu", adapter_rows=True)
