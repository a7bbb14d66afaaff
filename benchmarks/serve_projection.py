"""The step-level server's throughput on a TPU slice, projected from its compiled programs.

    python benchmarks/serve_projection.py --topology v6e-8 --mesh data=2,expert=4 --rules serving \
        --out benchmarks/results/serve_projection_v6e-8.json
    (--quantize int8|int4: the weight-only quantized parameters; the rows say which weights ran;
    --param-formats compiler (default): the parameters in the layouts the compiler prefers for the tick,
    as `dgemma serve` places them on a TPU (`serving.runner.SlotRunner`); default: as loaded)

For each slot count N it compiles the 26B's `slot_tick` for the topology, with the TPU compiler
(`dgemma_jax.perf.aot.compile_report`, no TPU needed). The program holds a tick that commits (its first,
under `slots.COMMIT_SCOPE`: K = G x max(1, N / G // 8) settled canvases written, G slot groups, in the
same pass over the layers as every slot's step) and the plain tick of its loop, and writes one row
per (N, steps per canvas S):

- step_ms: the plain tick's projected time without its collectives (max of HBM traffic / bandwidth
  and FLOPs / peak, from the compiled HLO); floor_ms: its roofline floor (the bytes and FLOPs a step
  must move and do, perf/roofline.py); ici_ms: its collectives under the project's ICI model (ring
  algorithms over one port's bandwidth, a fixed latency per ring hop; perf/collectives.py).
- commit_tick_ms / commit_tick_ici_ms: the same for the tick that commits; commit_ms / commit_ici_ms:
  what it costs over a plain tick (the commit's share of the pass).
- tokens_per_s_total = N * L / (S * (step_ms + ici_ms) + C * (commit_ms + commit_ici_ms)), C = ceil(N / K)
  commit ticks per S ticks: each of the N slots settles one canvas every S ticks, K of them in the same
  tick (slots in step, the best case for the commits); `..._overlapped` with every collective hidden
  under the HBM-bound work; `..._staggered` with the canvases settling at independent times, so that
  most ticks commit (`commit_passes_per_tick`: S x that many per S ticks instead of C).
- gb_per_chip: the program's memory per chip (XLA's memory analysis); fits: under the chip's HBM.

Projections from the TPU compiler's output, not measurements on a TPU.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgemma_jax.config import ModelConfig  # noqa: E402
from dgemma_jax.perf import aot, roofline  # noqa: E402
from dgemma_jax.perf import collectives as coll  # noqa: E402
from dgemma_jax.axis_rules import rules_for  # noqa: E402
from dgemma_jax.perf.report import write  # noqa: E402
from dgemma_jax.sampling.slots import COMMIT_SCOPE, commit_rows  # noqa: E402


CANVAS = 256   # tokens a canvas settles (the 26B's canvas_length)


def slot_groups(n: int, mesh: dict, rules: str) -> int:
    """The slot groups of N slots: the mesh's shards of the batch axis (`Runtime.shards`), 1 when they
    do not divide N."""
    entry = dict(rules_for(rules)).get("batch")
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    groups = math.prod(mesh.get(a, 1) for a in axes)
    return groups if groups > 0 and n % groups == 0 else 1


def commit_k(report: dict) -> int:
    """Settled canvases one tick commits: `commit_rows` of each slot group, the groups being the mesh's
    shards of the batch axis (`slots.slot_tick`)."""
    n = report["batch"]
    groups = slot_groups(n, report["mesh"], report["rules"])
    return groups * commit_rows(n // groups)


def commit_passes_per_tick(slots: int, groups: int, steps: int) -> float:
    """Expected ticks that commit, per tick, when the slots' canvases settle independently, each in a
    given tick with probability 1 / steps (slots admitted at different times): M canvases settled in a
    group take ceil(M / k) calls' first ticks, k = commit_rows(slots / groups) (`slots.slot_tick`: the
    rows past k wait a call), the group with the most setting the count."""
    per, p = slots // groups, 1.0 / steps
    k = commit_rows(per)
    pmf = [math.comb(per, i) * p ** i * (1 - p) ** (per - i) for i in range(per + 1)]
    cdf = [sum(pmf[:m + 1]) for m in range(per + 1)]
    return sum(1.0 - cdf[(j - 1) * k] ** groups for j in range(1, -(-per // k) + 1))


def staggered(row: dict) -> dict:
    """A row's throughput with the slots' canvases settling at independent times (`commit_passes_per_tick`)
    instead of K at a time: of S ticks, S x passes commit, not ceil(N / K)."""
    n, s = row["slots"], row["steps_per_canvas"]
    passes = commit_passes_per_tick(n, slot_groups(n, row["mesh"], row["rules"]), s)
    per = s * (row["step_ms"] + row["ici_ms"]) + s * passes * (row["commit_ms"] + row["commit_ici_ms"])
    return {"commit_passes_per_tick_staggered": round(passes, 3),
            "tokens_per_s_total_staggered": round(n * CANVAS / (per / 1e3), 1)}


def split(report: dict) -> dict:
    """The tick program's work split into its plain tick ("step") and its committing tick
    ("commit_tick", the ops under `slots.COMMIT_SCOPE`: every slot's step and K canvases' commit in one
    pass): HBM bytes and collectives by their source scope; FLOPs in the ratio of the two ticks'
    useful FLOPs (a step of N rows; that and a commit of K rows, its trunk only: no head)."""
    cfg = ModelConfig.preset(report["preset"])
    topo = aot.topology(report["topology"])
    n, tick = report["batch"], report["programs"]["slot_tick"]
    k = commit_k(report)
    step_f = roofline.denoise_step_flops(cfg, n, report["context"])
    commit_f = step_f + roofline.denoise_step_flops_by_part(cfg, k, report["context"])["trunk"]   # no head
    flops = {"step": tick["flops"] * step_f / (step_f + commit_f),
             "commit_tick": tick["flops"] * commit_f / (step_f + commit_f)}
    in_commit = lambda scope: COMMIT_SCOPE in scope  # noqa: E731
    commit_bytes = sum(v for s, v in tick["hbm_bytes_by_scope"].items() if in_commit(s))
    hbm = {"step": tick["hbm_bytes"] - commit_bytes, "commit_tick": commit_bytes}
    out = {}
    for part in ("step", "commit_tick"):
        items = [c for c in tick["collectives"] if in_commit(c.get("scope", "")) == (part == "commit_tick")]
        ici = coll.ici_seconds(items, topo.ring_bytes_per_s, report["ici"]["hop_latency_s"])["seconds"] \
            if topo.ring_bytes_per_s else 0.0
        out[part] = {"seconds": max(flops[part] / topo.bf16_flops, hbm[part] / topo.hbm_bw), "ici_seconds": ici,
                     "hbm_bytes": hbm[part], "flops": flops[part]}
    return out


def rows_for(report: dict, steps: int, canvas: int) -> dict:
    n = report["batch"]
    tick = report["programs"]["slot_tick"]
    parts = split(report)
    k = commit_k(report)
    calls = math.ceil(n / k)
    step, ici = parts["step"]["seconds"], parts["step"]["ici_seconds"]
    ct, ct_ici = parts["commit_tick"]["seconds"], parts["commit_tick"]["ici_seconds"]
    c, c_ici = max(ct - step, 0.0), max(ct_ici - ici, 0.0)   # what a committing tick costs over a plain one
    per = steps * (step + ici) + calls * (c + c_ici)
    per_overlapped = steps * max(step, ici) + calls * max(c, c_ici)
    floor = tick["roofline_floor_seconds"]
    return {"slots": n, "steps_per_canvas": steps, "step_ms": round(1e3 * step, 3),
            "floor_ms": round(1e3 * floor, 3), "ici_ms": round(1e3 * ici, 3),
            "commit_rows": k, "commit_ms": round(1e3 * c, 3), "commit_ici_ms": round(1e3 * c_ici, 3),
            "commit_tick_ms": round(1e3 * ct, 3), "commit_tick_ici_ms": round(1e3 * ct_ici, 3),
            "commit_tick_over_floor": round(ct / floor, 2),
            "tokens_per_s_total": round(n * canvas / per, 1),
            "tokens_per_s_total_overlapped": round(n * canvas / per_overlapped, 1),
            "gb_per_chip": round(tick["total_bytes"] / 1e9, 2), "fits": bool(tick["fits"]),
            "step_over_floor": round(step / floor, 2),
            "step_hbm_gb": round(parts["step"]["hbm_bytes"] / 1e9, 2),
            "commit_tick_hbm_gb": round(parts["commit_tick"]["hbm_bytes"] / 1e9, 2),
            "required_gb": round(tick["required_bytes"] / 1e9, 2),
            "hbm_gb_by_op": {k2: round(v / 1e9, 2) for k2, v in sorted(tick["hbm_bytes_by_op"].items(),
                                                                       key=lambda kv: -kv[1])[:8]},
            "hbm_gb_by_scope": {k2: round(v / 1e9, 2) for k2, v in list(tick["hbm_bytes_by_scope"].items())[:10]}}


def markdown_rows(rows: list, steps: int = 16) -> str:
    """The docs' table rows (docs/serving.md) of a result file's rows at `steps` steps a canvas."""
    out = []
    for r in sorted((r for r in rows if r.get("steps_per_canvas") == steps), key=lambda r: r["slots"]):
        out.append(f"| {r['slots']} | {r['gb_per_chip']:.2f} | {r['step_ms']:.2f} ({r['floor_ms']:.2f}, "
                   f"{r['step_over_floor']:.2f}x) | {r['ici_ms']:.2f} | {r['commit_ms']:.2f} + {r['commit_ici_ms']:.2f} "
                   f"({r['commit_rows']}) | {r['tokens_per_s_total']:,.0f} / {r['tokens_per_s_total_overlapped']:,.0f} | "
                   f"{staggered(r)['tokens_per_s_total_staggered']:,.0f} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", required=True)
    ap.add_argument("--preset", default="diffusiongemma-26b-a4b")
    ap.add_argument("--mesh", default=None, help="default: every chip on the experts (dgemma compile's default)")
    ap.add_argument("--rules", default="latency")
    ap.add_argument("--slots", default="1,8,32,64")
    ap.add_argument("--steps", default="16,32")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--quantize", choices=("int8", "int4"), default=None,
                    help="weight-only quantized parameters (model.quant); default: the bf16 weights")
    ap.add_argument("--param-formats", choices=("compiler", "default"), default="compiler", dest="param_formats",
                    help="the parameters' layouts: the tick's preferred ones, as dgemma serve places them on a TPU "
                         "(default), or as loaded (dgemma serve --param-layouts default)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows, reports = [], {}
    for n in [int(x) for x in args.slots.split(",")]:
        t0 = time.time()
        rep = aot.compile_report(args.preset, args.topology, mesh=args.mesh, rules=args.rules, batch=n,
                                 context=args.context, prompt=args.prompt, programs=("slot_tick",),
                                 quantize=args.quantize, param_formats=args.param_formats)
        print(f"{n} slots: compiled in {time.time() - t0:.0f} s", flush=True)
        progs = rep["programs"]
        reports[str(n)] = {k: {f: v for f, v in p.items() if f not in ("collectives",)} for k, p in progs.items()}
        if not all("projected_seconds" in p for p in progs.values()):   # did not fit: the compiler's message
            rows.append({"slots": n, "fits": False, "error": {k: p.get("error") for k, p in progs.items()}})
            continue
        for s in [int(x) for x in args.steps.split(",")]:
            rows.append(rows_for(rep, s, CANVAS))
            print(rows[-1], flush=True)
    for r in rows:
        r.update(topology=args.topology, mesh=rep["mesh"], rules=args.rules, context=args.context,
                 weights=args.quantize or "bfloat16", param_formats=args.param_formats)
        if "step_ms" in r:
            r.update(staggered(r))
    write(rows, args.out)
    print(markdown_rows(rows))   # docs/serving.md's table rows
    details = os.path.splitext(args.out)[0] + "_programs.json"
    write({"label": "projection from the TPU compiler's output (slot_tick of the step-level "
                    "engine, the 26B's shapes, weights " + (args.quantize or "bfloat16") + "), not a measurement on a TPU",
           "command": "python benchmarks/serve_projection.py " + " ".join(argv or sys.argv[1:]),
           "ici": rep["ici"], "programs": reports}, details)
    print("wrote", details)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
