"""The server's tick commits a settled canvas in the next call's first tick (`slots.slot_tick`'s
`commit`), on an accelerator in one pass with that tick's step (`Block.commit_rows_denoise`,
`loop.commit_and_step(rows=)`): the same cache, tokens and steps as the commit's own causal pass
followed by the step; rows past K per slot group wait a call without stepping; on a mesh whose data
axis splits the slots each group commits its own rows."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.model.cache import init_cache
from dgemma_jax.model.layout import stack_layers
from dgemma_jax.model.quant import quantize_params
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import SamplerConfig
from dgemma_jax.sampling import generate as gen
from dgemma_jax.sampling import slots as slots_lib
from dgemma_jax.sampling.loop import RowKnobs, commit_and_step, denoise_step, row_keys

# a sliding and a global layer, the window (8) shorter than the prompts: the sliding layer's cache is a
# ring that a commit wraps round
TWO = ModelConfig.preset("tiny-6layer", num_layers=2, layer_types=("sliding", "global"), sliding_window=8)
SAMPLER = SamplerConfig(canvas_length=16, max_denoising_steps=6, eos_ids=(1,))
CASES = {"unrolled_int8": (TWO, "unrolled", "int8"),
         "scan": (ModelConfig.preset("tiny-6layer", sliding_window=8), "scan", None)}


def _model(case, n=6, seed=0):
    cfg, layers, quant = CASES[case]
    params = init_params(cfg, seed)
    if quant:
        params = quantize_params(cfg, params, quant)
    if layers == "scan":
        params = stack_layers(params, cfg)
    rng = np.random.RandomState(seed)
    lengths = np.array([20, 13, 5, 17, 9, 11][:n], np.int32)
    tokens = rng.randint(3, cfg.vocab_size, (n, 20)).astype(np.int32)
    cache = jax.jit(gen.prefill, static_argnums=1, static_argnames="runtime")(
        params, cfg, tokens, lengths, init_cache(cfg, n, 96, layers=layers), runtime=Runtime(layers=layers))
    return cfg, params, cache, Runtime(layers=layers)


@pytest.mark.parametrize("case", list(CASES))
def test_the_rows_commit_in_the_steps_pass_equals_the_commit_then_the_step(case):
    """Two groups of three rows; rows 0 and 2 of group 0 and row 1 of group 1 are chosen, the last one
    writing nothing: one pass leaves the cache as `commit_slots` leaves it (the unchosen rows every bit)
    and its step decides as the step after it, for every row."""
    cfg, params, cache, rt = _model(case)
    n = 6
    rows = jnp.array([[0, 2], [1, 0]], jnp.int32)
    writes = jnp.array([[True, True], [True, False]])
    settled = jax.random.randint(jax.random.key(2), (2, 2, 16), 3, cfg.vocab_size)
    keys = row_keys(jax.random.key(1), n)
    canvas = gen.canvas_start(cfg, SAMPLER, keys, 1)

    @functools.partial(jax.jit, static_argnames="fused")
    def run(params, cache, fused):
        if fused:
            num = jnp.where(writes.reshape(-1), 16, 0).astype(jnp.int32)
            return commit_and_step(params, cfg, SAMPLER, cache, settled.reshape(4, 16), num, canvas.keys,
                                   canvas.state, runtime=rt, rows=rows)
        c = slots_lib.commit_slots(params, cfg, cache, rows, settled, writes, rt)
        return denoise_step(params, cfg, SAMPLER, c, c.lengths, canvas.keys, canvas.state, runtime=rt), c

    s_state, s_cache = run(params, cache, False)
    f_state, f_cache = run(params, cache, True)
    np.testing.assert_array_equal(f_cache.lengths, [36, 13, 21, 17, 25, 11])
    np.testing.assert_array_equal(f_cache.lengths, s_cache.lengths)
    for old, sep, fus in zip(jax.tree.leaves(cache), jax.tree.leaves(s_cache), jax.tree.leaves(f_cache)):
        np.testing.assert_allclose(np.asarray(fus, np.float32), np.asarray(sep, np.float32), rtol=1e-5, atol=1e-5)
        if old.ndim > 1:   # rows 1, 3 and 5 wrote nothing
            axis = old.ndim - 4
            for r in (1, 3, 5):
                np.testing.assert_array_equal(np.take(np.asarray(fus), r, axis=axis),
                                              np.take(np.asarray(old), r, axis=axis))
    for field in ("argmax", "canvas", "done", "steps"):
        np.testing.assert_array_equal(getattr(f_state, field), getattr(s_state, field), err_msg=field)
    # the soft embedding sums probabilities x the table: float32 last-bit differences of the joined
    # projections come out ~1e-4 relative in it
    np.testing.assert_allclose(np.asarray(f_state.soft, np.float32), np.asarray(s_state.soft, np.float32),
                               rtol=2e-4, atol=1e-3)


def _serve(cfg, params, cache, rt, calls, n, begin_at, owed_in=None):
    """A host driving `slot_tick` as `serving.runner.SlotRunner` does: rows owed a commit go into the
    next call. Returns every call's (settled, tokens, steps, committed, owed) and the last cache."""
    knobs = RowKnobs.of(SAMPLER, n)
    tick = jax.jit(functools.partial(slots_lib.slot_tick, config=cfg, sampler=SAMPLER, runtime=rt))
    state = slots_lib.idle_slots(cfg, SAMPLER, n)
    keys = row_keys(jax.random.key(3), n)
    canvas_index = np.zeros(n, np.int32)
    begin = np.array(begin_at)
    owed = np.zeros(n, bool) if owed_in is None else owed_in[0].copy()
    owed_tokens = np.zeros((n, SAMPLER.canvas_length), np.int32) if owed_in is None else owed_in[1].copy()
    out = []
    for _ in range(calls):
        o = tick(params, cache=cache, state=state, keys=keys, canvas_index=canvas_index, begin=begin,
                 active=np.ones(n, bool), last=canvas_index >= 5, keep=np.zeros(n, bool), knobs=knobs,
                 max_ticks=np.int32(4), commit=owed, commit_tokens=owed_tokens)
        cache, state = o.cache, o.state
        settled, toks, committed, new_owed = (np.asarray(x) for x in (o.settled, o.tokens, o.committed, o.owed))
        out.append((settled, toks, np.asarray(o.steps), committed, new_owed, int(o.ticks)))
        waiting = begin & owed & ~committed
        owed = (owed & ~committed) | new_owed
        owed_tokens = np.where(new_owed[:, None], toks, owed_tokens)
        canvas_index = canvas_index + settled
        begin = settled | waiting
    return out, cache


