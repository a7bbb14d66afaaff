"""Checkpoint conversion into our format: Hugging Face safetensors, and the `gemma` library's orbax layout.

The gemma-library (google-deepmind/gemma) layout of DiffusionGemma-26B-A4B, as its flax modules name the
parameters (`gemma/gm/nn/gemma4/_modules.py`, `_moe.py`, `_layers.py`; `gemma/diffusion/_transformer.py`),
with D = embed_dim, N/K = query/kv heads, H = head dim, F = dense hidden, E/I = experts/expert hidden:

    embedder/input_embedding [V, D]                  final_norm/scale [D]
    layer_{i}/pre_attention_norm/scale, post_attention_norm/scale, skip_scale [1]
    layer_{i}/attn/q_einsum/w [N, D, H]              attn/attn_vec_einsum/w [N, H, D]
    layer_{i}/attn/kv_einsum/w [2, K, D, H] (sliding) | attn/k_einsum/w [K, D, H] (global, k_eq_v)
    layer_{i}/attn/query_norm/scale, attn/key_norm/scale [H]
    layer_{i}/pre_ffw2_norm/scale, mlp2/gating_einsum [2, F, D], mlp2/linear [F, D], post_ffw2_norm/scale
    layer_{i}/pre_ffw_norm/scale, mlp/router_logits/w [D, E], mlp/router_scale [D], mlp/per_expert_scale [E],
              mlp/gating_einsum/w [E, 2, I, D], mlp/linear/w [E, I, D], post_ffw1_norm/scale, post_ffw_norm/scale
    self_conditioner/pre_norm/scale [D], self_conditioner/ffw/gating_einsum [2, F, D], ffw/linear [F, D]

`mlp2` and the self-conditioner's `ffw` are `FeedForward`s built with `nn.share_scope`: in memory their
weights are bare (`mlp2/gating_einsum`), on disk they keep the Einsum's `w` leaf (`mlp2/gating_einsum/w`):
gemma `gm/ckpts/_checkpoint.py` (`_reconcile_tree`) and `diffusion/hackable_diffusion_adapter/hd/
gemma_checkpointer.py` (`_remap_and_match_params`, strips a trailing `/w` only where the model lacks it).
Both spellings are accepted here. Other layouts the gemma loader knows are read too: names under a
`transformer/` prefix (FLAT), layers stacked by attention pattern (`transformer/stacked_layers/
attention_type_{j}/…` with a leading axis, layer = period·i + j: gemma `gm/ckpts/_compat.py`), and a
Kauldron training checkpoint (`params` next to `opt_state`, or the tree under `default/`).

The release also carries a vision encoder (gemma `gm/nn/gemma4/vision/`: `_encoder.py`, `_layers.py`,
`_transformer.py`, `_modules.py`; kept in float32), converted into our `vision_tower` / `embed_vision`
(`dgemma_jax.model.vision`) with its `VisionConfig` read from the tensor shapes (`vision_config_from_gemma`):

    vision_encoder/entry/input_projection/w [3 p^2, Dv]   vision_encoder/entry/pos_emb [P, 2, Dv] (x, y tables)
    vision_encoder/transformer/stacked_layers/block/...   one nn.scan over the layers: a leading [L] axis on
        pre_attention_norm, post_attention_norm, pre_ffw_norm, post_ffw_norm /scale, attn/q_einsum/w [N, Dv, H],
        attn/kv_einsum/w [2, K, Dv, H], attn/attn_vec_einsum/w [N, H, Dv], attn/query_norm, key_norm /scale,
        mlp/gating_einsum/w [2, F, Dv], mlp/linear/w [F, Dv]; with clipped linears each einsum also holds
        clip_input_min/max, clip_output_min/max scalars (one set for k and v together, one for gate and up)
    vision_encoder/standardize/{scale, bias} [Dv]         embedder/mm_input_projection/w [Dv, D] (its norm has
                                                          no scale)

The vision norms multiply by their scale directly, as ours do. Audio tensors (`audio_encoder/…`,
`embedder/audio_…`) and anything else multimodal stay unconverted: they are copied, under their gemma names,
into `<dst>/gemma_multimodal/` (an orbax checkpoint) and the conversion says so in a warning.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.errors import DgemmaWarning
from dgemma_jax.io.formats import detect_format
from dgemma_jax.io.hf import load_hf
from dgemma_jax.io.locations import resolve
from dgemma_jax.io.model_dir import load_model, read_checkpoint, save_model
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.quant import QUANT_MODES, quantization_of, quantize_params
from dgemma_jax.progress import tensor_bar

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

# where the vision (and any audio) tensors of a gemma checkpoint are kept, inside the output directory
MULTIMODAL_DIR = "gemma_multimodal"

_T = lambda *perm: (lambda x: np.transpose(x, perm))  # noqa: E731
_ID = lambda x: x  # noqa: E731


def _merge_gate_up(x):
    """Expert gate/up [E, 2, I, D] -> our [E, D, 2I] (gate columns, then up columns), as MoERagged does."""
    x = np.transpose(x, (0, 3, 1, 2))
    return x.reshape(x.shape[0], x.shape[1], -1)


# (gemma name inside `layer_{i}/` as the release stores it, our path inside `blocks_{i}`, gemma -> ours).
# A `.../w` name is also found without its `/w` (the in-memory spelling; see the module docstring).
LAYER_TABLE: list[tuple[str, tuple, Callable]] = [
    ("pre_attention_norm/scale", ("pre_attn_norm", "scale"), _ID),
    ("post_attention_norm/scale", ("post_attn_norm", "scale"), _ID),
    ("attn/q_einsum/w", ("attn", "q"), _T(1, 0, 2)),            # [N, D, H] -> [D, N, H]
    ("attn/attn_vec_einsum/w", ("attn", "o"), _ID),             # [N, H, D]
    ("attn/query_norm/scale", ("attn", "q_norm", "scale"), _ID),
    ("attn/key_norm/scale", ("attn", "k_norm", "scale"), _ID),
    ("pre_ffw2_norm/scale", ("pre_dense_norm", "scale"), _ID),
    ("mlp2/gating_einsum/w", ("dense_mlp", "gate_up"), _T(2, 0, 1)),  # [2, F, D] -> [D, 2, F]
    ("mlp2/linear/w", ("dense_mlp", "down"), _ID),                # [F, D]
    ("post_ffw2_norm/scale", ("post_dense_norm", "scale"), _ID),
    ("pre_ffw_norm/scale", ("pre_moe_norm", "scale"), _ID),
    ("mlp/gating_einsum/w", ("moe", "gate_up"), _merge_gate_up),  # [E, 2, I, D] -> [E, D, 2I]
    ("mlp/linear/w", ("moe", "down"), _ID),                     # [E, I, D]
    ("mlp/router_logits/w", ("moe", "router"), _ID),            # [D, E]
    ("mlp/router_scale", ("moe", "router_scale"), _ID),
    ("mlp/per_expert_scale", ("moe", "expert_scale"), _ID),
    ("post_ffw1_norm/scale", ("post_moe_norm", "scale"), _ID),
    ("post_ffw_norm/scale", ("post_ffw_norm", "scale"), _ID),
]
# the self-conditioning block (gemma/diffusion/_transformer.py `SelfConditioning`; its post_norm has no scale)
SC_TABLE: list[tuple[str, tuple, Callable]] = [
    ("self_conditioner/pre_norm/scale", ("sc_norm", "scale"), _ID),
    ("self_conditioner/ffw/gating_einsum/w", ("sc_mlp", "gate_up"), _T(2, 0, 1)),  # [2, F, D] -> [D, 2, F]
    ("self_conditioner/ffw/linear/w", ("sc_mlp", "down"), _ID),                    # [F, D]
]
# tensors of the multimodal encoders: carried aside, not converted
_MM_PREFIXES = ("vision_encoder/", "audio_encoder/", "SigLiPFromPatches_0/", "embedder/mm_", "embedder/audio_")
# namespaces of the text model: an unknown tensor inside one means a layout we do not understand
_TEXT_PREFIXES = ("layer_", "embedder/", "final_norm/", "self_conditioner/")
_STACKED = re.compile(r"^(.*?)stacked_layers/attention_type_(\d+)/(.*)$")


def detect_source(path: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"source checkpoint {path!r} does not exist or is not a directory")
    try:  # ours (re-written, e.g. with --quantize int8) or Hugging Face: the loaders' own detection
        return detect_format(path)
    except ValueError:
        pass
    files = os.listdir(path)
    if any(f in files for f in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "checkpoint")) or \
            any(f.startswith("ocdbt") or f == "d" for f in files):
        return "gemma"
    raise ValueError(f"cannot tell the format of {path!r}: expected a Hugging Face directory (config.json + "
                     "*.safetensors) or a gemma-library orbax checkpoint; pass --from hf|gemma")


def _flatten(tree, prefix="") -> dict[str, Any]:
    """Nested dicts (whose keys may themselves hold '/') -> {'a/b/c': leaf}."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
    else:
        out[prefix] = tree
    return out


