#!/usr/bin/env python
"""Reproduce the bundled model: train configs/train_bundled.py from scratch on the CPU, evaluate it
with the real sampler, sweep max_denoising_steps, and write

    dgemma_jax/assets/dgemma-tiny-digits/      the checkpoint, configs, tokenizer, metadata
    benchmarks/results/bundled_step_sweep.{json,png}, bundled_tokens_per_forward.png,
    benchmarks/results/bundled_loss_curve.png, bundled_training.json

Besides the held-out sample of the training mix, it evaluates each input kind of
dgemma_jax/training/tasks.py (DIGIT_KINDS: random, all-same, dominant digit, two distinct digits,
leading zeros, sorted, reverse sorted) on its own held-out problems (`--category-n` each, eval seed
!= data seed) and writes the per-category table.

Usage:  python scripts/train_bundled.py [--workdir /tmp/dgemma_bundled] [--eval-n 1000] [--sweep-n 500]
        python scripts/train_bundled.py --skip-train     # re-evaluate the workdir's export/
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CI_SAMPLE = {"n": 100, "seed": 2024}     # tests/test_training_bundled.py evaluates exactly this sample
CI_CATEGORIES = {"n": 100, "seed": 2024}  # ... and these per-category samples
EVAL_SEED = 12345
SWEEP_STEPS = (1, 2, 4, 8, 16, 48)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "train_bundled.py"))
    ap.add_argument("--workdir", default="/tmp/dgemma_bundled")
    ap.add_argument("--steps", type=int, default=None, help="override train.num_steps")
    ap.add_argument("--eval-n", type=int, default=1000)
    ap.add_argument("--sweep-n", type=int, default=500)
    ap.add_argument("--category-n", type=int, default=500, help="held-out problems per input kind")
    ap.add_argument("--assets", default=None, help="output asset dir (default dgemma_jax/assets/<model name>)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--skip-train", action="store_true", help="evaluate/export an existing workdir")
    ap.add_argument("--fresh", action="store_true", help="delete the workdir first (no resume)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from dgemma_jax.training import bundled
    from dgemma_jax.training.evaluate import evaluate_exact_match, sweep_steps
    from dgemma_jax.training.tasks import DIGIT_KINDS, kind_problems
    from dgemma_jax.training.plots import plot_loss_curve, plot_step_sweep, plot_tokens_per_forward
    from dgemma_jax.training.recipe import plain
    from dgemma_jax.training.train import load_config

    overrides = {"train.workdir": args.workdir}
    if args.steps:
        overrides["train.num_steps"] = args.steps
    cfg = load_config(args.config, overrides)
    t0 = time.time()
    run, params, summary = bundled.train_or_reload(cfg, args.workdir, args.skip_train, args.fresh)
    wall_train = time.time() - t0
    mcfg, sampler, tok = run.model_config, run.sampler, run.tokenizer
    lay = run.layout
    tasks = plain(cfg.data)["tasks"]
    meta_tasks = {"tasks": tasks}
    kw = dict(prompt_width=lay.prompt_length, max_new_tokens=lay.response_capacity, batch_size=100)

    print(f"evaluating on {args.eval_n} held-out examples ...", flush=True)
    main_eval = evaluate_exact_match(mcfg, params, sampler, tok, bundled.heldout_pairs(meta_tasks, args.eval_n, EVAL_SEED),
                                     seed=EVAL_SEED, **kw)
    ci_eval = evaluate_exact_match(mcfg, params, sampler, tok,
                                   bundled.heldout_pairs(meta_tasks, CI_SAMPLE["n"], CI_SAMPLE["seed"]),
                                   seed=CI_SAMPLE["seed"], **kw)
    print(json.dumps({k: v for k, v in main_eval.items() if k != "samples"}), flush=True)
    sort_spec = next(t for t in tasks if t["name"] == "sort")
    categories, ci_categories = {}, {}
    print(f"per-category eval: {args.category_n} held-out problems per kind ...", flush=True)
    for kind in DIGIT_KINDS:
        r = evaluate_exact_match(mcfg, params, sampler, tok, kind_problems(sort_spec, kind, args.category_n, EVAL_SEED),
                                 seed=EVAL_SEED, **kw)
        categories[kind] = {k: r[k] for k in ("n", "correct", "accuracy", "mean_steps_per_canvas",
                                              "tokens_per_forward", "failures")}
        c = evaluate_exact_match(mcfg, params, sampler, tok,
                                 kind_problems(sort_spec, kind, CI_CATEGORIES["n"], CI_CATEGORIES["seed"]),
                                 seed=CI_CATEGORIES["seed"], **kw)
        ci_categories[kind] = c["correct"]
        print(f"  {kind:14s} {r['correct']}/{r['n']} = {r['accuracy']:.4f}   (CI sample {c['correct']}/{c['n']})"
              + (f"   e.g. {r['failures'][0]}" if r["failures"] else ""), flush=True)
    print(f"sweeping max_denoising_steps {SWEEP_STEPS} on {args.sweep_n} examples ...", flush=True)
    sweep = sweep_steps(mcfg, params, sampler, tok, bundled.heldout_pairs(meta_tasks, args.sweep_n, EVAL_SEED + 1),
                        steps=SWEEP_STEPS, seed=EVAL_SEED + 1, **kw)
    for r in sweep:
        print(json.dumps(r), flush=True)

    import dataclasses

    n_params = int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
    metadata = {
        "name": mcfg.name,
        "description": "DiffusionGemma-architecture model trained from scratch on the CPU to sort digit strings "
                       "(answers of 9-16 digits + EOS span 2-3 canvases of 8).",
        "recipe": "configs/train_bundled.py",
        "reproduce": "python scripts/train_bundled.py --fresh",
        "tasks": tasks,
        "prompt_format": "BOS + '<task letter><input>=' (see dgemma_jax/training/tasks.py)",
        "layout": dataclasses.asdict(lay),
        "num_params": n_params,
        "train_steps": summary.get("steps"),
        "train_seconds": summary.get("train_seconds"),
        "train_batch_size": int(plain(cfg.data)["batch_size"]),
        "final_train_metrics": summary.get("final_metrics"),
        "machine": f"{os.cpu_count()} CPU cores (shared), jax {jax.__version__}",
        "sampler": dataclasses.asdict(sampler),
        "eval": {k: v for k, v in main_eval.items()} | {"seed": EVAL_SEED},
        "ci_sample": {"n": CI_SAMPLE["n"], "seed": CI_SAMPLE["seed"], "accuracy": ci_eval["accuracy"]},
        "category_eval": {"seed": EVAL_SEED, "task": sort_spec,
                          "generator": "dgemma_jax.training.tasks.kind_problems(task, kind, n, seed)",
                          "kinds": categories},
        "ci_categories": {"n": CI_CATEGORIES["n"], "seed": CI_CATEGORIES["seed"], "correct": ci_categories},
        "step_sweep": sweep,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = args.assets or bundled.asset_path(mcfg.name)
    bundled.save_bundled(out, mcfg, params, sampler, tok, metadata)
    print(f"wrote {out}", flush=True)

    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "bundled_step_sweep.json"), "w") as f:
        json.dump({"model": mcfg.name, "n": args.sweep_n, "sampler": dataclasses.asdict(sampler),
                   "rows": sweep}, f, indent=1)
    with open(os.path.join(args.results, "bundled_training.json"), "w") as f:
        json.dump({k: v for k, v in metadata.items() if k != "step_sweep"} | {"wall_seconds_train_call": wall_train,
                   "load_average_at_end": os.getloadavg()},
                  f, indent=1)
    title = f"{mcfg.name}: sort 9-16 digits, canvas {mcfg.canvas_length}, n={args.sweep_n}"
    plot_step_sweep(sweep, os.path.join(args.results, "bundled_step_sweep.png"), title)
    plot_tokens_per_forward(sweep, os.path.join(args.results, "bundled_tokens_per_forward.png"), mcfg.canvas_length,
                            f"{mcfg.name}: tokens per forward pass")
    plot_loss_curve(os.path.join(args.workdir, "metrics.jsonl"), os.path.join(args.results, "bundled_loss_curve.png"),
                    eval_path=os.path.join(args.workdir, "eval.jsonl"))
    print(f"wrote {args.results}", flush=True)


if __name__ == "__main__":
    main()
