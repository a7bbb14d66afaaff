"""Mixture of experts: router semantics and the dispatch strategies against the all-experts oracle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from dgemma_jax import ModelConfig, Runtime, denoise, init_cache, init_params, prefill
from dgemma_jax.model import moe

TOL = 1e-5


# ---------------------------------------------------------------------------------------------- numpy oracles
def np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def np_route(h, w_router, router_scale, expert_scale, top_k, eps):
    h = h.astype(np.float64)
    d = h.shape[-1]
    r = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + eps) * router_scale * d ** -0.5
    logits = r @ w_router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # softmax over ALL experts
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, idx, -1)
    w = w / w.sum(-1, keepdims=True)  # renormalised top-k
    return w * expert_scale[idx], idx, p


def np_experts(z, weights, experts, gate_up, down):
    """sum_k w_k * down_e(gelu(z G_e) * (z U_e)), e = experts[:, k]; gate_up [E, D, 2F], down [E, F, D]."""
    z = z.astype(np.float64)
    out = np.zeros_like(z)
    for n in range(z.shape[0]):
        for w, e in zip(weights[n], experts[n]):
            f = down.shape[1]
            g = z[n] @ gate_up[e, :, :f]
            u = z[n] @ gate_up[e, :, f:]
            out[n] += w * (np_gelu_tanh(g) * u) @ down[e]
    return out


def _expert_weights(rng, e, d, f):
    gate_up = rng.normal(0, d ** -0.5, (e, d, 2 * f)).astype(np.float32)
    down = rng.normal(0, f ** -0.5, (e, f, d)).astype(np.float32)
    return gate_up, down


def _random_choices(rng, n, e, k):
    experts = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.5, (n, k)).astype(np.float32)
    return weights, experts


STRATEGIES = {
    "ragged": moe.dispatch_ragged,
    "capacity": lambda z, w, x, gu, dn: moe.dispatch_capacity(
        z, w, x, gu, dn, moe.capacity_for(z.shape[0], x.shape[1], gu.shape[0], 2.0)),
}


# ---------------------------------------------------------------------------------------------- router
@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (7, 8, 2), (64, 16, 4), (33, 16, 16)])
def test_router_matches_numpy(n, e, k):
    rng = np.random.default_rng(n * 100 + e + k)
    d = 32
    h = (rng.normal(size=(n, d)) * rng.uniform(0.1, 10.0, (n, 1))).astype(np.float32)  # un-normed residual
    w_router = rng.normal(0, 1.0, (d, e)).astype(np.float32)
    router_scale = rng.uniform(0.5, 1.5, d).astype(np.float32)
    expert_scale = rng.uniform(0.5, 2.0, e).astype(np.float32)
    w, idx = moe.route(jnp.asarray(h), jnp.asarray(w_router), jnp.asarray(router_scale),
                       jnp.asarray(expert_scale), k, 1e-6)
    w, idx = np.asarray(w), np.asarray(idx)
    assert w.dtype == np.float32 and idx.dtype == np.int32 and w.shape == idx.shape == (n, k)
    w_ref, idx_ref, p = np_route(h, w_router, router_scale, expert_scale, k, 1e-6)
    # same expert set per token (order of equal-prob ties aside: sort by expert id)
    o, o_ref = np.argsort(idx, -1), np.argsort(idx_ref, -1)
    np.testing.assert_array_equal(np.take_along_axis(idx, o, -1), np.take_along_axis(idx_ref, o_ref, -1))
    np.testing.assert_allclose(np.take_along_axis(w, o, -1), np.take_along_axis(w_ref, o_ref, -1),
                               rtol=1e-5, atol=1e-6)
    # renormalised weights divided by per_expert_scale sum to one
    np.testing.assert_allclose((w / expert_scale[idx]).sum(-1), 1.0, rtol=1e-5)
    # renormalisation matters: the raw (un-renormalised) softmax probabilities are different
    if k < e:
        raw = np.take_along_axis(p, idx, -1) * expert_scale[idx]
        assert not np.allclose(w, raw, rtol=1e-3)
    # routing is invariant to the scale of h (the router RMS-normalises its input)
    w2, idx2 = moe.route(jnp.asarray(h * 7.0), jnp.asarray(w_router), jnp.asarray(router_scale),
                         jnp.asarray(expert_scale), k, 1e-6)
    np.testing.assert_array_equal(np.asarray(idx2), idx)
    np.testing.assert_allclose(np.asarray(w2), w, rtol=1e-4, atol=1e-5)


def test_router_uses_router_scale_and_expert_scale():
    rng = np.random.default_rng(0)
    n, d, e, k = 16, 32, 8, 2
    h = rng.normal(size=(n, d)).astype(np.float32)
    w_router = rng.normal(size=(d, e)).astype(np.float32)
    ones_d, ones_e = np.ones(d, np.float32), np.ones(e, np.float32)
    w1, i1 = moe.route(h, w_router, ones_d, ones_e, k, 1e-6)
    es = rng.uniform(0.5, 2.0, e).astype(np.float32)
    w2, i2 = moe.route(h, w_router, ones_d, es, k, 1e-6)
    np.testing.assert_array_equal(np.asarray(i1), np.asarray(i2))  # per_expert_scale does not change routing
    np.testing.assert_allclose(np.asarray(w2), np.asarray(w1) * es[np.asarray(i1)], rtol=1e-6)
    rs = rng.uniform(0.0, 3.0, d).astype(np.float32)
    _, i3 = moe.route(h, w_router, rs, ones_e, k, 1e-6)
    assert not np.array_equal(np.asarray(i3), np.asarray(i1))  # router_scale changes the logits


# ---------------------------------------------------------------------------------------------- dispatch
_dense = jax.jit(moe.dispatch_dense)
_capacity = jax.jit(moe.dispatch_capacity, static_argnums=5)


@pytest.mark.parametrize("n,e,k", [(1, 4, 1), (7, 8, 2), (7, 4, 4), (64, 16, 4), (300, 8, 2), (300, 16, 4)])
def test_dispatch_strategies_equal_dense_oracle(n, e, k):
    rng = np.random.default_rng(1000 * n + 10 * e + k)
    d, f = 24, 16
    z = rng.normal(size=(n, d)).astype(np.float32)
    gate_up, down = _expert_weights(rng, e, d, f)
    weights, experts = _random_choices(rng, n, e, k)
    ref = np.asarray(_dense(z, weights, experts, gate_up, down))
    assert ref.shape == (n, d) and ref.dtype == np.float32
    if n <= 64:  # the oracle itself against plain numpy
        np.testing.assert_allclose(ref, np_experts(z, weights, experts, gate_up, down), rtol=1e-4, atol=1e-5)
    for name, fn in STRATEGIES.items():
        out = np.asarray(jax.jit(fn)(z, weights, experts, gate_up, down))
        np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("levels", [8, (8, 16), (4, 8, 12)])
@pytest.mark.parametrize("n,e,k", [(64, 8, 2), (20, 4, 1)])
def test_capacity_overflow_takes_a_larger_buffer(n, e, k, levels):
    """Skewed routing: expert 0 is every token's first choice, so it gets n > 16 tokens, more than
    any requested buffer size: the dispatch must pick the token-count buffer and drop nothing."""
    rng = np.random.default_rng(n + e + k)
    d, f = 24, 16
    z = rng.normal(size=(n, d)).astype(np.float32)
    gate_up, down = _expert_weights(rng, e, d, f)
    experts = np.stack([np.concatenate([[0], 1 + rng.choice(e - 1, k - 1, replace=False)])
                        for _ in range(n)]).astype(np.int32)
    weights = rng.uniform(0.1, 1.5, (n, k)).astype(np.float32)
    capacity = 8
    load = np.bincount(experts.reshape(-1), minlength=e)
    assert load.max() > 16  # precondition: some expert overflows every requested size
    ref = np.asarray(_dense(z, weights, experts, gate_up, down))
    out = np.asarray(_capacity(z, weights, experts, gate_up, down, levels))
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
    # a buffered pass that dropped the overflow would be visibly different
    dropped = ref.copy()
    over = np.where(np.arange(n) >= capacity)[0]  # tokens past the first 8 lose expert 0's contribution
    for t in over:
        g = z[t].astype(np.float64) @ gate_up[0, :, :f]
        u = z[t].astype(np.float64) @ gate_up[0, :, f:]
        dropped[t] -= weights[t, 0] * (np_gelu_tanh(g) * u) @ down[0]
    assert np.abs(out - dropped).max() > 1e-3


def test_capacity_exact_fit_and_middle_level():
    """Loads exactly at a buffer size fit it; a load between two sizes takes the larger one."""
    rng = np.random.default_rng(5)
    n, e, k, d, f = 16, 4, 2, 24, 16
    z = rng.normal(size=(n, d)).astype(np.float32)
    gate_up, down = _expert_weights(rng, e, d, f)
    experts = np.array([[(2 * t) % e, (2 * t + 1) % e] for t in range(n)], np.int32)  # 8 tokens per expert
    weights = rng.uniform(0.1, 1.5, (n, k)).astype(np.float32)
    assert np.bincount(experts.reshape(-1)).max() == 8
    ref = np.asarray(_dense(z, weights, experts, gate_up, down))
    out = np.asarray(_capacity(z, weights, experts, gate_up, down, 8))
    np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL)
    experts[[1, 3]] = [0, 2]  # expert 0 now has 10 pairs: sizes (4, 8) are too small, 12 fits, 16 = n unused
    assert np.bincount(experts.reshape(-1)).max() == 10
    ref = np.asarray(_dense(z, weights, experts, gate_up, down))
    for levels in ((4, 8, 12), (12,), (4, 8)):
        out = np.asarray(_capacity(z, weights, experts, gate_up, down, levels))
        np.testing.assert_allclose(out, ref, rtol=TOL, atol=TOL, err_msg=str(levels))
    # the choice is made at run time: the compiled program holds one branch per size (+ the token count)
    hlo = jax.jit(moe.dispatch_capacity, static_argnums=5).lower(z, weights, experts, gate_up, down,
                                                                  (4, 8, 12)).as_text()
    assert "case" in hlo or "conditional" in hlo


def test_capacity_levels():
    assert moe.capacity_levels(256, 4, 16, 1.25) == (80, 88, 96, 104, 120, 128, 256)
    assert moe.capacity_levels(16, 2, 4, 1.25) == (16,)  # tiny: every size rounds up to the token count
    for n in (1, 7, 64, 300, 4096):
        lv = moe.capacity_levels(n, 4, 16, 1.25)
        assert list(lv) == sorted(set(lv)) and lv[-1] == n and all(1 <= c <= n for c in lv)


@pytest.mark.parametrize("strategy", ["ragged", "ragged_in_place", "capacity", "dense"])
@pytest.mark.parametrize("shards,skew", [(1, False), (4, False), (4, True), (8, False)])
def test_expert_shards_sum_to_the_oracle(strategy, shards, skew, monkeypatch):
    """Each expert shard serves only its experts [offset, offset + E/shards); the shards' partial
    outputs sum to the oracle. The ragged path runs the shard's pairs in blocks of ~1.25x its
    expected share; with skewed routing (every token's first choice on shard 0) shard 0 needs
    several blocks and must still drop nothing. "ragged_in_place": the form for sums too large to
    stay on chip (`moe.ON_CHIP_BYTES`), each block scattered into the sum in place."""
    from dgemma_jax import ModelConfig

    if strategy == "ragged_in_place":
        monkeypatch.setattr(moe, "ON_CHIP_BYTES", 0)
        strategy = "ragged"

    rng = np.random.default_rng(shards * 7 + skew)
    n, e, k, d, f = 96, 16, 4, 24, 16
    cfg = ModelConfig.preset("tiny-2layer", num_experts=e, top_k=k, hidden_size=d, moe_intermediate_size=f)
    z = rng.normal(size=(n, d)).astype(np.float32)
    gate_up, down = _expert_weights(rng, e, d, f)
    weights, experts = _random_choices(rng, n, e, k)
    if skew:
        experts[:, 0] = rng.integers(0, e // shards, n)
        experts = np.stack([np.concatenate([[r[0]], rng.choice([x for x in range(e) if x != r[0]], k - 1, replace=False)])
                            for r in experts]).astype(np.int32)
        assert (experts < e // shards).sum() > 1.25 * n * k / shards  # shard 0 overflows one block
    ref = np.asarray(_dense(z, weights, experts, gate_up, down))
    el = e // shards
    rt = Runtime(moe_dispatch=strategy)
    fn = jax.jit(lambda z, w, x, gu, dn, off: moe.dispatch(cfg, rt, z, w, x, gu, dn, offset=off, shards=shards))
    parts = [np.asarray(fn(z, weights, experts, gate_up[i * el:(i + 1) * el], down[i * el:(i + 1) * el], i * el))
             for i in range(shards)]
    assert all(p.dtype == np.float32 for p in parts)
    np.testing.assert_allclose(sum(parts), ref, rtol=TOL, atol=TOL)
    if shards > 1:  # each shard's part really is only its own experts' contribution
        w_own = np.where(experts < el, weights, 0.0)
        np.testing.assert_allclose(parts[0], np.asarray(_dense(z, w_own, experts, gate_up, down)), rtol=TOL, atol=TOL)


def test_ragged_blocks_cost_one_block():
    """Sharded ragged dispatch compiles to a loop whose body does ONE block of grouped matmuls
    (1.25x the shard's share of pairs), not the worst case of all pairs."""
    n, e, k, d, f, shards = 256, 16, 4, 64, 32, 8
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((n, k), jnp.float32),
            jax.ShapeDtypeStruct((n, k), jnp.int32), jax.ShapeDtypeStruct((e // shards, d, 2 * f), jnp.float32),
            jax.ShapeDtypeStruct((e // shards, f, d), jnp.float32))

    def flops(shards):
        fn = jax.jit(lambda *a: moe.dispatch_ragged(*a, rows=None if shards == 1 else
                                                    int(np.ceil(1.25 * n * k / shards / 8)) * 8))
        return fn.lower(*args).compile().cost_analysis()["flops"]

    rows = int(np.ceil(1.25 * n * k / shards / 8)) * 8
    assert rows < n * k
    assert flops(shards) < 0.5 * flops(1)


def test_capacity_for():
    for n in (1, 5, 8, 63, 300, 4096):
        for k, e in ((1, 4), (2, 8), (8, 128)):
            for factor in (0.01, 1.0, 2.0):
                cap = moe.capacity_for(n, k, e, factor)
                assert 1 <= cap <= n
                assert cap == n or cap % 8 == 0
                assert cap >= min(n, 8)
                assert cap >= min(n, np.ceil(factor * n * k / e))


def test_auto_dispatch_resolves():
    assert Runtime().dispatch() == ("capacity" if jax.default_backend() == "cpu" else "ragged")
    for s in ("dense", "ragged", "capacity"):
        assert Runtime(moe_dispatch=s).dispatch() == s


# ---------------------------------------------------------------------------------------------- the module
@pytest.mark.parametrize("dispatch", ["dense", "ragged", "capacity"])
def test_moe_module_matches_numpy(dispatch):
    cfg = ModelConfig.preset("tiny-6layer", top_k=3)
    rng = np.random.default_rng(3)
    b, t, d = 2, 9, cfg.hidden_size
    h = rng.normal(size=(b, t, d)).astype(np.float32) * 3
    z = rng.normal(size=(b, t, d)).astype(np.float32)
    module = moe.MoE(cfg, Runtime(moe_dispatch=dispatch))
    params = dict(nn.meta.unbox(jax.eval_shape(module.init, jax.random.key(0), h, z)["params"]))
    params["router"] = rng.normal(size=params["router"].shape).astype(np.float32)
    params["router_scale"] = rng.uniform(0.5, 1.5, d).astype(np.float32)
    params["expert_scale"] = rng.uniform(0.5, 2.0, cfg.num_experts).astype(np.float32)
    params["gate_up"] = rng.normal(0, d ** -0.5, params["gate_up"].shape).astype(np.float32)
    params["down"] = rng.normal(0, 0.2, params["down"].shape).astype(np.float32)
    out = np.asarray(jax.jit(module.apply)({"params": params}, jnp.asarray(h), jnp.asarray(z)))
    w, idx, _ = np_route(h.reshape(-1, d), params["router"], params["router_scale"], params["expert_scale"],
                         cfg.top_k, cfg.rms_norm_eps)
    ref = np_experts(z.reshape(-1, d), w, idx, params["gate_up"], params["down"]).reshape(b, t, d)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- whole model
@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig.preset("tiny-6layer")
    return cfg, init_params(cfg, 0)


def _run_model(cfg, params, soft, rt):
    rng = np.random.default_rng(11)
    lens = np.array([40, 23], np.int32)  # longer than the window (16)
    tokens = rng.integers(0, cfg.vocab_size, (2, 40)).astype(np.int32)
    cache = init_cache(cfg, 2, 40 + cfg.canvas_length)
    enc, cache = prefill(params, cfg, tokens, lens, cache, runtime=rt)
    canvas = rng.integers(0, cfg.vocab_size, (2, cfg.canvas_length)).astype(np.int32)
    den = denoise(params, cfg, canvas, cache, self_conditioning=soft, runtime=rt)
    enc = np.array(enc)
    enc[1, lens[1]:] = 0.0  # padding positions carry no meaning
    return enc, np.asarray(den)


def test_model_dispatch_strategies_agree(tiny):
    cfg, params = tiny
    rng = np.random.default_rng(12)
    # self-conditioning as a soft embedding [B, L, D] (what soft_embed returns), so the denoiser's whole input
    # path runs; one array for all variants avoids recompiling soft_embed per config
    soft = jnp.asarray(rng.normal(size=(2, cfg.canvas_length, cfg.hidden_size)).astype(np.float32) * 3)
    ref = _run_model(cfg, params, soft, Runtime(moe_dispatch="dense"))
    variants = {
        "ragged": Runtime(moe_dispatch="ragged"),
        # (the forced-overflow fallback is covered by test_capacity_overflow_falls_back_dropless)
        "capacity": Runtime(moe_dispatch="capacity"),
    }
    for name, rt in variants.items():
        got = _run_model(cfg, params, soft, rt)
        for what, a, r in zip(("prefill", "denoise"), got, ref):
            np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-4, err_msg=f"{name}/{what}")


def test_the_ragged_sum_of_a_32_slot_shard_stays_in_bfloat16_for_a_tpu():
    """One expert shard's ragged dispatch at the 26B's 32-slot serving shapes (a group's 4,096 rows, 32 of 128
    experts, blocks of 1.25x the shard's share), compiled for a v6e chip: a token's expert rows are summed in
    the activation dtype, so the compiled program holds no float32 [tokens, hidden] sum (the float32 sum, its
    casts and its zero fill moved 12.5 GB of the 32-slot step's HBM traffic; docs/serving.md)."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from dgemma_jax.perf.aot import tpu_devices

    where = SingleDeviceSharding(tpu_devices("v6e-1")[0])
    n, d, f, e_local, k, shards = 4096, 2816, 704, 32, 8, 4
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=where)  # noqa: E731
    args = (spec((n, d), jnp.bfloat16), spec((n, k), jnp.float32), spec((n, k), jnp.int32),
            spec((e_local, d, 2 * f), jnp.bfloat16), spec((e_local, f, d), jnp.bfloat16), spec((n, k), jnp.bool_))
    rows = int(1.25 * n * k / shards)
    hlo = jax.jit(lambda *a: moe.dispatch_ragged(*a, rows=rows)).lower(*args).compile().as_text()
    assert f"f32[{n},{d}]" not in hlo and f"bf16[{n},{d}]" in hlo
