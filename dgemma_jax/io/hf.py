"""Hugging Face DiffusionGemma checkpoints <-> our parameter tree, with safetensors and numpy (no torch).

This file is the only place that knows the Hugging Face tensor names. Each entry of the name table
maps one of our leaves to one HF tensor and a layout change, written as "reshape the HF tensor,
then transpose" so that it can be inverted for saving.

Tensors are read one at a time (a 26B checkpoint is never held whole in host memory) and, when
shardings are given, placed straight into their device shards.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dgemma_jax.config import ModelConfig
from dgemma_jax.errors import read_json
from dgemma_jax.io.finite import check_finite
from dgemma_jax.io.locations import resolve

DECODER = "model.decoder."
ENCODER_LAYERS = "model.encoder.language_model.layers."
VISION_TOWER = "model.encoder.vision_tower."
EMBED_VISION = "model.encoder.embed_vision."
VISION_PREFIXES = (VISION_TOWER, EMBED_VISION)
IGNORED_PREFIXES = VISION_PREFIXES + ("lm_head.",)  # what a text-only load leaves unread
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # ours: <kernel>_clip [4] in this order


@dataclasses.dataclass(frozen=True)
class Entry:
    """ours = hf.reshape(hf_view).transpose(perm); shapes are ours and HF's."""

    ours: tuple[str, ...]
    hf: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    hf_view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None

    def to_ours(self, x: np.ndarray) -> np.ndarray:
        if self.hf_view is not None:
            x = x.reshape(self.hf_view)
        if self.perm is not None:
            x = x.transpose(self.perm)
        return x.reshape(self.shape)

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.perm is not None:
            view = self.hf_view if self.hf_view is not None else self.hf_shape
            x = x.reshape(tuple(view[p] for p in self.perm)).transpose(np.argsort(self.perm))
        return np.array(x.reshape(self.hf_shape), order="C")  # (ascontiguousarray would make a scalar 1-D)


def name_table(cfg: ModelConfig) -> list[Entry]:
    """Every parameter of `cfg` with its Hugging Face name and layout."""
    d, n, v = cfg.hidden_size, cfg.num_heads, cfg.vocab_size
    f, e, fi = cfg.intermediate_size, cfg.num_experts, cfg.moe_intermediate_size
    out = [
        Entry(("embedding",), DECODER + "embed_tokens.weight", (v, d), (v, d)),
        Entry(("final_norm", "scale"), DECODER + "norm.weight", (d,), (d,)),
        Entry(("sc_norm", "scale"), DECODER + "self_conditioning.pre_norm.weight", (d,), (d,)),
    ]
    out += _gated_mlp(("sc_mlp",), DECODER + "self_conditioning.", d, f)
    norms = {
        "pre_attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
        "pre_dense_norm": "pre_feedforward_layernorm", "post_dense_norm": "post_feedforward_layernorm_1",
        "pre_moe_norm": "pre_feedforward_layernorm_2", "post_moe_norm": "post_feedforward_layernorm_2",
        "post_ffw_norm": "post_feedforward_layernorm",
    }
    for i in range(cfg.num_layers):
        blk = f"blocks_{i}"
        pre = f"{DECODER}layers.{i}."
        h, k = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        out += [
            Entry((blk, "attn", "q"), pre + "self_attn.q_proj.weight", (d, n, h), (n * h, d), (n, h, d), (2, 0, 1)),
            Entry((blk, "attn", "k"), pre + "self_attn.k_proj.weight", (d, k, h), (k * h, d), (k, h, d), (2, 0, 1)),
            Entry((blk, "attn", "o"), pre + "self_attn.o_proj.weight", (n, h, d), (d, n * h), (d, n, h), (1, 2, 0)),
            Entry((blk, "attn", "q_norm", "scale"), pre + "self_attn.q_norm.weight", (h,), (h,)),
            Entry((blk, "attn", "k_norm", "scale"), pre + "self_attn.k_norm.weight", (h,), (h,)),
        ]
        if not cfg.is_global(i):
            out.append(Entry((blk, "attn", "v"), pre + "self_attn.v_proj.weight", (d, k, h), (k * h, d),
                             (k, h, d), (2, 0, 1)))
        out += [Entry((blk, ours, "scale"), pre + theirs + ".weight", (d,), (d,)) for ours, theirs in norms.items()]
        out += _gated_mlp((blk, "dense_mlp"), pre + "mlp.", d, f)
        out += [
            Entry((blk, "moe", "router"), pre + "router.proj.weight", (d, e), (e, d), None, (1, 0)),
            Entry((blk, "moe", "router_scale"), pre + "router.scale", (d,), (d,)),
            Entry((blk, "moe", "expert_scale"), pre + "router.per_expert_scale", (e,), (e,)),
            Entry((blk, "moe", "gate_up"), pre + "experts.gate_up_proj", (e, d, 2 * fi), (e, 2 * fi, d),
                  (e, 2, fi, d), (0, 3, 1, 2)),
            Entry((blk, "moe", "down"), pre + "experts.down_proj", (e, fi, d), (e, d, fi), None, (0, 2, 1)),
            Entry((blk, "decoder_scalar"), pre + "layer_scalar", (1,), (1,)),
            Entry((blk, "encoder_scalar"), f"{ENCODER_LAYERS}{i}.layer_scalar", (1,), (1,)),
        ]
    if cfg.vision is not None:
        out += vision_name_table(cfg)
    return out


