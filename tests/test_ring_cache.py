"""The sliding-window layers' ring cache (model/cache.py): prompts several times longer than the ring,
in one pass or in chunks, canvas commits, the server's slots, rewinds (prefix reuse) and both layer
layouts give what a cache holding every position gives.

The reference is the same model with `canvas_length` as long as the cache: its ring then holds the
whole row (slot = position, no wrap), which is the layout the cache had before the ring. Parity with
transformers on prompts longer than the window is tests/test_parity_hf.py."""

import dataclasses

import jax
import numpy as np
import pytest

import dgemma_jax as dg
from dgemma_jax.config import ModelConfig
from dgemma_jax.model.cache import ring_size, rewind_ok, slot_positions
from dgemma_jax.sampling.generate import commit
from dgemma_jax.sampling.slots import commit_slots, prefill_slot

S = 120          # tokens per row: several rings of the tiny presets (24 and 32 slots)
TOL = 2e-4       # float32 logits: the same sums in another order


def _setup(name):
    cfg = dataclasses.replace(ModelConfig.preset(name), dtype="float32", param_dtype="float32")
    return cfg, dataclasses.replace(cfg, canvas_length=S), dg.init_params(cfg, 3)


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=TOL, rtol=TOL)


def test_slot_positions_and_rewind_limits():
    assert np.asarray(slot_positions(np.array([0, 3, 10, 11]), 4)).tolist() == [
        [-4, -3, -2, -1], [0, 1, 2, -1], [8, 9, 6, 7], [8, 9, 10, 7]]
    cfg = ModelConfig.preset("diffusiongemma-26b-a4b")
    assert ring_size(cfg, 8192) == 1024 + 256 and ring_size(cfg, 900) == 900
    # a row of 5,000 tokens: its ring holds [3720, 5000); the window before keep must lie inside it
    assert rewind_ok(cfg, 8192, 5000, 5000) and rewind_ok(cfg, 8192, 5000, 5000 - 257)
    assert not rewind_ok(cfg, 8192, 5000, 5000 - 258) and not rewind_ok(cfg, 8192, 5000, 100)
    assert rewind_ok(cfg, 8192, 1280, 1) and not rewind_ok(cfg, 8192, 1281, 1)
    assert rewind_ok(cfg, 900, 900, 3)   # the ring is the whole row


