"""ModelConfig: the released preset, validation, immutability, hashing and the Hugging Face reader/writer."""

import copy
import dataclasses
import json

import jax
import numpy as np
import pytest

from dgemma_jax import ModelConfig, SamplerConfig, param_shapes

RELEASED = "diffusiongemma-26b-a4b"


def _released_flat_config() -> dict:
    """A config.json shaped like the released google/diffusiongemma-26B-A4B-it one (flat global keys)."""
    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)]
    return {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": 256,
        "dtype": "bfloat16",
        "boi_token_id": 255999, "eoi_token_id": 258882, "image_token_id": 258880,
        "text_config": {
            "model_type": "diffusion_gemma_text",
            "vocab_size": 262144, "hidden_size": 2816, "intermediate_size": 2112,
            "num_hidden_layers": 30, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 256,
            "global_head_dim": 512, "num_global_key_value_heads": 2,
            "attention_k_eq_v": True,
            "sliding_window": 1024, "layer_types": layer_types,
            "num_experts": 128, "top_k_experts": 8, "moe_intermediate_size": 704,
            "enable_moe_block": True,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                   "partial_rotary_factor": 0.25},
            },
            "rms_norm_eps": 1e-6, "final_logit_softcapping": 30.0,
            "max_position_embeddings": 262144,
            "hidden_activation": "gelu_pytorch_tanh",
            "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": [1, 106, 50],
            "tie_word_embeddings": True, "use_bidirectional_attention": "vision",
            "attention_bias": False,
        },
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 1152},
    }


def _to_per_layer_form(config: dict) -> dict:
    """What transformers >= 5.23 writes on save: global shapes folded into per_layer_config."""
    config = copy.deepcopy(config)
    text = config["text_config"]
    ghd, gkv = text.pop("global_head_dim"), text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {str(i): {"head_dim": ghd, "num_key_value_heads": gkv}
                                for i, t in enumerate(text["layer_types"]) if t == "full_attention"}
    return config


def _neutral(cfg: ModelConfig) -> ModelConfig:
    """Drop the fields that are not part of a checkpoint's shape/numerics description, and the image path
    (the vision tower and image token ids: tests/test_vision.py)."""
    return cfg.replace(name="x", dtype="float32", param_dtype="float32", vision=None, image_token_id=None,
                       boi_token_id=None, eoi_token_id=None)


# ---------------------------------------------------------------------------------------------- the release
def test_released_preset_numbers():
    c = ModelConfig.preset(RELEASED)
    assert c.name == RELEASED
    assert c.num_layers == 30
    assert c.hidden_size == 2816
    assert c.num_heads == 16
    assert (c.num_kv_heads, c.head_dim) == (8, 256)
    assert (c.num_global_kv_heads, c.global_head_dim) == (2, 512)
    assert c.sliding_window == 1024
    assert [i for i in range(c.num_layers) if c.is_global(i)] == [5, 11, 17, 23, 29]
    assert c.layer_types.count("sliding") == 25 and c.layer_types[-1] == "global"
    # per-layer derived shapes
    assert {c.layer_head_dim(i) for i in range(30) if not c.is_global(i)} == {256}
    assert {c.layer_kv_heads(i) for i in range(30) if not c.is_global(i)} == {8}
    assert c.layer_head_dim(29) == 512 and c.layer_kv_heads(29) == 2
    assert c.rope_theta_local == 1e4 and c.rope_theta_global == 1e6
    assert c.global_rope_proportion == 0.25
    assert (c.num_experts, c.top_k, c.moe_intermediate_size) == (128, 8, 704)
    assert c.intermediate_size == 2112
    assert c.vocab_size == 262144
    assert c.final_logit_softcap == 30.0
    assert c.canvas_length == 256
    assert c.rms_norm_eps == 1e-6
    assert c.max_position_embeddings == 262144
    assert (c.pad_id, c.bos_id) == (0, 2) and 1 in c.eos_ids
    assert c.param_dtype == "bfloat16"
    assert abs(c.embed_scale - 2816 ** 0.5) < 1e-9


def test_released_param_count():
    counts = ModelConfig.preset(RELEASED).param_count()
    assert abs(counts["total"] / 25.2e9 - 1) < 0.02, counts
    assert abs(counts["active"] / 3.8e9 - 1) < 0.02, counts
    assert counts["embedding"] == 262144 * 2816
    assert counts["experts"] == 30 * 128 * 3 * 2816 * 704


@pytest.mark.parametrize("name", ["tiny-2layer", "tiny-6layer", "bench", RELEASED])
def test_param_count_matches_param_tree(name):
    """param_count()["total"] is the size of the actual parameter tree (no allocation: eval_shape)."""
    cfg = ModelConfig.preset(name)
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(cfg)))
    # our tree stores the two layer_scalar copies (encoder and decoder) like the HF checkpoint
    assert n == cfg.param_count()["total"], (n, cfg.param_count())


def test_preset_names_and_unknown_preset():
    names = ModelConfig.preset_names()
    assert RELEASED in names and "tiny-6layer" in names
    with pytest.raises(ValueError, match="nope") as info:
        ModelConfig.preset("nope")
    for n in names:
        assert n in str(info.value)


