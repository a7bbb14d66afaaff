"""Compile time of the 26B programs with the layers unrolled vs scanned (`Runtime.layers`).

For each TPU topology and layer layout, AOT-compiles (from this CPU machine, needs `jax[tpu]`) the
engine's denoise step and fused generate for the 26B preset exactly as `dgemma compile` does
(`perf.aot.compile_report`: expert=N mesh, latency rules, context 32768, prompt 2048, bfloat16),
and records each program's compile seconds and the compiled program's HBM traffic
(`perf.hbm_traffic`), one (topology, layout) at a time, writing the JSON after each so that a
partial run keeps what it measured. The machine's load average and CPU count are recorded before
and after each compile: compile times on a shared machine depend on them.

    python benchmarks/compile_time.py --out benchmarks/results/compile_time.json
    python benchmarks/compile_time.py --topologies v6e-8 --layers scan,unrolled
    python benchmarks/compile_time.py --topologies v6e-8 --layers unrolled --num-layers 1,2,6,12

--batch, --quantize and --tag measure another entry point's programs under its own key, e.g. the
server's (`--programs slot_tick,prefill_slot --batch 8 --tag serve8`) or the one-chip notebook's
(`--topologies v6e-1 --quantize int8 --context 8192 --programs generate --tag int8`).

--num-layers compiles the preset cut to its first N layers (same widths, experts, cache and mesh;
run key "TOPOLOGY/LAYOUT/NL"): how compile time grows with the layers a program holds, so the
floor of a scanned program (one 6-layer group per call site) can be read off a 6-layer one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dgemma_jax.config import ModelConfig  # noqa: E402
from dgemma_jax.perf.aot import compile_report  # noqa: E402
from dgemma_jax.perf.report import machine_info  # noqa: E402


def _load() -> dict:
    return {"loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="diffusiongemma-26b-a4b")
    ap.add_argument("--topologies", default="v6e-8,v5e-8")
    ap.add_argument("--layers", default="scan,unrolled")
    ap.add_argument("--programs", default="denoise_step,generate")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--num-layers", default=None,
                    help="comma list: compile the preset cut to its first N layers (default: all of them)")
    ap.add_argument("--batch", type=int, default=1, help="rows (the server's programs: slots)")
    ap.add_argument("--quantize", choices=["int8", "int4"], default=None)
    ap.add_argument("--tag", default="",
                    help="suffix of the run keys (TOPOLOGY/LAYOUT/TAG): what the entry point is, e.g. serve8")
    ap.add_argument("--out", default="benchmarks/results/compile_time.json")
    args = ap.parse_args(argv)
    res = {"machine": machine_info(), "preset": args.preset, "context": args.context, "prompt": args.prompt,
           "note": "AOT compile for the TPU topology on this CPU machine (perf.aot.compile_report), one compile "
                   "at a time; hbm_bytes: the compiled program's HBM traffic (perf.hbm_traffic)",
           "runs": {}}
    if os.path.exists(args.out):  # keep what an earlier (partial) run measured, and any other record in the file
        with open(args.out) as f:
            old = json.load(f)
        res["runs"] = old.get("runs", {})
        res.update({k: v for k, v in old.items() if k not in res and k != "scan_vs_unrolled"})
    counts = [None] if not args.num_layers else [int(n) for n in args.num_layers.split(",")]
    for topo, layers, n in ((t, ly, n) for t in args.topologies.split(",") for ly in args.layers.split(",")
                            for n in counts):
        key = f"{topo}/{layers}" + (f"/{n}L" if n else "") + (f"/{args.tag}" if args.tag else "")
        before = _load()
        t0 = time.perf_counter()
        rep = compile_report(_cut(args.preset, n), topo, context=args.context, prompt=args.prompt,
                             programs=tuple(args.programs.split(",")), layers=layers, batch=args.batch,
                             quantize=args.quantize)
        run = {"layers": rep["layers"], "batch": args.batch, "quantize": args.quantize, "context": args.context,
               "prompt": args.prompt, "num_layers": n or ModelConfig.preset(args.preset).num_layers,
               "mesh": rep["mesh"], "wall_seconds": round(time.perf_counter() - t0, 1),
               "load_before": before, "load_after": _load(), "programs": {}}
        for name, p in rep["programs"].items():
            run["programs"][name] = {k: p.get(k) for k in ("compile_seconds", "hbm_bytes", "bytes_accessed",
                                                           "flops", "total_bytes", "fits", "hbm_bytes_by_op",
                                                           "hbm_bytes_by_scope", "projected_seconds")}
        res["runs"][key] = run
        print(key, json.dumps(run["programs"]), file=sys.stderr, flush=True)
        _compare(res)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


def _cut(preset: str, n: int | None):
    """The preset, or its first n layers (same layer types from the start of the stack)."""
    cfg = ModelConfig.preset(preset)
    if not n:
        return preset
    if not 1 <= n <= cfg.num_layers:
        raise SystemExit(f"--num-layers {n}: the preset has {cfg.num_layers} layers")
    return cfg.replace(num_layers=n, layer_types=cfg.layer_types[:n])


def _compare(res: dict) -> None:
    """scan / unrolled ratios per topology where both layouts were measured."""
    cmp = {}
    for key, run in res["runs"].items():
        topo, layers, *rest = key.split("/")
        if rest and rest[0].endswith("L") and rest[0][:-1].isdigit():  # a cut preset (--num-layers)
            continue
        other = res["runs"].get("/".join([topo, "unrolled", *rest]))
        if layers != "scan" or other is None:
            continue
        c = {}
        for name, p in run["programs"].items():
            q = other["programs"].get(name)
            if q and p.get("compile_seconds") and q.get("compile_seconds"):
                c[name] = {"compile_seconds_scan": p["compile_seconds"], "compile_seconds_unrolled": q["compile_seconds"],
                           "hbm_bytes_scan_over_unrolled": p["hbm_bytes"] / q["hbm_bytes"]}
        cmp["/".join([topo, *rest])] = c
    res["scan_vs_unrolled"] = cmp


if __name__ == "__main__":
    sys.exit(main())