@pytest.mark.parametrize("case", list(CASES))
def test_a_server_committing_in_the_steps_pass_gives_the_separate_passes_tokens(case):
    """Six slots over eight calls, canvases settling and their commits carried into the next call: with
    the commit in the step's pass (`commit_pass="fused"`) every call settles the same canvases to the
    same tokens after the same steps as with the commit's own pass, and the caches agree."""
    cfg, params, cache, rt = _model(case)
    runs = {}
    for mode in ("separate", "fused"):
        runs[mode] = _serve(cfg, params, cache, Runtime(layers=rt.layers, commit_pass=mode), 8, 6,
                            np.ones(6, bool))
    (sep, s_cache), (fus, f_cache) = runs["separate"], runs["fused"]
    assert sum(int(c[3].sum()) for c in fus) >= 4   # commits happened, in the first tick of a call
    for a, b in zip(sep, fus):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(f_cache.lengths, s_cache.lengths)
    for sep_leaf, fus_leaf in zip(jax.tree.leaves(s_cache), jax.tree.leaves(f_cache)):
        np.testing.assert_allclose(np.asarray(fus_leaf, np.float32), np.asarray(sep_leaf, np.float32), atol=1e-4)


def test_rows_past_k_wait_a_call_without_stepping():
    """Three rows owed a commit in one group of eight slots (K = 1): the first call writes the first
    one, steps it and every other live row, and returns after that one tick; the two waiting rows
    keep their step count (0) and are neither settled nor committed; the next calls write them."""
    cfg, params, cache, rt = _model("unrolled_int8", n=6)
    n = 8
    cache = jax.tree.map(lambda x: jnp.concatenate([x, x[:2]], axis=x.ndim - 4 if x.ndim > 1 else 0), cache)
    owed = np.array([False, True, False, True, True, False, False, False])
    toks = np.asarray(jax.random.randint(jax.random.key(5), (n, 16), 3, cfg.vocab_size), np.int32)
    out, after = _serve(cfg, params, cache, Runtime(commit_pass="fused"), 3, n, np.ones(n, bool), (owed, toks))
    settled, _, steps, committed, _, ticks = out[0]
    assert ticks == 1 and committed.tolist() == [False, True] + [False] * 6
    assert steps[[3, 4]].tolist() == [0, 0] and not settled[[3, 4]].any()
    assert steps[[0, 1, 2, 5, 6, 7]].tolist() == [1] * 6
    assert out[1][3].tolist() == [False, False, False, True] + [False] * 4
    assert out[2][3].tolist() == [False] * 4 + [True] + [False] * 3
    lengths = np.asarray(cache.lengths)
    np.testing.assert_array_equal(np.asarray(after.lengths), lengths + 16 * owed)