def test_preset_overrides():
    c = ModelConfig.preset("tiny-6layer", dtype="bfloat16", canvas_length=8)
    assert c.dtype == "bfloat16" and c.canvas_length == 8 and c.name == "tiny-6layer"
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.preset("tiny-6layer", top_k=99)


def test_default_layer_pattern():
    c = ModelConfig.preset("tiny-2layer", num_layers=8, layer_types=())
    assert c.layer_types == ("sliding",) * 5 + ("global",) + ("sliding", "global")  # last layer forced global


# ---------------------------------------------------------------------------------------------- validation
BAD = [
    (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
    (dict(num_heads=4, num_global_kv_heads=3), "num_global_kv_heads"),
    (dict(top_k=9), "top_k"),
    (dict(head_dim=15), "head_dim"),
    (dict(global_head_dim=33), "global_head_dim"),
    (dict(layer_types=("sliding",) * 5), "layer_types"),
    (dict(layer_types=("sliding",) * 5 + ("full",)), "layer_types"),
    (dict(dtype="float64"), "dtype"),
    (dict(param_dtype="int8"), "param_dtype"),
    (dict(denoise_window="diagonal"), "denoise_window"),
    (dict(eos_ids=(1, 256)), "eos_ids"),
    (dict(eos_ids=(-1,)), "eos_ids"),
    (dict(pad_id=256), "pad_id"),
    (dict(bos_id=-1), "bos_id"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(hidden_size=64.0), "hidden_size"),
    (dict(num_layers=True), "num_layers"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(canvas_length=-1), "canvas_length"),
    (dict(global_rope_proportion=1.5), "global_rope_proportion"),
    (dict(rope_theta_local=0.0), "rope_theta_local"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (dict(final_logit_softcap=0.0), "final_logit_softcap"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[f for _, f in BAD])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        ModelConfig.preset("tiny-6layer", **overrides)
    # replace() validates too
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        ModelConfig.preset("tiny-6layer").replace(**overrides)


def test_valid_edge_values():
    c = ModelConfig.preset("tiny-6layer", top_k=8, num_kv_heads=4, global_rope_proportion=0.0, eos_ids=1)
    assert c.top_k == c.num_experts and c.eos_ids == (1,)
    assert isinstance(ModelConfig.preset("tiny-6layer", eos_ids=[1, 2]).eos_ids, tuple)


def test_frozen_and_hashable():
    a = ModelConfig.preset("tiny-6layer")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_layers = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.dtype = "bfloat16"
    b = ModelConfig.preset("tiny-6layer", layer_types=list(a.layer_types), eos_ids=[1])
    assert a == b and hash(a) == hash(b)
    assert isinstance(b.layer_types, tuple) and isinstance(b.eos_ids, tuple)
    c = a.replace(denoise_window="band")
    assert c != a and a.denoise_window == "block"  # replace returns a new object
    assert len({a, b, c}) == 2

    # usable as a static jit argument: equal configs share the compiled function
    traces = []
    g = jax.jit(lambda cfg, x: (traces.append(1), x * cfg.num_layers)[1], static_argnums=0)
    assert int(g(a, 2)) == 12 and int(g(b, 2)) == 12 and len(traces) == 1


# ---------------------------------------------------------------------------------------------- Hugging Face
def test_from_hf_released_flat_form():
    cfg = ModelConfig.from_hf(_released_flat_config())
    assert _neutral(cfg) == _neutral(ModelConfig.preset(RELEASED))


def test_from_hf_per_layer_config_form():
    cfg = ModelConfig.from_hf(_to_per_layer_form(_released_flat_config()))
    assert _neutral(cfg) == _neutral(ModelConfig.preset(RELEASED))


@pytest.mark.parametrize("name", ["tiny-2layer", "tiny-6layer", "bench"])
def test_from_hf_per_layer_config_small(name):
    """Global shapes must come from per_layer_config (defaults 512 / kv heads would be wrong here)."""
    ours = ModelConfig.preset(name)
    cfg = {"model_type": "diffusion_gemma", "canvas_length": ours.canvas_length,
           "text_config": ours.to_hf_text_config()}
    cfg = _to_per_layer_form(cfg)
    got = ModelConfig.from_hf(cfg)
    assert got.global_head_dim == ours.global_head_dim != 512
    assert got.num_global_kv_heads == ours.num_global_kv_heads != ours.num_kv_heads
    assert _neutral(got) == _neutral(ours)


@pytest.mark.parametrize("name", ModelConfig.preset_names())
def test_to_hf_round_trip(name):
    ours = ModelConfig.preset(name)
    # wrapped like a full config.json ...
    full = {"model_type": "diffusion_gemma", "canvas_length": ours.canvas_length,
            "text_config": ours.to_hf_text_config()}
    assert _neutral(ModelConfig.from_hf(full)) == _neutral(ours)
    # ... through JSON (tuples become lists, floats stay floats) ...
    assert _neutral(ModelConfig.from_hf(json.loads(json.dumps(full)))) == _neutral(ours)
    # ... and the bare text config (canvas_length then takes its default)
    bare = ModelConfig.from_hf(ours.to_hf_text_config())
    assert _neutral(bare).replace(canvas_length=ours.canvas_length) == _neutral(ours)


def test_round_trip_non_default_numerics():
    ours = ModelConfig.preset("tiny-6layer", rope_theta_local=5000.0, rope_theta_global=2e6,
                              global_rope_proportion=0.5, rms_norm_eps=1e-5, final_logit_softcap=20.0,
                              max_position_embeddings=4096, pad_id=3, bos_id=4, eos_ids=(5, 6),
                              layer_types=("sliding", "global") * 3)
    got = ModelConfig.from_hf({"canvas_length": 16, "text_config": ours.to_hf_text_config()})
    assert _neutral(got) == _neutral(ours)


def test_from_hf_directory_and_file(tmp_path):
    ours = ModelConfig.preset("tiny-6layer")
    full = _to_per_layer_form({"model_type": "diffusion_gemma", "canvas_length": 16,
                               "text_config": ours.to_hf_text_config(), "_name_or_path": "my/model"})
    (tmp_path / "config.json").write_text(json.dumps(full))
    a = ModelConfig.from_hf(tmp_path)
    b = ModelConfig.from_hf(str(tmp_path / "config.json"))
    assert a == b and a.name == "my/model"
    assert _neutral(a) == _neutral(ours)
    # overrides apply (and are validated)
    assert ModelConfig.from_hf(tmp_path, dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig.from_hf(tmp_path, dtype="nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_hf(tmp_path / "missing")


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "head_dim", "intermediate_size", "num_experts",
                                   "top_k_experts", "moe_intermediate_size", "sliding_window"])
def test_from_hf_missing_field(field):
    cfg = _released_flat_config()
    del cfg["text_config"][field]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(cfg)
    cfg["text_config"][field] = None  # e.g. num_experts: null in a dense Gemma 4 config
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(cfg)


def test_from_hf_bad_values():
    cfg = _released_flat_config()
    cfg["text_config"]["hidden_size"] = "wide"
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_hf(cfg)
    cfg = _released_flat_config()
    cfg["model_type"] = "llama"
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf(cfg)
    cfg = _released_flat_config()
    cfg["text_config"]["rope_parameters"]["full_attention"]["rope_type"] = "yarn"
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf(cfg)
    cfg = _released_flat_config()
    cfg["text_config"]["top_k_experts"] = 129  # validated by ModelConfig
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig.from_hf(cfg)


@pytest.fixture(scope="module", params=["golden", pytest.param("live", marks=pytest.mark.ref)])
def hf_config_source(request):
    """transformers' config dicts: from tests/golden/config.npz, or made by transformers now (ref)."""
    from tests.golden.reference_source import GoldenReference, LiveReference, record_path

    if request.param == "golden":
        yield GoldenReference("config")
        return
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    live = LiveReference(record_path())
    yield live
    live.flush()


@pytest.mark.parametrize("name", ["tiny-2layer", "tiny-6layer"])
def test_from_hf_reads_transformers_config(name, hf_config_source):
    """The config.json that transformers itself writes (per_layer_config form) reads back exactly."""
    ours = ModelConfig.preset(name)
    text_kwargs = ours.to_hf_text_config()

    def compute():
        from tests.reference import hf_reference as ref

        return np.asarray(json.dumps(ref.make_config(text_kwargs, ours.canvas_length).to_dict()))

    hf_cfg = json.loads(str(hf_config_source.value(
        f"config/{name}", compute, json.dumps(text_kwargs, sort_keys=True), ours.canvas_length)))
    assert "per_layer_config" in hf_cfg["text_config"]
    assert _neutral(ModelConfig.from_hf(hf_cfg)) == _neutral(ours)
    vision = ModelConfig.from_hf(hf_cfg).vision  # the harness's tiny tower (1 layer, width 16)
    assert (vision.num_layers, vision.hidden_size, vision.head_dim) == (1, 16, 8)


def test_sampler_for_model_is_the_one_default_everywhere():
    import dgemma_jax
    from dgemma_jax.engine import Engine
    from dgemma_jax.model import init_params

    cfg = ModelConfig.preset("tiny-2layer").replace(eos_ids=(1, 5), pad_id=3, canvas_length=8)
    s = SamplerConfig.for_model(cfg)
    assert (s.canvas_length, s.eos_ids, s.pad_id) == (8, (1, 5), 3)
    assert s.max_denoising_steps == 48 and s.t_max == 0.8  # the released settings otherwise
    assert SamplerConfig.for_model(cfg, max_denoising_steps=4).max_denoising_steps == 4
    params = init_params(cfg, jax.random.key(0))
    assert Engine(cfg, params).sampler == s
    # the curated top level
    for name in ("ModelConfig", "SamplerConfig", "Engine", "generate", "DiffusionGemma", "load_hf"):
        assert name in dgemma_jax.__all__ and getattr(dgemma_jax, name) is not None
    assert dgemma_jax.SamplerConfig is SamplerConfig
