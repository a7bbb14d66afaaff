"""What batch-invariant generation costs: one batched program vs each prompt as its own program.

    python benchmarks/batch_invariance.py [--out benchmarks/results/batch_invariance.json]

Two models, 8 prompts of different lengths with one seed each, on this machine's CPU, in one run: the
bundled model (digit prompts) and the random 12-layer config of tests/test_batch_invariance.py (its
8 prompts; a model of random weights, whose near-uniform logits make the sampler sensitive to rounding).
Per model: `Engine(batch_invariant=False)` (one fused program for the batch of 8, padded to the longest
prompt) and `Engine(batch_invariant=True)` (the default: each prompt its own batch-1 program, shaped
by that prompt alone, run one after another). Per mode: the wall time of a warm `generate` (median
of --repeats, the two modes' calls interleaved), the denoising loop iterations it ran (batched: per
canvas the slowest row's steps, for all 8 rows at once; row by row: every row's own steps), the time
per iteration, XLA's memory
analysis of the compiled programs (batched: the one program; row by row: the largest of the row
programs, since they run one at a time), and how many of the 8 rows give other tokens than the
same prompt with the same seed alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time

import jax
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.engine.programs import compiled_memory
from dgemma_jax.pipeline import DiffusionGemma

PROMPTS = ["s3=", "s91=", "s4172=", "s904215=", "s31415926535=", "s27182818=", "s55012=", "s8642097531=",]
SEEDS = [3, 1, 4, 1, 5, 9, 2, 6]


def _random_12layer():
    """The random 12-layer model and prompts of tests/test_batch_invariance.py."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests import test_batch_invariance as t

    from dgemma_jax import init_params

    model = DiffusionGemma(t.CFG, init_params(t.CFG, 0), t.TOK, t.SAMPLER)
    return "random-12layer", model, t.TEXTS, t.SEEDS


def _timed(fns: dict, repeats: int) -> dict:
    """{name: (last output, median seconds)}; the functions' calls interleaved, so that both modes see the
    same load on a shared machine."""
    for fn in fns.values():
        jax.block_until_ready(fn().tokens)  # compile and warm up
    times = {k: [] for k in fns}
    outs = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            outs[k] = fn()
            jax.block_until_ready(outs[k].tokens)
            times[k].append(time.perf_counter() - t)
    return {k: (outs[k], statistics.median(times[k])) for k in fns}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_invariance.json"))
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    n = args.new_tokens
    out_all = dict(command="python benchmarks/batch_invariance.py " + " ".join(argv or []),
                   device=jax.devices()[0].device_kind, cpus=os.cpu_count(), machine=platform.machine(),
                   new_tokens=n, repeats=args.repeats, models={})
    for name, model, prompts, seeds in (("bundled", DiffusionGemma.from_pretrained(None), PROMPTS, SEEDS),
                                        _random_12layer()):
        out_all["models"][name] = _measure(model, prompts, seeds, n, args.repeats)
        out_all["models"][name]["load_average_after"] = os.getloadavg()[0]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out_all, f, indent=1)


def _measure(model, prompts, seeds, n, repeats):
    cfg, sampler = model.config, model.sampler
    tokens, lengths = model.encode_batch(prompts)
    res = dict(model=cfg.name, num_layers=cfg.num_layers, batch=len(prompts), prompt_lengths=lengths.tolist(),
               load_average_before=os.getloadavg()[0], modes={})
    engines = {mode: Engine(cfg, model.params, sampler, batch_invariant=invariant)
               for mode, invariant in (("batched", False), ("row_by_row", True))}
    timed = _timed({mode: functools.partial(eng.generate, tokens, lengths, rng=seeds, max_new_tokens=n)
                    for mode, eng in engines.items()}, repeats)
    for mode, eng in engines.items():
        invariant = eng.batch_invariant
        out, wall = timed[mode]
        steps = np.asarray(out.steps)
        iterations = int(steps.max(0).sum()) if not invariant else int(steps.sum())
        fn = eng.fused_program(n)
        if invariant:
            rows = eng._prepare_rows(tokens, lengths, seeds, n, None, None, None)
            mems = [compiled_memory(fn.lower(eng.params, prompt_tokens=t, prompt_lengths=ln, cache=c, keys=k,
                                             seed_canvas=None, pinned=None, images=None).compile())
                    for t, ln, k, c, _, _, _ in rows]
            mem = max(mems, key=lambda m: m.get("total_bytes", 0))
        else:
            t, ln, k, c, _, _, _ = eng._prepare(tokens, lengths, seeds, n, None, None, None)
            mem = compiled_memory(fn.lower(eng.params, prompt_tokens=t, prompt_lengths=ln, cache=c, keys=k,
                                           seed_canvas=None, pinned=None, images=None).compile())
        differ = 0
        for i in range(len(prompts)):
            m = int(lengths[i])
            alone = eng.generate(tokens[i:i + 1, :m], lengths[i:i + 1], rng=[seeds[i]], max_new_tokens=n)
            differ += not np.array_equal(np.asarray(alone.tokens)[0], np.asarray(out.tokens)[i])
        res["modes"][mode] = dict(generate_ms=round(wall * 1e3, 2), loop_iterations=iterations,
                                  ms_per_iteration=round(wall * 1e3 / max(iterations, 1), 3),
                                  denoiser_passes_per_row=steps.sum(1).tolist(), memory=mem,
                                  rows_differing_from_alone=differ)
        print(mode, json.dumps(res["modes"][mode]))
    b, r = res["modes"]["batched"], res["modes"]["row_by_row"]
    res["row_by_row_over_batched"] = dict(
        generate_time=round(r["generate_ms"] / b["generate_ms"], 3),
        peak_program_bytes=round(r["memory"].get("total_bytes", 0) / max(b["memory"].get("total_bytes", 1), 1), 3))
    print(json.dumps(res["row_by_row_over_batched"]))
    return res


if __name__ == "__main__":
    main()