def vision_name_table(cfg: ModelConfig) -> list[Entry]:
    """The vision tower (`vision_tower`) and its projection (`embed_vision`) of a config with `vision`.

    A clip bound (`use_clipped_linears`) is one HF scalar per bound; ours stacks the four of a linear into
    `<kernel>_clip` [4] (input_min, input_max, output_min, output_max): an entry's path then ends with the
    bound's index."""
    v = cfg.vision
    d, n, k, h, f = v.hidden_size, v.num_heads, v.num_kv_heads, v.head_dim, v.intermediate_size
    out = [
        Entry(("vision_tower", "input_proj"), VISION_TOWER + "patch_embedder.input_proj.weight", (v.patch_dim, d),
              (d, v.patch_dim), None, (1, 0)),
        Entry(("vision_tower", "position_table"), VISION_TOWER + "patch_embedder.position_embedding_table",
              (2, v.position_embedding_size, d), (2, v.position_embedding_size, d)),
        Entry(("embed_vision", "projection"), EMBED_VISION + "embedding_projection.weight",
              (d, cfg.hidden_size), (cfg.hidden_size, d), None, (1, 0)),
    ]
    if v.standardize:
        out += [Entry(("vision_tower", "std_bias"), VISION_TOWER + "std_bias", (d,), (d,)),
                Entry(("vision_tower", "std_scale"), VISION_TOWER + "std_scale", (d,), (d,))]
    norms = {"pre_attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    for i in range(v.num_layers):
        lay = ("vision_tower", f"layers_{i}")
        pre = f"{VISION_TOWER}encoder.layers.{i}."
        linears = [
            Entry(lay + ("attention", "q"), pre + "self_attn.q_proj", (d, n, h), (n * h, d), (n, h, d), (2, 0, 1)),
            Entry(lay + ("attention", "k"), pre + "self_attn.k_proj", (d, k, h), (k * h, d), (k, h, d), (2, 0, 1)),
            Entry(lay + ("attention", "v"), pre + "self_attn.v_proj", (d, k, h), (k * h, d), (k, h, d), (2, 0, 1)),
            Entry(lay + ("attention", "o"), pre + "self_attn.o_proj", (n, h, d), (d, n * h), (d, n, h), (1, 2, 0)),
            Entry(lay + ("mlp", "gate"), pre + "mlp.gate_proj", (d, f), (f, d), None, (1, 0)),
            Entry(lay + ("mlp", "up"), pre + "mlp.up_proj", (d, f), (f, d), None, (1, 0)),
            Entry(lay + ("mlp", "down"), pre + "mlp.down_proj", (f, d), (d, f), None, (1, 0)),
        ]
        for e in linears:
            out.append(dataclasses.replace(e, hf=e.hf + ".linear.weight"))
            if v.use_clipped_linears:
                out += [Entry(e.ours[:-1] + (e.ours[-1] + "_clip", j), f"{e.hf}.{b}", (), ())
                        for j, b in enumerate(CLIP_BOUNDS)]
        out += [Entry(lay + ("attention", "q_norm", "scale"), pre + "self_attn.q_norm.weight", (h,), (h,)),
                Entry(lay + ("attention", "k_norm", "scale"), pre + "self_attn.k_norm.weight", (h,), (h,))]
        out += [Entry(lay + (ours, "scale"), pre + theirs + ".weight", (d,), (d,)) for ours, theirs in norms.items()]
    return out


def _grouped(path: tuple) -> tuple[int, int] | None:
    """(how many parts, the axis they stack on) when a table path names one part of a stacked leaf: a gate/up
    half of a [D, 2, F] MLP kernel, or one of the four clip bounds of a vision linear; else None."""
    if not isinstance(path[-1], int):
        return None
    return (4, 0) if str(path[-2]).endswith("_clip") else (2, 1)


def _gated_mlp(path, prefix, d, f) -> list[Entry]:
    # gate and up are two HF tensors; ours stacks them as [D, 2, F]: handled by `_GATE_UP` pairs.
    return [
        Entry(path + ("gate_up", 0), prefix + "gate_proj.weight", (d, f), (f, d), None, (1, 0)),
        Entry(path + ("gate_up", 1), prefix + "up_proj.weight", (d, f), (f, d), None, (1, 0)),
        Entry(path + ("down",), prefix + "down_proj.weight", (f, d), (d, f), None, (1, 0)),
    ]


# ---------------------------------------------------------------------------- reading
class SafetensorsDir:
    """Lazy access to the tensors of a directory of *.safetensors files (sharded index or not)."""

    def __init__(self, path: str):
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_json(index, require=("weight_map",))["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(fn for fn in os.listdir(path) if fn.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
            weight_map = None
        self._handles = {}
        self.where = {}
        for fn in files:
            full = os.path.join(path, fn)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"the index names {fn!r} but {full!r} does not exist")
            try:
                h = safe_open(full, framework="numpy")
            except (SafetensorError, OSError) as e:  # a bad header, a file cut short
                raise ValueError(f"{full!r} is not a readable safetensors file ({e}); it is truncated or corrupt: "
                                 "re-download it") from e
            self._handles[fn] = h
            for k in h.keys():
                self.where[k] = fn
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.where))
            if missing:
                raise ValueError(f"the safetensors index lists tensors that no file holds: {missing[:5]}")

    def keys(self):
        return self.where.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[self.where[name]].get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        return self._handles[self.where[name]].get_tensor(name)


