"""`dgemma convert --from gemma` on a checkpoint laid out as Google's gemma library stores DiffusionGemma.

The fixture (tests/helpers/gemma_release.py) is written from Google's module definitions, not from our
converter's inverse; every converted parameter is checked against the fixture through the einsum each
side computes with it (Google's spec on Google's tensor, ours on ours), so a wrong transpose or split
shows even where shapes happen to agree."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from dgemma_jax import ModelConfig
from tests.helpers.gemma_release import TEXT, nest, random_values, release_layout, vision_layout
from tests.test_cli import _one_line_error, dgemma

PRESET = "tiny-6layer"


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def check_against_fixture(params, g, layers=TEXT["LAYERS"], global_layers=TEXT["GLOBAL"]):
    """Our converted `params` against the fixture `g` ({gemma name: array}), tensor by tensor."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, TEXT["D"]))  # three token vectors
    take = lambda name: _f64(g[name] if name in g else g[name.removesuffix("/w")])  # noqa: E731

    def dense_ffw(prefix, ours):
        # Google FeedForward: '...F,NHF->...NH', gelu(gate[0]) * gate[1], '...H,HF->...F'
        w_g, w_l = take(prefix + "gating_einsum/w"), take(prefix + "linear/w")
        gate = np.einsum("tf,nhf->tnh", x, w_g)
        want = np.einsum("th,hf->tf", _gelu(gate[:, 0]) * gate[:, 1], w_l)
        # ours GatedMLP: '...d,dcf->...cf', gelu(h0) * h1, '...f,fd->...d'
        h = np.einsum("td,dcf->tcf", x, _f64(ours["gate_up"]))
        _close(np.einsum("tf,fd->td", _gelu(h[:, 0]) * h[:, 1], _f64(ours["down"])), want)

    _close(_f64(params["embedding"]), take("embedder/input_embedding"))
    _close(_f64(params["final_norm"]["scale"]), take("final_norm/scale"))
    assert sorted(k for k in params if k.startswith("blocks_")) == sorted(f"blocks_{i}" for i in range(layers))
    for i in range(layers):
        p, blk = f"layer_{i}/", params[f"blocks_{i}"]
        for theirs, ours in [("pre_attention_norm/scale", ("pre_attn_norm",)),
                             ("post_attention_norm/scale", ("post_attn_norm",)),
                             ("attn/query_norm/scale", ("attn", "q_norm")),
                             ("attn/key_norm/scale", ("attn", "k_norm")),
                             ("pre_ffw2_norm/scale", ("pre_dense_norm",)),
                             ("post_ffw2_norm/scale", ("post_dense_norm",)),
                             ("pre_ffw_norm/scale", ("pre_moe_norm",)), ("post_ffw1_norm/scale", ("post_moe_norm",)),
                             ("post_ffw_norm/scale", ("post_ffw_norm",))]:
            node = blk
            for k in ours:
                node = node[k]
            _close(_f64(node["scale"]), take(p + theirs))
        _close(_f64(blk["encoder_scalar"]), take(p + "skip_scale"))
        _close(_f64(blk["decoder_scalar"]), take(p + "skip_scale"))
        a = blk["attn"]
        # q: Google 'BTD,NDH->BTNH'; ours 'btd,dnh->btnh'
        _close(np.einsum("td,dnh->tnh", x, _f64(a["q"])), np.einsum("td,ndh->tnh", x, take(p + "attn/q_einsum/w")))
        if i in global_layers:
            # k_eq_v: Google 'BSD,KDH->BSKH' for both k and v; ours has k only (v = k)
            assert "v" not in a
            _close(np.einsum("td,dkh->tkh", x, _f64(a["k"])), np.einsum("td,kdh->tkh", x, take(p + "attn/k_einsum/w")))
        else:
            # Google 'BSD,CKDH->CBSKH': c = 0 is k, c = 1 is v
            kv = np.einsum("td,ckdh->ctkh", x, take(p + "attn/kv_einsum/w"))
            _close(np.einsum("td,dkh->tkh", x, _f64(a["k"])), kv[0])
            _close(np.einsum("td,dkh->tkh", x, _f64(a["v"])), kv[1])
        # output: Google 'BTNH,NHD->BTD'; ours 'btnh,nhd->btd'
        y = rng.standard_normal((3,) + a["o"].shape[:2])
        _close(np.einsum("tnh,nhd->td", y, _f64(a["o"])),
               np.einsum("tnh,nhd->td", y, take(p + "attn/attn_vec_einsum/w")))
        dense_ffw(p + "mlp2/", blk["dense_mlp"])
        m = blk["moe"]
        # router: Google 'gsd,de->gse'; ours 'nd,de->ne'
        _close(np.einsum("td,de->te", x, _f64(m["router"])), np.einsum("td,de->te", x, take(p + "mlp/router_logits/w")))
        _close(_f64(m["router_scale"]), take(p + "mlp/router_scale"))
        _close(_f64(m["expert_scale"]), take(p + "mlp/per_expert_scale"))
        # experts: Google 'gecd,ekfd->kgecf', gelu(x1) * x2, 'gecf,efd->gecd'
        gate = np.einsum("td,ekfd->ketf", x, take(p + "mlp/gating_einsum/w"))
        want = np.einsum("etf,efd->etd", _gelu(gate[0]) * gate[1], take(p + "mlp/linear/w"))
        # ours: 'nd,edf->nef' with gate columns [:I] then up columns [I:], 'nef,efd->ned'
        h = np.einsum("td,edf->tef", x, _f64(m["gate_up"]))
        inner = m["down"].shape[1]
        _close(np.einsum("tef,efd->etd", _gelu(h[..., :inner]) * h[..., inner:], _f64(m["down"])), want)
    _close(_f64(params["sc_norm"]["scale"]), take("self_conditioner/pre_norm/scale"))
    dense_ffw("self_conditioner/ffw/", params["sc_mlp"])


