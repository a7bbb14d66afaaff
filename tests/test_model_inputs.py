"""Bad inputs to the model passes and to the checkpoint loader fail early with a message naming the problem."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dgemma_jax import KVCache, ModelConfig, denoise, init_cache, load_hf, param_shapes, prefill, save_hf

NAME = "tiny-6layer"


def _random_params(cfg, seed=0):
    """Random parameters of the right shapes, without compiling the model (init_params is tested elsewhere)."""
    rng = np.random.default_rng(seed)
    shapes = param_shapes(cfg)
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(0, 0.5, s.shape).astype(np.float32)), shapes)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.preset(NAME)
    return cfg, _random_params(cfg)


@pytest.fixture(scope="module")
def filled(model):
    """A cache of 2 rows x 48 slots holding 10 and 7 committed tokens."""
    cfg, params = model
    tokens = np.arange(20, dtype=np.int32).reshape(2, 10) + 3
    _, cache = prefill(params, cfg, tokens, [10, 7], init_cache(cfg, 2, 48), logits="none")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [10, 7])
    return cache


# ---------------------------------------------------------------------------------------------- prefill
def test_prefill_bad_tokens(model):
    cfg, params = model
    good = np.full((2, 5), 3, np.int32)
    with pytest.raises(ValueError, match=r"tokens must be integer token ids; got dtype float32"):
        prefill(params, cfg, good.astype(np.float32))
    with pytest.raises(ValueError, match=r"tokens must be integer token ids; got dtype bool"):
        prefill(params, cfg, good.astype(bool))
    with pytest.raises(ValueError, match=r"tokens must have shape \[batch, length\]; got shape \(5,\)"):
        prefill(params, cfg, good[0])
    with pytest.raises(ValueError, match=r"tokens must have shape \[batch, length\]; got shape \(1, 2, 5\)"):
        prefill(params, cfg, good[None])
    bad = good.copy()
    bad[1, 3] = cfg.vocab_size
    v = cfg.vocab_size
    with pytest.raises(ValueError, match=rf"tokens contains id {v}, outside the vocabulary \[0, {v}\)"):
        prefill(params, cfg, bad)
    bad[1, 3] = -4
    with pytest.raises(ValueError, match=r"tokens contains id -4, outside the vocabulary"):
        prefill(params, cfg, bad)
    with pytest.raises(ValueError, match=r"tokens contains id 100000"):
        prefill(params, cfg, jnp.asarray(good + 99997))  # jax arrays are checked too


def test_prefill_bad_lengths(model):
    cfg, params = model
    tokens = np.full((2, 5), 3, np.int32)
    with pytest.raises(ValueError, match=r"lengths must have shape \[2\] \(one per row\); got \(1,\)"):
        prefill(params, cfg, tokens, [5])
    with pytest.raises(ValueError, match=r"lengths must have shape \[2\].*got \(2, 1\)"):
        prefill(params, cfg, tokens, [[5], [5]])
    with pytest.raises(ValueError, match=r"lengths must be in \[0, 5\]; got \[5, 6\]"):
        prefill(params, cfg, tokens, [5, 6])
    with pytest.raises(ValueError, match=r"lengths must be in \[0, 5\]; got \[-1, 5\]"):
        prefill(params, cfg, tokens, [-1, 5])
    with pytest.raises(ValueError, match=r"lengths must be integers; got dtype float"):
        prefill(params, cfg, tokens, [4.5, 5.0])


def test_prefill_prompt_longer_than_cache(model):
    cfg, params = model
    tokens = np.full((2, 30), 3, np.int32)
    cache = init_cache(cfg, 2, 24)
    with pytest.raises(ValueError, match=r"cache holds 24 tokens.*needs 30.*max_length>=30"):
        prefill(params, cfg, tokens, None, cache)
    # only the valid tokens count: 24 fit exactly
    with pytest.raises(ValueError, match=r"needs 25.*max_length>=25"):
        prefill(params, cfg, tokens, [24, 25], cache)


def test_prefill_continuation_overflows_cache(model, filled):
    cfg, params = model
    more = np.full((2, 40), 3, np.int32)
    # row 0 has 10 committed + 39 new = 49 > 48
    with pytest.raises(ValueError, match=r"holds 48 tokens.*needs 49.*already committed \[10, 7\].*max_length>=49"):
        prefill(params, cfg, more, [39, 39], filled)


def test_prefill_cache_from_another_config(model):
    cfg, params = model
    tokens = np.full((2, 5), 3, np.int32)
    other = ModelConfig.preset("tiny-2layer")
    with pytest.raises(ValueError, match=r"cache has 2 layers but the model has 6"):
        prefill(params, cfg, tokens, None, init_cache(other, 2, 8))
    # same layer count, different head shapes: must not surface as a broadcasting error inside jit
    wide = cfg.replace(head_dim=32, global_head_dim=64)
    with pytest.raises(ValueError, match=r"cache layer 0 .*needs \(2, 2, 8, 16\) \[batch, kv_heads"):
        prefill(params, cfg, tokens, None, init_cache(wide, 2, 8))
    more_kv = cfg.replace(num_global_kv_heads=2)
    with pytest.raises(ValueError, match=r"cache layer 5 .*needs \(2, 1, 8, 32\)"):
        prefill(params, cfg, tokens, None, init_cache(more_kv, 2, 8))
    with pytest.raises(ValueError, match=r"cache must be a KVCache.*dict"):
        prefill(params, cfg, tokens, None, {"keys": ()})


def test_prefill_batch_mismatch(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"cache batch size 3 != input batch size 2"):
        prefill(params, cfg, np.full((2, 5), 3, np.int32), None, init_cache(cfg, 3, 8))


def test_prefill_bad_logits_mode(model):
    cfg, params = model
    with pytest.raises(ValueError, match=r"logits must be 'all', 'last' or 'none'; got 'first'"):
        prefill(params, cfg, np.full((1, 5), 3, np.int32), logits="first")


def test_text_and_another_configs_params_are_one_line_errors(model):
    """A string where token ids belong said "got shape ()"; params of another config raised Flax's
    ScopeParamShapeError. Both are now one-line ValueErrors naming the problem and the fix."""
    import dgemma_jax as dg
    from dgemma_jax.engine import Engine

    CFG, params = model
    eng = Engine(CFG, params)
    for text in ("s9350814272=", ["s93=", "s21="]):
        with pytest.raises(ValueError, match="not text: tokenize it first") as e:
            eng.generate(text)
        assert "\n" not in str(e.value)
    other = ModelConfig.preset("tiny-2layer")
    foreign = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), dg.param_shapes(other))
    tokens, lengths = np.arange(3, 23, dtype=np.int32).reshape(2, 10), np.array([10, 6], np.int32)
    calls = [lambda: Engine(CFG, foreign).generate(tokens, lengths, max_new_tokens=16),
             lambda: dg.prefill(foreign, CFG, tokens, lengths),
             lambda: dg.prefill(params, other, tokens % other.vocab_size, lengths)]
    for call in calls:
        with pytest.raises(ValueError, match=r"the params do not fit this ModelConfig \(tiny-.layer\): For parameter "
                                             r".* Pass the params made for this config") as e:
            call()
        assert "\n" not in str(e.value)


def test_a_left_padded_prefill_equals_the_right_padded_and_each_row_alone(model):
    """prefill(padding="left"): row b's last lengths[b] tokens at positions cache.lengths[b] + i, as when
    right-padded: the same cache and logits (left layout) as the right-padded batch, and each row's as
    when it is prefilled alone and unpadded (to float32 rounding)."""
    cfg, params = model
    rng = np.random.default_rng(3)
    n = np.array([9, 4, 1], np.int32)
    rows = [rng.integers(3, cfg.vocab_size, k).astype(np.int32) for k in n]
    right, left = np.zeros((3, 9), np.int32), np.full((3, 9), 7, np.int32)   # left padding of another id
    for b, r in enumerate(rows):
        right[b, : len(r)], left[b, 9 - len(r):] = r, r
    lr, cr = prefill(params, cfg, right, n, init_cache(cfg, 3, 16))
    ll, cl = prefill(params, cfg, left, n, init_cache(cfg, 3, 16), padding="left")
    last_r, _ = prefill(params, cfg, right, n, init_cache(cfg, 3, 16), logits="last")
    last_l, _ = prefill(params, cfg, left, n, init_cache(cfg, 3, 16), logits="last", padding="left")
    np.testing.assert_array_equal(np.asarray(cl.lengths), n)
    np.testing.assert_array_equal(np.asarray(last_l), np.asarray(last_r))
    for b, r in enumerate(rows):
        k = len(r)
        np.testing.assert_array_equal(np.asarray(ll)[b, 9 - k:], np.asarray(lr)[b, :k])
        for kr, kl in zip(cr.keys + cr.values, cl.keys + cl.values):
            np.testing.assert_array_equal(np.asarray(kl)[b, :, :k], np.asarray(kr)[b, :, :k])
        alone, ca = prefill(params, cfg, r[None], None, init_cache(cfg, 1, 16))
        np.testing.assert_allclose(np.asarray(ll)[b, 9 - k:], np.asarray(alone)[0], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(cl.keys[-1])[b, :, :k], np.asarray(ca.keys[-1])[0, :, :k], atol=2e-5)
    with pytest.raises(ValueError, match="padding must be 'right' or 'left'"):
        prefill(params, cfg, left, n, padding="middle")


def test_image_features_are_what_the_prompt_pass_scatters_in():
    """dg.image_features: the vision tower's soft tokens, image after image; prefilled through
    prefill(image_features=) they give the engine's prompt pass's cache (which runs the tower itself)."""
    import dgemma_jax as dg
    from dgemma_jax.io.bundled import VISION_NAME, load_bundled
    from dgemma_jax.io.images import prompt_with_images
    from dgemma_jax.model.api import image_features_pass
    from dgemma_jax.sampling import generate as gen

    cfg, params, _, tok = load_bundled(VISION_NAME)
    digits = os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "digits.png")
    tokens, lengths, batch = prompt_with_images(cfg, tok, "<|image|> sort <|image|>", [digits, digits],
                                                max_soft_tokens=70)
    feats = dg.image_features(params, cfg, batch.pixel_values, batch.position_ids)
    assert feats.shape == (int(np.sum(batch.soft_tokens)), cfg.hidden_size), (feats.shape, batch.soft_tokens)
    full, n_valid = image_features_pass(params, cfg, jnp.asarray(batch.pixel_values), jnp.asarray(batch.position_ids))
    assert int(n_valid) == feats.shape[0] and float(jnp.abs(feats).max()) > 0
    marks = tokens == cfg.image_token_id
    _, mine = prefill(params, cfg, tokens, lengths, init_cache(cfg, 1, 256), logits="none", image_features=feats,
                      image_tokens=marks)
    engine_cache = jax.jit(lambda p, t, n, c, px, pos: gen.prefill(p, cfg, t, n, c, images=(px, pos)))(
        params, jnp.asarray(tokens), jnp.asarray(lengths), init_cache(cfg, 1, 256), jnp.asarray(batch.pixel_values),
        jnp.asarray(batch.position_ids))
    for a, b in zip(mine.keys + mine.values, engine_cache.keys + engine_cache.values):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    # the features matter: other rows in their place give another cache
    _, other = prefill(params, cfg, tokens, lengths, init_cache(cfg, 1, 256), logits="none",
                       image_features=feats[::-1], image_tokens=marks)
    assert not np.allclose(np.asarray(other.keys[-1]), np.asarray(mine.keys[-1]), atol=1e-3)
    with pytest.raises(ValueError, match="has no vision tower"):
        dg.image_features(None, ModelConfig.preset(NAME), batch.pixel_values, batch.position_ids)


def test_init_cache_bad_args():
    cfg = ModelConfig.preset(NAME)
    with pytest.raises(ValueError, match="batch_size"):
        init_cache(cfg, 0, 8)
    with pytest.raises(ValueError, match="max_length"):
        init_cache(cfg, 1, 0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        init_cache(cfg.replace(max_position_embeddings=64), 1, 65)
    with pytest.raises(ValueError, match="kv_replicas has 2 entries"):
        init_cache(cfg, 1, 8, kv_replicas=(1, 2))
    with pytest.raises(ValueError, match=r"kv_replicas\[0\]=3 must .* divide the layer's query-group size 2"):
        init_cache(cfg, 1, 8, kv_replicas=(3,) + (1,) * (cfg.num_layers - 1))


# ---------------------------------------------------------------------------------------------- denoise
def test_denoise_bad_canvas(model, filled):
    cfg, params = model
    canvas = np.full((2, cfg.canvas_length), 3, np.int32)
    with pytest.raises(ValueError, match=r"canvas must be integer token ids; got dtype float64"):
        denoise(params, cfg, canvas.astype(np.float64), filled)
    with pytest.raises(ValueError, match=r"canvas must have shape \[batch, length\]; got shape \(16,\)"):
        denoise(params, cfg, canvas[0], filled)
    bad = canvas.copy()
    bad[0, 0] = cfg.vocab_size + 7
    with pytest.raises(ValueError, match=rf"canvas contains id {cfg.vocab_size + 7}, outside the vocabulary"):
        denoise(params, cfg, bad, filled)
    bad[0, 0] = -1
    with pytest.raises(ValueError, match=r"canvas contains id -1"):
        denoise(params, cfg, bad, filled)
    with pytest.raises(ValueError, match=r"canvas must hold at least one token"):
        denoise(params, cfg, canvas[:, :0], filled)


def test_denoise_batch_and_cache_mismatch(model, filled):
    cfg, params = model
    canvas = np.full((3, cfg.canvas_length), 3, np.int32)
    with pytest.raises(ValueError, match=r"cache batch size 2 != input batch size 3"):
        denoise(params, cfg, canvas, filled)
    canvas = canvas[:2]
    with pytest.raises(ValueError, match=r"cache has 2 layers but the model has 6"):
        denoise(params, cfg, canvas, init_cache(ModelConfig.preset("tiny-2layer"), 2, 8))
    with pytest.raises(ValueError, match=r"cache layer 0 .*needs"):
        denoise(params, cfg, canvas, init_cache(cfg.replace(head_dim=32), 2, 8))
    with pytest.raises(ValueError, match=r"cache must be a KVCache.*NoneType"):
        denoise(params, cfg, canvas, None)


def test_denoise_bad_self_conditioning(model, filled):
    cfg, params = model
    b, l = 2, cfg.canvas_length
    canvas = np.full((b, l), 3, np.int32)
    with pytest.raises(ValueError, match=rf"self_conditioning last axis 7 is neither vocab_size {cfg.vocab_size} "
                                         rf"\(logits\) nor hidden_size {cfg.hidden_size}"):
        denoise(params, cfg, canvas, filled, np.zeros((b, l, 7), np.float32))
    with pytest.raises(ValueError, match=rf"self_conditioning must be \[batch=2, canvas={l}, V or D\]; "
                                         rf"got \(2, {l - 1}, {cfg.hidden_size}\)"):
        denoise(params, cfg, canvas, filled, np.zeros((b, l - 1, cfg.hidden_size), np.float32))
    with pytest.raises(ValueError, match=r"self_conditioning must be .*got \(2, 16\)"):
        denoise(params, cfg, canvas, filled, np.zeros((b, l), np.float32))
    with pytest.raises(ValueError, match=r"self_conditioning must be .*got \(1, 16, 256\)"):
        denoise(params, cfg, canvas, filled, np.zeros((1, l, cfg.vocab_size), np.float32))


def test_denoise_bad_context_end(model, filled):
    cfg, params = model
    canvas = np.full((2, cfg.canvas_length), 3, np.int32)
    with pytest.raises(ValueError, match=r"context_end must have shape \[2\] \(one per row\); got \(1,\)"):
        denoise(params, cfg, canvas, filled, context_end=[3])
    # more context than was committed would expose never-written cache slots
    with pytest.raises(ValueError, match=r"context_end must be in \[0, cache.lengths\].*\[10, 8\].*\[10, 7\]"):
        denoise(params, cfg, canvas, filled, context_end=[10, 8])
    with pytest.raises(ValueError, match=r"context_end must be in .*\[-1, 7\]"):
        denoise(params, cfg, canvas, filled, context_end=[-1, 7])
    with pytest.raises(ValueError, match=r"context_end must be integers; got dtype float"):
        denoise(params, cfg, canvas, filled, context_end=[3.0, 7.0])


# ---------------------------------------------------------------------------------------------- load_hf
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = ModelConfig.preset("tiny-2layer")
    params = _random_params(cfg, seed=1)
    path = tmp_path_factory.mktemp("ckpt")
    save_hf(params, cfg, path)
    return cfg, params, path


def _copy(src, tmp_path, name="c"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_tensors(path, fn):
    f = os.path.join(path, "model.safetensors")
    tensors = dict(load_file(f))
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def test_load_hf_control(checkpoint):
    """The unmodified checkpoint loads back exactly (so the failures below are caused by the edits)."""
    cfg, params, path = checkpoint
    cfg2, params2 = load_hf(path, dtype="float32")
    assert cfg2.replace(name=cfg.name) == cfg
    flat, flat2 = jax.tree.leaves_with_path(params), dict(jax.tree.leaves_with_path(params2))
    assert len(flat) == len(flat2)
    for k, v in flat:
        np.testing.assert_array_equal(np.asarray(flat2[k]), np.asarray(v), err_msg=jax.tree_util.keystr(k))


def test_load_hf_no_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf(tmp_path / "nothing-here")


def test_load_hf_no_config(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(path)


def test_load_hf_no_safetensors(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files"):
        load_hf(path)


@pytest.mark.parametrize("keep", [0, 6, 300])
def test_load_hf_truncated_safetensors_names_the_file(checkpoint, tmp_path, keep):
    path = _copy(checkpoint[2], tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:keep] if keep < 300 else data[: len(data) // 2])  # empty / cut header / cut tensors
    with pytest.raises(ValueError, match=r"model\.safetensors' is not a readable safetensors file.*re-download"):
        load_hf(path)


@pytest.mark.parametrize("name,text,what", [
    ("config.json", "{not json", "as JSON"),
    ("config.json", "[1, 2]", "expected an object"),
    ("model.safetensors.index.json", '{"metadata": {}}', "lacks the required key"),
])
def test_load_hf_damaged_json_names_the_file(checkpoint, tmp_path, name, text, what):
    path = _copy(checkpoint[2], tmp_path)
    (path / name).write_text(text)
    with pytest.raises(ValueError, match=what) as err:
        load_hf(path)
    assert name in str(err.value)


def test_load_hf_index_names_missing_shard(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    names = list(load_file(path / "model.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00002-of-00002.safetensors" for n in names}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf(path)


MISSING = ["model.decoder.layers.1.self_attn.k_proj.weight", "model.decoder.self_conditioning.pre_norm.weight",
           "model.encoder.language_model.layers.0.layer_scalar", "model.decoder.layers.0.experts.gate_up_proj"]


@pytest.mark.parametrize("name", MISSING)
def test_load_hf_missing_tensor(checkpoint, tmp_path, name):
    path = _copy(checkpoint[2], tmp_path)
    _edit_tensors(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"1 missing tensor\(s\): " + name.replace(".", r"\.")):
        load_hf(path)


def test_load_hf_misshaped_tensor(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    name = "model.decoder.layers.0.router.proj.weight"

    def edit(t):
        t[name] = np.zeros((5, 64), np.float32)  # 5 experts instead of 4

    _edit_tensors(path, edit)
    with pytest.raises(ValueError, match=r"mis-shaped tensor\(s\): " + name.replace(".", r"\.")
                       + r": file \(5, 64\) vs expected \(4, 64\)"):
        load_hf(path)


def test_load_hf_unexpected_tensor(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    # a V projection on the global (K = V) layer must not be silently dropped
    extra = ["model.decoder.layers.1.self_attn.v_proj.weight", "model.decoder.layers.7.mlp.gate_proj.weight"]

    def edit(t):
        t[extra[0]] = np.zeros((32, 64), np.float32)
        t[extra[1]] = np.zeros((96, 64), np.float32)

    _edit_tensors(path, edit)
    with pytest.raises(ValueError, match=r"2 unexpected tensor\(s\)") as info:
        load_hf(path)
    for name in extra:
        assert name in str(info.value)


def test_load_hf_reports_all_problems_at_once(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    rm, bad, extra = ("model.decoder.norm.weight", "model.decoder.embed_tokens.weight",
                      "model.decoder.layers.0.self_attn.bogus")

    def edit(t):
        t.pop(rm)
        t[bad] = np.zeros((127, 64), np.float32)
        t[extra] = np.zeros((3,), np.float32)

    _edit_tensors(path, edit)
    with pytest.raises(ValueError) as info:
        load_hf(path)
    msg = str(info.value)
    assert all(n in msg for n in (rm, bad, extra)), msg


def test_load_hf_config_mismatch(checkpoint, tmp_path):
    """config.json saying 3 layers for a 2-layer file: the missing layer's tensors are named."""
    path = _copy(checkpoint[2], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 3
    cfg["text_config"]["layer_types"] = ["sliding_attention", "sliding_attention", "full_attention"]
    cfg["text_config"]["per_layer_config"] = {"2": {"head_dim": 32, "num_key_value_heads": 1}}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): .*model\.decoder\.layers\.2\."):
        load_hf(path)


