#!/usr/bin/env python
"""RL (GRPO, exact-match reward) on the bundled image model, on the CPU: evaluate the bundled model on
held-out pictures, train configs/rl_vision_digits.py from it, evaluate the result the same way, and write

    benchmarks/results/rl_vision_bundled.json   before / after per instruction, steps, wall time, curves
    benchmarks/results/rl_vision_curves.png     reward per step and held-out exact match vs step

With --install, and only when both instructions reach --target (0.98) held out, the result replaces
dgemma_jax/assets/dgemma-tiny-vision-digits (its metadata records the RL run).

Usage:  python scripts/rl_vision_bundled.py [--workdir /tmp/dgemma_rl_vision] [--eval-n 500] [--fresh] [--install]
        python scripts/rl_vision_bundled.py --skip-train     # re-evaluate the workdir's export/
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

EVAL_SEED = 12345                     # the bundled model's held-out table (scripts/train_vision_bundled.py)
CI_SAMPLE = {"n": 100, "seed": 2024}  # tests/test_image_training.py's sort sample


def plot_curves(metrics, evals, out_png, before=None, after=None, last_step=None):
    from dgemma_jax.training.plots import _plt, _save

    plt = _plt()
    if plt is None or not metrics:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot([r["step"] for r in metrics], [r["reward_mean"] for r in metrics], lw=1.0, alpha=0.7,
            label="mean exact-match reward of the rollouts (sort 3 : read 1)")
    kept = [r for r in metrics if r.get("groups_kept") is not None]
    if kept:   # dynamic sampling (rl.skip_equal_groups): the update's fraction of groups with reward variance
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in kept], [r["groups_kept"] for r in kept], lw=0.8, alpha=0.5, color="gray")
        ax2.set_ylim(0.0, 1.0)
        ax2.set_ylabel("groups kept (gray): update's groups with differing rewards", fontsize=8, color="gray")
    if evals:
        ax.plot([r["step"] for r in evals], [r["accuracy"] for r in evals], "o-", lw=1.5,
                label=f"held-out exact match ({evals[0].get('n', '?')} pictures, same mix)")
    for op, marker in (("sort", "s"), ("read", "^")):
        if before and after and op in before:
            ax.plot([0, last_step], [before[op]["accuracy"], after[op]["accuracy"]], marker + "--", lw=1.0,
                    label=f"held out, {op!r} alone ({before[op]['n']} pictures): before / after")
    ax.set_xlabel("RL step")
    ax.set_ylabel("exact match")
    ax.set_ylim(min(0.8, min(r["reward_mean"] for r in metrics) - 0.02), 1.0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("GRPO on the bundled image model (configs/rl_vision_digits.py)", fontsize=10)
    fig.tight_layout()
    _save(fig, out_png)
    plt.close(fig)
    return out_png


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "rl_vision_digits.py"))
    ap.add_argument("--workdir", default="/tmp/dgemma_rl_vision")
    ap.add_argument("--eval-n", type=int, default=500, help="held-out pictures per instruction")
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--skip-train", action="store_true", help="evaluate the workdir's export/")
    ap.add_argument("--fresh", action="store_true", help="delete the workdir first (no resume)")
    ap.add_argument("--baseline-only", action="store_true", help="evaluate the bundled model and stop")
    ap.add_argument("--install", action="store_true", help="replace the bundled model if --target is reached")
    ap.add_argument("--target", type=float, default=0.98)
    ap.add_argument("--resume-before", action="store_true",
                    help="take the bundled model's numbers from an earlier results JSON (same --eval-n)")
    ap.add_argument("--set", nargs="*", default=[], help="recipe overrides key=value")
    args = ap.parse_args(argv)

    import jax

    from dgemma_jax.io.bundled import load_bundled, load_metadata
    from dgemma_jax.training import bundled, image_tasks
    from dgemma_jax.training.evaluate import evaluate_exact_match
    from dgemma_jax.training.plots import read_jsonl
    from dgemma_jax.training.recipe import plain
    from dgemma_jax.training.train import load_config

    overrides = {"train.workdir": args.workdir}
    for kv in args.set:
        k, v = kv.split("=", 1)
        overrides[k] = json.loads(v) if v[:1] in "0123456789-[{tf" else v
    cfg = load_config(args.config, overrides)
    name = plain(cfg.init)["name"]
    mcfg, base_params, sampler, tok = load_bundled(name)
    base_meta = load_metadata(name)
    specs = plain(cfg.data)["image_tasks"]
    tasks = image_tasks.tasks_from_config(specs)
    lay = plain(cfg.data)
    from dgemma_jax.io.images import settings_for

    kw = dict(prompt_width=int(lay["prompt_length"]), max_new_tokens=int(lay["num_canvases"]) * mcfg.canvas_length,
              batch_size=100, image_settings=settings_for(mcfg, lay.get("max_soft_tokens")))

    def evaluate(params, task, n, seed):
        problems = image_tasks.heldout_examples([task], n, seed)
        r = evaluate_exact_match(mcfg, params, sampler, tok, [(p, a) for _, p, a in problems], seed=seed,
                                 images=[im for im, _, _ in problems], **kw)
        return {k: r[k] for k in ("n", "correct", "accuracy", "mean_steps_per_canvas", "tokens_per_forward",
                                  "seconds", "failures")}

    def evaluate_all(params, label):
        out = {}
        for task in tasks:
            r = evaluate(params, task, args.eval_n, EVAL_SEED)
            out[task.op] = r
            print(f"{label} {task.op!r}: {r['correct']}/{r['n']} = {r['accuracy']:.4f} ({r['seconds']:.0f} s)",
                  flush=True)
        sort = next(t for t in tasks if t.op == "sort")
        out["ci_sample_sort"] = evaluate(params, sort, CI_SAMPLE["n"], CI_SAMPLE["seed"])["accuracy"]
        return out

    res_path = os.path.join(args.results, "rl_vision_bundled.json")
    before = None
    if args.resume_before and os.path.exists(res_path):  # a resumed run: the bundled model's numbers again
        with open(res_path) as f:
            prev = json.load(f)
        if prev["held_out"]["n_per_instruction"] == args.eval_n:
            before = prev["before"]
    before = before or evaluate_all(base_params, "bundled (before)")
    if args.baseline_only:
        return
    t0 = time.time()
    run, params, summary = bundled.train_or_reload(cfg, args.workdir, args.skip_train, args.fresh)
    wall = time.time() - t0
    after = evaluate_all(params, "after RL")
    metrics = read_jsonl(os.path.join(args.workdir, "metrics.jsonl"))
    evals = read_jsonl(os.path.join(args.workdir, "eval.jsonl"))
    png = plot_curves(metrics, evals, os.path.join(args.results, "rl_vision_curves.png"), before, after,
                      summary.get("steps"))
    reached = all(after[t.op]["accuracy"] >= args.target for t in tasks)
    result = {
        "recipe": os.path.relpath(args.config, ROOT), "overrides": args.set,
        "recipe_values": {k: plain(getattr(cfg, k)) for k in ("data", "optimizer", "rl", "train")},
        "reproduce": "python scripts/rl_vision_bundled.py --fresh" + (" --set " + " ".join(args.set) if args.set else ""),
        "held_out": {"seed": EVAL_SEED, "n_per_instruction": args.eval_n, "sampler": "the bundled model's"},
        "before": before, "after": after, "target": args.target, "target_reached": reached,
        "steps": summary.get("steps"), "train_seconds": summary.get("train_seconds"),
        "stopped_by_time_limit": summary.get("stopped_by_time_limit"), "wall_seconds_incl_eval": round(wall, 1),
        "machine": f"{os.cpu_count()} CPU cores (shared with other jobs), jax {jax.__version__}",
        "load_average_at_end": os.getloadavg(),
        "reward_curve": [{"step": r["step"], "reward_mean": r.get("reward_mean"), "kl": r.get("kl"),
                          "groups_all_equal": r.get("groups_all_equal"), "groups_kept": r.get("groups_kept"),
                          "rollout_rounds": r.get("rollout_rounds"), "time_s": r.get("time_s")} for r in metrics],
        "accuracy_curve": [{k: r[k] for k in ("step", "accuracy", "n") if k in r} for r in evals],
        "curves_png": os.path.relpath(png, ROOT) if png else None,
        "installed": False, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.install and reached:
        meta = dict(base_meta)
        meta["rl"] = {k: result[k] for k in ("recipe", "reproduce", "steps", "train_seconds", "before")}
        meta["eval"] = {t.op: {k: v for k, v in after[t.op].items()} | {"seed": EVAL_SEED, "prompt": t.prompt}
                        for t in tasks}
        meta["ci_sample"] = {**CI_SAMPLE, "accuracy": after["ci_sample_sort"]}
        meta["created"] = result["created"]
        bundled.save_bundled(bundled.asset_path(name), mcfg, params, sampler, tok, meta)
        result["installed"] = True
        print(f"installed into {bundled.asset_path(name)}", flush=True)
    os.makedirs(args.results, exist_ok=True)
    with open(res_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {res_path}; target reached: {reached}", flush=True)


if __name__ == "__main__":
    main()