def _set(tree: dict, path: tuple, value):
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def _unstack(flat: dict[str, Any]) -> dict[str, Any]:
    """`{prefix}stacked_layers/attention_type_{j}/X` [n, ...] -> `{prefix}layer_{period*i+j}/X`, the period
    being the number of attention types (gemma `_compat.unstack_params`). The vision encoder's own
    `stacked_layers/block` (an nn.scan) has no `attention_type_` and is left alone."""
    hits = {name: _STACKED.match(name) for name in flat}
    period = 1 + max((int(m.group(2)) for m in hits.values() if m), default=-1)
    out = {}
    for name, arr in flat.items():
        m = hits[name]
        if not m:
            out[name] = arr
            continue
        head, j, sub = m.group(1), int(m.group(2)), m.group(3)
        for i, piece in enumerate(np.asarray(arr)):
            out[f"{head}layer_{period * i + j}/{sub}"] = piece
    return out


def gemma_names(tree: dict) -> dict[str, Any]:
    """A restored gemma-library tree in any of its layouts -> {gemma name: array}, names as the NESTED
    layout spells them (`layer_3/attn/q_einsum/w`, `vision_encoder/...`), `/w` leaves left as stored."""
    if isinstance(tree, dict) and "params" in tree and ("opt_state" in tree or set(tree) == {"params"}):
        tree = tree["params"]  # a Kauldron training state, or params wrapped once
    flat = _unstack(_flatten(tree))
    out = {}
    for name, arr in flat.items():
        name = name.removeprefix("transformer/")  # FLAT/STACKED keep the text model under `transformer/`
        if name in out:
            raise ValueError(f"gemma checkpoint holds {name!r} twice (with and without the transformer/ prefix)")
        out[name] = arr
    return out


