"""Model directories: our orbax format, Hugging Face directories, and telling them apart.

Our format (written atomically by orbax)::

    <dir>/dgemma_model.json   {"format": "dgemma_jax.model", "version": 1, "config": {...},
                               "sampler": {...} | null, "tokenizer": "<file name>" | null,
                               "quantization": {"mode": "int8", "embedding": bool} | absent}
    <dir>/params/             orbax StandardCheckpointer tree of the parameters (a quantized checkpoint:
                              each int8 kernel as {"int8", "scale"}, see `dgemma_jax.model.quant`)
    <dir>/<tokenizer file>    optional

A Hugging Face directory has config.json + *.safetensors (see `dgemma_jax.io.hf`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import shutil
from typing import Any

import jax

from dgemma_jax.config import ModelConfig
from dgemma_jax.errors import read_json
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.io.finite import check_finite
from dgemma_jax.io.formats import FORMAT, META, CheckpointSource, detect_format  # noqa: F401 (also this module's API)
from dgemma_jax.io.hf import load_hf, read_hf_source
from dgemma_jax.io.locations import locate, open_fs, orbax_path, remote_error
from dgemma_jax.io.tokenizer import load_tokenizer
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.quant import (embedding_quantized, quantization_of, quantize_params, quantized_shapes,
                                    vision_quantized)
from dgemma_jax.runtime import split_choices
from dgemma_jax.sampling.config import SamplerConfig


def config_to_dict(cfg: ModelConfig) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(cfg).items()}


def config_from_dict(d: dict) -> ModelConfig:
    """The ModelConfig stored in checkpoint metadata. Execution choices that older versions stored in
    it (MoE dispatch, remat, ...) are dropped: they belong to a `Runtime`, not to the checkpoint."""
    d, _ = split_choices(d)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(d) - fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) in checkpoint metadata: {unknown}")
    return ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def read_ours(path: str | os.PathLike, weights: str | None = None, need_weights: bool = True) -> CheckpointSource:
    """Our format's metadata (dgemma_model.json, read once); weights: the URL of the directory holding its
    params/ when orbax restores them from there (`locations.locate`)."""
    path = os.fspath(path)
    meta = read_json(os.path.join(path, META), require=("format", "config"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r}: {META} has format {meta.get('format')!r}, expected {FORMAT!r}")
    return CheckpointSource(path=path, weights=weights, format="dgemma", config=config_from_dict(meta["config"]),
                            quantization=meta.get("quantization") or None,
                            sampler=SamplerConfig(**meta["sampler"]) if meta.get("sampler") else None,
                            tokenizer=meta.get("tokenizer"), files={META: meta})


def read_checkpoint(path: str | os.PathLike, weights: str | None = None, need_weights: bool = True) -> CheckpointSource:
    """The `CheckpointSource` of a local checkpoint directory: its format detected and its metadata read, once.
    weights: the URL its weights are read from when they are not in `path` (`locations.locate`);
    need_weights=False: a Hugging Face config.json alone will do (describing a model, not loading it)."""
    fmt = detect_format(path, need_weights and weights is None)
    return FORMATS[fmt][0](path, weights, need_weights)


def open_checkpoint(location: str | os.PathLike, revision: str | None = None, *, mirror: bool | None = None,
                    progress: bool = True) -> CheckpointSource:
    """The `CheckpointSource` of a checkpoint anywhere (a local directory, an fsspec URL, a Hub repo
    id[@revision]): its location resolved (`locations.locate`), then `read_checkpoint`."""
    return read_checkpoint(*locate(location, revision, mirror=mirror, progress=progress))


def save_params(path: str | os.PathLike, params: Any) -> None:
    """A parameter tree alone, as an orbax checkpoint (atomic: orbax writes then renames)."""
    import orbax.checkpoint as ocp  # deferred: orbax takes ~0.2 s to import; only saving and loading need it

    with ocp.StandardCheckpointer() as ckptr:  # multi-host: every process calls this with the same global arrays
        ckptr.save(orbax_path(path), params, force=True)


def load_params(path: str | os.PathLike, abstract_params: Any = None) -> Any:
    """Restore `save_params` output; `abstract_params` fixes shapes, dtypes and shardings."""
    import orbax.checkpoint as ocp  # deferred: orbax takes ~0.2 s to import; only saving and loading need it

    path = orbax_path(path)
    with ocp.StandardCheckpointer() as ckptr:
        if abstract_params is None:
            return _upgrade(ckptr.restore(path))
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_params)
        stored = getattr(ckptr.metadata(path), "item_metadata", None)
        old = _old_gate_up_paths(stored) if stored is not None else []
        if stored is not None:
            _check_stored_shapes(path, stored, target, old)
        if not old:
            return ckptr.restore(path, target)
        # a checkpoint from before the expert gate/up merge: restore those leaves in their stored
        # [E, D, 2, F] shape, then merge them and place them as the target asks
        for blk in old:
            leaf = target[blk]["moe"]["gate_up"]
            target[blk]["moe"]["gate_up"] = jax.ShapeDtypeStruct(
                tuple(stored[blk]["moe"]["gate_up"].shape), leaf.dtype)
        out = ckptr.restore(path, target)
        for blk in old:
            want = abstract_params[blk]["moe"]["gate_up"]
            merged = jax.numpy.reshape(out[blk]["moe"]["gate_up"], want.shape)
            sharding = getattr(want, "sharding", None)
            out[blk]["moe"]["gate_up"] = jax.device_put(merged, sharding) if sharding is not None else merged
        return out


class ParamsMismatch(ValueError):
    """Stored parameters whose names or shapes differ from what the config asks for."""


def _check_stored_shapes(path: str, stored, target, old_gate_up=()) -> None:
    """Compare the stored parameter shapes with the ones the config asks for, before orbax restores
    anything: orbax would return the stored shapes as they are and the model would fail later with
    a flax shape error far from the cause. A mismatch names the first differing tensor, its expected
    and its stored shape (and how many more differ); a missing or unexpected tensor is named too."""
    def flat(tree):
        return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in kp): leaf
                for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    try:
        have = {k: tuple(v.shape) for k, v in flat(stored).items()}
    except (AttributeError, TypeError):  # metadata without shapes: leave the check to orbax
        return
    want = {k: tuple(v.shape) for k, v in flat(target).items()}
    skip = {f"{blk}/moe/gate_up" for blk in old_gate_up}  # the pre-merge layout, reshaped after restore
    wrong = [k for k in want if k in have and k not in skip and have[k] != want[k]]
    missing = [k for k in want if k not in have]
    extra = [k for k in have if k not in want]
    problems = [f"tensor {k}: the config expects shape {want[k]}, the checkpoint holds {have[k]}" for k in wrong]
    problems += [f"tensor {k} is missing" for k in missing] + [f"tensor {k} is not part of this model" for k in extra]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ParamsMismatch(f"the parameters at {path!r} do not match the checkpoint's config: {problems[0]}{more}; "
                         "the config was edited or belongs to another model: restore the matching "
                         "dgemma_model.json or convert the checkpoint again")


def _old_gate_up_paths(tree) -> list[str]:
    """Blocks whose expert gate_up is stored in the old [E, D, 2, F] layout."""
    try:
        return [k for k, v in tree.items() if k.startswith("blocks_") and len(v["moe"]["gate_up"].shape) == 4]
    except (AttributeError, KeyError, TypeError):
        return []


def _upgrade(params):
    """Merge an old-layout expert gate_up [E, D, 2, F] into [E, D, 2F] (untargeted restores)."""
    for k in _old_gate_up_paths(params):
        g = params[k]["moe"]["gate_up"]
        params[k]["moe"]["gate_up"] = g.reshape(g.shape[0], g.shape[1], -1)
    return params


def save_model(path: str | os.PathLike, config: ModelConfig, params: Any, sampler=None,
               tokenizer_file: str | None = None) -> None:
    """Write params (orbax) + metadata (+ a copy of the tokenizer file) to `path`. Parameters with int8
    kernels (`model.quant.quantize_params`) are written as they are and the metadata says so."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    save_params(os.path.join(path, "params"), params)
    tok_name = None
    if tokenizer_file:
        tok_name = os.path.basename(tokenizer_file)
        if os.path.abspath(tokenizer_file) != os.path.join(path, tok_name):
            shutil.copyfile(tokenizer_file, os.path.join(path, tok_name))
    meta = {"format": FORMAT, "version": 1, "config": config_to_dict(config),
            "sampler": sampler.settings() if sampler is not None else None, "tokenizer": tok_name,
            "params_files": params_files(os.path.join(path, "params"))}
    mode = quantization_of(params)
    if mode is not None:
        meta["quantization"] = {"mode": mode, "embedding": embedding_quantized(params),
                                "vision": vision_quantized(params)}
    tmp = os.path.join(path, META + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(tmp, os.path.join(path, META))


def params_files(params_dir: str) -> dict[str, int]:
    """{path relative to params_dir: size in bytes} of every file orbax wrote (kept in the metadata)."""
    out = {}
    for root, _, files in os.walk(params_dir):
        for fn in files:
            full = os.path.join(root, fn)
            out[os.path.relpath(full, params_dir)] = os.path.getsize(full)
    return dict(sorted(out.items()))


def _check_params_files(path: str, params_dir: str, recorded: dict) -> None:
    """Compare the parameter files (local, or at a URL) with the sizes recorded at save time: a missing,
    emptied or cut file is named here instead of surfacing as a storage-library error mid-restore."""
    sizes = _file_sizes(params_dir)
    bad = []
    for rel, size in recorded.items():
        now = sizes.get(rel)
        if now is None:
            bad.append(f"params/{rel} is missing")
        elif now != size:
            bad.append(f"params/{rel} is {now} bytes, saved as {size}")
    if bad:
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise ValueError(f"checkpoint {path!r} is damaged: {'; '.join(bad[:3])}{more}; restore it from a copy or "
                         "convert it again")


def _file_sizes(directory: str) -> dict[str, int]:
    """{path relative to `directory`: bytes} of every file under it, a local path or a URL."""
    if "://" not in directory:
        return params_files(directory)
    fs, root = open_fs(directory)
    root = root.rstrip("/")
    try:
        listing = fs.find(root, detail=True)
    except Exception as e:  # noqa: BLE001 - auth, network: each store's own exception types
        raise remote_error(directory, e) from None
    return {posixpath.relpath(p, root): int(info.get("size") or 0) for p, info in listing.items()
            if info.get("type") != "directory"}


def load_model(checkpoint: CheckpointSource | str | os.PathLike, dtype: str | None = None, shardings=None,
               quantize: str | None = None, progress=None):
    """A checkpoint -> (ModelConfig, params, SamplerConfig | None).

    checkpoint: its `CheckpointSource` (`open_checkpoint`: read from where `locate` put it, with shardings
    each process its own shards: a Hugging Face checkpoint's *.safetensors, or the gs:// directory holding
    our format's params/ tree, which orbax restores in place), or a local directory of either format.
    quantize: "int8" / "int4" quantizes a float checkpoint's kernels as they are read (Hugging Face: one
    tensor at a time, `load_hf`; ours: after the restore), placed like the float ones; a checkpoint saved
    quantized is a ValueError then. progress: wraps the Hugging Face loader's tensor iterator (`load_hf`;
    e.g. `progress.tensor_bar()`)."""
    source = checkpoint if isinstance(checkpoint, CheckpointSource) else read_checkpoint(checkpoint)
    return FORMATS[source.format][1](source, dtype, shardings, quantize, progress)


def _load_hf_model(source: CheckpointSource, dtype, shardings, quantize, progress):
    # shardings: a `Shardings`, or a pytree of shardings matching the parameters
    cfg, params = load_hf(source, dtype=dtype, shardings=getattr(shardings, "params", shardings),
                          quantize=quantize, progress=progress)
    if quantize is not None and callable(getattr(shardings, "place_params", None)):
        params = shardings.place_params(params)  # the pairs laid out as `Shardings.for_params` says
    return cfg, params, source.sampler


def _load_ours(source: CheckpointSource, dtype, shardings, quantize, progress):
    path, weights, meta, quant = source.path, source.weights, source.files[META], source.quantization
    if quantize is not None and quant:
        raise ValueError(f"checkpoint {path!r} is already quantized ({source.quantized}); load it without quantize")
    cfg = source.config
    params_dir = posixpath.join(weights.rstrip("/"), "params") if weights else os.path.join(path, "params")
    if isinstance(meta.get("params_files"), dict):
        _check_params_files(weights or path, params_dir, meta["params_files"])
    if dtype:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    if quant:  # int8 kernels: restored as int8 (never through a float copy)
        abstract = quantized_shapes(cfg, quant.get("mode"), embedding=bool(quant.get("embedding")),
                                    vision=bool(quant.get("vision")))  # absent: written before towers were
    else:
        abstract = param_shapes(cfg)
    if shardings is not None:
        if quant and not callable(getattr(shardings, "for_params", None)):
            raise ValueError("a quantized checkpoint is placed by a dgemma_jax.parallel.Shardings (shardings=sh), "
                             "which lays out its int8 kernels and scales")
        tree = shardings.for_params(abstract) if quant else getattr(shardings, "params", shardings)
        abstract = jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), abstract, tree)
    try:
        params = load_params(params_dir, abstract)
    except ParamsMismatch:
        raise
    except (ValueError, KeyError) as e:
        raise ValueError(f"could not restore the parameters of checkpoint {path!r}: they are damaged or do "
                         f"not match its config ({e})") from None
    check_finite(params, path)
    if quantize is not None:
        params = quantize_params(cfg, params, quantize)
        if callable(getattr(shardings, "place_params", None)):
            params = shardings.place_params(params)
    return cfg, params, source.sampler


