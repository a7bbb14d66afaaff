"""Is a refactor free? The denoise step and the fused generate timed at two revisions, side by side.

A refactor that claims "behaviour and speed unchanged" is held to it here: a temporary git worktree
holds the base revision; a child process per revision and round builds the `bench` model with the
same random weights, compiles the separately jitted denoise step and a 2-canvas fused generate, and
times them. The revisions alternate round by round (A B A B ...), so drifting machine load falls on
both; each round's median is recorded and the verdict compares the medians of the rounds. The
child also returns a digest of the generated tokens (a pure refactor must give the same tokens) and
of the step program as lowered (StableHLO text, no source locations: equal digests, the same program).

    python benchmarks/compare_revisions.py --base 69ece3d --out benchmarks/results/runtime_refactor.json

The head is the working tree. Only the public API both revisions share is used (`ModelConfig`,
`init_params`, `Engine`, `denoise_step` under a jit of its own, `sampling.loop`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the parent only records the machine: no TPU probing
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from dgemma_jax.perf import report  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the child: run with the revision's checkout first on sys.path; prints one JSON line
CHILD = r"""
import functools, hashlib, json, os, sys, time
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
import dgemma_jax
from dgemma_jax import Engine, ModelConfig, SamplerConfig, init_params
from dgemma_jax.model.cache import init_cache
from dgemma_jax.sampling.loop import init_state, initial_canvas, row_keys

