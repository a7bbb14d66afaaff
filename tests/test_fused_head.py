"""The fused head + sampler pass equals the separate reference ops and never holds a [B, L, V] buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dgemma_jax import ModelConfig, Runtime, cache_shape, param_shapes
from dgemma_jax.model.layers import softcap
from dgemma_jax.model.transformer import Transformer
from dgemma_jax.sampling import SamplerConfig, ops
from dgemma_jax.sampling.fused import head_sample_stats, head_sample_stats_full, row_gumbel, vocab_chunk
from dgemma_jax.sampling.loop import denoise_step, init_state, row_keys


def _setup(v=1000, d=32, l=24, b=2, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(b, l, d)), jnp.float32)
    emb = jnp.asarray(rng.normal(size=(v, d)) * 0.7, jnp.float32)
    return h, emb



@pytest.mark.parametrize("chunk", [None, 250, 1000, "full"])
def test_fused_matches_reference_ops(chunk):
    h, emb = _setup()
    t = jnp.float32(0.6)
    keys = jax.random.split(jax.random.key(0), h.shape[0])
    if chunk == "full":
        stats, soft = head_sample_stats_full(h, emb, 30.0, t, keys, 5.0)
    else:
        stats, soft = head_sample_stats(h, emb, 30.0, t, keys, 5.0, chunk=chunk)
    logits = softcap(jnp.einsum("bld,vd->blv", h, emb), 30.0)
    z = ops.sanitize_logits(logits / t)
    ref = ops.sample_step_stats(z, jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(stats.argmax), np.asarray(ref.argmax))
    np.testing.assert_allclose(np.asarray(stats.entropy), np.asarray(ref.entropy), atol=2e-5)
    ref_soft = jnp.einsum("blv,vd->bld", jax.nn.softmax(z, -1), emb) * 5.0
    np.testing.assert_allclose(np.asarray(soft), np.asarray(ref_soft), atol=2e-5)
    assert ((np.asarray(stats.sampled) >= 0) & (np.asarray(stats.sampled) < emb.shape[0])).all()


@pytest.mark.parametrize("variant", ["chunked", "chunked12", "full"])
def test_fused_sampling_follows_softmax(variant):
    """Streaming draws across chunks (and Gumbel-max over the full vocab) follow softmax(z): many
    positions share one distribution."""
    v, d, l = 12, 8, 20000
    rng = np.random.default_rng(3)
    emb = jnp.asarray(rng.normal(size=(v, d)), jnp.float32)
    h = jnp.broadcast_to(jnp.asarray(rng.normal(size=(d,)) * 0.5, jnp.float32), (1, l, d))
    keys = jax.random.split(jax.random.key(5), 1)
    if variant == "full":
        stats, _ = head_sample_stats_full(h, emb, 30.0, jnp.float32(0.8), keys, 1.0)
    else:  # chunks of 4 (sub-blocks of 2) or one chunk of 12 (4 sub-blocks of 3)
        stats, _ = head_sample_stats(h, emb, 30.0, jnp.float32(0.8), keys, 1.0, chunk=12 if variant == "chunked12" else 4)
    p = np.asarray(jax.nn.softmax(softcap(h[0, 0] @ emb.T, 30.0) / 0.8))
    freq = np.bincount(np.asarray(stats.sampled).ravel(), minlength=v) / l
    chi2 = float((((freq - p) ** 2) / p).sum() * l)
    assert chi2 < 40.0, f"chi-square {chi2:.1f} over {v - 1} dof"


@pytest.mark.parametrize("chunk", [None, 100, 300, "full"])
def test_fused_argmax_ties_take_the_first_index(chunk):
    """Exactly equal maxima in one sub-block, in another sub-block and in a later chunk: the first wins
    (as jnp.argmax over the whole vocabulary)."""
    h, emb = _setup(v=300, l=6)
    top = jnp.abs(h).sum(-1).max() * 10.0
    emb = emb.at[jnp.array([60, 63, 90, 150, 299])].set(jnp.sign(h[0, 0]) * 1.0)
    h = h.at[:, :3].set(jnp.sign(h[0, 0]) * top)  # these positions put the same largest logit on all five rows
    keys = jax.random.split(jax.random.key(0), 2)
    if chunk == "full":
        stats, _ = head_sample_stats_full(h, emb, 1e4, jnp.float32(1.0), keys, 1.0)
    else:
        stats, _ = head_sample_stats(h, emb, 1e4, jnp.float32(1.0), keys, 1.0, chunk=chunk)
    ref = jnp.argmax(softcap(jnp.einsum("bld,vd->blv", h, emb), 1e4), -1)
    np.testing.assert_array_equal(np.asarray(stats.argmax), np.asarray(ref))
    assert (np.asarray(stats.argmax)[:, :3] == 60).all()


@pytest.mark.parametrize("variant", ["chunked", "full"])
def test_fused_non_finite_hidden_state_gives_valid_ids(variant):
    h, emb = _setup(v=300)
    h = h.at[0, :3].set(jnp.nan).at[1, 5].set(jnp.inf)
    keys = jax.random.split(jax.random.key(0), 2)
    if variant == "full":
        stats, soft = head_sample_stats_full(h, emb, 30.0, jnp.float32(0.5), keys, 1.0)
    else:
        stats, soft = head_sample_stats(h, emb, 30.0, jnp.float32(0.5), keys, 1.0, chunk=100)
    for x in (stats.sampled, stats.argmax):
        x = np.asarray(x)
        assert ((x >= 0) & (x < 300)).all()
    assert np.isfinite(np.asarray(stats.entropy)).all()


def test_vocab_chunk():
    assert vocab_chunk(262144) == 2048 and 262144 % vocab_chunk(262144) == 0
    assert vocab_chunk(32768) == 2048
    assert vocab_chunk(18) == 18
    assert vocab_chunk(1_000_003) == 1_000_003  # prime: one chunk


def test_denoise_step_holds_no_full_vocab_buffer():
    """Compiled memory at the bench config: the sampler part of a denoise step (everything beyond the
    model trunk) needs less than ONE [B, L, V] float32 buffer; logits are never materialised."""
    cfg = ModelConfig.preset("bench")
    sampler = SamplerConfig(canvas_length=256, max_denoising_steps=16, eos_ids=(1,))
    ps = param_shapes(cfg)
    cache = cache_shape(cfg, 1, 768)
    keys = jax.eval_shape(lambda: row_keys(jax.random.key(0), 1))
    state = jax.eval_shape(lambda: init_state(cfg, sampler, jnp.zeros((1, 256), jnp.int32)))

    def temp(f, *a):
        return jax.jit(f).lower(*a).compile().memory_analysis().temp_size_in_bytes

    trunk = temp(lambda p, c, s: Transformer(cfg, Runtime()).apply({"params": p}, s.canvas, c.lengths, c, s.soft,
                                                        method="denoise_features"), ps, cache, state)
    step = temp(lambda p, c, k, s: denoise_step(p, cfg, sampler, c, c.lengths, k, s), ps, cache, keys, state)
    blv = 1 * 256 * cfg.vocab_size * 4

    def unfused_step(p, c, k, s):  # the same step with the separate ops: logits materialised
        model = Transformer(cfg, Runtime())
        logits = model.apply({"params": p}, s.canvas, c.lengths, c, s.soft, method="denoise")
        z = ops.sanitize_logits(ops.apply_temperature(logits, sampler, s.step))
        stats = ops.sample_step_stats(z, k[0])
        return stats, model.apply({"params": p}, z, method="soft_embed")

    unfused = temp(unfused_step, ps, cache, keys, state)
    print(f"bench denoise step temp {step / 1e6:.1f} MB = trunk {trunk / 1e6:.1f} MB + {(step - trunk) / 1e6:.1f} MB; "
          f"one [B,L,V] f32 buffer = {blv / 1e6:.1f} MB; unfused step = {unfused / 1e6:.1f} MB")
    assert step - trunk < blv
    assert unfused - trunk >= blv  # the check can fail: the unfused sampler holds at least one


@pytest.mark.parametrize("shape", [(7,), (5, 9), (3, 4, 6), (256, 1000)])
def test_row_gumbel_is_jax_random_gumbel_row_by_row(shape):
    """The accelerator head's noise is jax's own: row b equals jax.random.gumbel(keys[b], shape) bit for bit."""
    keys = jax.random.split(jax.random.key(11), 3)
    ours = np.asarray(row_gumbel(keys, shape))
    jaxs = np.asarray(jax.vmap(lambda k: jax.random.gumbel(k, shape, jnp.float32))(keys))
    np.testing.assert_array_equal(ours, jaxs)
    assert ours.shape == (3, *shape) and np.isfinite(ours).all()


@pytest.mark.parametrize("batch", [1, 2])
def test_the_heads_temporaries_for_the_26b_on_one_tpu_chip(batch):
    """The 26B's head on a v5e-1 (int8 tied table, 262,144 ids, a 256-token canvas). The full pass (the
    head of vocabulary-split meshes) holds the [B, L, V] float32 logits and little else: the vmapped
    jax.random.gumbel it used before made XLA:TPU store its threefry counters as two [L, V] uint32
    arrays besides (512 MiB more at 2 rows). The head one chip runs (`head_step`: the vocabulary is
    whole there) is the scan over vocab chunks: under 16 MiB."""
    pytest.importorskip("libtpu")
    from jax.sharding import SingleDeviceSharding

    from dgemma_jax.perf.aot import tpu_devices
    from dgemma_jax.perf.hbm_traffic import hbm_traffic
    from dgemma_jax.sampling.fused import head_step

    where = SingleDeviceSharding(tpu_devices("v5e-1")[0])
    l, d, v = 256, 2816, 262144
    rt = Runtime(platform="tpu")

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=where)

    def compiled(head):
        def f(h, values, scale, t, keys):
            return head(h, {"int8": values, "scale": scale}, 30.0, t, keys, 53.0, rt)
        c = jax.jit(f).lower(spec((batch, l, d), jnp.bfloat16), spec((v, d), jnp.int8), spec((v, 1), jnp.bfloat16),
                             spec((batch, 1, 1), jnp.float32), spec((batch,), jax.random.key(0).dtype)).compile()
        return c.memory_analysis().temp_size_in_bytes, hbm_traffic(c.as_text())["total"]

    (full, full_hbm), (chip, chip_hbm) = compiled(head_sample_stats_full), compiled(head_step)
    logits, table = batch * l * v * 4, v * d
    print(f"batch {batch}: full pass {full / 2**20:.0f} MiB (logits {logits / 2**20:.0f} MiB), "
          f"{full_hbm / 1e9:.2f} GB of HBM traffic; one chip's head {chip / 2**20:.1f} MiB, {chip_hbm / 1e9:.2f} GB")
    assert logits <= full < logits + 64 * 2**20
    assert chip < 16 * 2**20
    # both read the table twice (logits, soft embedding); the full pass also writes and reads its logits.
    # The scan's traffic is counted once per vocab chunk (perf.hbm_traffic's counted loops)
    assert 2 * table <= chip_hbm < 2 * table + logits < full_hbm


def test_row_gumbel_draws_any_window_of_the_full_draw():
    keys = jax.random.split(jax.random.key(4), 2)
    whole = np.asarray(row_gumbel(keys, (5, 40)))
    for start in (0, 8, 32):
        np.testing.assert_array_equal(np.asarray(row_gumbel(keys, (5, 8), start, 40)), whole[..., start:start + 8])
    traced = jax.jit(lambda s: row_gumbel(keys, (5, 8), s, 40))(jnp.int32(16))
    np.testing.assert_array_equal(np.asarray(traced), whole[..., 16:24])


@pytest.mark.parametrize("chunk", [100, 250, 1000])
def test_one_chips_scan_draws_what_the_vocabulary_split_full_pass_draws(chunk):
    """head_step's head where the vocabulary is whole on an accelerator (the scan, Gumbel-max chunk by
    chunk) samples the tokens of the full pass a vocabulary-split slice runs: same seed, same tokens;
    entropy and soft embedding equal up to float32 rounding."""
    h, emb = _setup()
    keys = jax.random.split(jax.random.key(7), h.shape[0])
    scan, soft_scan = head_sample_stats(h, emb, 30.0, jnp.float32(0.6), keys, 5.0, chunk=chunk, gumbel=True)
    full, soft_full = head_sample_stats_full(h, emb, 30.0, jnp.float32(0.6), keys, 5.0)
    np.testing.assert_array_equal(np.asarray(scan.sampled), np.asarray(full.sampled))
    np.testing.assert_array_equal(np.asarray(scan.argmax), np.asarray(full.argmax))
    assert (np.asarray(scan.sampled) != np.asarray(scan.argmax)).any()  # the draw is not the argmax
    np.testing.assert_allclose(np.asarray(scan.entropy), np.asarray(full.entropy), atol=2e-5)
    np.testing.assert_allclose(np.asarray(soft_scan), np.asarray(soft_full), atol=5e-5)


def _split_runtime(mesh: str, rules: str = "latency"):
    from dgemma_jax.parallel import make_mesh
    from dgemma_jax.axis_rules import rules_for

    if len(jax.devices()) < 4:
        pytest.skip("needs 4 (fake) devices")
    m = make_mesh(mesh, devices=jax.devices()[:4])
    return Runtime(platform="tpu", mesh=m, rules=rules_for(rules, m))


def test_head_step_scans_the_vocabulary_on_every_layout_it_can():
    """The choice `head_step` makes, read from the lowered program: the scan's loop (its named scope) is
    there on CPU, on one accelerator device and, inside a `shard_map`, on a mesh that splits the
    vocabulary; only a layout the per-shard scan cannot take (the table's hidden axis split too) keeps
    the full pass."""
    from dgemma_jax.sampling.fused import VOCAB_LOOP_SCOPE, head_step

    h, emb = _setup(v=1024, d=32, l=8)
    keys = jax.random.split(jax.random.key(0), h.shape[0])
    split = _split_runtime("expert=4")
    assert split.shards(emb.shape[0], "vocab") == 4
    hidden_split = split.replace(rules=tuple(r for r in split.rules if r[0] != "embed") + (("embed", "expert"),))

    def lowered(rt):
        return jax.jit(lambda h, e, k: head_step(h, e, 30.0, jnp.float32(0.7), k, 1.0, rt)).lower(
            h, emb, keys).as_text(debug_info=True)

    for rt in (Runtime(platform="cpu"), Runtime(platform="tpu"), split):
        assert f"{VOCAB_LOOP_SCOPE}/while" in lowered(rt)
    assert "shard_map" in lowered(split)
    assert f"{VOCAB_LOOP_SCOPE}/while" not in lowered(hidden_split)


@pytest.mark.parametrize("mesh, rules, int8, parts", [("expert=4", "latency", False, False),
                                                      ("expert=4", "latency", True, False),
                                                      ("data=2,expert=2", "serving", False, False),
                                                      ("expert=4", "latency", False, True),
                                                      ("data=2,expert=2", "serving", True, True),
                                                      ("data=2,expert=2", "throughput", False, False),
                                                      ("data=2,expert=2", "throughput", True, True)])
def test_the_vocabulary_split_scan_draws_what_the_full_pass_draws(mesh, rules, int8, parts, monkeypatch):
    """On a mesh that splits the vocabulary (4 CPU devices), each device scanning its own rows of the
    table and the shards' statistics merged gives the full pass's tokens for the same seed (sampled and
    argmax, per-row temperatures, an int8 table), and its entropy and soft embedding up to float32
    rounding; on the serving mesh the rows are split over `data` as well, on the throughput rules over
    `expert` too (each device gathers its group's rows and keeps its own). parts: each device scans its
    rows one at a time (`fused.CARRY_ON_CHIP_BYTES` set to one row's running sum)."""
    from dgemma_jax.model.quant import quantize_kernel
    from dgemma_jax.sampling import fused
    from dgemma_jax.sampling.fused import head_sample_stats_split

    if parts:
        monkeypatch.setattr(fused, "CARRY_ON_CHIP_BYTES", 24 * 32 * 4)
    rt = _split_runtime(mesh, rules)
    h, emb = _setup(v=1024, d=32, l=24, b=4, seed=3)
    table = quantize_kernel(emb, (1,)) if int8 else emb
    keys = jax.random.split(jax.random.key(11), h.shape[0])
    temps = jnp.asarray([0.6, 1.0, 0.8, 1.3], jnp.float32).reshape(4, 1, 1)
    split, soft_split = jax.jit(lambda h, e, k: head_sample_stats_split(h, e, 30.0, temps, k, 5.0, rt, chunk=128))(
        h, table, keys)
    full, soft_full = jax.jit(lambda h, e, k: head_sample_stats_full(h, e, 30.0, temps, k, 5.0, rt))(h, table, keys)
    np.testing.assert_array_equal(np.asarray(split.sampled), np.asarray(full.sampled))
    np.testing.assert_array_equal(np.asarray(split.argmax), np.asarray(full.argmax))
    assert (np.asarray(split.sampled) != np.asarray(split.argmax)).any()   # the draw is not the argmax
    assert len({int(t) // 256 for t in np.asarray(split.sampled).ravel()}) == 4   # tokens from every shard
    np.testing.assert_allclose(np.asarray(split.entropy), np.asarray(full.entropy), atol=2e-5)
    np.testing.assert_allclose(np.asarray(soft_split), np.asarray(soft_full), atol=5e-5)


def test_the_vocabulary_split_scan_gives_a_tie_to_the_lower_token_id():
    """Equal maxima on two shards: the argmax is the lower id, as jnp.argmax gives it."""
    from dgemma_jax.sampling.fused import head_sample_stats_split

    rt = _split_runtime("expert=4")
    h, emb = _setup(v=1024, d=32, l=8, b=2, seed=5)
    emb = emb.at[700].set(emb[300] * 3.0).at[300].set(emb[300] * 3.0)   # ids 300 (shard 1) and 700 (shard 2)
    keys = jax.random.split(jax.random.key(2), 2)
    split, _ = jax.jit(lambda h, e, k: head_sample_stats_split(h, e, 30.0, jnp.float32(1.0), k, 1.0, rt))(h, emb, keys)
    full, _ = jax.jit(lambda h, e, k: head_sample_stats_full(h, e, 30.0, jnp.float32(1.0), k, 1.0, rt))(h, emb, keys)
    np.testing.assert_array_equal(np.asarray(split.argmax), np.asarray(full.argmax))
    assert (np.asarray(full.argmax) == 300).any() and not (np.asarray(split.argmax) == 700).any()
