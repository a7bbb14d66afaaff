"""The denoiser's attention kernel (model/flash.py: canvas and cache under one softmax, Pallas;
interpreted on CPU) gives what the XLA path gives: alone, in the model, in gradients and sharded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, Runtime, denoise, init_cache, prefill
from dgemma_jax.model import api, flash
from dgemma_jax.model.attention import attend

# head_dim 128 everywhere; canvas 64: 64 x 2 query rows per kv head on sliding layers (4 heads on 2),
# 64 x 4 on the global one; a 128-token sliding window: every layer's cache part fits the kernel
CFG = ModelConfig.preset("tiny-6layer", head_dim=128, global_head_dim=128, sliding_window=128, canvas_length=64)
SLOTS = 256


def _qkv(rng, b=2, t=32, n=8, kh=2, s=256, h=128):
    """q [B, T, N, H]; k, v in the cache's layout [B, K, S, H]."""
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((b, t, n, h), (b, kh, s, h), (b, kh, s, h)))
    return q, k, v


def _cache_and_canvas(rng, used):
    """q; a 256-slot cache of which row 0 sees the first `used` slots and row 1 none; canvas keys."""
    q, kc, vc = _qkv(rng)
    _, k, v = _qkv(rng, s=32)
    valid = np.zeros((2, 256), bool)
    valid[0, :used] = True
    return q, kc, vc, k, v, jnp.asarray(valid)


def test_denoise_attention_is_one_softmax_over_canvas_and_visible_slots():
    """Against float64 numpy: each query's softmax over all canvas keys and the visible cache slots
    (not contiguous), on several shapes: the tiny one, 26B-like head_dim 256 with a 128-row canvas, a
    cache of many key blocks, and a row (1) that sees no cache slot at all (only its canvas)."""
    for b, t, n, kh, s, h in ((2, 32, 8, 2, 256, 128), (1, 128, 4, 2, 1536, 256), (2, 64, 2, 1, 640, 128)):
        rng = np.random.default_rng(s)
        q, kc, vc = _qkv(rng, b=b, t=t, n=n, kh=kh, s=s, h=h)
        _, k, v = _qkv(rng, b=b, t=t, n=n, kh=kh, s=t, h=h)
        valid = np.zeros((b, s), bool)
        valid[0, :s // 3] = True
        valid[0, s - 70:s - 60] = True
        out = np.asarray(flash.denoise_attention(q, k, v, kc, vc, jnp.asarray(valid)))
        assert out.shape == q.shape
        qn, kn, vn, kcn, vcn = (np.asarray(x, np.float64) for x in (q, k, v, kc, vc))
        for r in range(b):
            for head in range(n):
                kv = head // (n // kh)
                keys = np.concatenate([kcn[r, kv, valid[r]], kn[r, kv]])
                vals = np.concatenate([vcn[r, kv, valid[r]], vn[r, kv]])
                sc = qn[r, :, head] @ keys.T
                p = np.exp(sc - sc.max(-1, keepdims=True))
                # float32 rounding of sharp head_dim-256 scores: the XLA path is as far (6.4e-5, measured)
                np.testing.assert_allclose(out[r, :, head], p @ vals / p.sum(-1, keepdims=True), rtol=1e-4,
                                           atol=1e-4, err_msg=str((b, t, n, kh, s, h, r, head)))


def test_denoise_attention_equals_the_xla_path():
    """The kernel and `attend` over [cache where visible ; canvas] (what the model runs off TPU)."""
    q, kc, vc, k, v, valid = _cache_and_canvas(np.random.default_rng(1), 77)
    whole = attend(q, [(kc, vc, valid[:, None]), (k, v, None)])
    fused = flash.denoise_attention(q, k, v, kc, vc, valid)
    np.testing.assert_allclose(np.asarray(fused), np.asarray(whole), rtol=1e-5, atol=1e-5)


def test_denoise_attention_rejects_shapes_it_cannot_tile():
    rng = np.random.default_rng(0)
    q, kc, vc = _qkv(rng, t=24)  # 24 x 4 = 96 query rows
    _, k, v = _qkv(rng, t=24, s=24)
    with pytest.raises(ValueError, match="T x G = 96"):
        flash.denoise_attention(q, k, v, kc, vc, jnp.ones((2, 256), bool))
    q, kc, vc = _qkv(rng, s=200)  # 200 slots: not whole 128-lane tiles
    _, k, v = _qkv(rng, s=32)
    with pytest.raises(ValueError, match="S = 200"):
        flash.denoise_attention(q, k, v, kc, vc, jnp.ones((2, 200), bool))
    q, kc, vc = _qkv(rng, h=64)  # a 64-wide head
    _, k, v = _qkv(rng, s=32, h=64)
    with pytest.raises(ValueError, match="H = 64"):
        flash.denoise_attention(q, k, v, kc, vc, jnp.ones((2, 256), bool))


def _close(out, ref):
    """Logits equal up to float32 rounding. With head_dim 128 and random weights the softmaxes are
    sharp: merely regrouping the XLA path's keys (attn_key_block 64 or 100) moves these logits by
    1.5e-3 and 4.9e-3 at a logit scale of 25, and the kernel moves them by 1.2e-3."""
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-4 * scale)
    assert np.mean(np.abs(out - ref) < 1e-5 * scale) > 0.5  # most logits agree to float32 rounding
    np.testing.assert_array_equal(out.argmax(-1), ref.argmax(-1))


