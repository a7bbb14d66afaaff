"""Start-up time, cold and warm, of `dgemma serve` and `dgemma generate` with the defaults.

    python benchmarks/startup.py [--slots 8] [--out benchmarks/results/startup.json]

A cold start finds an empty compilation cache, a warm start the cache the cold one wrote; nothing is
set by hand (no JAX_COMPILATION_CACHE_DIR: the default `$DGEMMA_CACHE/xla`, with DGEMMA_CACHE a fresh
directory for this run). Each start is timed from launching the process:
- `dgemma serve --slots N`: to its first `/health` answer of any kind (it listens, answering 503
  "starting" while it compiles), to `/health` answering 200, and to the first answered request (the
  official `openai` client, a 10-digit sorting prompt);
- `dgemma generate`: to the printed answer (the process's exit).
Cold and warm run in this one invocation, one after the other; absolute seconds on a shared 2-core
machine are noisy, the cold/warm ratio is the result.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dgemma_jax.perf.report import write  # noqa: E402
from tests.helpers.serve import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"compilation cache (\S+): (\d+) program\(s\) from the cache, (\d+) compiled in ([\d.]+) s")


def environment(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "XLA_FLAGS")}
    env.update(DGEMMA_CACHE=cache, JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"), PYTHONPATH=ROOT)
    return env


def cache_counts(text: str) -> dict | None:
    m = SUMMARY.search(text)
    if not m:
        return None
    return {"from_cache": int(m.group(2)), "compiled": int(m.group(3)), "compile_s": float(m.group(4))}


def start_serve(env: dict, slots: int, timeout: float = 600) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "dgemma_jax.cli", "serve", "--port", str(port), "--slots", str(slots)]
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        health = listening = None
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {open(log.name).read()[-2000:]}")
            try:
                status = httpx.get(url + "/health", timeout=2).status_code
                listening = listening or time.perf_counter() - t0
                if status == 200:
                    health = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if health is None:
            raise RuntimeError(f"no /health 200 in {timeout} s")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt="s9350814272=", seed=0, max_tokens=16)
        first = time.perf_counter() - t0
        return {"listening_s": round(listening, 2), "health_200_s": round(health, 2), "first_answer_s": round(first, 2),
                "answer": r.choices[0].text,
                "cache": cache_counts(open(log.name).read())}
    finally:
        proc.terminate()
        proc.wait(60)
        os.unlink(log.name)


def start_generate(env: dict) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", "s9350814272="],
                       capture_output=True, text=True, env=env, timeout=600)
    seconds = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
    return {"answer_s": round(seconds, 2), "answer": r.stdout.strip(), "cache": cache_counts(r.stderr)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup.json"))
    args = ap.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as serve_cache, tempfile.TemporaryDirectory() as gen_cache:
        for kind in ("cold", "warm"):
            rows[f"serve_{kind}"] = start_serve(environment(serve_cache), args.slots)
            print(f"serve --slots {args.slots}, {kind}: {rows[f'serve_{kind}']}", flush=True)
        for kind in ("cold", "warm"):
            rows[f"generate_{kind}"] = start_generate(environment(gen_cache))
            print(f"generate, {kind}: {rows[f'generate_{kind}']}", flush=True)
    result = {"benchmark": "startup", "slots": args.slots, "model": "bundled dgemma-tiny-digits",
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d"), "runs": rows,
              "warm_serve_health_s_target": 15.0,
              "notes": "cold: empty cache directory; warm: the cache the cold start wrote; no variable set by hand. "
                       "listening_s: the first /health answer (503 while the programs compile, then 200)."}
    write(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
