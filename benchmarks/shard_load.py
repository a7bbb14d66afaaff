"""Weights straight into their shards (issue 34, point 4): what each process of a multi-process load
reads from an fsspec store, and its peak memory.

A random model in Hugging Face layout (bfloat16 safetensors split over several files with a
`model.safetensors.index.json`, written with the `safetensors` library by `save_hf`) is loaded by P
CPU processes of D devices each under jax.distributed (gloo), on the mesh `expert=P*D`, from the URL
`countfile://<dir>`: a local directory behind an fsspec filesystem that counts every byte read
through it (`CountingFileSystem`), so the bytes are counted, not assumed. Each process reports:

- bytes_read: counted bytes (tensor ranges, safetensors headers, the index);
- share: the bytes of this process's distinct shard slices in the file dtype, from jax's own
  `addressable_devices_indices_map` of each parameter's sharding (replicated tensors count whole for
  every process: each reads them);
- headers: the safetensors headers (8 + header length per file), read by every process;
- device_bytes: what the load left on this process's devices (host memory on CPU: every device holds
  its own copy of a replicated tensor), in the loaded dtype;
- peak_rss_mb (VmHWM) and rss_before_mb (VmRSS before the load, after what the load does besides
  reading weights: the small files mirrored, the parameter shapes traced for the shardings, the
  tokenizer read), load_s.

    python benchmarks/shard_load.py --out benchmarks/results/shard_load_cpu.json

tests/test_shard_reads.py runs the same processes on a smaller model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# the benchmark's model: hidden 256, 64 experts, vocabulary 32768 (73 MB in bfloat16)
BENCH = dict(vocab_size=32768, hidden_size=256, num_layers=2, num_heads=8, head_dim=32, num_kv_heads=2,
             global_head_dim=64, num_global_kv_heads=1, intermediate_size=512, num_experts=64, top_k=2,
             moe_intermediate_size=256, sliding_window=8, canvas_length=16, eos_ids=(1,))
# the test's: the same shape of model, small
SMALL = dict(BENCH, vocab_size=1024, hidden_size=64, num_heads=8, head_dim=16, intermediate_size=128,
             num_experts=8, moe_intermediate_size=64)  # 0.86 MB


def write_checkpoint(path: str, sizes: dict, files: int = 3, seed: int = 0):
    """A random bfloat16 model in Hugging Face layout, its tensors split over `files` safetensors files
    (HF names: model-0000i-of-0000n.safetensors + model.safetensors.index.json) -> its ModelConfig."""
    import jax
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from dgemma_jax.config import ModelConfig
    from dgemma_jax.io.hf import save_hf
    from dgemma_jax.model.api import param_shapes

    cfg = ModelConfig.preset("tiny-2layer", **sizes, dtype="bfloat16", param_dtype="bfloat16")
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32).astype(jax.numpy.bfloat16),
                          param_shapes(cfg))
    save_hf(params, cfg, path)
    whole = os.path.join(path, "model.safetensors")
    tensors = load_file(whole)
    os.remove(whole)
    names = sorted(tensors)
    weight_map = {}
    for i in range(files):
        fn = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::files]}
        save_file(part, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}, f)
    from tests.helpers.gemma_tokenizer import gemma_like_tokenizer_json  # a byte-level HF tokenizer.json

    gemma_like_tokenizer_json(os.path.join(path, "tokenizer.json"))
    return cfg


def file_bytes(path: str) -> dict:
    """{"weights": bytes of every tensor, "headers": 8 + header length summed over the files}."""
    weights = headers = 0
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            with open(os.path.join(path, fn), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            headers += 8 + n
            weights += os.path.getsize(os.path.join(path, fn)) - 8 - n
    return {"weights": weights, "headers": headers}


# ---------------------------------------------------------------------------- one process
def _counting_filesystem():
    """An fsspec local filesystem under the protocol countfile:// that counts the bytes read through it."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    class CountingFileSystem(LocalFileSystem):
        protocol = ("countfile",)
        count = [0]

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            return super()._strip_protocol(path[len("countfile://"):] if path.startswith("countfile://") else path)

        def _open(self, path, mode="rb", **kw):
            f = super()._open(path, mode, **kw)
            read, count = f.read, self.count

            def counted(*a):
                data = read(*a)
                count[0] += len(data)
                return data

            f.read = counted
            return f

    fsspec.register_implementation("countfile", CountingFileSystem, clobber=True)
    return CountingFileSystem