# format -> (its metadata reader, its weight loader): a new format is one entry (and `detect_format`)
FORMATS = {"dgemma": (read_ours, _load_ours), "hf": (read_hf_source, _load_hf_model)}


def load_model_tokenizer(checkpoint: CheckpointSource | str | os.PathLike):
    """The tokenizer stored with a checkpoint (ours: the file named in the metadata; HF: tokenizer.json/.model),
    its special ids from the metadata files the `CheckpointSource` already read."""
    source = checkpoint if isinstance(checkpoint, CheckpointSource) else read_checkpoint(checkpoint, need_weights=False)
    path = source.path
    if source.format == "dgemma":
        name = source.tokenizer
        if not name:  # converted without one: a tokenizer file copied in since then counts
            name = next((n for n in ("tokenizer.json", "tokenizer.model") if os.path.isfile(os.path.join(path, n))),
                        None)
        if not name:
            raise FileNotFoundError(f"checkpoint {path!r} has no tokenizer: copy the model's tokenizer.json or "
                                    f"tokenizer.model into {path!r}")
        path = os.path.join(path, name)
        if name.endswith(".json"):  # ours (a CharTokenizer vocab) or a Hugging Face tokenizer.json: read once
            with open(path, encoding="utf-8") as f:
                head = f.read(200)
                if '"type": "char"' in head or '"type":"char"' in head:
                    return CharTokenizer.from_json(head + f.read(), path)
    return load_tokenizer(path, known=source.known_json())