def _fixture(on_disk_w=True, seed=0):
    values = random_values(release_layout(on_disk_w), seed)
    return values, nest(values)


def _save(path, tree):
    import orbax.checkpoint as ocp

    with ocp.PyTreeCheckpointer() as c:
        c.save(os.path.abspath(path), tree)


def _shard(tree):
    """The same tree as jax arrays spread over this process's 8 devices, the way a multi-device job
    saves it (bigger tensors split along their first axis when it divides, the rest replicated)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = len(jax.devices())

    def put(x):
        spec = P("x") if x.ndim >= 2 and x.shape[0] % n == 0 else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree.map(put, tree)


def check_vision_against_fixture(params, g):
    """Our converted vision tower against the fixture's gemma vision encoder, through each side's einsums."""
    from tests.helpers.gemma_release import VISION

    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, VISION["d"]))
    vt = params["vision_tower"]
    b = "vision_encoder/transformer/stacked_layers/block/"
    _close(_f64(vt["input_proj"]), _f64(g["vision_encoder/entry/input_projection/w"]))
    for i in range(2):  # gemma factorized_posemb: table i = pos_emb[:, i] (x, then y)
        _close(_f64(vt["position_table"][i]), _f64(g["vision_encoder/entry/pos_emb"][:, i]))
    _close(_f64(vt["std_scale"]), _f64(g["vision_encoder/standardize/scale"]))
    _close(_f64(vt["std_bias"]), _f64(g["vision_encoder/standardize/bias"]))
    _close(_f64(params["embed_vision"]["projection"]), _f64(g["embedder/mm_input_projection/w"]))
    for i in range(VISION["layers"]):
        lay, G = vt[f"layers_{i}"], (lambda name: _f64(g[b + name][i]))  # noqa: E731
        for ours, theirs in (("pre_attn_norm", "pre_attention_norm"), ("post_attn_norm", "post_attention_norm"),
                             ("pre_ffw_norm", "pre_ffw_norm"), ("post_ffw_norm", "post_ffw_norm")):
            _close(_f64(lay[ours]["scale"]), G(theirs + "/scale"))
        att = lay["attention"]
        _close(_f64(att["q_norm"]["scale"]), G("attn/query_norm/scale"))
        _close(_f64(att["k_norm"]["scale"]), G("attn/key_norm/scale"))
        _close(np.einsum("td,dnh->tnh", x, _f64(att["q"])), np.einsum("TD,NDH->TNH", x, G("attn/q_einsum/w")))
        k, v = np.einsum("SD,CKDH->CSKH", x, G("attn/kv_einsum/w"))
        _close(np.einsum("td,dkh->tkh", x, _f64(att["k"])), k)
        _close(np.einsum("td,dkh->tkh", x, _f64(att["v"])), v)
        a = rng.standard_normal((3, VISION["heads"], VISION["hd"]))
        _close(np.einsum("tnh,nhd->td", a, _f64(att["o"])), np.einsum("TNH,NHD->TD", a, G("attn/attn_vec_einsum/w")))
        gate = np.einsum("td,cfd->tcf", x, G("mlp/gating_einsum/w"))  # gemma vision FeedForward
        want = np.einsum("tf,fd->td", _gelu(gate[:, 0]) * gate[:, 1], G("mlp/linear/w"))
        m = lay["mlp"]
        h = _gelu(x @ _f64(m["gate"])) * (x @ _f64(m["up"]))
        _close(h @ _f64(m["down"]), want)


def test_release_layout_converts_with_vision(tmp_path):
    """The release's NESTED tree (`mlp2/.../w`, self-conditioner `ffw/.../w`, a vision encoder and
    `embedder/mm_input_projection/w`), saved sharded from 8 devices, converts in a one-device process:
    every text parameter matches the fixture, and so does the vision tower, its config read from the shapes."""
    import jax

    from dgemma_jax.config import VisionConfig
    from dgemma_jax.io.convert import RELEASE_IMAGE_IDS
    from tests.helpers.gemma_release import VISION

    assert len(jax.devices()) == 8
    values, tree = _fixture()
    assert "w" in tree["layer_0"]["mlp2"]["gating_einsum"]  # the on-disk spelling
    src, dst = tmp_path / "release", tmp_path / "ours"
    _save(src, _shard(tree))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
    r = dgemma("convert", str(src), str(dst), "--quiet", "--preset", PRESET, env=env)  # format auto-detected
    assert r.returncode == 0, r.stderr[-3000:]
    assert "converted" in r.stdout and "from gemma" in r.stdout
    assert "gemma_multimodal" not in r.stderr and not (dst / "gemma_multimodal").exists()

    from dgemma_jax.io.model_dir import load_model

    cfg, params, _ = load_model(dst)
    vision = VisionConfig(hidden_size=VISION["d"], intermediate_size=VISION["ffw"], num_layers=VISION["layers"],
                          num_heads=VISION["heads"], num_kv_heads=VISION["heads"], head_dim=VISION["hd"],
                          patch_size=VISION["patch"], pooling_kernel_size=3, position_embedding_size=VISION["pos"],
                          standardize=True)
    assert cfg == ModelConfig.preset(PRESET, vision=vision, **RELEASE_IMAGE_IDS)
    params = jax.tree.map(np.asarray, params)
    check_against_fixture(params, values)
    check_vision_against_fixture(params, values)


def test_vision_round_trip_with_clipped_linears():
    """params_to_gemma and back with clip bounds (one gemma set for k and v together, one for gate and up)."""
    import jax

    from dgemma_jax.config import VisionConfig
    from dgemma_jax.io.convert import gemma_names, params_to_gemma, split_gemma, vision_config_from_gemma
    from tests.reference.random_params import random_params

    vision = VisionConfig(hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8,
                          patch_size=2, position_embedding_size=12, standardize=False, use_clipped_linears=True)
    cfg = ModelConfig.preset(PRESET, vision=vision)
    params = jax.tree.map(np.asarray, random_params(cfg, 4))
    for i in range(vision.num_layers):  # gemma holds one clip set per einsum: make the shared ones agree
        lay = params["vision_tower"][f"layers_{i}"]
        lay["attention"]["v_clip"] = lay["attention"]["k_clip"]
        lay["mlp"]["up_clip"] = lay["mlp"]["gate_clip"]
    for i in range(cfg.num_layers):  # and one skip_scale for both layer scalars
        params[f"blocks_{i}"]["encoder_scalar"] = params[f"blocks_{i}"]["decoder_scalar"]
    tree = params_to_gemma(params, cfg)
    assert vision_config_from_gemma(gemma_names(tree)) == vision
    back, mm, skipped = split_gemma(tree, cfg)
    assert mm == {} and skipped == []
    jax.tree.map(np.testing.assert_array_equal, back, params)
    text, mm, _ = split_gemma(tree, ModelConfig.preset(PRESET))  # a text-only target keeps the tower aside
    assert "vision_tower" not in text and "embedder/mm_input_projection/w" in mm


def test_bare_names_and_transformer_prefix(tmp_path):
    """The in-memory spelling (`mlp2/gating_einsum` without `/w`) under the FLAT layout's
    `transformer/` prefix converts to the same parameters."""
    from dgemma_jax.io.convert import restore_gemma, split_gemma

    values, tree = _fixture(on_disk_w=False, seed=3)
    assert not isinstance(tree["layer_0"]["mlp2"]["gating_einsum"], dict)
    text = {k: v for k, v in tree.items() if k != "vision_encoder"}
    flat = {f"transformer/{k}": v for k, v in text.items()}
    flat["vision_encoder"] = tree["vision_encoder"]
    _save(tmp_path / "src", flat)
    params, mm, skipped = split_gemma(restore_gemma(str(tmp_path / "src")), ModelConfig.preset(PRESET))
    check_against_fixture(params, values)
    assert set(mm) == {name for name, _, _ in vision_layout()} and skipped == []


def test_kauldron_training_checkpoint(tmp_path):
    """A Kauldron trainer step (a checkpoint-manager step directory whose item sits in `default/`, the
    params next to opt_state/step/collections: gemma `_checkpoint.py` `_get_metadata_and_path`,
    `_is_kauldron_layout`) gives the same parameters; its detect_source says gemma."""
    import orbax.checkpoint as ocp

    from dgemma_jax.io.convert import detect_source, restore_gemma, split_gemma

    values, tree = _fixture(seed=7)
    state = {"params": tree, "opt_state": {"mu": np.zeros(3, np.float32)}, "step": np.array(12, np.int64),
             "collections": {"stats": np.zeros(2, np.float32)}}
    with ocp.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(12, args=ocp.args.Composite(default=ocp.args.StandardSave(state)))
        mgr.wait_until_finished()
    step = tmp_path / "run" / "12"
    assert (step / "default").is_dir() and detect_source(str(step)) == "gemma"
    params, mm, skipped = split_gemma(restore_gemma(str(step)), ModelConfig.preset(PRESET))
    check_against_fixture(params, values)
    assert set(mm) == {name for name, _, _ in vision_layout()} and skipped == []


def test_copy_without_finalisation_marker(tmp_path, monkeypatch):
    """Where orbax's Checkpointer refuses a copy it thinks unfinished (as public bucket copies can look),
    the restore goes through the handler, which does not check."""
    import orbax.checkpoint as ocp

    from dgemma_jax.io.convert import restore_gemma, split_gemma

    values, tree = _fixture(seed=9)
    _save(tmp_path / "src", tree)

    def refuse(self, *a, **k):
        raise ValueError("Found incomplete checkpoint at " + str(a[0]))

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", refuse)
    params, _, _ = split_gemma(restore_gemma(str(tmp_path / "src")), ModelConfig.preset(PRESET))
    check_against_fixture(params, values)


def test_stacked_layout():
    """`transformer/stacked_layers/attention_type_{j}/...` with a leading axis (layer = period*i + j,
    period = number of attention types: gemma `_compat.unstack_params`) reads as the layers it stacks."""
    from dgemma_jax.io.convert import split_gemma

    cfg = ModelConfig.preset(PRESET).replace(num_layers=12, layer_types=(("sliding",) * 5 + ("global",)) * 2)
    rows = []
    for name, shape, dt in release_layout():
        m = re.match(r"layer_(\d+)/(.*)", name)
        if m:
            rows += [(f"layer_{i}/{m[2]}", shape, dt) for i in (int(m[1]), int(m[1]) + 6)]
        elif not name.startswith(("vision_encoder/", "embedder/mm_")):
            rows.append((name, shape, dt))
    values = random_values(rows, 5)
    tree: dict = {}
    for name, x in values.items():
        m = re.match(r"layer_(\d+)/(.*)", name)
        if m is None:
            mod, leaf = name.rsplit("/", 1)
            tree.setdefault("transformer/" + mod, {})[leaf] = x
        elif int(m[1]) < 6:
            j, rest = int(m[1]), m[2]
            mod, leaf = rest.rsplit("/", 1) if "/" in rest else ("", rest)
            key = f"transformer/stacked_layers/attention_type_{j}" + (f"/{mod}" if mod else "")
            tree.setdefault(key, {})[leaf] = np.stack([x, values[f"layer_{j + 6}/{rest}"]])
    params, mm, skipped = split_gemma(tree, cfg)
    assert mm == {} and skipped == []
    check_against_fixture(params, values, layers=12, global_layers=(5, 11))


def test_missing_unknown_and_extra_tensors():
    from dgemma_jax.io.convert import split_gemma

    cfg = ModelConfig.preset(PRESET)
    values, _ = _fixture()
    gone = dict(values)
    del gone["layer_3/mlp2/linear/w"]
    with pytest.raises(ValueError, match=r"no tensor 'layer_3/mlp2/linear/w' \(nor 'layer_3/mlp2/linear'\)"):
        split_gemma(nest(gone), cfg)
    odd = dict(values, **{"layer_2/attn/extra_norm/scale": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="does not know inside the text model.*layer_2/attn/extra_norm/scale"):
        split_gemma(nest(odd), cfg)
    bad = dict(values, **{"layer_1/mlp/gating_einsum/w": np.ones((8, 32, 64), np.float32)})
    with pytest.raises(ValueError, match=r"'layer_1/mlp/gating_einsum/w' has shape \(8, 32, 64\)"):
        split_gemma(nest(bad), cfg)
    short = {k: v for k, v in values.items() if not k.startswith("layer_5/")}
    with pytest.raises(ValueError, match="has 5 layers .* has 6"):
        split_gemma(nest(short), cfg)
    # tensors outside the model (a distillation head, an audio projection) are skipped, not fatal
    extra = dict(values, **{"distill_final_norm/scale": np.ones(64, np.float32),
                            "embedder/audio_input_projection/w": np.ones((4, 64), np.float32)})
    params, mm, skipped = split_gemma(nest(extra), cfg)
    check_against_fixture(params, values)
    assert skipped == ["distill_final_norm/scale"] and "embedder/audio_input_projection/w" in mm


def test_cli_names_the_missing_tensor(tmp_path):
    values, _ = _fixture()
    del values["layer_0/mlp2/gating_einsum/w"]
    _save(tmp_path / "src", nest(values))
    msg = _one_line_error(dgemma("convert", str(tmp_path / "src"), str(tmp_path / "out"), "--from", "gemma",
                                 "--quiet", "--preset", PRESET))
    assert "no tensor 'layer_0/mlp2/gating_einsum/w'" in msg
    assert not (tmp_path / "out").exists()
