"""Would a `lax.scan` over repeated layer groups pay off? (performance issue: "scan over repeated
layer groups if it cuts compile time without slowing the step")

The 26B model repeats one 6-layer group (5 sliding + 1 global) five times. A scan would compile
the group once instead of unrolling 30 layers, but needs every weight and cache array stacked per
group position, which the loop body then slices per iteration. This script measures both sides on
the real `Block` code at the bench widths (hidden 512, 16 experts top-4, context 512, canvas 256,
float32) with G groups:

- the denoise trunk (all blocks, no head) unrolled vs scanned: compile time and step time on this
  CPU, alternating the two compiled programs in one process, and the largest output difference;
- with `--tpu v5e-1` (needs `jax[tpu]`): the same two programs AOT-compiled for the TPU topology in
  bfloat16: compile time, and the compiler's FLOP count (does the scan recompute anything?). Nothing
  runs, so the TPU step time stays unknown until it is measured on hardware.

    python benchmarks/scan_layers.py --groups 5 --tpu v5e-1 --out benchmarks/results/scan_layers.json

The stacking here is a prototype (the library keeps one parameter subtree per layer).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark modules

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemm_ceiling import samples  # noqa: E402
from dgemma_jax.config import GLOBAL, SLIDING, ModelConfig  # noqa: E402
from dgemma_jax.model.api import param_shapes  # noqa: E402
from dgemma_jax.model.cache import init_cache  # noqa: E402
from dgemma_jax.model.block import Block  # noqa: E402
from dgemma_jax.perf.compiled import compile_timed, cost  # noqa: E402
from dgemma_jax.perf.report import write  # noqa: E402
from dgemma_jax.runtime import Runtime  # noqa: E402

GROUP = (SLIDING,) * 5 + (GLOBAL,)
CONTEXT, CANVAS = 512, 256


def group_config(groups: int, dtype: str = "float32", preset: str = "bench") -> ModelConfig:
    return ModelConfig.preset(preset, num_layers=len(GROUP) * groups, layer_types=GROUP * groups,
                              dtype=dtype, param_dtype=dtype)


def _stack(trees):
    return jax.tree.map(lambda *a: jnp.stack(a), *trees)


def trunk_programs(cfg: ModelConfig, rt: Runtime | None = None):
    """(unrolled, scanned, to_stacked): two functions of the same denoise trunk (run as `rt` says,
    default `Runtime()`), and the argument conversion from per-layer lists to per-group-position stacks."""
    rt = rt or Runtime()
    n, g = len(GROUP), cfg.num_layers // len(GROUP)

    def unrolled(blocks, x, context_end, keys, values):
        for i in range(cfg.num_layers):
            x = Block(cfg, rt, i).apply({"params": blocks[i]}, x, context_end, keys[i], values[i], method="denoise")
        return x

    def scanned(stacked, x, context_end, keys, values):
        def body(x, xs):
            p, k, v = xs
            for j in range(n):  # Block(cfg, rt, j) has layer j's type, shared by every group
                x = Block(cfg, rt, j).apply({"params": p[j]}, x, context_end, k[j], v[j], method="denoise")
            return x, None

        return jax.lax.scan(body, x, (stacked, keys, values))[0]

    def to_stacked(blocks, keys, values):
        pick = lambda seq, j: [seq[gi * n + j] for gi in range(g)]  # noqa: E731
        return ([_stack(pick(blocks, j)) for j in range(n)], [jnp.stack(pick(keys, j)) for j in range(n)],
                [jnp.stack(pick(values, j)) for j in range(n)])

    return unrolled, scanned, to_stacked


def cpu_inputs(cfg: ModelConfig, seed: int = 0, context: int = CONTEXT, canvas: int = CANVAS):
    from dgemma_jax.model.api import init_params

    params = init_params(cfg, seed)
    blocks = [params[f"blocks_{i}"] for i in range(cfg.num_layers)]
    cache = init_cache(cfg, 1, context + canvas)
    keys = [jax.random.normal(jax.random.key(seed + 10 + i), k.shape, k.dtype) for i, k in enumerate(cache.keys)]
    values = [jax.random.normal(jax.random.key(seed + 90 + i), v.shape, v.dtype) for i, v in enumerate(cache.values)]
    x = jax.random.normal(jax.random.key(seed + 7), (1, canvas, cfg.hidden_size), jnp.float32)
    return blocks, x, jnp.array([context], jnp.int32), keys, values


def run_cpu(groups: int, rounds: int) -> dict:
    cfg = group_config(groups)
    unrolled, scanned, to_stacked = trunk_programs(cfg)
    blocks, x, ce, keys, values = cpu_inputs(cfg)
    sb, sk, sv = to_stacked(blocks, keys, values)
    progs = {"unrolled": (unrolled, (blocks, x, ce, keys, values)), "scan": (scanned, (sb, x, ce, sk, sv))}
    out = {}
    for name, (fn, args) in progs.items():
        compiled, t = compile_timed(jax.jit(fn), *args)
        out[name] = {"compile": t, "samples_s": [], "_c": compiled, "_a": args}
    for _ in range(rounds):  # alternate so drift hits both alike
        for rec in out.values():
            rec["samples_s"] += samples(lambda: jax.block_until_ready(rec["_c"](*rec["_a"])), 1, warm=1)
    a = np.asarray(out["unrolled"]["_c"](*out["unrolled"]["_a"]))
    b = np.asarray(out["scan"]["_c"](*out["scan"]["_a"]))
    diff = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
    for rec in out.values():
        rec.pop("_c"), rec.pop("_a")
        rec["median_s"] = float(np.median(rec["samples_s"]))
    return {"layers": cfg.num_layers, "max_rel_diff": diff, **out,
            "scan_over_unrolled_step": out["scan"]["median_s"] / out["unrolled"]["median_s"]}


def run_tpu(groups: int, topo: str) -> dict:
    from dgemma_jax.perf.aot import tpu_devices

    dev = tpu_devices(topo)[0]
    cfg = group_config(groups, "bfloat16")
    unrolled, scanned, _ = trunk_programs(cfg)
    shapes = param_shapes(cfg)
    sds = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(dev))  # noqa: E731
    blocks = [jax.tree.map(sds, shapes[f"blocks_{i}"]) for i in range(cfg.num_layers)]
    cache = jax.eval_shape(lambda: init_cache(cfg, 1, CONTEXT + CANVAS))
    keys, values = [sds(k) for k in cache.keys], [sds(v) for v in cache.values]
    x = sds(jax.ShapeDtypeStruct((1, CANVAS, cfg.hidden_size), jnp.bfloat16))
    ce = sds(jax.ShapeDtypeStruct((1,), jnp.int32))
    n, g = len(GROUP), groups
    stk = lambda s: jax.ShapeDtypeStruct((g,) + s.shape, s.dtype, sharding=s.sharding)  # noqa: E731
    sb = [jax.tree.map(stk, blocks[j]) for j in range(n)]
    sk, sv = [stk(keys[j]) for j in range(n)], [stk(values[j]) for j in range(n)]
    compile_timed(jax.jit(lambda a: a * 2), x)  # the first TPU compile also initialises the compiler: keep it out
    out = {}
    for name, fn, args in (("unrolled", unrolled, (blocks, x, ce, keys, values)), ("scan", scanned, (sb, x, ce, sk, sv))):
        compiled, t = compile_timed(jax.jit(fn), *args)
        out[name] = {"compile": t, "flops": cost(compiled)["flops"]}
    # cost_analysis takes a loop body once: G x the scan's count vs the unrolled count shows whether the
    # scan recomputes anything. (No HBM-traffic comparison: our HLO reader also takes the body once and
    # counts an async slice of a stacked operand at the operand's full size, so it cannot compare them.)
    out["scan"]["flops_x_groups_over_unrolled"] = out["scan"]["flops"] * groups / out["unrolled"]["flops"]
    return {"topology": topo, "layers": cfg.num_layers, "dtype": "bfloat16", **out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=5, help="6-layer groups (the 26B has 5)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tpu", default="", help="also AOT-compile both for this TPU topology, e.g. v5e-1")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.groups < 1:
        raise SystemExit("--groups must be >= 1")
    res = {"machine": {"python": platform.python_version(), "jax": jax.__version__, "cpus": os.cpu_count()},
           "config": {"widths": "bench", "group": list(GROUP), "groups": args.groups, "context": CONTEXT,
                      "canvas": CANVAS},
           "cpu": run_cpu(args.groups, args.rounds)}
    if args.tpu:
        res["tpu"] = run_tpu(args.groups, args.tpu)
    c = res["cpu"]
    print(f"CPU, {c['layers']} layers: trunk unrolled {c['unrolled']['median_s'] * 1e3:.1f} ms, "
          f"scan {c['scan']['median_s'] * 1e3:.1f} ms ({c['scan_over_unrolled_step']:.2f}x); compile "
          f"{c['unrolled']['compile']['compile_s']:.1f} s vs {c['scan']['compile']['compile_s']:.1f} s; "
          f"max rel diff {c['max_rel_diff']:.1e}")
    if args.tpu:
        t = res["tpu"]
        print(f"TPU {t['topology']} AOT compile: unrolled {t['unrolled']['compile']['compile_s']:.1f} s, "
              f"scan {t['scan']['compile']['compile_s']:.1f} s; FLOPs scan x groups / unrolled "
              f"{t['scan']['flops_x_groups_over_unrolled']:.3f}")
    write(res, args.out)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