# the released tokenizer's image ids (boi + image x n + eoi), set on a converted model with a vision encoder
RELEASE_IMAGE_IDS = dict(image_token_id=258_880, boi_token_id=255_999, eoi_token_id=258_882)
_VISION_BLOCK = "vision_encoder/transformer/stacked_layers/block/"
# (gemma name under _VISION_BLOCK, our path(s) in `layers_{i}`, how to split one layer's [..] tensor)
VISION_LAYER_TABLE: list[tuple[str, tuple[tuple, ...], Callable]] = [
    ("pre_attention_norm/scale", (("pre_attn_norm", "scale"),), lambda x: (x,)),
    ("post_attention_norm/scale", (("post_attn_norm", "scale"),), lambda x: (x,)),
    ("pre_ffw_norm/scale", (("pre_ffw_norm", "scale"),), lambda x: (x,)),
    ("post_ffw_norm/scale", (("post_ffw_norm", "scale"),), lambda x: (x,)),
    ("attn/query_norm/scale", (("attention", "q_norm", "scale"),), lambda x: (x,)),
    ("attn/key_norm/scale", (("attention", "k_norm", "scale"),), lambda x: (x,)),
    ("attn/q_einsum/w", (("attention", "q"),), lambda x: (np.transpose(x, (1, 0, 2)),)),       # [N,Dv,H]->[Dv,N,H]
    ("attn/kv_einsum/w", (("attention", "k"), ("attention", "v")),
     lambda x: (np.transpose(x[0], (1, 0, 2)), np.transpose(x[1], (1, 0, 2)))),                # [2,K,Dv,H]
    ("attn/attn_vec_einsum/w", (("attention", "o"),), lambda x: (x,)),                         # [N,H,Dv]
    ("mlp/gating_einsum/w", (("mlp", "gate"), ("mlp", "up")), lambda x: (x[0].T, x[1].T)),   # [2,F,Dv]->[Dv,F]
    ("mlp/linear/w", (("mlp", "down"),), lambda x: (x,)),                                      # [F,Dv]
]
_CLIP_NAMES = ("clip_input_min", "clip_input_max", "clip_output_min", "clip_output_max")


