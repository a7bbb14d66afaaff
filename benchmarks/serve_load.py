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

    flock /tmp/heavy.lock python benchmarks/serve_load.py --overload-only --out benchmarks/results/serve_load.json

The overload scenario (`--overload-only`, merged into the JSON under "overload"): 2x slots long
requests and short ones behind them, on a server with `--schedule fcfs` (before: first come, first
served) and with `--schedule preempt` (after: the short ones take a long one's slot at a canvas
boundary), p50/p95 latency per class.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
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
    return (time.perf_counter() - t0, r.choices[0].text, r.usage.completion_tokens, r.usage.model_extra["denoising_steps"],
            r.usage.model_extra["canvases"])


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


def _pcts(lat):
    lat = np.asarray(lat)
    return {q: round(float(np.percentile(lat, int(q[1:]))), 4) for q in ("p50", "p95")}


def run_overload(srv, client, model, slots, long_steps, rounds=3, shorts_per_round=4):
    """Overload: 2x slots long requests at once (40-digit prompts, max_tokens 48: up to 6 canvases, each
    forced to `long_steps` steps), and once they hold every slot and half of them wait, short
    requests (one canvas, the default sampler) all at once; per class p50/p95 latency, and the short
    ones alone (one at a time) on the same idle server."""
    long_extra = {"max_denoising_steps": long_steps, "confidence_threshold": 0.0}
    rng = np.random.default_rng(10)
    short_jobs = [(p, 7000 + i, 8, None) for i, p in enumerate(prompts(shorts_per_round * rounds, seed=3))]
    alone = [_ask(client, model, j)[0] for j in short_jobs[:8]]
    long_res, short_lat, texts, queued_seen = [], [], [], 0
    for r in range(rounds):
        jobs = [("s" + "".join(map(str, rng.integers(0, 10, 40))) + "=", 9000 + 100 * r + i, 48, long_extra)
                for i in range(2 * slots)]
        with cf.ThreadPoolExecutor(2 * slots) as pool:
            running = [pool.submit(_ask, client, model, j) for j in jobs]
            deadline = time.monotonic() + 30
            while srv.health()["queued"] < slots and time.monotonic() < deadline:
                time.sleep(0.002)
            queued_seen += srv.health()["queued"] >= slots
            with cf.ThreadPoolExecutor(shorts_per_round) as shorts:
                res = list(shorts.map(lambda j: _ask(client, model, j),
                                      short_jobs[r * shorts_per_round:(r + 1) * shorts_per_round]))
            short_lat += [x[0] for x in res]
            texts += [x[1] for x in res]
            done = [f.result() for f in running]
        long_res += done
        texts += [d[1] for d in done]
    out = {"long_steps_a_canvas": long_steps, "short_alone_s": _pcts(alone), "short_s": _pcts(short_lat),
           "long_s": _pcts([d[0] for d in long_res]),
           "long_mean_canvases": round(float(np.mean([d[4] for d in long_res])), 2),
           "long_mean_denoising_steps": round(float(np.mean([d[3] for d in long_res])), 1),
           "rounds_with_slots_longs_still_queued_as_the_shorts_went": f"{queued_seen}/{rounds}",
           "requests": {"short": len(short_lat), "long": len(long_res)}, "texts": texts}
    out["short_p50_over_alone_p50"] = round(out["short_s"]["p50"] / out["short_alone_s"]["p50"], 2)
    out["short_p95_over_alone_p50"] = round(out["short_s"]["p95"] / out["short_alone_s"]["p50"], 2)
    return out


def overload(slots, steps_list, cwd=None):
    """The overload scenario on a server of each policy (`--schedule`), fcfs first."""
    out = {}
    for policy in ("fcfs", "preempt"):
        srv = ServerProcess("--slots", str(slots), "--max-queue", "256", "--max-steps", "64", "--schedule", policy,
                            cwd=cwd)
        try:
            model = srv.health()["model"]
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            runs = [run_overload(srv, client, model, slots, st) for st in steps_list]
            out[policy] = {"runs": runs, "server": srv.health()["stats"]}
        finally:
            srv.stop()
        for run in out[policy]["runs"]:
            print(f"overload {policy:>7} slots {slots} long {run['long_steps_a_canvas']} steps/canvas: short p50 "
                  f"{run['short_s']['p50']:.3f} p95 {run['short_s']['p95']:.3f} s (alone {run['short_alone_s']['p50']:.3f}, "
                  f"{run['short_p50_over_alone_p50']}x); long p50 {run['long_s']['p50']:.3f} p95 "
                  f"{run['long_s']['p95']:.3f} s", flush=True)
    same = [a == b for x, y in zip(out["fcfs"]["runs"], out["preempt"]["runs"]) for a, b in zip(x["texts"], y["texts"])]
    out["same_text_fcfs_vs_preempt"] = f"{sum(same)}/{len(same)}"
    return out


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
    ap.add_argument("--overload-only", action="store_true",
                    help="run only the overload scenario (fcfs vs preempt), merged into --out's JSON")
    ap.add_argument("--overload-slots", type=int, default=4)
    ap.add_argument("--overload-steps", default="16,64", help="forced steps a canvas of the long requests")
    args = ap.parse_args(argv)
    steps_list = [int(x) for x in args.overload_steps.split(",")]
    if args.overload_only:
        report = json.load(open(args.out)) if os.path.exists(args.out) else {}
        report["overload"] = {
            "workload": f"--slots {args.overload_slots}: per round 2x slots long requests at once (40-digit "
                        "prompts, max_tokens 48: up to 6 canvases of 8 tokens, every canvas forced to the given "
                        "steps: confidence threshold 0), and once half of them wait, 4 short requests at "
                        "once (9-16 digit prompts, max_tokens 8: one canvas, the default sampler); 3 "
                        "rounds; 'alone': 8 short requests with the server idle",
            "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "loadavg_start": os.getloadavg()},
            **overload(args.overload_slots, steps_list)}
        report["overload"]["machine"]["loadavg_end"] = os.getloadavg()
        write(report, args.out)
        print("wrote", args.out)
        return
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