def _spy(monkeypatch):
    """Record the query shape of every kernel call traced from here on."""
    seen = []
    real = flash._kernel_call
    monkeypatch.setattr(flash, "_kernel_call", lambda q, *a: seen.append(q.shape) or real(q, *a))
    return seen


@pytest.fixture(scope="module")
def state():
    from test_model_behaviour import _random_params

    params = _random_params(CFG, 0)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CFG.vocab_size, (2, 200)).astype(np.int32)
    # row 0 reaches past the sliding window; row 1 has no context at all
    _, cache = prefill(params, CFG, tokens, [200, 0], init_cache(CFG, 2, SLOTS))
    canvas = rng.integers(0, CFG.vocab_size, (2, CFG.canvas_length)).astype(np.int32)
    return params, cache, canvas


def test_model_denoise_through_the_kernel_equals_xla(state, monkeypatch):
    params, cache, canvas = state
    ref = np.asarray(denoise(params, CFG, canvas, cache, runtime=Runtime(attn_kernel="xla")))
    seen = _spy(monkeypatch)
    out = np.asarray(denoise(params, CFG, canvas, cache, runtime=Runtime(attn_kernel="pallas")))
    assert len(seen) == CFG.num_layers  # every layer's attention went through the kernel
    _close(out, ref)
    # the default ("auto") keeps XLA off TPU: bit-identical to "xla"
    np.testing.assert_array_equal(np.asarray(denoise(params, CFG, canvas, cache)), ref)