def _find(flat: dict, name: str):
    for a in ((name, name.removesuffix("/w")) if name.endswith("/w") else (name, name + "/w")):
        if a in flat:
            return a
    return None


def vision_config_from_gemma(flat: dict[str, Any]) -> VisionConfig | None:
    """The `VisionConfig` of a gemma tree's vision encoder ({gemma name: array}, see `gemma_names`), read from
    its tensor shapes; None when it has none. Not in the tensors: the pooling kernel (3) and RoPE theta (100),
    gemma's fixed values."""
    if _find(flat, "vision_encoder/entry/input_projection/w") is None:
        return None

    def shape(name):
        key = _find(flat, name)
        if key is None:
            raise ValueError(f"gemma checkpoint has a vision encoder but no tensor {name!r}")
        return tuple(np.shape(flat[key]))

    patch_dim, d = shape("vision_encoder/entry/input_projection/w")
    n_pos = shape("vision_encoder/entry/pos_emb")[0]
    n_layers, heads, _, hd = shape(_VISION_BLOCK + "attn/q_einsum/w")
    kv = shape(_VISION_BLOCK + "attn/kv_einsum/w")[2]
    ffw = shape(_VISION_BLOCK + "mlp/linear/w")[1]
    patch = int(round(math.sqrt(patch_dim / 3)))
    if 3 * patch * patch != patch_dim:
        raise ValueError(f"gemma vision input_projection has {patch_dim} inputs, not 3 x patch^2")
    return VisionConfig(hidden_size=d, intermediate_size=ffw, num_layers=n_layers, num_heads=heads, num_kv_heads=kv,
                        head_dim=hd, patch_size=patch, pooling_kernel_size=3, position_embedding_size=n_pos,
                        rope_theta=100.0, standardize=_find(flat, "vision_encoder/standardize/scale") is not None,
                        use_clipped_linears=_find(flat, _VISION_BLOCK + "attn/q_einsum/clip_input_min") is not None)


def _is_multimodal(name: str) -> bool:
    return name.startswith(_MM_PREFIXES)