def _rss_mb(field: str = "VmRSS") -> float:
    """This process's resident memory now (VmRSS) or its peak (VmHWM), from /proc. Not ru_maxrss: Linux
    keeps that across fork + exec, so a child started by a large parent reports the parent's peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def worker(url: str, mesh_spec: str, dtype: str, out: str) -> None:
    """Load `url` on the mesh in this process (one of a jax.distributed run), write its numbers (JSON) and
    its distinct shard slices (npz: "leaf path|box" -> array) under `out`."""
    counting = _counting_filesystem()
    from dgemma_jax.parallel import distributed

    distributed.initialize()
    import jax
    import numpy as np

    from dgemma_jax.errors import DgemmaWarning
    from dgemma_jax.io.model_dir import load_model_tokenizer, open_checkpoint
    from dgemma_jax.parallel.mesh import make_mesh
    from dgemma_jax.parallel.shardings import Shardings
    from dgemma_jax.pipeline import load_checkpoint

    mesh = make_mesh(mesh_spec)
    # what the load does besides reading weights, done first so that the RSS before the load holds it: the
    # config and tokenizer files mirrored, the parameter shapes traced for the shardings, the tokenizer read
    source = open_checkpoint(url)
    Shardings(source.config, mesh)
    load_model_tokenizer(source)
    counting.count[0] = 0
    rss_before = _rss_mb()
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # the byte tokenizer covers fewer ids than the model's vocabulary
        warnings.simplefilter("ignore", DgemmaWarning)
        cfg, params, _, _ = load_checkpoint(url, dtype=dtype, mesh=mesh)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t0
    peak = _rss_mb("VmHWM")
    bytes_read = counting.count[0]

    share = 0
    pieces = {}
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    shardings = dict(jax.tree_util.tree_flatten_with_path(Shardings(cfg, mesh).params)[0])
    for kp, x in flat:
        name = "/".join(str(getattr(k, "key", k)) for k in kp)
        assert x.sharding == shardings[kp], name  # placed as the rules say
        boxes = {}
        for d, index in shardings[kp].addressable_devices_indices_map(x.shape).items():
            boxes[tuple(s.indices(n)[:2] for s, n in zip(index, x.shape))] = d
        share += sum(int(np.prod([b - a for a, b in box])) * 2 for box in boxes)  # bfloat16 files
        by_device = {s.device: s for s in x.addressable_shards}
        for box, d in boxes.items():
            pieces[f"{name}|{json.dumps(box)}"] = np.asarray(by_device[d].data)
    pid = jax.process_index()
    np.savez(os.path.join(out, f"shards{pid}.npz"), **pieces)
    on_devices = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    res = {"process": pid, "processes": jax.process_count(), "devices": jax.local_device_count(),
           "bytes_read": bytes_read, "share": share, "device_bytes": on_devices, "load_s": round(load_s, 3),
           "rss_before_mb": round(rss_before, 1), "peak_rss_mb": round(peak, 1)}
    with open(os.path.join(out, f"process{pid}.json"), "w") as f:
        json.dump(res, f)
    print(f"process {pid}: read {bytes_read} bytes (its shards: {share}), peak RSS {peak:.1f} MB "
          f"({rss_before:.1f} MB before the load), {load_s:.2f} s", flush=True)


# ---------------------------------------------------------------------------- the run
def share_bounds(path: str) -> dict:
    """What a process may read beyond its shards' share and the safetensors headers: "small" (config,
    tokenizer and index, copied locally, the index read once more by the loader) and "covering" (the
    [out, in] matrices split along their inner axis: o_proj, the dense and self-conditioning down_proj,
    whose slice is one run per row, under REMOTE_GAP apart, so one covering range is read instead)."""
    import numpy as np

    from dgemma_jax.io.hf import SafetensorsDir

    small = sum(os.path.getsize(os.path.join(path, f))
                for f in ("config.json", "tokenizer.json", "model.safetensors.index.json"))
    small += os.path.getsize(os.path.join(path, "model.safetensors.index.json"))
    st = SafetensorsDir(path)
    covering = sum(int(np.prod(st.shape(k))) * 2 for k in st.keys()
                   if k.endswith(("o_proj.weight", "mlp.down_proj.weight", "self_conditioning.down_proj.weight")))
    return {"small": small, "covering": covering}


def check_pieces(path: str, out: str, processes: int) -> None:
    """Every slice the processes wrote (`worker`'s shards{i}.npz) equals that slice of a one-process load
    of `path`, and together they cover every parameter (AssertionError otherwise)."""
    import jax
    import numpy as np

    from dgemma_jax.pipeline import load_checkpoint

    want = load_checkpoint(path, dtype="float32")[1]
    flat = {"/".join(str(getattr(k, "key", k)) for k in kp): np.asarray(x)
            for kp, x in jax.tree_util.tree_flatten_with_path(want)[0]}
    covered = {name: np.zeros(x.shape, bool) for name, x in flat.items()}
    for i in range(processes):
        with np.load(os.path.join(out, f"shards{i}.npz")) as pieces:
            for key in pieces.files:
                name, box = key.split("|")
                index = tuple(slice(a, b) for a, b in json.loads(box))
                np.testing.assert_array_equal(pieces[key], flat[name][index], err_msg=key)
                covered[name][index] = True
    missing = [name for name, c in covered.items() if not c.all()]
    assert not missing, f"no process holds all of {missing[:5]}"


def run(path: str, out: str, processes: int = 2, devices: int = 4, dtype: str = "float32",
        timeout: float = 300, url: str | None = None, env_for=None) -> list[dict]:
    """Load the checkpoint at `path` in `processes` processes -> their numbers. url: where they load it
    from (default: countfile://PATH, which counts their bytes); env_for(i): more environment for process i."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.makedirs(out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               DGEMMA_COORDINATOR=f"127.0.0.1:{port}", DGEMMA_NUM_PROCESSES=str(processes))
    env.setdefault("DGEMMA_CACHE", os.path.join(out, "cache"))
    url = url or "countfile://" + os.path.abspath(path)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", url, "--mesh",
                               f"expert={processes * devices}", "--dtype", dtype, "--out", out],
                              env=dict(env, DGEMMA_PROCESS_ID=str(i), **(env_for(i) if env_for else {})),
                              stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for i in range(processes)]
    for p in procs:
        o, e = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"a loading process failed:\n{o[-2000:]}\n{e[-3000:]}")
        print(o.strip())
    return [json.load(open(os.path.join(out, f"process{i}.json"))) for i in range(processes)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mesh", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--out", default=None, help="results JSON (a worker: its output directory)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.mesh, args.dtype, args.out)
        return 0
    import tempfile

    from dgemma_jax.perf.report import machine_info, write

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        write_checkpoint(ckpt, BENCH)
        sizes = file_bytes(ckpt)
        results = run(ckpt, os.path.join(tmp, "out"), args.processes, args.devices, args.dtype)
    res = {"what": "each process of a jax.distributed CPU run loads a bfloat16 Hugging Face checkpoint (3 safetensors "
                   "files) from an fsspec store (countfile://, a counting local filesystem) on the mesh "
                   f"expert={args.processes * args.devices}, as {args.dtype}",
           "command": "python benchmarks/shard_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": BENCH, "checkpoint_bytes": sizes, "processes": results, "machine": machine_info()}
    for r in results:
        r["read_over_share"] = round(r["bytes_read"] / r["share"], 4)
        r["read_over_checkpoint"] = round(r["bytes_read"] / (sizes["weights"] + sizes["headers"]), 4)
        r["load_rss_increase_mb"] = round(r["peak_rss_mb"] - r["rss_before_mb"], 1)
    write(res, args.out)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
