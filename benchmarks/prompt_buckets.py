"""What prompt-width buckets save: several prompts of nearby lengths, one after another, as a chat or
a notebook sends them, through `Engine.generate` with buckets (the default) and with exact shapes.

Bench config (`ModelConfig.preset("bench")`, random float32 weights), one canvas of 256 tokens per
prompt, 16 denoising steps (early stop off), batch 1. Each prompt's wall time includes whatever
compilation it triggers; the persistent compilation cache is off, so a new shape compiles for real.
Then both engines run every prompt again, warm and alternated: the padding's own cost.
The two engines get the same prompts in the same order. The padding is masked, so the two differ
only in the order of floating-point sums: the script records how far that moves the first denoiser
pass's logits, and how many sampled tokens still agree (a sampler fed slightly different logits can
pick another token at a near tie, and the canvas then goes its own way).

    python benchmarks/prompt_buckets.py --out benchmarks/results/prompt_buckets.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark modules

import jax  # noqa: E402
import numpy as np  # noqa: E402

import dgemma_jax as dg  # noqa: E402
from dgemma_jax import ModelConfig, init_params  # noqa: E402
from dgemma_jax.engine import Engine  # noqa: E402
from dgemma_jax.engine.inputs import bucket_length, prepare_inputs  # noqa: E402
from dgemma_jax.perf.report import machine_info, write  # noqa: E402
from dgemma_jax.sampling import SamplerConfig  # noqa: E402

STEPS = 16


def run(engine: Engine, prompts, max_new: int) -> dict:
    times, tokens = [], []
    before = engine.fused_program(max_new)._cache_size()
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        out = engine.generate(p[None], None, rng=i, max_new_tokens=max_new)
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - t0)
        tokens.append(np.asarray(out.tokens))
        assert (np.asarray(out.steps) == STEPS).all(), "early stop fired"
    return {"seconds_per_prompt": [round(t, 3) for t in times], "total_s": round(sum(times), 2),
            "programs_compiled": engine.fused_program(max_new)._cache_size() - before, "tokens": tokens}


def first_pass_logit_difference(cfg, params, sampler, prompt, max_new: int) -> dict:
    """The first denoiser pass (prefill, then one canvas) at the exact and at the bucketed shapes:
    how far the padding moves the logits (only the order of sums changes; the padding is masked)."""
    canvas = jax.random.randint(jax.random.key(1), (1, sampler.canvas_length), 0, cfg.vocab_size)
    logits = {}
    for bucket in (False, True):
        tokens, lengths, s, _, _ = prepare_inputs(cfg, sampler, prompt[None], None, max_new, bucket=bucket)
        _, cache = dg.prefill(params, cfg, tokens, lengths, dg.init_cache(cfg, 1, s), logits="none")
        logits[bucket] = np.asarray(dg.denoise(params, cfg, canvas, cache), np.float64)
    diff = np.abs(logits[True] - logits[False])
    return {"max_abs": float(diff.max()), "median_abs": float(np.median(diff)),
            "max_abs_logit": float(np.abs(logits[False]).max()),
            "argmax_agreement": float((logits[True].argmax(-1) == logits[False].argmax(-1)).mean())}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="300,317,329,342,356,361,370,383",
                    help="prompt lengths, in the order sent (default: one bucket, 384)")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]

    cfg = ModelConfig.preset("bench")
    params = init_params(cfg, 0)
    sampler = SamplerConfig(canvas_length=256, max_denoising_steps=STEPS, stability_threshold=STEPS + 1,
                            eos_ids=(), pad_id=0)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(3, cfg.vocab_size, n).astype(np.int32) for n in lengths]
    res = {"machine": machine_info(), "config": "bench", "steps": STEPS, "canvas": 256, "max_new_tokens": 256,
           "prompt_lengths": lengths, "buckets": sorted({bucket_length(n) for n in lengths})}
    exact, bucketed = Engine(cfg, params, sampler, bucket=False), Engine(cfg, params, sampler)
    for name, engine in (("exact_shapes", exact), ("buckets", bucketed)):
        print(f"{name}, cold ...", flush=True)
        res[name] = run(engine, prompts, 256)
        print(f"  {res[name]['total_s']} s, {res[name]['programs_compiled']} programs", flush=True)
    # the padding's own price once nothing compiles: both engines warm, alternated prompt by prompt
    print("both warm, alternated ...", flush=True)
    warm = {"exact_shapes": [], "buckets": []}
    for _ in range(2):
        for p in prompts:
            for name, engine in (("exact_shapes", exact), ("buckets", bucketed)):
                warm[name].append(run(engine, [p], 256))
    for name, runs in warm.items():
        assert all(r["programs_compiled"] == 0 for r in runs)
        res[name]["warm_median_s"] = round(float(np.median([r["total_s"] for r in runs])), 3)
    res["padding_cost_warm"] = round(res["buckets"]["warm_median_s"] / res["exact_shapes"]["warm_median_s"], 3)
    ta, tb = res["exact_shapes"].pop("tokens"), res["buckets"].pop("tokens")
    res["same_tokens"] = [bool(np.array_equal(a, b)) for a, b in zip(ta, tb)]
    res["token_agreement"] = [round(float((a == b).mean()), 4) for a, b in zip(ta, tb)]
    res["first_pass_logits"] = [first_pass_logit_difference(cfg, params, sampler, p, 256) for p in prompts]
    res["speedup_total"] = round(res["exact_shapes"]["total_s"] / res["buckets"]["total_s"], 2)
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    write(res, args.out)


if __name__ == "__main__":
    main()