def split_gemma(tree: dict, cfg: ModelConfig) -> tuple[dict, dict, list[str]]:
    """(our parameter tree, {gemma name: tensor} of the multimodal encoders, [names skipped]).

    Raises a one-line ValueError naming the first missing tensor, a tensor whose shape does not fit its
    transform, or tensors inside the text model we do not know (a layout or model we cannot convert)."""
    flat = gemma_names(tree)
    used: set[str] = set()

    def take(name):
        alts = (name, name.removesuffix("/w")) if name.endswith("/w") else (name, name + "/w")
        for a in alts:
            if a in flat:
                used.add(a)
                return a, np.asarray(flat[a])
        near = sorted(k for k in flat if k.rsplit("/", 1)[0] == name.rsplit("/", 1)[0])[:3]
        raise ValueError(f"gemma checkpoint has no tensor {alts[0]!r} (nor {alts[1]!r})"
                         + (f"; beside it: {near}" if near else "")
                         + f"; not a {cfg.name} checkpoint in a layout dgemma_jax knows ({len(flat)} tensors read)")

    def put(ours: tuple, name: str, fn: Callable = _ID):
        key, x = take(name)
        try:
            y = fn(x)
        except ValueError as e:
            raise ValueError(f"gemma tensor {key!r} has shape {tuple(x.shape)}, which does not fit {cfg.name} ({e})") \
                from None
        _set(params, ours, y)
        return x

    params: dict = {}
    layers = sorted({int(m.group(1)) for k in flat if (m := re.match(r"layer_(\d+)/", k))})
    if layers and layers != list(range(cfg.num_layers)):
        raise ValueError(f"gemma checkpoint has {len(layers)} layers (layer_{layers[0]}..layer_{layers[-1]}), "
                         f"{cfg.name} has {cfg.num_layers}; pick the matching --preset")
    put(("embedding",), "embedder/input_embedding")
    put(("final_norm", "scale"), "final_norm/scale")
    for i in range(cfg.num_layers):
        pre, blk = f"layer_{i}/", f"blocks_{i}"
        for theirs, ours, fn in LAYER_TABLE:
            put((blk,) + ours, pre + theirs, fn)
        if cfg.is_global(i):  # k_eq_v: one [K, D, H] einsum, V = K
            put((blk, "attn", "k"), pre + "attn/k_einsum/w", _T(1, 0, 2))
        else:
            kv = put((blk, "attn", "k"), pre + "attn/kv_einsum/w", lambda x: np.transpose(x[0], (1, 0, 2)))
            _set(params, (blk, "attn", "v"), np.transpose(kv[1], (1, 0, 2)))
        skip = put((blk, "encoder_scalar"), pre + "skip_scale", lambda x: x.reshape(1))
        _set(params, (blk, "decoder_scalar"), skip.reshape(1).copy())
    for theirs, ours, fn in SC_TABLE:
        put(ours, theirs, fn)
    if cfg.vision is not None:
        _split_vision(cfg, take, put, params)
    rest = sorted(set(flat) - used)
    mm = {k: flat[k] for k in rest if _is_multimodal(k)}
    rest = [k for k in rest if k not in mm]
    unknown = [k for k in rest if k.startswith(_TEXT_PREFIXES)]
    if unknown:
        more = f" (and {len(unknown) - 6} more)" if len(unknown) > 6 else ""
        raise ValueError(f"gemma checkpoint has tensors dgemma_jax does not know inside the text model: "
                         f"{unknown[:6]}{more}; its layout or model differs from {cfg.name}")
    return params, mm, rest


def _split_vision(cfg: ModelConfig, take: Callable, put: Callable, params: dict):
    """The vision encoder and `embedder/mm_input_projection` into `vision_tower` / `embed_vision` (checked
    against cfg.vision's shapes by the caller's `_check_shapes`)."""
    v = cfg.vision
    put(("vision_tower", "input_proj"), "vision_encoder/entry/input_projection/w")
    put(("vision_tower", "position_table"), "vision_encoder/entry/pos_emb", _T(1, 0, 2))  # [P, 2, Dv] -> [2, P, Dv]
    put(("embed_vision", "projection"), "embedder/mm_input_projection/w")
    if v.standardize:
        put(("vision_tower", "std_scale"), "vision_encoder/standardize/scale")
        put(("vision_tower", "std_bias"), "vision_encoder/standardize/bias")
    for theirs, ours, split in VISION_LAYER_TABLE:
        key, x = take(_VISION_BLOCK + theirs)
        if x.shape[0] != v.num_layers:
            raise ValueError(f"gemma tensor {key!r} has shape {tuple(x.shape)}: expected {v.num_layers} stacked layers")
        clips = None
        if v.use_clipped_linears and theirs.endswith("/w"):  # every vision einsum is a ClippedEinsum
            base = _VISION_BLOCK + theirs.removesuffix("/w") + "/"
            clips = np.stack([take(base + c)[1] for c in _CLIP_NAMES], axis=-1)  # [L, 4]
        for i in range(v.num_layers):
            try:
                parts = split(x[i])
            except (ValueError, IndexError) as e:
                raise ValueError(f"gemma tensor {key!r} has shape {tuple(x.shape)}, which does not fit the vision "
                                 f"encoder ({e})") from None
            for path, part in zip(ours, parts):
                _set(params, ("vision_tower", f"layers_{i}") + path, part)
                if clips is not None:
                    _set(params, ("vision_tower", f"layers_{i}") + path[:-1] + (path[-1] + "_clip",), clips[i])