def test_gradients_through_the_kernel_equal_xla():
    """The kernel's custom gradient (the XLA formulation's) equals differentiating the XLA path."""
    rng = np.random.default_rng(5)
    q, kc, vc, k, v, valid = _cache_and_canvas(rng, 50)
    w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)

    def xla(q, kc, vc, k, v):
        return jnp.sum(w * jnp.tanh(attend(q, [(kc, vc, valid[:, None]), (k, v, None)])))

    def kernel(q, kc, vc, k, v):
        return jnp.sum(w * jnp.tanh(flash.denoise_attention(q, k, v, kc, vc, valid)))

    g_ref = jax.grad(xla, argnums=range(5))(q, kc, vc, k, v)
    g = jax.grad(kernel, argnums=range(5))(q, kc, vc, k, v)
    for name, a, b in zip(("q", "k cache", "v cache", "k canvas", "v canvas"), g_ref, g):
        scale = float(jnp.abs(a).max())
        assert scale > 1e-3, name  # a real gradient reaches every input
        # float32 rounding of sharp softmaxes: both paths sit ~4e-6 x scale from a float64 gradient
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-5 * scale, err_msg=name)
    assert np.all(np.asarray(g[1])[1] == 0)  # no gradient into slots no query sees


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_kernel_runs_per_head_shard(monkeypatch):
    """Under a mesh the kernel runs per head shard (shard_map, each device on its own heads) and
    gives what the sharded XLA path gives."""
    from dgemma_jax.parallel import Shardings, make_mesh
    from test_model_behaviour import _random_params

    cfg = CFG.replace(num_heads=8, num_kv_heads=4, num_global_kv_heads=2)
    params = _random_params(cfg, 3)
    # batch split 2 ways, heads 4 ways: each device holds 2 query heads and the 1 kv head they read
    # (the global layer's 2 kv heads stored twice each, see model/cache.py)
    sh = Shardings(cfg, make_mesh("data=2,tensor=4"), "serving")
    assert sh.kv_replicas == (1,) * 5 + (2,)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)
    _, cache = prefill(params, cfg, tokens, [150, 9], init_cache(cfg, 2, SLOTS, kv_replicas=sh.kv_replicas))
    canvas = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, cfg.canvas_length)).astype(np.int32))
    placed, cache_sh = sh.place_params(params), jax.device_put(cache, sh.cache(2, SLOTS))
    seen = _spy(monkeypatch)

    def run(mode):
        fn = jax.jit(functools.partial(api._denoise.__wrapped__, config=cfg, runtime=sh.runtime(attn_kernel=mode)))
        return np.asarray(fn(placed, canvas=canvas, cache=cache_sh, context_end=cache.lengths, soft=None))

    ref = run("xla")
    assert seen == []
    out = run("pallas")
    assert seen == [(1, cfg.canvas_length, 2, 128)] * cfg.num_layers  # traced once per layer, per shard
    _close(out, ref)
    # and the unsharded kernel agrees with the unsharded XLA path on the same (replicated) cache
    un = np.asarray(denoise(params, cfg, canvas, cache, runtime=Runtime(attn_kernel="pallas")))
    un_ref = np.asarray(denoise(params, cfg, canvas, cache, runtime=Runtime(attn_kernel="xla")))
    _close(un, un_ref)


def _attention_primitives(rt):
    """Primitive counts of a TPU-traced denoiser pass under the attention's name scopes, kernel bodies
    (pallas_call) counted as one call each and not entered."""
    import collections

    from jax.extend import core as jcore

    cfg = ModelConfig.preset("tiny-2layer", hidden_size=128, num_heads=2, head_dim=128, num_kv_heads=1,
                             global_head_dim=128, canvas_length=128, sliding_window=128)
    cache = init_cache(cfg, 1, 256)
    canvas = jnp.zeros((1, 128), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p, c: api.denoise_logits(p, cfg, canvas, c.lengths, c, runtime=rt))(
        api.param_shapes(cfg), cache)
    found = collections.Counter()

    def walk(j):
        for e in j.eqns:
            if e.primitive.name == "pallas_call":
                found["pallas_call"] += 1
                continue
            if "attn" in str(e.source_info.name_stack):
                found[e.primitive.name] += 1
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(sub, (jcore.ClosedJaxpr, jcore.Jaxpr)):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jaxpr.jaxpr)
    return found


def test_on_tpu_no_softmax_of_the_denoiser_runs_outside_the_kernel():
    """Traced for TPU, each layer's attention is one kernel call and no softmax piece (exp, row max) is
    left to XLA: canvas and cache share the kernel's softmax. (With jax's flash kernel, before, the
    canvas's own keys were attended and merged in XLA: 6 exps and 2 row maxes here.) The XLA path,
    the control, has them."""
    fused = _attention_primitives(Runtime(platform="tpu"))
    assert fused["pallas_call"] == 2  # two layers
    assert fused["exp"] == 0 and fused["reduce_max"] == 0, fused
    xla = _attention_primitives(Runtime(platform="tpu", attn_kernel="xla"))
    assert xla["pallas_call"] == 0 and xla["exp"] > 0 and xla["reduce_max"] > 0, xla
