"""Hugging Face DiffusionGemma checkpoints <-> our parameter tree, with safetensors and numpy (no torch).

This file is the only place that knows the Hugging Face tensor names. Each entry of the name table
maps one of our leaves to one HF tensor and a layout change, written as "reshape the HF tensor,
then transpose" so that it can be inverted for saving.

Tensors are read one at a time, as byte ranges of the safetensors files (local, or straight from an
fsspec store such as gs://): a 26B checkpoint is never held whole in host memory, and when shardings
are given each process reads only the slices of its own devices' shards and places them there.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import struct
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from dgemma_jax.config import ModelConfig, preset_name_of
from dgemma_jax.errors import read_json
from dgemma_jax.io.finite import check_finite
from dgemma_jax.io.formats import CheckpointSource
from dgemma_jax.io.locations import kind, locate, open_fs, remote_error
from dgemma_jax.model.quant import quantize_leaf
from dgemma_jax.sampling.config import SamplerConfig

DECODER = "model.decoder."
ENCODER_LAYERS = "model.encoder.language_model.layers."
VISION_TOWER = "model.encoder.vision_tower."
EMBED_VISION = "model.encoder.embed_vision."
VISION_PREFIXES = (VISION_TOWER, EMBED_VISION)
IGNORED_PREFIXES = VISION_PREFIXES + ("lm_head.",)  # what a text-only load leaves unread
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")  # ours: <kernel>_clip [4] in this order


@dataclasses.dataclass(frozen=True)
class Entry:
    """ours = hf.reshape(hf_view).transpose(perm).reshape(shape); shapes are ours and HF's. `part` reads a
    slice of ours from the HF tensor, `to_hf` writes ours back."""

    ours: tuple[str, ...]
    hf: str
    shape: tuple[int, ...]
    hf_shape: tuple[int, ...]
    hf_view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None

    def part(self, box: tuple[tuple[int, int], ...]) -> tuple[tuple[tuple[int, int], ...], Callable]:
        """The slice `box` ([start, stop) per axis of ours) -> (the box of the HF tensor to read, the function
        from that HF box to the slice). The HF box covers the slice: a slice that is not one box on disk
        (gate and up halves of an expert's merged axis, a split inner axis of an HF axis) is read as the
        smallest box that holds it, then cut; slices along the axes that shardings split (heads, experts,
        hidden units, vocabulary rows) are exact."""
        view = self.hf_view if self.hf_view is not None else self.hf_shape
        perm = self.perm if self.perm is not None else tuple(range(len(view)))
        moved = tuple(view[p] for p in perm)  # after the transpose, before the final reshape
        moved_box = [(0, n) for n in moved]
        cuts, merged = [], []
        for g, (a, b) in zip(_merges(moved, self.shape), box):
            sub, first = _cover([moved[i] for i in g], a, b)
            for i, r in zip(g, sub):
                moved_box[i] = r
            cuts.append(slice(a - first, b - first))
            merged.append(math.prod(hi - lo for lo, hi in sub))
        view_box = [None] * len(view)
        for i, p in enumerate(perm):
            view_box[p] = moved_box[i]
        hf_box, read_view, inner = [], [], []
        for g in _merges(view, self.hf_shape):  # an HF axis split into view axes: whole inner view axes read
            lo, hi = view_box[g[0]]
            rest = math.prod(view[i] for i in g[1:])
            hf_box.append((lo * rest, hi * rest))
            read_view += [hi - lo] + [view[i] for i in g[1:]]
            inner += [slice(0, hi - lo)] + [slice(*view_box[i]) for i in g[1:]]

        def finish(x: np.ndarray) -> np.ndarray:
            x = x.reshape(read_view)[tuple(inner)].transpose(perm)
            return x.reshape(merged)[tuple(cuts)]

        return tuple(hf_box), finish

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        if self.perm is not None:
            view = self.hf_view if self.hf_view is not None else self.hf_shape
            x = x.reshape(tuple(view[p] for p in self.perm)).transpose(np.argsort(self.perm))
        return np.array(x.reshape(self.hf_shape), order="C")  # (ascontiguousarray would make a scalar 1-D)


def _merges(fine: tuple[int, ...], coarse: tuple[int, ...]) -> list[list[int]]:
    """For a reshape that merges consecutive axes, fine -> coarse: the fine axes of each coarse axis."""
    out, i = [], 0
    for size in coarse:
        group, n = [i], fine[i]
        i += 1
        while n < size:
            group.append(i)
            n *= fine[i]
            i += 1
        if n != size:
            raise ValueError(f"{fine} does not merge into {coarse}")
        out.append(group)
    if any(n != 1 for n in fine[i:]):
        raise ValueError(f"{fine} does not merge into {coarse}")
    if out:
        out[-1] += list(range(i, len(fine)))  # trailing size-1 axes
    return out


def _cover(dims: list[int], a: int, b: int) -> tuple[list[tuple[int, int]], int]:
    """The smallest box of axes `dims` whose C-order flattening is a contiguous range holding [a, b) of the
    flattened axes -> (the box, the flat index of its first element)."""
    rest = math.prod(dims[1:])
    lo, hi = a // rest, (b - 1) // rest + 1
    if len(dims) == 1:
        return [(a, b)], a
    if hi - lo > 1:
        return [(lo, hi)] + [(0, n) for n in dims[1:]], lo * rest
    sub, first = _cover(dims[1:], a - lo * rest, b - lo * rest)
    return [(lo, hi)] + sub, lo * rest + first


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
# safetensors dtype names -> numpy (bfloat16 and the float8s through ml_dtypes, as jax names them)
_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
MAX_HEADER = 100 * 2 ** 20  # the safetensors format's own bound on a header
READ_CHUNK = 64 * 2 ** 20  # a long range is read as pieces of this size, requested together
READ_BATCH = 8  # pieces in flight at once: the most one read holds beyond its output buffers
# byte ranges closer than this are read as one range (the gap read and dropped): a request to a store
# costs about as much as reading ~1 MiB; on a local disk only touching ranges are merged
REMOTE_GAP = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file, from its header: `start` is its first byte in the file."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int

    @property
    def strides(self) -> tuple[int, ...]:  # in bytes, C order
        out, step = [], self.dtype.itemsize
        for n in reversed(self.shape):
            out.append(step)
            step *= n
        return tuple(reversed(out))


def _protocols(fs) -> tuple[str, ...]:
    p = fs.protocol
    return (p,) if isinstance(p, str) else tuple(p)


class SafetensorsDir:
    """The tensors of a directory of *.safetensors files (sharded index or not), local or at an fsspec
    URL (gs://, memory://, ...). Each file's header (8-byte length + JSON) is parsed here; tensors are
    read as byte ranges of the files (`read`: only the rows and slices asked for), never whole files.

    max_gap: ranges closer than this many bytes are read as one (default: 0 locally, REMOTE_GAP for a URL)."""

    def __init__(self, path: str, max_gap: int | None = None):
        self.path = path
        self.fs, self.root = (None, path) if kind(path) == "local" else open_fs(path)
        self.root = self.root.rstrip("/") or "/"
        self.max_gap = max_gap if max_gap is not None else (0 if self.fs is None else REMOTE_GAP)
        try:
            self._read_headers()
        except (ValueError, FileNotFoundError):
            raise
        except Exception as e:  # noqa: BLE001 - a store's auth or network failure
            if self.fs is None:
                raise
            raise remote_error(path, e) from None

    def _read_headers(self):
        path = self.path
        index = self._join("model.safetensors.index.json")
        if self._isfile(index):
            weight_map = self._read_json(index)["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(fn for fn in self._listdir() if fn.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
            weight_map = None
        self.tensors: dict[str, Tensor] = {}
        for fn in files:
            full = self._join(fn)
            if not self._isfile(full):
                raise FileNotFoundError(f"the index names {fn!r} but {self._show(full)!r} does not exist")
            for name, t in self._header(fn).items():
                self.tensors[name] = t
        if weight_map is not None:
            missing = sorted(set(weight_map) - set(self.tensors))
            if missing:
                raise ValueError(f"the safetensors index lists tensors that no file holds: {missing[:5]}")

    # the file system: a local directory through os, a URL through its fsspec filesystem
    def _join(self, fn: str) -> str:
        return os.path.join(self.root, fn) if self.fs is None else f"{self.root}/{fn}"

    def _show(self, full: str) -> str:
        return full if self.fs is None else f"{self.path.rstrip('/')}/{full.rsplit('/', 1)[-1]}"

    def _isfile(self, full: str) -> bool:
        return os.path.isfile(full) if self.fs is None else self.fs.isfile(full)

    def _listdir(self) -> list[str]:
        if self.fs is None:
            return os.listdir(self.root)
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]

    def _size(self, full: str) -> int:
        return os.path.getsize(full) if self.fs is None else int(self.fs.size(full))

    def _read_json(self, full: str) -> dict:
        if self.fs is None:
            return read_json(full, require=("weight_map",))
        try:
            data = json.loads(self.fs.cat_file(full))
        except ValueError as e:
            raise ValueError(f"{self._show(full)!r} cannot be read as JSON ({e})") from None
        if not isinstance(data, dict) or "weight_map" not in data:
            raise ValueError(f"{self._show(full)!r} lacks the required key 'weight_map'")
        return data

    def _fetch(self, full: str, ranges: list[tuple[int, int]]) -> list[bytearray]:
        """The bytes of each [start, end) range of one file: long ranges in READ_CHUNK pieces, READ_BATCH
        pieces requested together (concurrently on an async store such as gcsfs), each written into its
        range's buffer."""
        out = [bytearray(b - a) for a, b in ranges]
        pieces = [(i, s, min(s + READ_CHUNK, b)) for i, (a, b) in enumerate(ranges) for s in range(a, b, READ_CHUNK)]
        if self.fs is None:
            with open(full, "rb") as f:
                for i, s, e in pieces:
                    f.seek(s)
                    view = memoryview(out[i])[s - ranges[i][0]:e - ranges[i][0]]
                    if f.readinto(view) != e - s:
                        raise EOFError(f"{full!r} ends before byte {e}")
            return out
        for k in range(0, len(pieces), READ_BATCH):
            batch = pieces[k:k + READ_BATCH]
            try:
                got = self._cat_ranges(full, batch)
            except Exception as e:  # noqa: BLE001 - auth, network: each store's own exception types
                raise remote_error(self.path, e) from None
            for (i, s, e), data in zip(batch, got):
                if isinstance(data, Exception):
                    raise remote_error(self.path, data)
                if len(data) != e - s:
                    raise EOFError(f"{self._show(full)!r} ends before byte {e}")
                out[i][s - ranges[i][0]:e - ranges[i][0]] = data
        return out

    def _cat_ranges(self, full: str, batch: list[tuple[int, int, int]]) -> list:
        """The bytes of each (_, start, end) of one file, requested together. An async store (gcsfs, s3fs)
        does that itself; the Hub's `hf://` filesystem reads one range at a time through a read-ahead
        buffer (megabytes more than asked), so its ranges go out as exact HTTP range requests from
        threads."""
        starts, ends = [s for _, s, _ in batch], [e for *_, e in batch]
        if "hf" not in _protocols(self.fs):
            return self.fs.cat_ranges([full] * len(batch), starts, ends)
        from concurrent.futures import ThreadPoolExecutor  # deferred: only Hub reads use threads

        with ThreadPoolExecutor(len(batch)) as pool:
            return list(pool.map(lambda se: self.fs.cat_file(full, se[0], se[1], cache_type="none"),
                                 zip(starts, ends)))

    def _header(self, fn: str) -> dict[str, Tensor]:
        full = self._join(fn)
        try:
            size = self._size(full)
            if size < 8:
                raise ValueError(f"{size} bytes, shorter than the header length")
            (n,) = struct.unpack("<Q", bytes(self._fetch(full, [(0, 8)])[0]))
            if n > min(MAX_HEADER, size - 8):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(bytes(self._fetch(full, [(8, 8 + n)])[0]))
            out = {}
            for name, d in header.items():
                if name == "__metadata__":
                    continue
                dtype = np.dtype(jnp.dtype(_DTYPES[d["dtype"]]))
                shape = tuple(int(x) for x in d["shape"])
                begin, end = (int(x) for x in d["data_offsets"])
                if end - begin != dtype.itemsize * int(np.prod(shape)) or 8 + n + end > size:
                    raise ValueError(f"tensor {name} lies outside the file or has the wrong size")
                out[name] = Tensor(fn, dtype, shape, 8 + n + begin)
            return out
        except (ValueError, KeyError, TypeError, EOFError, struct.error) as e:  # a bad header, a file cut short
            raise ValueError(f"{self._show(full)!r} is not a readable safetensors file ({e}); it is truncated or "
                             "corrupt: re-download it") from None

    def keys(self):
        return self.tensors.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name].dtype

    def get(self, name: str) -> np.ndarray:
        """A whole tensor."""
        return self.read(name, [tuple((0, n) for n in self.shape(name))])[0]

    def read(self, name: str, boxes: list[tuple[tuple[int, int], ...]]) -> list[np.ndarray]:
        """The boxes ([start, stop) per axis) of one tensor, read together: each box is the rows of its
        contiguous runs on disk (a box cut along an inner axis is one run per outer row); runs closer
        than max_gap are merged into one read."""
        t = self.tensors[name]
        strides = t.strides
        runs = []  # per box: (run starts in bytes, run length in bytes)
        for box in boxes:
            k = len(box)  # the box is whole along the axes from k on
            while k > 0 and box[k - 1] == (0, t.shape[k - 1]):
                k -= 1
            inner = (box[k - 1][1] - box[k - 1][0]) * strides[k - 1] if k else t.dtype.itemsize * int(np.prod(t.shape))
            starts = np.array([t.start + (box[k - 1][0] * strides[k - 1] if k else 0)], np.int64)
            for ax in range(k - 1):  # the outer axes: one run per row, in C order
                rows = np.arange(*box[ax], dtype=np.int64) * strides[ax]
                starts = (starts[:, None] + rows[None, :]).reshape(-1)
            runs.append((starts, inner))
        merged: list[list[int]] = []
        for a, length in sorted((int(s), n) for starts, n in runs for s in starts):
            if merged and a - merged[-1][1] <= self.max_gap:
                merged[-1][1] = max(merged[-1][1], a + length)
            else:
                merged.append([a, a + length])
        try:
            data = self._fetch(self._join(t.file), [(a, b) for a, b in merged])
        except EOFError as e:
            raise ValueError(f"{e}: it is truncated; re-download it") from None
        firsts = [a for a, _ in merged]
        out = []
        for box, (starts, inner) in zip(boxes, runs):
            shape = tuple(b - a for a, b in box)
            first = bisect.bisect_right(firsts, int(starts[0])) - 1
            last_end = int(starts[-1]) + inner
            if last_end <= merged[first][1]:  # the whole box lies in one read: a strided view of it, no copy
                out.append(np.ndarray(shape, t.dtype, buffer=data[first], offset=int(starts[0]) - firsts[first],
                                      strides=strides))
                continue
            flat = np.empty(len(starts) * inner, np.uint8)
            for j, s in enumerate(starts):
                r = bisect.bisect_right(firsts, int(s)) - 1
                flat[j * inner:(j + 1) * inner] = np.frombuffer(data[r], np.uint8, inner, int(s) - firsts[r])
            out.append(flat.view(t.dtype).reshape(shape))
        return out


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


def read_hf_source(path: str | os.PathLike, weights: str | None = None, need_weights: bool = True) -> CheckpointSource:
    """A Hugging Face directory's metadata, each file read once: config.json, generation_config.json and the
    safetensors headers (at `weights`, a URL, when they are not in `path`). need_weights=False: a directory
    without readable weights describes its model as config.json states it."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no config.json at {file!r}: pass a Hugging Face model directory")
    files = {"config.json": read_json(file)}
    declared = ModelConfig.from_hf(files["config.json"])
    if declared.vision is not None:  # the image budget of the directory's processor, as transformers' would make it
        declared = declared.replace(vision=declared.vision.with_processor(path))
    gen = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen):
        files["generation_config.json"] = read_json(gen)
    try:
        st = SafetensorsDir(weights or path)
    except (OSError, ValueError):
        if need_weights:
            raise
        st = None
    cfg = declared
    # a vision_config whose tower the files do not hold (save_hf's text-only stub) is no tower
    if cfg.vision is not None and st is not None and not any(k.startswith(VISION_PREFIXES) for k in st.keys()):
        cfg = cfg.replace(vision=None)
    cfg = preset_name_of(cfg)
    return CheckpointSource(path=path, weights=weights, format="hf", config=cfg, declared=declared,
                            sampler=hf_sampler(files.get("generation_config.json"), cfg), files=files, tensors=st)


def hf_sampler(generation_config: dict | None, cfg: ModelConfig) -> SamplerConfig | None:
    """The SamplerConfig of a generation_config.json's content (None: no such file)."""
    if generation_config is None:
        return None
    d = generation_config
    d = dict(d, eos_token_id=[e for e in np.atleast_1d(d.get("eos_token_id", [])).tolist() if e < cfg.vocab_size])
    return SamplerConfig.from_hf_generation_config(d, canvas_length=cfg.canvas_length)


def load_hf(path: str | os.PathLike | CheckpointSource, dtype: str | None = None, *,
            shardings: Any | None = None, config_overrides: dict | None = None,
            progress: Callable[[Iterator], Iterator] | None = None, revision: str | None = None,
            vision: bool | None = None, mirror: bool | None = None, quantize: str | None = None):
    """Read a Hugging Face DiffusionGemma checkpoint (config.json + safetensors).

    Args:
      path: a local directory, a gs:// (or other fsspec) URL, or a Hub repo id[@revision]
        (`dgemma_jax.io.locations.locate`), or the `CheckpointSource` of one (`model_dir.open_checkpoint`:
        its metadata already read). From a URL the config and tokenizer files are copied into
        the local mirror and the weights are read straight from the store, unless `mirror=True` (the
        whole directory copied first, so that later starts read the local copy).
      dtype: parameter dtype ("float32", "bfloat16"; default: float32 for float32 files, else bfloat16).
      shardings: optional pytree of `jax.sharding.Sharding` matching the params: each process reads
        only the bytes of its own shards (each distinct slice once) and puts them straight into the
        devices; without, each tensor is read whole. Never more than one tensor's slices are held on
        the host beyond the parameters themselves.
      config_overrides: `ModelConfig` fields to change after reading config.json.
      progress: wraps the iterator over tensors (a progress bar).
      revision: the Hub revision (branch, tag or commit).
      vision: read the vision tower (`model.encoder.vision_tower.*`, `model.encoder.embed_vision.*`)
        into `vision_tower` / `embed_vision`. None (default): when config.json has a `vision_config`
        and the files hold vision tensors; True: required; False: text only, the tower left unread.
      mirror: see `path`.
      quantize: "int8" or "int4" quantizes each kernel right after it is read
        (`model.quant.quantize_leaf`): the float model is never whole, neither on the host nor on the
        devices; the peak is the quantized parameters plus one float tensor.
    Returns:
      (ModelConfig, params): params a nested dict of arrays in the unrolled layout.
    Raises:
      ValueError naming missing, unexpected or mis-shaped tensors.
    """
    source = path if isinstance(path, CheckpointSource) else read_hf_source(*locate(path, revision, mirror=mirror))
    path, st, cfg = source.path, source.tensors, source.declared
    if vision is None:
        vision = source.config.vision is not None
    if vision and cfg.vision is None:
        raise ValueError(f"checkpoint {st.path!r}: vision=True but its config.json has no vision_config")
    if not vision:
        cfg = cfg.replace(vision=None)
    table = name_table(cfg)
    _check(cfg, st, table)
    if dtype is None:
        dtype = "float32" if st.dtype(table[1].hf) == np.float32 else "bfloat16"
    cfg = preset_name_of(cfg).replace(param_dtype=dtype, dtype=dtype, **(config_overrides or {}))
    np_dtype = jnp.dtype(dtype)

    flat_shardings = {}
    if shardings is not None:
        for kp, s in jax.tree_util.tree_flatten_with_path(shardings)[0]:
            flat_shardings[tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp)] = s

    params: dict = {}
    leaves = _leaves(table)
    for path_, parts, axis in (leaves if progress is None else progress(leaves)):
        leaf = _read_leaf(st, parts, axis, flat_shardings.get(path_), np_dtype)
        if quantize is not None:  # checked while still float: the quantized values cannot say which weight
            name = "/".join(map(str, path_))
            check_finite({name: leaf}, path, lambda name: _stored_name(st, table, name))
            leaf = quantize_leaf(name, leaf, quantize)
        _set(params, path_, leaf)
    if quantize is None:
        check_finite(params, path, lambda name: _stored_name(st, table, name))
    return cfg, params