def gemma_to_params(tree: dict, cfg: ModelConfig) -> dict:
    """A restored gemma-library tree (any layout) -> our parameter tree (numpy); multimodal and other
    tensors outside the text model are left out (see `split_gemma`)."""
    return split_gemma(tree, cfg)[0]


def params_to_gemma(params: dict, cfg: ModelConfig) -> dict:
    """Our tree -> the gemma-library NESTED layout as it is stored (`/w` leaves on `mlp2` and the
    self-conditioner's `ffw`); the inverse of `gemma_to_params` (for export and round-trip tests)."""
    inv: dict = {}

    def put(name, x):
        _set(inv, tuple(name.split("/")), np.asarray(x))

    def get(tree, path):
        for p in path:
            tree = tree[p]
        return np.asarray(tree)

    inverse = {"attn/q_einsum/w": _T(1, 0, 2), "mlp2/gating_einsum/w": _T(1, 2, 0),
               "mlp/gating_einsum/w": lambda x: np.transpose(x.reshape(x.shape[0], x.shape[1], 2, -1), (0, 2, 3, 1))}
    put("embedder/input_embedding", params["embedding"])
    put("final_norm/scale", params["final_norm"]["scale"])
    for i in range(cfg.num_layers):
        blk, pre = params[f"blocks_{i}"], f"layer_{i}/"
        for theirs, ours, _ in LAYER_TABLE:
            put(pre + theirs, inverse.get(theirs, _ID)(get(blk, ours)))
        k = np.transpose(get(blk, ("attn", "k")), (1, 0, 2))
        if cfg.is_global(i):
            put(pre + "attn/k_einsum/w", k)
        else:
            put(pre + "attn/kv_einsum/w", np.stack([k, np.transpose(get(blk, ("attn", "v")), (1, 0, 2))]))
        put(pre + "skip_scale", blk["decoder_scalar"])
    put("self_conditioner/pre_norm/scale", params["sc_norm"]["scale"])
    put("self_conditioner/ffw/gating_einsum/w", np.transpose(get(params, ("sc_mlp", "gate_up")), (1, 2, 0)))
    put("self_conditioner/ffw/linear/w", params["sc_mlp"]["down"])
    if cfg.vision is not None:
        v, vt = cfg.vision, params["vision_tower"]
        put("vision_encoder/entry/input_projection/w", vt["input_proj"])
        put("vision_encoder/entry/pos_emb", np.transpose(np.asarray(vt["position_table"]), (1, 0, 2)))
        put("embedder/mm_input_projection/w", params["embed_vision"]["projection"])
        if v.standardize:
            put("vision_encoder/standardize/scale", vt["std_scale"])
            put("vision_encoder/standardize/bias", vt["std_bias"])
        layers = [vt[f"layers_{i}"] for i in range(v.num_layers)]
        join = {"attn/q_einsum/w": lambda q: np.transpose(q[0], (1, 0, 2)),
                "attn/kv_einsum/w": lambda kv: np.stack([np.transpose(a, (1, 0, 2)) for a in kv]),
                "mlp/gating_einsum/w": lambda gu: np.stack([a.T for a in gu])}
        for theirs, ours, _ in VISION_LAYER_TABLE:
            parts = [[get(lay, p) for p in ours] for lay in layers]
            put(_VISION_BLOCK + theirs, np.stack([join.get(theirs, lambda a: a[0])(ps) for ps in parts]))
            if v.use_clipped_linears and theirs.endswith("/w"):  # every vision einsum is a ClippedEinsum
                clip = np.stack([get(lay, ours[0][:-1] + (ours[0][-1] + "_clip",)) for lay in layers])  # [L, 4]
                for j, c in enumerate(_CLIP_NAMES):
                    put(_VISION_BLOCK + theirs.removesuffix("/w") + "/" + c, clip[:, j])
    return inv


