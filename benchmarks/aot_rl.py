"""AOT compile-and-fit of the 26B LoRA RL step on TPU topologies, from this CPU machine (needs `jax[tpu]`).

One GRPO step of `dgemma train` with an rl recipe is a rollout (the engine's fused generate over
prompts x group_size rows, per canvas a prefill, denoise steps and a commit) and an update (GRPO's
clipped surrogate on the rollout rows, `training.step.make_rl_update`, LoRA rank 16 on attention + MLP,
remat). Each program is compiled as `dgemma compile --rules training --programs rl_step,prefill,
denoise_step,commit,generate` compiles it (`perf.aot.compile_report`), ONE PROGRAM PER CALL, in the
order given (by default every topology's update first, then its rollout's generate, then the step
programs that price the rollout), each saved under --parts as it finishes so that a partial run keeps
what it compiled; the per-topology JSON (`perf.aot.combine_reports`: fit per program, the rollout
beside the training state, the projected rollout + update time) is rewritten after each.

    flock /tmp/aot.lock python benchmarks/aot_rl.py        # -> benchmarks/results/aot_26b_lora_rl_<topology>.json

Defaults: 8 rollout rows (2 prompts x group 4, the recipe's group_size), 1024 prompt tokens + one
256-token canvas (context 1280: the shapes of the SFT LoRA step's aot_26b_lora_v5p-8.json), 1 noise
draw per canvas (`perf.aot.RL_STEP_DEFAULTS`: then the compiler's cost counts the whole update), the
mesh every chip on the experts (v5p-8 expert=4, v6e-8 expert=8). Times are projections from the
compiler's cost analysis and HBM traffic (performance.md's roofline), not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from dgemma_jax.perf.aot import combine_reports, compile_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = {"v5p-8": "expert=4", "v6e-8": "expert=8"}
ORDER = ("rl_step", "generate", "denoise_step", "commit", "prefill")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topologies", default="v5p-8,v6e-8")
    p.add_argument("--programs", default=",".join(ORDER))
    p.add_argument("--preset", default="diffusiongemma-26b-a4b")
    p.add_argument("--batch", type=int, default=8, help="rollout rows: prompts x group size")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--context", type=int, default=1280)
    p.add_argument("--layers", default="scan", choices=("scan", "unrolled"),
                   help="the programs' layer layout: a recipe's model.overrides.layers, which the trainer's update "
                        "and rollout engine both run (unrolled: the 26B update's compile needs > 23 GB of host memory)")
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--parts", default="/tmp/aot_rl_parts", help="one JSON per compiled (topology, program)")
    args = p.parse_args()
    topologies = [t for t in args.topologies.split(",") if t]
    programs = [n for n in args.programs.split(",") if n]
    os.makedirs(args.parts, exist_ok=True)
    for name in programs:           # a program on every topology before the next program
        for topo in topologies:
            part = os.path.join(args.parts, f"{topo}_{name}.json")
            if os.path.exists(part):
                print(f"{topo} {name}: compiled before ({part})", flush=True)
            else:
                print(f"{topo} {name}: compiling (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                t0 = time.time()
                rep = compile_report(args.preset, topo, mesh=MESHES.get(topo), rules="training", batch=args.batch,
                                     context=args.context, prompt=args.prompt, programs=(name,),
                                     layers=args.layers)
                rep["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
                with open(part, "w") as f:
                    json.dump(rep, f, indent=2)
                e = rep["programs"][name]
                print(f"{topo} {name}: {time.time() - t0:.0f} s, "
                      f"{e.get('total_bytes', float('nan')) / 1e9:.2f} GB per chip, fits {e['fits']}", flush=True)
            _write(args, topo, topologies, programs)


def _write(args, topo: str, topologies, programs) -> None:
    parts = [os.path.join(args.parts, f"{topo}_{n}.json") for n in programs]
    reports = []
    for path in parts:
        if os.path.exists(path):
            with open(path) as f:
                reports.append(json.load(f))
    rep = combine_reports(reports)
    rep["compiled"] = sorted(rep["programs"])
    rep["not_compiled"] = [n for n in programs if n not in rep["programs"]]
    rep["command"] = ("flock /tmp/aot.lock python benchmarks/aot_rl.py --topologies " + ",".join(topologies)
                      + f" --batch {args.batch} --prompt {args.prompt} --context {args.context} --layers {args.layers}")
    rep["machine_note"] = ("compiled one program per process call on a 2-core CPU shared with other sessions' "
                           "compiles and tests (load in each part's loadavg_after): compile_seconds are not "
                           "comparable with other runs")
    out = os.path.join(args.out_dir, f"aot_26b_lora_rl_{topo}.json")
    with open(out, "w") as f:
        json.dump(rep, f, indent=2)


if __name__ == "__main__":
    main()
