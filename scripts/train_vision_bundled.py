#!/usr/bin/env python
"""Reproduce the bundled image model: train configs/train_vision_digits.py from scratch on the CPU,
evaluate it on held-out pictures with the real sampler, and write

    dgemma_jax/assets/dgemma-tiny-vision-digits/   the checkpoint, configs, tokenizer, metadata
    examples/digits.png                            a held-out picture for `dgemma generate --image`
    benchmarks/results/bundled_vision_training.json, bundled_vision_loss_curve.png

Usage:  python scripts/train_vision_bundled.py [--workdir /tmp/dgemma_vision] [--eval-n 500] [--fresh]
        python scripts/train_vision_bundled.py --skip-train     # re-evaluate the workdir's export/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

CI_SAMPLE = {"n": 100, "seed": 2024}   # tests/test_image_training.py evaluates exactly this sample
EVAL_SEED = 12345
EXAMPLE = {"seed": 7, "digits": "5190"}  # examples/digits.png: a picture no training batch drew


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "train_vision_digits.py"))
    ap.add_argument("--workdir", default="/tmp/dgemma_vision")
    ap.add_argument("--eval-n", type=int, default=500, help="held-out pictures per task")
    ap.add_argument("--assets", default=None, help="output asset dir (default dgemma_jax/assets/<model name>)")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--example", default=os.path.join(ROOT, "examples", "digits.png"))
    ap.add_argument("--skip-train", action="store_true", help="evaluate/export an existing workdir")
    ap.add_argument("--fresh", action="store_true", help="delete the workdir first (no resume)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from PIL import Image

    from dgemma_jax.training import bundled, image_tasks
    from dgemma_jax.training.evaluate import evaluate_exact_match
    from dgemma_jax.training.plots import plot_loss_curve, read_jsonl
    from dgemma_jax.training.recipe import plain
    from dgemma_jax.training.train import load_config

    cfg = load_config(args.config, {"train.workdir": args.workdir})
    run, params, summary = bundled.train_or_reload(cfg, args.workdir, args.skip_train, args.fresh)
    mcfg, sampler, tok, lay = run.model_config, run.sampler, run.tokenizer, run.layout
    specs = plain(cfg.data)["image_tasks"]
    tasks = image_tasks.tasks_from_config(specs)
    kw = dict(prompt_width=lay.prompt_length, max_new_tokens=lay.response_capacity, batch_size=100,
              image_settings=run.source.settings)

    def evaluate(task, n, seed):
        problems = image_tasks.heldout_examples([task], n, seed)
        return evaluate_exact_match(mcfg, params, sampler, tok, [(p, a) for _, p, a in problems], seed=seed,
                                    images=[im for im, _, _ in problems], **kw)

    evals = {}
    for task in tasks:
        print(f"evaluating {task.op!r} on {args.eval_n} held-out pictures ...", flush=True)
        r = evaluate(task, args.eval_n, EVAL_SEED)
        evals[task.op] = {k: v for k, v in r.items()} | {"seed": EVAL_SEED, "prompt": task.prompt}
        print(f"  {r['correct']}/{r['n']} = {r['accuracy']:.4f}, steps/canvas {r['mean_steps_per_canvas']:.2f}",
              flush=True)
    sort_task = next(t for t in tasks if t.op == "sort")
    ci = evaluate(sort_task, CI_SAMPLE["n"], CI_SAMPLE["seed"])

    picture = image_tasks.draw_digits(EXAMPLE["digits"], np.random.default_rng(EXAMPLE["seed"]))
    os.makedirs(os.path.dirname(args.example), exist_ok=True)
    Image.fromarray(picture).save(args.example)

    n_params = int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
    n_vision = int(sum(np.prod(x.shape) for k, x in params.items() if k in ("vision_tower", "embed_vision")
                       for x in jax.tree_util.tree_leaves(x)))
    curve = read_jsonl(os.path.join(args.workdir, "eval.jsonl"))
    metadata = {
        "name": mcfg.name,
        "description": "DiffusionGemma-architecture model with a Gemma 4 vision tower, trained from scratch on the "
                       "CPU to read 4-6 digits drawn into a 128x32 picture and sort them.",
        "recipe": "configs/train_vision_digits.py",
        "reproduce": "python scripts/train_vision_bundled.py --fresh",
        "image_tasks": specs,
        "prompt_format": "BOS + <|image> + 64 x <|image|> + <image|> + instruction (prompt_with_images)",
        "layout": dataclasses.asdict(lay),
        "num_params": n_params,
        "num_vision_params": n_vision,
        "train_steps": summary.get("steps"),
        "train_seconds": summary.get("train_seconds"),
        "stopped_by_time_limit": summary.get("stopped_by_time_limit"),
        "train_batch_size": int(plain(cfg.data)["batch_size"]),
        "final_train_metrics": summary.get("final_metrics"),
        "machine": f"{os.cpu_count()} CPU cores, jax {jax.__version__}",
        "sampler": dataclasses.asdict(sampler),
        "eval": evals,
        "ci_sample": {"n": CI_SAMPLE["n"], "seed": CI_SAMPLE["seed"], "accuracy": ci["accuracy"]},
        "learning_curve": [{k: r[k] for k in ("step", "accuracy", "n") if k in r} for r in curve],
        "example": {"path": "examples/digits.png", "digits": EXAMPLE["digits"], "seed": EXAMPLE["seed"],
                    "answer": "".join(sorted(EXAMPLE["digits"]))},
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = args.assets or bundled.asset_path(mcfg.name)
    bundled.save_bundled(out, mcfg, params, sampler, tok, metadata)
    print(f"wrote {out} and {args.example}", flush=True)
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "bundled_vision_training.json"), "w") as f:
        json.dump({k: v for k, v in metadata.items()} | {"load_average_at_end": os.getloadavg()}, f, indent=1)
    plot_loss_curve(os.path.join(args.workdir, "metrics.jsonl"),
                    os.path.join(args.results, "bundled_vision_loss_curve.png"),
                    eval_path=os.path.join(args.workdir, "eval.jsonl"))
    print(f"wrote {args.results}", flush=True)


if __name__ == "__main__":
    main()