def restore_gemma(src: str) -> dict:
    """Restore a gemma-library orbax checkpoint as host numpy arrays, with a target built from the
    checkpoint's own metadata: that ignores the devices and sharding it was saved with, so a checkpoint
    written by a multi-device (sharded) job restores on any machine."""
    import orbax.checkpoint as ocp  # deferred: orbax takes ~0.2 s to import; only gemma-layout checkpoints need it

    def tree_metadata(ckptr, path):
        try:
            meta = ckptr.metadata(path)
        except (FileNotFoundError, ValueError, KeyError, OSError):
            return None
        item = getattr(meta, "item_metadata", meta)
        return getattr(item, "tree", item) if item is not None else None

    path = os.path.abspath(src)
    with ocp.PyTreeCheckpointer() as ckptr:
        tree = tree_metadata(ckptr, path)
        if not isinstance(tree, dict) and os.path.isdir(os.path.join(path, "default")):
            path = os.path.join(path, "default")  # a checkpoint-manager step: the item sits in default/
            tree = tree_metadata(ckptr, path)
        if not isinstance(tree, dict):
            raise ValueError(f"{src!r} has no readable orbax tree metadata (_METADATA); it is not a complete "
                             "gemma-library orbax checkpoint")
        restore_args = jax.tree.map(
            lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=getattr(m, "dtype", None)), tree)
        args = ocp.args.PyTreeRestore(restore_args=restore_args)
        try:
            return ckptr.restore(path, args=args)
        except ValueError as e:
            if "incomplete" not in str(e).lower():
                raise
        # a copy without orbax's finalisation marker (as public bucket copies can be): restore with the
        # handler, which does not look for it
        return ocp.PyTreeCheckpointHandler().restore(epath.Path(path), args=args)


def _save_multimodal(dst: str, mm: dict) -> str:
    import orbax.checkpoint as ocp  # deferred: orbax takes ~0.2 s to import; only gemma-layout checkpoints need it

    tree: dict = {}
    for name, x in mm.items():
        _set(tree, tuple(name.split("/")), np.asarray(x))
    out = os.path.join(os.path.abspath(dst), MULTIMODAL_DIR)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(out, tree, force=True)
    return out


def _check_shapes(params, cfg: ModelConfig):
    want = param_shapes(cfg)
    got_paths = jax.tree_util.tree_flatten_with_path(params)[0]
    want_flat = {jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(want)[0]}
    got_flat = {jax.tree_util.keystr(p): np.shape(x) for p, x in got_paths}
    missing = sorted(set(want_flat) - set(got_flat))
    extra = sorted(set(got_flat) - set(want_flat))
    bad = [f"{k}: {got_flat[k]} vs {want_flat[k]}" for k in sorted(set(want_flat) & set(got_flat))
           if tuple(got_flat[k]) != tuple(want_flat[k])]
    if missing or extra or bad:
        raise ValueError(f"converted parameters do not match {cfg.name}: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}, mis-shaped {bad[:4]}")


