"""Temporaries of the serving tick with int4 weights on one v5e chip, for a cut of the 26B (its first
N layers of the repeated group), from the TPU compiler (compile-only devices; no TPU run).

    python benchmarks/int4_loop_temps.py 2 2 --out /tmp/t.json     # layers, slots

    python benchmarks/int4_loop_temps.py 2 2 --explain 12       # and what is live at the peak

Used to find out why the 26B's int4 tick needed 37.9 GB: XLA hoisted the loop-invariant int4 -> int8
widening of every expert block out of the tick's loop, keeping a widened copy of every layer's experts
(`moe._ragged` now ties the blocks to the activations with an optimization barrier). Then, with
--explain (`perf.memory_peak`), what the remaining depth-independent 1.1 GB was: the sampling head's
float32 logits and the threefry counters of its Gumbel noise. Results of the runs before and after:
benchmarks/results/int4_loop_temps.json.
"""

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layers", type=int)
    ap.add_argument("slots", type=int)
    ap.add_argument("--program", default="slot_tick")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--explain", type=int, default=0, metavar="N",
                    help="record the N largest buffers live at the memory peak (perf.memory_peak)")
    ap.add_argument("--moe-dispatch", default="auto", help="the MoE dispatch compiled (gmm: the Pallas kernel)")
    ap.add_argument("--param-formats", default="default", choices=["default", "compiler"],
                    help="compiler: the parameters in the layouts the compiler prefers (perf.aot.compile_report)")
    ap.add_argument("--images", type=int, default=0, help="with the released vision tower in the parameters")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from dgemma_jax.config import ModelConfig
    from dgemma_jax.perf.aot import compile_report

    cfg = ModelConfig.preset("diffusiongemma-26b-a4b")
    if args.layers < cfg.num_layers:  # the last layers of the first repeated group (5 sliding, 1 global)
        cfg = cfg.replace(num_layers=args.layers, layer_types=cfg.layer_types[6 - args.layers:6])
    rep = compile_report(cfg, "v5e-1", context=args.context, prompt=1024, batch=args.slots, programs=(args.program,),
                         quantize="int4", layers="unrolled", explain_memory=args.explain,
                         moe_dispatch=args.moe_dispatch, param_formats=args.param_formats, images=args.images)
    p = rep["programs"][args.program]
    out = {"layers": args.layers, "slots": args.slots, "program": args.program, "context": args.context,
           "moe_dispatch": rep["moe_dispatch"], "param_formats": args.param_formats, "images": args.images,
           "hbm_limit_bytes": rep["hbm_limit_bytes"], "total_bytes": p.get("total_bytes"),
           "projected_seconds": p.get("projected_seconds"), "hbm_bytes": p.get("hbm_bytes"),
           "roofline_floor_seconds": p.get("roofline_floor_seconds"),
           "fits": p.get("fits"), "memory": p.get("memory"), "compile_seconds": p.get("compile_seconds")}
    if "memory_peak" in p:
        peak = p["memory_peak"]
        out["peak"] = {"bytes_by_kind": peak["bytes_by_kind"],
                       "largest": [{k: b[k] for k in ("bytes", "shape", "op")} for b in peak["largest"]]}
    print(json.dumps(out))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
