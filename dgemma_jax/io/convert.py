"""Checkpoint conversion into our format: Hugging Face safetensors, and the `gemma` library's orbax layout.

The gemma (google-deepmind/gemma) layout, per layer `layer_{i}` (gemma4_backbone.md §4.2-4.3):
`attn/q_einsum/w [N,D,H]`, `attn/kv_einsum/w [2,K,D,H]` (sliding) or `attn/k_einsum/w [K,D,H]`
(global), `attn/attn_vec_einsum/w [N,H,D]`, `attn/{query,key}_norm/scale`, `mlp2/*` = dense MLP,
`mlp/*` = MoE, `skip_scale`. Released checkpoints may be STACKED:
`transformer/stacked_layers/attention_type_{j}/...` with a leading axis, layer = period * i + j.
The self-conditioning block's names are matched by shape inside any `*self_cond*` subtree.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import numpy as np

from dgemma_jax.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "generation_config.json")

# (gemma path inside a layer, our path inside a block, gemma -> ours)
_T = lambda *perm: (lambda x: np.transpose(x, perm))  # noqa: E731
_ID = lambda x: x  # noqa: E731


def _merge_gate_up(x):
    """Expert gate/up [E, D, 2, F] -> our [E, D, 2F] (gate columns, then up columns)."""
    return x.reshape(x.shape[0], x.shape[1], -1)

LAYER_TABLE: list[tuple[str, tuple, Callable]] = [
    ("pre_attention_norm/scale", ("pre_attn_norm", "scale"), _ID),
    ("post_attention_norm/scale", ("post_attn_norm", "scale"), _ID),
    ("attn/q_einsum/w", ("attn", "q"), _T(1, 0, 2)),
    ("attn/attn_vec_einsum/w", ("attn", "o"), _ID),
    ("attn/query_norm/scale", ("attn", "q_norm", "scale"), _ID),
    ("attn/key_norm/scale", ("attn", "k_norm", "scale"), _ID),
    ("pre_ffw2_norm/scale", ("pre_dense_norm", "scale"), _ID),
    ("mlp2/gating_einsum", ("dense_mlp", "gate_up"), _T(2, 0, 1)),
    ("mlp2/linear", ("dense_mlp", "down"), _ID),
    ("post_ffw2_norm/scale", ("post_dense_norm", "scale"), _ID),
    ("pre_ffw_norm/scale", ("pre_moe_norm", "scale"), _ID),
    ("mlp/gating_einsum/w", ("moe", "gate_up"), lambda x: _merge_gate_up(np.transpose(x, (0, 3, 1, 2)))),
    ("mlp/linear/w", ("moe", "down"), _ID),
    ("mlp/router_logits/w", ("moe", "router"), _ID),
    ("mlp/router_scale", ("moe", "router_scale"), _ID),
    ("mlp/per_expert_scale", ("moe", "expert_scale"), _ID),
    ("post_ffw1_norm/scale", ("post_moe_norm", "scale"), _ID),
    ("post_ffw_norm/scale", ("post_ffw_norm", "scale"), _ID),
]


def detect_source(path: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"source checkpoint {path!r} does not exist or is not a directory")
    files = os.listdir(path)
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return "hf"
    if any(f in files for f in ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "checkpoint")) or \
            any(f.startswith("ocdbt") or f == "d" for f in files):
        return "gemma"
    raise ValueError(f"cannot tell the format of {path!r}: expected a Hugging Face directory (config.json + "
                     "*.safetensors) or a gemma-library orbax checkpoint; pass --from hf|gemma")


def _flatten(tree, prefix="") -> dict[str, Any]:
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


def _unstack(flat: dict[str, Any], period: int) -> dict[str, Any]:
    """transformer/stacked_layers/attention_type_{j}/X [n, ...] -> transformer/layer_{period*i+j}/X."""
    out = {}
    for name, arr in flat.items():
        marker = "stacked_layers/attention_type_"
        if marker not in name:
            out[name] = arr
            continue
        head, rest = name.split(marker, 1)
        j, sub = rest.split("/", 1)
        arr = np.asarray(arr)
        for i in range(arr.shape[0]):
            out[f"{head}layer_{period * i + int(j)}/{sub}"] = arr[i]
    return out


def gemma_to_params(tree: dict, cfg: ModelConfig, period: int = 6) -> dict:
    """A restored gemma-library tree (nested or flat names) -> our parameter tree (numpy)."""
    flat = _unstack({k.removeprefix("params/"): v for k, v in _flatten(tree).items()}, period)
    flat = {k.split("transformer/", 1)[-1] if "transformer/" in k else k: v for k, v in flat.items()}
    used: set[str] = set()

    def take(name):
        if name not in flat:
            raise ValueError(f"gemma checkpoint is missing {name!r} (have e.g. {sorted(flat)[:4]})")
        used.add(name)
        return np.asarray(flat[name])

    params: dict = {}
    _set(params, ("embedding",), take("embedder/input_embedding"))
    _set(params, ("final_norm", "scale"), take("final_norm/scale"))
    for i in range(cfg.num_layers):
        pre, blk = f"layer_{i}/", f"blocks_{i}"
        for theirs, ours, fn in LAYER_TABLE:
            _set(params, (blk,) + ours, fn(take(pre + theirs)))
        if cfg.is_global(i):
            _set(params, (blk, "attn", "k"), np.transpose(take(pre + "attn/k_einsum/w"), (1, 0, 2)))
        else:
            kv = take(pre + "attn/kv_einsum/w")
            _set(params, (blk, "attn", "k"), np.transpose(kv[0], (1, 0, 2)))
            _set(params, (blk, "attn", "v"), np.transpose(kv[1], (1, 0, 2)))
        skip = take(pre + "skip_scale").reshape(1)
        _set(params, (blk, "encoder_scalar"), skip)
        _set(params, (blk, "decoder_scalar"), skip.copy())
    sc = {k: v for k, v in flat.items() if "self_cond" in k}
    d, f = cfg.hidden_size, cfg.intermediate_size
    gate = [k for k, v in sc.items() if np.shape(v) == (2, f, d)]
    down = [k for k, v in sc.items() if np.shape(v) == (f, d)]
    norm = [k for k, v in sc.items() if np.shape(v) == (d,)]
    if len(gate) != 1 or len(down) != 1 or len(norm) != 1:
        raise ValueError(f"cannot identify the self-conditioning block in the gemma checkpoint (found {sorted(sc)})")
    used.update(gate + down + norm)
    _set(params, ("sc_mlp", "gate_up"), np.transpose(np.asarray(sc[gate[0]]), (2, 0, 1)))
    _set(params, ("sc_mlp", "down"), np.asarray(sc[down[0]]))
    _set(params, ("sc_norm", "scale"), np.asarray(sc[norm[0]]))
    unused = sorted(k for k in set(flat) - used if "vision" not in k and "audio" not in k)
    if unused:
        raise ValueError(f"unexpected tensors in the gemma checkpoint: {unused[:6]}")
    return params


def params_to_gemma(params: dict, cfg: ModelConfig) -> dict:
    """Our tree -> the gemma-library nested layout (flat layers); the inverse of `gemma_to_params`."""
    inv = {}

    def put(name, x):
        _set(inv, tuple(("transformer/" + name).split("/")), np.asarray(x))

    put("embedder/input_embedding", params["embedding"])
    put("final_norm/scale", params["final_norm"]["scale"])
    for i in range(cfg.num_layers):
        blk, pre = params[f"blocks_{i}"], f"layer_{i}/"
        for theirs, ours, fn in LAYER_TABLE:
            node = blk
            for p in ours:
                node = node[p]
            x = np.asarray(node)
            # inverse of each transform
            if theirs in ("attn/q_einsum/w",):
                x = np.transpose(x, (1, 0, 2))
            elif theirs == "mlp2/gating_einsum":
                x = np.transpose(x, (1, 2, 0))
            elif theirs == "mlp/gating_einsum/w":
                x = np.transpose(x.reshape(x.shape[0], x.shape[1], 2, -1), (0, 2, 3, 1))
            put(pre + theirs, x)
        k = np.transpose(np.asarray(blk["attn"]["k"]), (1, 0, 2))
        if cfg.is_global(i):
            put(pre + "attn/k_einsum/w", k)
        else:
            put(pre + "attn/kv_einsum/w", np.stack([k, np.transpose(np.asarray(blk["attn"]["v"]), (1, 0, 2))]))
        put(pre + "skip_scale", blk["decoder_scalar"])
    put("self_conditioner/pre_norm/scale", params["sc_norm"]["scale"])
    put("self_conditioner/mlp/gating_einsum", np.transpose(np.asarray(params["sc_mlp"]["gate_up"]), (1, 2, 0)))
    put("self_conditioner/mlp/linear", params["sc_mlp"]["down"])
    return inv


def _check_shapes(params, cfg: ModelConfig):
    import jax

    from dgemma_jax.model.api import param_shapes

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
            progress: bool = True, overwrite: bool = False) -> int:
    """Convert `src` into a dgemma_jax checkpoint directory `dst`; returns the number of tensors.

    An existing non-empty `dst` is an error unless `overwrite` (`dgemma convert --force`). A source
    without a tokenizer file converts with a DgemmaWarning: the checkpoint then needs one copied in.
    `src` may also be a gs:// (fsspec) URL or a Hub repo id[@revision] (`dgemma_jax.io.locations`)."""
    from dgemma_jax.io.locations import resolve

    src = resolve(src, check=False)
    if os.path.exists(dst) and os.path.realpath(dst) == os.path.realpath(src):
        raise ValueError(f"the destination {dst!r} is the source directory; convert into a new directory")
    if os.path.exists(dst) and not overwrite and (not os.path.isdir(dst) or os.listdir(dst)):
        raise ValueError(f"the destination {dst!r} already exists and is not empty; choose a new directory, or "
                         "replace it with dgemma convert --force (overwrite=True)")
    if os.path.isfile(dst):
        raise ValueError(f"the destination {dst!r} is a file; convert into a directory")
    import jax
    import jax.numpy as jnp

    from dgemma_jax.io.model_dir import save_model

    wrap = None
    if progress:
        try:
            from tqdm import tqdm

            wrap = lambda it: tqdm(it, desc="tensors", unit="t")  # noqa: E731
        except ImportError:  # pragma: no cover
            wrap = None
    sampler = None
    if src_format == "hf":
        from dgemma_jax.io.hf import load_hf
        from dgemma_jax.io.model_dir import hf_sampler

        cfg, params = load_hf(src, dtype=dtype, progress=wrap)
        sampler = hf_sampler(src, cfg)
    elif src_format == "gemma":
        import orbax.checkpoint as ocp

        cfg = ModelConfig.preset(preset or "diffusiongemma-26b-a4b")
        if dtype:
            cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
        with ocp.StandardCheckpointer() as ckptr:
            tree = ckptr.restore(os.path.abspath(src))
        params = gemma_to_params(tree, cfg)
        params = jax.tree.map(lambda x: jnp.asarray(x, cfg.param_dtype), params)
    else:
        raise ValueError(f"unknown source format {src_format!r}; use 'hf' or 'gemma'")
    _check_shapes(params, cfg)
    tok = None
    if src_format == "hf":
        for name in TOKENIZER_FILES:
            p = os.path.join(src, name)
            if os.path.isfile(p):
                os.makedirs(dst, exist_ok=True)
                shutil.copyfile(p, os.path.join(dst, name))
                if name in ("tokenizer.json", "tokenizer.model") and tok is None:
                    tok = p
    leaves = jax.tree.leaves(params)
    save_model(dst, cfg, params, sampler=sampler, tokenizer_file=tok)
    if tok is None:
        import warnings

        from dgemma_jax.errors import DgemmaWarning

        warnings.warn(f"no tokenizer came along: {src!r} has no tokenizer.json or tokenizer.model, so the checkpoint "
                      f"at {dst!r} has none; copy the model's tokenizer file into {dst!r} before generating",
                      DgemmaWarning, stacklevel=2)
    return len(leaves)