def test_load_hf_config_missing_field(checkpoint, tmp_path):
    path = _copy(checkpoint[2], tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["text_config"]["moe_intermediate_size"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        load_hf(path)


def test_load_hf_bad_dtype(checkpoint):
    with pytest.raises(ValueError, match="dtype"):
        load_hf(checkpoint[2], dtype="float64")


@pytest.mark.parametrize("source", ["golden", pytest.param("live", marks=pytest.mark.ref)])
def test_load_hf_transformers_checkpoint_missing_tensor(tmp_path, source):
    """The same on a checkpoint in the layout transformers' save_pretrained writes: written by it now
    (live, HF harness), or rebuilt without torch from the config.json and tensor list it wrote, stored
    in tests/golden/parity_tiny-2layer.npz (golden)."""
    path = tmp_path / "hf"
    if source == "golden":
        from tests.golden import parity_case, store

        parity_case.rebuild_checkpoint(store.load(parity_case.golden_name("tiny-2layer"))[0], path)
    else:
        pytest.importorskip("transformers")
        pytest.importorskip("torch")
        from tests.reference import hf_reference as ref

        ref.save_reference(ref.build_preset("tiny-2layer", seed=3), path)
    cfg, _ = load_hf(path)  # control: loads as is
    assert cfg.num_layers == 2
    name = "model.encoder.language_model.layers.1.layer_scalar"
    _edit_tensors(path, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing tensor\(s\): " + name.replace(".", r"\.")):
        load_hf(path)


def test_kvcache_is_the_public_type(model, filled):
    assert isinstance(filled, KVCache)


def test_params_saved_with_the_old_expert_layout_load_merged(tmp_path):
    """Checkpoints written before the expert gate/up merge ([E, D, 2, F]) load into today's
    [E, D, 2F] layout, targeted (shapes/shardings given) or not, with gate columns first."""
    from dgemma_jax import init_params
    from dgemma_jax.io.model_dir import load_params, save_params

    cfg = ModelConfig.preset("tiny-2layer")
    params = init_params(cfg, 3)
    e, d, two_f = params["blocks_0"]["moe"]["gate_up"].shape
    old = jax.tree.map(lambda x: x, params)
    for i in range(cfg.num_layers):  # the old layout: [E, D, 2, F] with [:, :, 0] = gate, [:, :, 1] = up
        old[f"blocks_{i}"]["moe"]["gate_up"] = params[f"blocks_{i}"]["moe"]["gate_up"].reshape(e, d, 2, two_f // 2)
    save_params(tmp_path / "old", old)
    for loaded in (load_params(tmp_path / "old", param_shapes(cfg)), load_params(tmp_path / "old")):
        for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------- our checkpoint directory
@pytest.fixture(scope="module")
def model_dir(checkpoint, tmp_path_factory):
    from dgemma_jax.io.model_dir import save_model

    cfg, params, _ = checkpoint
    path = tmp_path_factory.mktemp("ours") / "m"
    save_model(path, cfg, params)
    return path


def test_model_dir_records_its_files_and_loads(model_dir, checkpoint):
    from dgemma_jax.io.model_dir import load_model

    meta = json.loads((model_dir / "dgemma_model.json").read_text())
    assert meta["params_files"] and all(size > 0 for size in meta["params_files"].values())
    cfg, params, _ = load_model(model_dir)
    np.testing.assert_array_equal(np.asarray(params["embedding"]), np.asarray(checkpoint[1]["embedding"]))


@pytest.mark.parametrize("damage", ["empty", "cut", "missing"])
def test_damaged_params_file_is_named_before_orbax_reads_it(model_dir, tmp_path, damage):
    from dgemma_jax.io.model_dir import load_model

    path = _copy(model_dir, tmp_path)
    meta = json.loads((path / "dgemma_model.json").read_text())
    rel = max(meta["params_files"], key=meta["params_files"].get)  # the largest: a data file
    f = path / "params" / rel
    if damage == "missing":
        f.unlink()
    else:
        f.write_bytes(b"" if damage == "empty" else f.read_bytes()[:10])
    with pytest.raises(ValueError, match="is damaged: params/") as err:
        load_model(path)
    assert rel in str(err.value) and ("missing" if damage == "missing" else "saved as") in str(err.value)


def test_model_dir_without_a_file_list_still_loads(model_dir, tmp_path):
    from dgemma_jax.io.model_dir import load_model

    path = _copy(model_dir, tmp_path)  # a checkpoint written before the file list existed
    meta = json.loads((path / "dgemma_model.json").read_text())
    del meta["params_files"]
    (path / "dgemma_model.json").write_text(json.dumps(meta))
    assert load_model(path)[0].num_layers == 2


def test_model_dir_metadata_without_config_names_the_file(model_dir, tmp_path):
    from dgemma_jax.io.model_dir import load_model

    path = _copy(model_dir, tmp_path)
    (path / "dgemma_model.json").write_text('{"format": "dgemma_jax.model"}')
    with pytest.raises(ValueError, match=r"dgemma_model\.json' lacks the required key\(s\) \['config'\]"):
        load_model(path)


def test_convert_refuses_to_write_into_its_source(checkpoint):
    from dgemma_jax.io.convert import convert

    with pytest.raises(ValueError, match="is the source directory"):
        convert(str(checkpoint[2]), str(checkpoint[2]) + "/", "hf", progress=False)
