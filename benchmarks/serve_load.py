"""Load on `dgemma serve` over loopback: throughput and latency at concurrency 1/4/16, 1 slot vs 8.

    python benchmarks/serve_load.py [--requests 48] [--out benchmarks/results/serve_load.json]

Starts a real server per slot count (the bundled model unless --checkpoint), sends the same
requests (random 9-16 digit sorting prompts, a seed each) from N client threads with the official
`openai` client, and records per-request latency, requests/s and completion tokens/s. Both servers
run in this one invocation, one after the other, on the same machine state; absolute numbers on a
shared 2-core machine are noisy, the ratios between the configurations are the result.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import platform
import sys
import time

import numpy as np
import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgemma_jax.perf.report import write  # noqa: E402
from tests.helpers.serve import ServerProcess  # noqa: E402


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["s" + "".join(map(str, rng.integers(0, 10, rng.integers(9, 17)))) + "=" for _ in range(n)]


def run_level(client, model, jobs, concurrency):
    def ask(job):
        p, seed = job
        t0 = time.perf_counter()
        r = client.completions.create(model=model, prompt=p, seed=seed, max_tokens=24)
        return time.perf_counter() - t0, r.choices[0].text, r.usage.completion_tokens, \
            r.usage.model_extra["denoising_steps"]

    ask(jobs[0])  # warm: the prefill bucket of the first prompt
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(ask, jobs))
    wall = time.perf_counter() - t0
    lat = np.array([r[0] for r in res])
    toks = sum(r[2] for r in res)
    exact = sum(r[1] == "".join(sorted(p[1:-1])) for r, (p, _) in zip(res, jobs))
    return {"concurrency": concurrency, "requests": len(jobs), "wall_s": round(wall, 3),
            "requests_per_s": round(len(jobs) / wall, 2), "completion_tokens_per_s": round(toks / wall, 1),
            "latency_s": {q: round(float(np.percentile(lat, int(q[1:]))), 4) for q in ("p50", "p90", "p99")},
            "mean_denoising_steps": round(float(np.mean([r[3] for r in res])), 2),
            "exact_match": f"{exact}/{len(jobs)}", "texts": [r[1] for r in res]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--slots", default="1,8")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--out", default="/tmp/serve_load.json", help="JSON results (default: a scratch path)")
    args = ap.parse_args(argv)
    jobs = [(p, 1000 + i) for i, p in enumerate(prompts(args.requests))]
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "loadavg_start": os.getloadavg()},
              "workload": "bundled digit sorter, random 9-16 digit prompts, max_tokens 24, one seed each",
              "runs": {}}
    for slots in [int(s) for s in args.slots.split(",")]:
        extra = ["--checkpoint", args.checkpoint] if args.checkpoint else []
        srv = ServerProcess("--slots", str(slots), "--max-queue", str(4 * args.requests), *extra)
        try:
            model = srv.health()["model"]
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            levels = [run_level(client, model, jobs, int(c)) for c in args.concurrency.split(",")]
            report["runs"][f"slots_{slots}"] = {"slots": slots, "levels": levels, "server": srv.health()["stats"]}
        finally:
            srv.stop()
        for lv in report["runs"][f"slots_{slots}"]["levels"]:
            print(f"slots {slots:>2} concurrency {lv['concurrency']:>2}: {lv['requests_per_s']:7.2f} req/s "
                  f"{lv['completion_tokens_per_s']:8.1f} tok/s  p50 {lv['latency_s']['p50']:.3f} s  "
                  f"p90 {lv['latency_s']['p90']:.3f} s  p99 {lv['latency_s']['p99']:.3f} s  "
                  f"exact {lv['exact_match']}", flush=True)
    report["machine"]["loadavg_end"] = os.getloadavg()
    runs = report["runs"]
    if "slots_1" in runs and "slots_8" in runs:
        by = {k: {lv["concurrency"]: lv for lv in v["levels"]} for k, v in runs.items()}
        report["speedup_8_slots_over_1"] = {
            str(c): round(by["slots_8"][c]["requests_per_s"] / by["slots_1"][c]["requests_per_s"], 2)
            for c in by["slots_1"] if c in by["slots_8"]}
        same = [a == b for c in by["slots_1"] if c in by["slots_8"]
                for a, b in zip(by["slots_1"][c]["texts"], by["slots_8"][c]["texts"])]
        report["same_text_1_vs_8_slots"] = f"{sum(same)}/{len(same)}"
        print("8 slots over 1 (requests/s):", report["speedup_8_slots_over_1"])
    write(report, args.out)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
