"""Load on `dgemma serve` over loopback: the step-level engine against an earlier revision's, side by side.

    python benchmarks/serve_load.py --base 2e34c1a --out benchmarks/results/serve_load.json

Starts a real server per (engine, slot count) with the bundled model, sends the same requests from N
client threads with the official `openai` client, and records per-request latency, requests/s and
completion tokens/s at each concurrency, then a mixed workload: short requests (one 8-token canvas,
the default sampler) among long ones (three canvases forced to run 32 steps each: confidence
threshold 0). `--base REV` runs the server of that revision (a temporary git worktree) right before
the head's at each slot count, on the same machine state; absolute numbers on a shared 2-core
machine are noisy, the ratios between the engines are the result. Same seeds give the same texts on
both engines (checked: `same_text_as_base`).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np
import openai

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from dgemma_jax.perf.report import write  # noqa: E402
from tests.helpers.serve import ServerProcess  # noqa: E402

SLOW = {"max_denoising_steps": 32, "confidence_threshold": 0.0}


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["s" + "".join(map(str, rng.integers(0, 10, rng.integers(9, 17)))) + "=" for _ in range(n)]


def _ask(client, model, job):
    p, seed, max_tokens, extra = job
    t0 = time.perf_counter()
    r = client.completions.create(model=model, prompt=p, seed=seed, max_tokens=max_tokens, extra_body=extra or None)
    return time.perf_counter() - t0, r.choices[0].text, r.usage.completion_tokens, r.usage.model_extra["denoising_steps"]


def _stats(res, wall):
    lat = np.array([r[0] for r in res])
    return {"requests": len(res), "requests_per_s": round(len(res) / wall, 2),
            "completion_tokens_per_s": round(sum(r[2] for r in res) / wall, 1),
            "latency_s": {q: round(float(np.percentile(lat, int(q[1:]))), 4) for q in ("p50", "p99")},
            "mean_denoising_steps": round(float(np.mean([r[3] for r in res])), 2)}


def run_level(client, model, jobs, concurrency):
    _ask(client, model, jobs[0])  # warm
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda j: _ask(client, model, j), jobs))
    wall = time.perf_counter() - t0
    exact = sum(r[1] == "".join(sorted(j[0][1:-1])) for r, j in zip(res, jobs))
    return {"concurrency": concurrency, "wall_s": round(wall, 3), **_stats(res, wall),
            "exact_match": f"{exact}/{len(jobs)}", "texts": [r[1] for r in res]}


def run_mixed(client, model, n, concurrency=16):
    """Short requests among long, slow ones: latency of each kind."""
    ps = prompts(n, seed=1)
    jobs = [(p, 5000 + i, 24, SLOW) if i % 4 == 0 else (p, 5000 + i, 8, None) for i, p in enumerate(ps)]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(lambda j: _ask(client, model, j), jobs))
    wall = time.perf_counter() - t0
    short = [r for r, j in zip(res, jobs) if j[3] is None]
    long = [r for r, j in zip(res, jobs) if j[3] is not None]
    return {"concurrency": concurrency, "wall_s": round(wall, 3), "all": _stats(res, wall),
            "short": _stats(short, wall), "long": _stats(long, wall), "texts": [r[1] for r in res]}


def serve_and_measure(slots, jobs, levels, n_mixed, cwd=None):
    srv = ServerProcess("--slots", str(slots), "--max-queue", str(4 * len(jobs)), "--max-steps", "32", cwd=cwd)
    try:
        model = srv.health()["model"]
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        out = {"slots": slots, "levels": [run_level(client, model, jobs, c) for c in levels]}
        out["mixed"] = run_mixed(client, model, n_mixed)
        out["server"] = srv.health()["stats"]
        return out
    finally:
        srv.stop()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=None, help="the revision whose engine to compare with (git rev)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--mixed", type=int, default=48, help="requests in the mixed workload (1 in 4 long)")
    ap.add_argument("--slots", default="1,8,32")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--out", default="/tmp/serve_load.json", help="JSON results (default: a scratch path)")
    args = ap.parse_args(argv)
    jobs = [(p, 1000 + i, 24, None) for i, p in enumerate(prompts(args.requests))]
    levels = [int(c) for c in args.concurrency.split(",")]
    head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "loadavg_start": os.getloadavg()},
              "workload": {"levels": "bundled digit sorter, random 9-16 digit prompts, max_tokens 24, one seed each",
                           "mixed": f"{args.mixed} requests at concurrency 16: 3 in 4 short (max_tokens 8, default "
                                    "sampler), 1 in 4 long (max_tokens 24, 32 steps a canvas: "
                                    f"{SLOW})"},
              "head": head + " (working tree)", "base": args.base, "runs": {}}
    tmp = None
    if args.base:
        tmp = tempfile.mkdtemp(prefix="serve_load_base_")
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tmp, args.base], check=True,
                       capture_output=True)
    try:
        for slots in [int(s) for s in args.slots.split(",")]:
            for name, cwd in ([("base", tmp)] if tmp else []) + [("head", None)]:
                run = serve_and_measure(slots, jobs, levels, args.mixed, cwd)
                report["runs"][f"{name}_slots_{slots}"] = run
                for lv in run["levels"]:
                    print(f"{name} slots {slots:>2} concurrency {lv['concurrency']:>2}: {lv['requests_per_s']:7.2f} "
                          f"req/s {lv['completion_tokens_per_s']:8.1f} tok/s  p50 {lv['latency_s']['p50']:.3f} s  "
                          f"p99 {lv['latency_s']['p99']:.3f} s  exact {lv['exact_match']}", flush=True)
                m = run["mixed"]
                print(f"{name} slots {slots:>2} mixed: short p50 {m['short']['latency_s']['p50']:.3f} s p99 "
                      f"{m['short']['latency_s']['p99']:.3f} s; long p50 {m['long']['latency_s']['p50']:.3f} s; "
                      f"{m['all']['requests_per_s']:.2f} req/s", flush=True)
    finally:
        if tmp:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", tmp], capture_output=True)
    report["machine"]["loadavg_end"] = os.getloadavg()
    if args.base:
        summary = {}
        for slots in [int(s) for s in args.slots.split(",")]:
            b, h = report["runs"][f"base_slots_{slots}"], report["runs"][f"head_slots_{slots}"]
            row = {f"c{lb['concurrency']}_requests_per_s_head_over_base":
                   round(lh["requests_per_s"] / lb["requests_per_s"], 2) for lb, lh in zip(b["levels"], h["levels"])}
            row["mixed_short_p50_head_over_base"] = round(h["mixed"]["short"]["latency_s"]["p50"]
                                                         / b["mixed"]["short"]["latency_s"]["p50"], 2)
            row["mixed_short_p99_head_over_base"] = round(h["mixed"]["short"]["latency_s"]["p99"]
                                                         / b["mixed"]["short"]["latency_s"]["p99"], 2)
            same = [x == y for lb, lh in zip(b["levels"], h["levels"]) for x, y in zip(lb["texts"], lh["texts"])]
            same += [x == y for x, y in zip(b["mixed"]["texts"], h["mixed"]["texts"])]
            row["same_text_as_base"] = f"{sum(same)}/{len(same)}"
            summary[f"slots_{slots}"] = row
        report["head_vs_base"] = summary
        print(summary)
    write(report, args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