def test_on_a_mesh_each_slot_group_commits_its_own_rows():
    """A mesh whose data axis splits four slots in two groups: each group writes its own owed row (one
    per group a tick) in the first tick's pass, and the call gives what a call without a mesh gives
    after those rows were committed by a pass of their own."""
    from dgemma_jax.parallel.mesh import make_mesh
    from dgemma_jax.parallel.shardings import Shardings

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (the suite runs with 8 fake CPU devices)")
    cfg, params, cache, _ = _model("unrolled_int8", n=4)
    owed = np.array([True, False, False, True])
    toks = np.asarray(jax.random.randint(jax.random.key(6), (4, 16), 3, cfg.vocab_size), np.int32)
    committed = jax.jit(slots_lib.commit_slots, static_argnums=1)(
        params, cfg, cache, jnp.array([[0, 3]], jnp.int32), jnp.asarray(toks[[0, 3]])[None], jnp.ones((1, 2), bool))
    want, w_cache = _serve(cfg, params, committed, Runtime(), 1, 4, np.ones(4, bool))
    sh = Shardings(cfg, make_mesh("data=2,expert=2", devices=jax.devices()[:4]), "serving")
    rt = dataclasses.replace(sh.runtime(), commit_pass="fused")
    assert rt.shards(4, "batch") == 2
    got, g_cache = _serve(cfg, sh.place_params(params), cache, rt, 1, 4, np.ones(4, bool), (owed, toks))
    assert got[0][3].tolist() == [True, False, False, True]   # one row of each group, in the one tick
    np.testing.assert_array_equal(np.asarray(g_cache.lengths), np.asarray(cache.lengths) + 16 * owed)
    for i in (0, 1, 2, 5):   # settled, tokens, steps, ticks
        np.testing.assert_array_equal(want[0][i], got[0][i])
    for g, w in zip(jax.tree.leaves(g_cache), jax.tree.leaves(w_cache)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-5)


def _driven(commit_pass):
    """The bundled model's scheduler (2 slots), its worker's steps run here one by one (`_admit`,
    `_tick`), so the same script meets the same ticks: two long requests; a short one arriving while
    both run, which preempts one of them at a canvas boundary (its row saved with the canvas it is
    owed); then follow-ups of the long ones' prompts and answers, which reuse their rows up to the
    kept answers. Returns each request's (tokens, steps, text), the preemptions and how many tokens
    past its own first prompt each follow-up found in a row."""
    from dgemma_jax.pipeline import load_checkpoint
    from dgemma_jax.serving.scheduler import Request, Scheduler

    cfg, params, sampler, tok = load_checkpoint(None)
    long = sampler.replace(max_denoising_steps=6, confidence_threshold=0.0)   # every canvas 6 steps
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=2, max_steps=16,
                              runtime=Runtime(commit_pass=commit_pass))
    sch.runner.start(sch._tick_args())
    done = {}

    def submit(name, prompt, max_tokens, smp, seed):
        def on(ev, name=name):
            if ev.finish_reason is not None:
                done[name] = ev
        sch.submit(Request(tok.encode(prompt, add_bos=True), max_tokens, smp, seed, on_event=on))

    def run(until):
        for _ in range(400):
            if until():
                return
            sch._admit()
            if any(sch.plan.busy) or sch.runner.owed.any():
                sch._tick()
        raise AssertionError("the script did not finish")

    submit("a", "s8877665544332211=", 40, long, 1)
    submit("b", "s31415926535=", 40, long, 2)
    run(lambda: all(c is not None and c.canvas >= 1 and c.at_boundary() for c in sch.plan.busy))
    assert sch.runner.owed.all()   # the settled canvases wait for the next call
    submit("s", "s705182936=", 8, sampler, 3)
    run(lambda: {"a", "b", "s"} <= set(done))
    for name, prompt in (("a", "s8877665544332211="), ("b", "s31415926535=")):   # follow-ups of both answers
        submit("f" + name, prompt + done[name].text + "s9350814272=", 8, sampler, 4)
    run(lambda: {"fa", "fb"} <= set(done))
    reused = {k: done[k].cached_tokens - len(tok.encode(p, add_bos=True))
              for k, p in (("fa", "s8877665544332211="), ("fb", "s31415926535="))}
    return {k: (tuple(v.token_ids), v.steps, v.text) for k, v in done.items()}, sch.stats["preemptions"], reused


def test_the_server_with_the_commit_in_the_steps_pass_answers_as_with_its_own_pass():
    """The whole scheduler (preemption with a row owed its canvas, prefix reuse of a kept answer) with
    the commit in the step's pass gives every request the tokens and steps of the separate passes,
    and the answers a request gets alone."""
    sep, fus = _driven("separate"), _driven("fused")
    assert fus[1] >= 1 and sep[1] >= 1, "a long request was preempted"
    assert max(fus[2].values()) > 8 and fus[2] == sep[2], "a follow-up reused its answer's kept canvases"
    assert fus[0] == sep[0]
    assert fus[0]["a"][2] == "1122334455667788" and fus[0]["s"][2] == "01235678"   # 8 tokens: one canvas