def _set(tree: dict, path: tuple, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _check(cfg: ModelConfig, st: SafetensorsDir, table: list[Entry]):
    expected = {e.hf: e for e in table}
    present = set(st.keys())
    missing = sorted(set(expected) - present)
    ignored = IGNORED_PREFIXES if cfg.vision is None else ("lm_head.",)
    unexpected = sorted(k for k in present - set(expected)
                        if not k.startswith(ignored) and not k.startswith("model.encoder.language_model."))
    misshaped = [f"{k}: file {st.shape(k)} vs expected {expected[k].hf_shape}"
                 for k in sorted(present & set(expected)) if st.shape(k) != expected[k].hf_shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:6])}" + (" ..." if len(missing) > 6 else ""))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): {', '.join(unexpected[:6])}"
                        + (" ..." if len(unexpected) > 6 else ""))
    if misshaped:
        problems.append(f"{len(misshaped)} mis-shaped tensor(s): {'; '.join(misshaped[:4])}")
    if problems:
        raise ValueError(f"checkpoint {st.path!r} does not match its config ({cfg.name}): " + " | ".join(problems))


def vision_tensors_present(path: str | os.PathLike) -> bool | None:
    """Whether the safetensors of a local HF directory hold any vision tensor (None: no readable weights)."""
    try:
        st = SafetensorsDir(os.fspath(path))
    except (OSError, ValueError):
        return None
    return any(k.startswith(VISION_PREFIXES) for k in st.keys())