def convert(src: str, dst: str, src_format: str, *, dtype: str | None = None, preset: str | None = None,
            progress: bool = True, overwrite: bool = False, quantize: str | None = None) -> int:
    """Convert `src` into a dgemma_jax checkpoint directory `dst`; returns the number of parameter tensors
    (as the progress bar counts them: an MLP's gate and up halves are one, its quantized kernel and scale too).

    An existing non-empty `dst` is an error unless `overwrite` (`dgemma convert --force`). A source
    without a tokenizer file converts with a DgemmaWarning: the checkpoint then needs one copied in.
    `src` may also be a gs:// (fsspec) URL or a Hub repo id[@revision] (`dgemma_jax.io.locations`).
    quantize: "int8" / "int4" writes weight-only quantized kernels (`dgemma_jax.model.quant`), which
    `load_model` reads back as they are. A Hugging Face source is quantized one tensor at a time as it is
    read (`load_hf(quantize=)`): its float model is never whole in memory. A dgemma_jax or gemma source is
    restored whole, then quantized."""
    if quantize is not None and quantize not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quantize!r}; choose one of {', '.join(QUANT_MODES)}")
    src = resolve(src, check=False)
    if os.path.exists(dst) and os.path.realpath(dst) == os.path.realpath(src):
        raise ValueError(f"the destination {dst!r} is the source directory; convert into a new directory")
    if os.path.exists(dst) and not overwrite and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ValueError(f"the destination {dst!r} already exists and is not empty; choose a new directory, or "
                         "replace it with dgemma convert --force (overwrite=True)")
    if os.path.isfile(dst):
        raise ValueError(f"the destination {dst!r} is a file; convert into a directory")
    parent = os.path.dirname(os.path.abspath(dst))
    if "://" not in dst and not os.path.isdir(parent):
        raise ValueError(f"the destination's parent directory {parent!r} does not exist (a typo?); "
                         "create it first (mkdir -p) or convert into an existing directory")
    wrap = tensor_bar("tensors" + (f" into {quantize}" if quantize else "")) if progress else None
    sampler = None
    multimodal, skipped = {}, []
    source = read_checkpoint(src) if src_format in ("hf", "dgemma") else None  # its metadata read once
    if source is not None and source.format != src_format:
        raise ValueError(f"{src!r} is a {source.format!r} checkpoint, not {src_format!r}; convert it with "
                         f"--from {source.format} (or without --from)")
    if src_format == "dgemma" and quantize is not None and source.quantized is not None:
        raise ValueError(f"{src!r} is already quantized ({source.quantized}); convert it without --quantize")
    if src_format == "hf":
        cfg, params = load_hf(source, dtype=dtype, progress=wrap, quantize=quantize)
        sampler = source.sampler
    elif src_format == "dgemma":
        cfg, params, sampler = load_model(source, dtype=dtype, quantize=quantize)
        params = jax.device_get(params)
    elif src_format == "gemma":
        cfg = ModelConfig.preset(preset or "diffusiongemma-26b-a4b")
        if dtype:
            cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
        tree = restore_gemma(src)
        vision = vision_config_from_gemma(gemma_names(tree))
        if vision is not None:  # the vision encoder converts too (its image ids: the released tokenizer's)
            cfg = cfg.replace(vision=vision, **RELEASE_IMAGE_IDS)
        params, multimodal, skipped = split_gemma(tree, cfg)
        params = jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
    else:
        raise ValueError(f"unknown source format {src_format!r}; use 'hf', 'gemma' or 'dgemma'")

    if quantization_of(params) is None:  # quantized kernels were checked by their loader
        _check_shapes(params, cfg)
    if quantize is not None and src_format == "gemma":
        params = quantize_params(cfg, params, quantize)
    tok = None
    if src_format in ("hf", "dgemma"):
        for name in TOKENIZER_FILES:
            p = os.path.join(src, name)
            if os.path.isfile(p):
                os.makedirs(dst, exist_ok=True)
                shutil.copyfile(p, os.path.join(dst, name))
                if name in ("tokenizer.json", "tokenizer.model") and tok is None:
                    tok = p
    count = len(jax.tree.leaves(param_shapes(cfg)))
    save_model(dst, cfg, params, sampler=sampler, tokenizer_file=tok)
    if overwrite and os.path.isdir(os.path.join(dst, MULTIMODAL_DIR)):
        shutil.rmtree(os.path.join(dst, MULTIMODAL_DIR))  # from an earlier conversion into this directory
    if multimodal:
        kept = _save_multimodal(dst, multimodal)
        encoders = sorted({k.split("/", 1)[0] if not k.startswith("embedder/") else "embedder/" + k.split("/")[1]
                           for k in multimodal})
        warnings.warn(f"{src!r} carries multimodal weights dgemma_jax does not convert ({len(multimodal)} tensors: "
                      f"{', '.join(encoders)}); they are kept, unchanged and under their gemma names, in {kept!r}",
                      DgemmaWarning, stacklevel=2)
    if skipped:
        more = f" (and {len(skipped) - 6} more)" if len(skipped) > 6 else ""
        warnings.warn(f"{src!r} holds {len(skipped)} tensor(s) outside the model that were not converted: "
                      f"{skipped[:6]}{more}", DgemmaWarning, stacklevel=2)
    if tok is None:
        warnings.warn(f"no tokenizer came along: {src!r} has no tokenizer.json or tokenizer.model, so the checkpoint "
                      f"at {dst!r} has none; copy the model's tokenizer file into {dst!r} before generating",
                      DgemmaWarning, stacklevel=2)
    return count