@pytest.mark.parametrize("name", ["tiny-2layer", "tiny-6layer"])
def test_long_prompts_chunks_and_commits_equal_a_cache_of_every_position(name):
    cfg, ref_cfg, params = _setup(name)
    ring = ring_size(cfg, S)
    assert ring == cfg.sliding_window + cfg.canvas_length < S // 3
    cache = dg.init_cache(cfg, 2, S)
    assert [k.shape[2] for k in cache.keys] == [S if cfg.is_global(i) else ring for i in range(cfg.num_layers)]
    rng = np.random.default_rng(0)
    t = 100
    toks = rng.integers(2, cfg.vocab_size, (2, t)).astype(np.int32)
    lengths = np.array([t, t - 37], np.int32)
    want, ref = dg.prefill(params, ref_cfg, toks, lengths, dg.init_cache(ref_cfg, 2, S))
    got, one = dg.prefill(params, cfg, toks, lengths, cache)   # one pass: the ring wraps several times
    _close(got, want)
    chunks, c = [], cache
    for lo, hi in [(0, 5), (5, 37), (37, 40), (40, 90), (90, 100)]:   # chunks shorter and longer than the ring
        out, c = dg.prefill(params, cfg, toks[:, lo:hi], np.clip(lengths - lo, 0, hi - lo), c)
        chunks.append(out)
    for lo, out in zip([0, 5, 37, 40, 90], chunks):
        valid = np.arange(lo, lo + out.shape[1])[None, :] < lengths[:, None]
        _close(np.where(valid[..., None], out, 0), np.where(valid[..., None], want[:, lo:lo + out.shape[1]], 0))
    assert np.asarray(c.lengths).tolist() == lengths.tolist()
    f, fr = (jax.jit(lambda p, x, k, cf=cf: dg.denoise(p, cf, x, k)) for cf in (cfg, ref_cfg))
    for k in range(2):   # two canvases committed, each read by the denoiser through the wrapped ring
        canvas = rng.integers(2, cfg.vocab_size, (2, cfg.canvas_length // 2)).astype(np.int32)
        _close(f(params, canvas, c), fr(params, canvas, ref))
        _close(f(params, canvas, one), fr(params, canvas, ref))
        active = np.array([True, k == 0])
        c = jax.jit(commit, static_argnums=1)(params, cfg, c, canvas, active)
        one = jax.jit(commit, static_argnums=1)(params, cfg, one, canvas, active)
        ref = jax.jit(commit, static_argnums=1)(params, ref_cfg, ref, canvas, active)
    _close(f(params, canvas, c), fr(params, canvas, ref))


@pytest.mark.parametrize("name", ["tiny-2layer", "tiny-6layer"])
def test_a_rewound_row_equals_a_fresh_prefill_and_a_rewind_too_far_is_refused(name):
    """Prefix reuse across window boundaries: a row rewound within canvas_length + 1 tokens of its end
    continues exactly as a fresh prefill of the new prompt; further back the ring no longer holds the
    window before it, which `rewind_ok` and `denoise` say."""
    cfg, _, params = _setup(name)
    rng = np.random.default_rng(1)
    a = rng.integers(2, cfg.vocab_size, (1, 90)).astype(np.int32)
    keep = 90 - cfg.canvas_length - 1
    assert rewind_ok(cfg, S, 90, keep) and not rewind_ok(cfg, S, 90, keep - 1)
    tail = rng.integers(2, cfg.vocab_size, (1, 20)).astype(np.int32)
    b = np.concatenate([a[:, :keep], tail], axis=1)
    _, row = dg.prefill(params, cfg, a, cache=dg.init_cache(cfg, 1, S), logits="none")
    rewound = row.replace(lengths=np.array([keep], np.int32))
    got, got_cache = dg.prefill(params, cfg, tail, cache=rewound)
    want, want_cache = dg.prefill(params, cfg, b, cache=dg.init_cache(cfg, 1, S))
    _close(got, want[:, keep:])
    canvas = rng.integers(2, cfg.vocab_size, (1, 8)).astype(np.int32)
    _close(dg.denoise(params, cfg, canvas, got_cache), dg.denoise(params, cfg, canvas, want_cache))
    back = ring_size(cfg, S) - cfg.sliding_window + 1
    with pytest.raises(ValueError, match=rf"more than {back} tokens before cache.lengths.*ring caches"):
        dg.denoise(params, cfg, canvas, row, context_end=[90 - back - 1])
    dg.denoise(params, cfg, canvas, row, context_end=[90 - back])


def test_scan_and_unrolled_layouts_give_the_same_ring():
    from dgemma_jax.model.layout import stack_layers, unstack_cache

    cfg, _, params = _setup("tiny-6layer")
    rng = np.random.default_rng(2)
    toks = rng.integers(2, cfg.vocab_size, (2, 70)).astype(np.int32)
    canvas = rng.integers(2, cfg.vocab_size, (2, 16)).astype(np.int32)
    scan = dg.Runtime(layers="scan")
    outs = {}
    for layers, rt, p in (("unrolled", None, params), ("scan", scan, stack_layers(params, cfg))):
        c = dg.init_cache(cfg, 2, S, layers=layers)
        l1, c = dg.prefill(p, cfg, toks[:, :50], cache=c, runtime=rt)
        l2, c = dg.prefill(p, cfg, toks[:, 50:], np.array([20, 9], np.int32), c, runtime=rt)
        outs[layers] = (l1, l2, dg.denoise(p, cfg, canvas, c, runtime=rt), unstack_cache(c, cfg))
    for a, b in zip(outs["unrolled"][:3], outs["scan"][:3]):
        _close(a, b)
    for a, b in zip(outs["unrolled"][3].keys, outs["scan"][3].keys):
        _close(a, b)


@pytest.mark.parametrize("layers", ["unrolled", "scan"])
def test_the_servers_slots_prefill_rewind_and_commit_through_the_ring(layers):
    """`prefill_slot` (chunks and a rewound prefix) and `commit_slots` on rows whose rings wrap give each
    row what a batch-1 cache of every position gives."""
    from dgemma_jax.model.layout import stack_cache, stack_layers

    cfg, ref_cfg, params = _setup("tiny-6layer")
    rt = dg.Runtime(layers=layers)
    p = stack_layers(params, cfg) if layers == "scan" else params
    rng = np.random.default_rng(4)
    n, w = 3, 40
    cache = dg.init_cache(cfg, n, S)
    cache = stack_cache(cache, cfg) if layers == "scan" else cache
    pre = jax.jit(prefill_slot, static_argnums=1, static_argnames="runtime")
    prompts = [rng.integers(2, cfg.vocab_size, 75 + 7 * s).astype(np.int32) for s in range(n)]
    for s, ids in enumerate(prompts):
        for lo in range(0, len(ids), w):
            chunk = np.zeros((1, w), np.int32)
            chunk[0, :len(ids[lo:lo + w])] = ids[lo:lo + w]
            cache = pre(p, cfg, cache, np.int32(s), chunk, np.array([len(ids[lo:lo + w])], np.int32), np.int32(lo),
                        runtime=rt)
    # slot 1 rewound to 10 tokens before its end and given another ending
    keep = len(prompts[1]) - 10
    tail = rng.integers(2, cfg.vocab_size, 12).astype(np.int32)
    chunk = np.zeros((1, w), np.int32)
    chunk[0, :12] = tail
    cache = pre(p, cfg, cache, np.int32(1), chunk, np.array([12], np.int32), np.int32(keep), runtime=rt)
    prompts[1] = np.concatenate([prompts[1][:keep], tail])
    canvases = rng.integers(2, cfg.vocab_size, (1, 2, cfg.canvas_length)).astype(np.int32)
    cache = jax.jit(commit_slots, static_argnums=1, static_argnames="runtime")(
        p, cfg, cache, np.array([[2, 0]], np.int32), canvases, np.array([[True, True]]), runtime=rt)
    rows = {0: np.concatenate([prompts[0], canvases[0, 1]]), 1: prompts[1],
            2: np.concatenate([prompts[2], canvases[0, 0]])}
    assert np.asarray(cache.lengths).tolist() == [len(rows[s]) for s in range(n)]
    probe = rng.integers(2, cfg.vocab_size, (n, 8)).astype(np.int32)
    got = dg.denoise(p, cfg, probe, cache, runtime=rt)
    for s in range(n):
        _, ref = dg.prefill(params, ref_cfg, rows[s][None], cache=dg.init_cache(ref_cfg, 1, S), logits="none")
        _close(got[s:s + 1], dg.denoise(params, ref_cfg, probe[s:s + 1], ref))