reps, context = int(sys.argv[2]), int(sys.argv[3])
cfg = ModelConfig.preset("bench")
params = init_params(cfg, 0)
sampler = SamplerConfig.for_model(cfg, max_denoising_steps=16)
prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (1, context)).astype(np.int32)
engine = Engine(cfg, params, sampler)
out = engine.generate(prompt, rng=0, max_new_tokens=2 * cfg.canvas_length)   # compile + warm
tokens = np.asarray(out.tokens)
t_gen, c_gen = [], []
for _ in range(max(1, reps // 4)):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(engine.generate(prompt, rng=0, max_new_tokens=2 * cfg.canvas_length).tokens)
    t_gen.append(time.perf_counter() - t0)
    c_gen.append(time.process_time() - c0)
cache = init_cache(cfg, 1, context + cfg.canvas_length)
_, cache = dgemma_jax.prefill(params, cfg, prompt, None, cache, logits="none")
keys = row_keys(0, 1)
state = init_state(cfg, sampler, initial_canvas(keys, cfg.canvas_length, cfg.vocab_size))
step = jax.jit(functools.partial(dgemma_jax.denoise_step, config=cfg, sampler=sampler))
args = dict(cache=cache, context_end=cache.lengths, keys=keys, state=state)
jax.block_until_ready(step(params, **args))
# the step program as lowered (StableHLO, printed without source locations): equal text, equal
# input to the compiler, equal compiled program
hlo = step.lower(params, **args).as_text()
t_step, c_step = [], []
for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    jax.block_until_ready(step(params, **args))
    t_step.append(time.perf_counter() - t0)
    c_step.append(time.process_time() - c0)
print(json.dumps(dict(step_s=t_step, generate_s=t_gen, step_cpu_s=c_step, generate_cpu_s=c_gen,
                      tokens_sha256=hashlib.sha256(tokens.tobytes()).hexdigest(),
                      steps=np.asarray(out.steps).tolist(),
                      step_hlo_sha256=hashlib.sha256(hlo.encode()).hexdigest())))
"""


def run_child(checkout: str, reps: int, context: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=checkout)
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    try:
        out = subprocess.run([sys.executable, f.name, checkout, str(reps), str(context)], env=env, cwd=checkout,
                             capture_output=True, text=True, timeout=1800)
    finally:
        os.unlink(f.name)
    if out.returncode:
        raise RuntimeError(f"child at {checkout} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(rounds: dict) -> dict:
    """Per timing: the medians over rounds of each round's median, head / base, the larger
    round-to-round spread of the two revisions, and whether head / base lies within it (at least 2%);
    None with a single round, which measures no spread."""
    def medians(name, key):
        return [statistics.median(x[key]) for x in rounds[name]]

    summary = {}
    # *_cpu_s: the process's CPU seconds (every XLA thread) per call, older JSONs lack them: less disturbed
    # than the wall time by other processes on a loaded machine (they take cores, not this program's work)
    for key in [k for k in ("step_s", "generate_s", "step_cpu_s", "generate_cpu_s") if k in rounds["base"][0]]:
        b, h = statistics.median(medians("base", key)), statistics.median(medians("head", key))
        spread = max(max(medians(n, key)) / min(medians(n, key)) for n in ("base", "head")) - 1
        within = abs(h / b - 1) <= max(spread, 0.02) if len(rounds["base"]) > 1 else None
        summary[key] = dict(base=b, head=h, head_over_base=h / b, round_spread=spread, within_noise=within)
    return summary


def render(res: dict) -> str:
    rows = [[k, report.ms(v["base"]), report.ms(v["head"]), f"{v['head_over_base']:.3f}",
             report.pct(v["round_spread"]), {True: "yes", False: "no", None: "n/a (one round)"}[v["within_noise"]]]
            for k, v in res["summary"].items()]
    md = [f"# {res['base']} vs {res['head']} ({len(res['rounds']['base'])} alternating rounds, {res['config']} config, "
          f"context {res['context']})", ""]
    md += report.table(["median (ms)", "base", "head", "head / base", "round-to-round spread", "within noise"], rows)
    md += ["", f"Same generated tokens at both revisions: {'yes' if res['same_tokens'] else 'NO'}."]
    md += [f"Load average when it ended: {res.get('loadavg')} (the timings are only as quiet as the machine was)."]
    if "same_step_program" in res:
        md += [f"Same denoise-step program (lowered StableHLO text): {'yes' if res['same_step_program'] else 'no'}."]
    return "\n".join(md) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="git revision to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per revision")
    ap.add_argument("--reps", type=int, default=20, help="timed denoise steps per round (generates: reps / 4)")
    ap.add_argument("--context", type=int, default=512, help="prompt tokens before the canvas")
    ap.add_argument("--out", default=None, help="results JSON (markdown next to it)")
    ap.add_argument("--render", metavar="JSON", help="recompute the summary and markdown of a results JSON")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            res = json.load(f)
        res["summary"] = summarize(res["rounds"])
        report.write(res, args.render, render(res))
        return 0
    if not args.base:
        ap.error("--base is required (or --render JSON)")

    base_rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="dgemma_base_")
    base_dir = os.path.join(tmp, "base")
    subprocess.run(["git", "worktree", "add", "--detach", "-q", base_dir, base_rev], cwd=REPO, check=True)
    rounds: dict[str, list[dict]] = {"base": [], "head": []}
    try:
        for r in range(args.rounds):
            for name, checkout in (("base", base_dir), ("head", REPO)):
                res = run_child(checkout, args.reps, args.context)
                rounds[name].append(res)
                print(f"round {r} {name}: step {1e3 * statistics.median(res['step_s']):.1f} ms, "
                      f"generate {statistics.median(res['generate_s']):.2f} s", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base_dir], cwd=REPO, check=False)

    everything = rounds["base"] + rounds["head"]
    res = dict(machine=report.machine_info(), loadavg=report.loadavg(), base=base_rev, head="working tree",
               config="bench", context=args.context, reps=args.reps, rounds=rounds, summary=summarize(rounds),
               same_tokens=len({x["tokens_sha256"] for x in everything}) == 1,
               same_step_program=len({x.get("step_hlo_sha256") for x in everything}) == 1)
    md = render(res)
    report.write(res, args.out, md)
    print(md)
    return 0 if res["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