def _leaves(table: list[Entry]) -> list[tuple[tuple, list[Entry], int | None]]:
    """The table as our parameters: (leaf path, its entries, the axis they stack on or None), one per leaf
    (the gate/up halves of an MLP kernel and the clip bounds of a vision linear: one leaf of several entries)."""
    out, parts = [], {}
    for entry in table:
        group = _grouped(entry.ours)
        if group is None:
            out.append((entry.ours, [entry], None))
            continue
        count, axis = group  # one part of a stacked leaf
        got = parts.setdefault(entry.ours[:-1], {})
        got[entry.ours[-1]] = entry
        if len(got) == count:
            out.append((entry.ours[:-1], [got[j] for j in range(count)], axis))
    return out


def _read_leaf(st: SafetensorsDir, parts: list[Entry], axis: int | None, sharding, dtype):
    """One parameter (one table entry, or the parts stacked on `axis`): whole, or, with a sharding, the
    slices of this process's devices (each distinct slice read once) placed into its shards."""
    one = parts[0].shape
    shape = one if axis is None else one[:axis] + (len(parts),) + one[axis:]

    def box_of(index) -> tuple[tuple[int, int], ...]:
        return tuple(s.indices(n)[:2] for s, n in zip(index, shape))

    boxes = [tuple((0, n) for n in shape)] if sharding is None else \
        sorted({box_of(i) for i in sharding.addressable_devices_indices_map(shape).values()})
    wanted: dict[str, list] = {}  # HF tensor -> [(its box, finish, leaf box, part)]
    for box in boxes:
        for j, (entry, sub) in enumerate([(parts[0], box)] if axis is None else
                                         [(parts[j], box[:axis] + box[axis + 1:]) for j in range(*box[axis])]):
            hf_box, finish = entry.part(sub)
            wanted.setdefault(entry.hf, []).append((hf_box, finish, box, j))
    got: dict = {}
    for name, todo in wanted.items():
        for (_, finish, box, j), x in zip(todo, st.read(name, [t[0] for t in todo])):
            got[box, j] = finish(x).astype(dtype, copy=False)
    pieces = {box: got[box, 0] if axis is None else
              np.stack([got[box, j] for j in range(box[axis][1] - box[axis][0])], axis=axis) for box in boxes}
    del got
    if sharding is None:
        return jnp.asarray(pieces[boxes[0]])
    return jax.make_array_from_callback(shape, sharding, lambda index: pieces[box_of(index)])


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
    """Write params as a Hugging Face DiffusionGemma directory, which transformers and `load_hf` read.

    Args:
      params: float parameters of `cfg` (unrolled layout, as `load_hf` returns them).
      cfg: the model. path: the directory (created when missing).
      canvas_length: the config's canvas length (default `cfg.canvas_length`).
      dtype: the tensors' dtype (default `cfg.param_dtype`).
      generation_config: written as generation_config.json when given.
    Returns:
      None; path holds config.json, model.safetensors (and generation_config.json).
    """
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