def load_hf(path: str | os.PathLike, dtype: str | None = None, *,
            shardings: Any | None = None, config_overrides: dict | None = None,
            progress: Callable[[Iterator], Iterator] | None = None, revision: str | None = None,
            vision: bool | None = None):
    """Read a Hugging Face DiffusionGemma directory (config.json + safetensors) -> (ModelConfig, params).

    vision: whether to read the vision tower (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`)
    into the params `vision_tower` / `embed_vision` (config.vision set). None (default): when config.json
    has a `vision_config` and the files hold vision tensors (a checkpoint without any, such as one `save_hf`
    wrote for a text-only model, loads text-only); True: required; False: text only, the tower left unread.

    path: a local directory, a gs:// (or other fsspec) URL, or a Hub repo id[@revision]
    (`dgemma_jax.io.locations`: remote files are copied into a local cache first); revision: the
    Hub revision (branch, tag or commit).

    dtype: parameter dtype ("float32", "bfloat16"; default: float32 for float32 files, else bfloat16).
    shardings: optional pytree of `jax.sharding.Sharding` matching the params: each tensor is put
    straight into its shards. Raises ValueError naming missing, unexpected or mis-shaped tensors.
    """
    path = resolve(path, revision)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    cfg = ModelConfig.from_hf(path)
    st = SafetensorsDir(path)
    if vision is None:
        vision = cfg.vision is not None and any(k.startswith(VISION_PREFIXES) for k in st.keys())
    if vision and cfg.vision is None:
        raise ValueError(f"checkpoint {st.path!r}: vision=True but its config.json has no vision_config")
    if not vision:
        cfg = cfg.replace(vision=None)
    table = name_table(cfg)
    _check(cfg, st, table)
    if dtype is None:
        first = st.get(table[1].hf)
        dtype = "float32" if first.dtype == np.float32 else "bfloat16"
    cfg = cfg.replace(param_dtype=dtype, dtype=dtype, **(config_overrides or {}))
    np_dtype = jnp.dtype(dtype)

    flat_shardings = {}
    if shardings is not None:
        for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
            flat_shardings[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)] = s

    params: dict = {}
    pending_parts: dict = {}
    items = table if progress is None else progress(table)
    for entry in items:
        arr = entry.to_ours(st.get(entry.hf)).astype(np_dtype)
        path_ = entry.ours
        group = _grouped(path_)
        if group is not None:  # one part of a stacked leaf (gate/up halves, clip bounds)
            count, axis = group
            key = path_[:-1]
            pending_parts.setdefault(key, {})[path_[-1]] = arr
            if len(pending_parts[key]) < count:
                continue
            arr = np.stack([pending_parts[key][j] for j in range(count)], axis=axis)
            del pending_parts[key]
            path_ = key
        sharding = flat_shardings.get(path_)
        if sharding is not None:
            value = jax.make_array_from_callback(arr.shape, sharding, lambda idx, a=arr: a[idx])
        else:
            value = jnp.asarray(arr)
        _set(params, path_, value)
    check_finite(params, path, lambda name: _stored_name(st, table, name))
    return cfg, params


def _stored_name(st: SafetensorsDir, table: list[Entry], name: str) -> str:
    """The safetensors name of our parameter `name`; for a leaf stacked from several tensors (gate/up
    halves, clip bounds) the one holding a non-finite value (read again: only on the error path)."""
    parts = [e.hf for e in table if "/".join(map(str, e.ours)) == name
             or (_grouped(e.ours) is not None and "/".join(map(str, e.ours[:-1])) == name)]
    bad = [hf for hf in parts if not np.isfinite(st.get(hf).astype(np.float32)).all()]
    return " or ".join(bad or parts or [name])


# ---------------------------------------------------------------------------- writing
def save_hf(params, cfg: ModelConfig, path: str | os.PathLike, *, canvas_length: int | None = None,
            dtype: str | None = None, generation_config: dict | None = None):
    """Write params as a Hugging Face DiffusionGemma directory (config.json + model.safetensors)."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    np_dtype = np.dtype(dtype or cfg.param_dtype) if (dtype or cfg.param_dtype) != "bfloat16" else None
    tensors = {}
    for entry in name_table(cfg):
        node = params
        group = _grouped(entry.ours)
        for p in entry.ours:
            node = node[p] if not isinstance(p, int) else (node[p] if group[1] == 0 else node[:, p])
        arr = np.asarray(node)
        if np_dtype is not None:
            arr = arr.astype(np_dtype)
        tensors[entry.hf] = entry.to_hf(arr)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    text = cfg.to_hf_text_config()
    text["model_type"] = "diffusion_gemma_text"
    text.pop("global_head_dim")
    text.pop("num_global_key_value_heads")
    text["per_layer_config"] = {str(i): {"head_dim": cfg.global_head_dim,
                                         "num_key_value_heads": cfg.num_global_kv_heads}
                                for i in range(cfg.num_layers) if cfg.is_global(i)}
    config = {
        "architectures": ["DiffusionGemmaForBlockDiffusion"],
        "model_type": "diffusion_gemma",
        "canvas_length": canvas_length or cfg.canvas_length,
        "text_config": text,
        # a text-only model keeps a tiny stub (transformers would otherwise build its default 768x16 tower);
        # load_hf reads a checkpoint without vision tensors as text-only
        "vision_config": cfg.vision.to_hf() if cfg.vision is not None else {
            "model_type": "gemma4_vision", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8},
        **{f: getattr(cfg, f) for f in ("image_token_id", "boi_token_id", "eoi_token_id")
           if getattr(cfg, f) is not None},
        "tie_word_embeddings": True,
        "dtype": "bfloat16" if cfg.param_dtype == "bfloat16" else "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if generation_config is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(generation_config, f, indent=2)
