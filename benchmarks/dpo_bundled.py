"""A preference (DPO) run on the bundled text model, measured on held-out pairs before and after.

    flock /tmp/heavy.lock python benchmarks/dpo_bundled.py [--steps 150] [--nll-weights 0,1] [--out ...]

The preference (configs/dpo_bundled.py): for "s<digits>=" the chosen answer is each distinct digit once,
in order ("s3141592=" -> "123459", shorter), the rejected one the full sorted string the bundled model
was trained to give ("11234599"). Training pairs: 9-16 uniform random digits from one seed stream;
held-out pairs from another (an input with no repeated digit, where both answers are equal, is skipped).

One run per --nll-weights entry, each from the bundled weights: 0 is DPO's loss alone, w > 0 adds w times
the chosen answer's per-token NLL (rl.nll_weight, RPO's regulariser). Measured on the held-out prompts,
before (the bundled weights) and after each run (its export):

* generation, with the bundled model's released sampler, one key per prompt: the share of answers equal
  to the chosen one, equal to the rejected one, and their mean length;
* likelihood: the share of held-out pairs whose estimated log-likelihood (`likelihood.sequence_logprob`,
  8 stratified noise draws per canvas, the same noise for both answers' canvases) ranks the chosen
  answer above the rejected one, and the mean of that difference.

Runs `dgemma train`'s loop (`training.train.train`) in this process on the CPU; wall times include compiles.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.training.checkpoint import load_params
from dgemma_jax.training.data import Layout, collate
from dgemma_jax.training.evaluate import pad_prompts
from dgemma_jax.training.likelihood import sequence_logprob
from dgemma_jax.training.rl import completion_ids
from dgemma_jax.training.tasks import Task
from dgemma_jax.training.train import load_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pairs(n: int, seed: int) -> list[dict]:
    """n preference pairs from the seed stream [seed, 48]: prompts with at least one repeated digit."""
    rng = np.random.default_rng([seed, 48])
    task, out = Task("sort", 9, 16), []
    while len(out) < n:
        prompt, answer = task.sample(rng, "random")
        distinct = "".join(sorted(set(answer)))
        if distinct != answer:
            out.append({"prompt": prompt, "chosen": distinct, "rejected": answer})
    return out


def measure(cfg, params, sampler, tok, held: list[dict], layout: Layout, samples: int = 8) -> dict:
    ids = [[tok.bos_id] + tok.encode(p["prompt"]) for p in held]
    toks, lens = pad_prompts(ids, layout.prompt_length, cfg.pad_id)
    keys = jax.random.split(jax.random.key(1234), len(ids))
    out = Engine(cfg, params, sampler, batch_invariant=False, compilation_cache=False).generate(
        toks, lens, rng=keys, max_new_tokens=layout.response_capacity)
    answers = [tok.decode(c) for c in completion_ids(np.asarray(out.tokens), cfg.eos_ids)]
    chosen = collate([(i, tok.encode(p["chosen"])) for i, p in zip(ids, held)], layout)
    rejected = collate([(i, tok.encode(p["rejected"])) for i, p in zip(ids, held)], layout)
    score = jax.jit(functools.partial(sequence_logprob, rng=jax.random.key(7), config=cfg,
                                      num_canvases=layout.num_canvases, num_samples=samples))
    lp_c = np.asarray(score(params, {k: jnp.asarray(v) for k, v in chosen.items()}))
    lp_r = np.asarray(score(params, {k: jnp.asarray(v) for k, v in rejected.items()}))
    n = len(held)
    return {
        "generated_chosen": sum(a == p["chosen"] for a, p in zip(answers, held)) / n,
        "generated_rejected": sum(a == p["rejected"] for a, p in zip(answers, held)) / n,
        "generated_mean_length": float(np.mean([len(a) for a in answers])),
        "chosen_mean_length": float(np.mean([len(p["chosen"]) for p in held])),
        "rejected_mean_length": float(np.mean([len(p["rejected"]) for p in held])),
        "likelihood_prefers_chosen": float(np.mean(lp_c > lp_r)),
        "mean_logp_chosen_minus_rejected": float(np.mean(lp_c - lp_r)),
        "examples": [{"prompt": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"], "answer": a}
                     for p, a in list(zip(held, answers))[:6]],
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--nll-weights", default="0,1", help="comma list: one run per rl.nll_weight")
    ap.add_argument("--train-pairs", type=int, default=2000)
    ap.add_argument("--held-out", type=int, default=200)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "dpo_bundled.json"))
    args = ap.parse_args()

    work = args.workdir or tempfile.mkdtemp(prefix="dgemma_dpo_")
    train_path = os.path.join(work, "train_pairs.jsonl")
    os.makedirs(work, exist_ok=True)
    with open(train_path, "w") as f:
        for p in pairs(args.train_pairs, seed=0):
            f.write(json.dumps(p) + "\n")
    held = pairs(args.held_out, seed=1)
    train_prompts = {p["prompt"] for p in pairs(args.train_pairs, seed=0)}
    overlap = sum(p["prompt"] in train_prompts for p in held)

    cfg, params, sampler, tok = load_bundled()
    recipe = os.path.join(ROOT, "configs", "dpo_bundled.py")
    rc = load_config(recipe, {"data.path": train_path})
    layout = Layout(int(rc.data.prompt_length), int(rc.data.num_canvases), cfg.canvas_length,
                    eos_id=cfg.eos_ids[0], pad_id=cfg.pad_id)
    t0 = time.time()
    before = measure(cfg, params, sampler, tok, held, layout)
    t_measure = time.time() - t0

    runs = []
    for w in [float(x) for x in args.nll_weights.split(",")]:
        run_dir = os.path.join(work, f"run_nll{w:g}")
        rc = load_config(recipe, {"data.path": train_path, "train.workdir": run_dir, "train.num_steps": args.steps,
                                  "rl.nll_weight": w})
        t0 = time.time()
        train(rc)
        t_train = time.time() - t0
        after = measure(cfg, load_params(os.path.join(run_dir, "export")), sampler, tok, held, layout)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            curve = [json.loads(line) for line in f]
        runs.append({"nll_weight": w, "after": after, "train_wall_s": round(t_train, 1),
                     "train_curve": [{k: r[k] for k in ("step", "loss", "margin", "pair_accuracy", "chosen_logp",
                                                        "rejected_logp", "grad_norm") if k in r} for r in curve]})

    result = {
        "what": "DPO on the bundled digit-sorting model (dgemma-tiny-digits): prefer each distinct digit once "
                "(shorter) over the full sorted string; held-out pairs measured before and after",
        "recipe": "configs/dpo_bundled.py", "script": "benchmarks/dpo_bundled.py",
        "steps": args.steps, "batch_pairs": int(rc.data.batch_size), "dpo_beta": float(rc.rl.dpo_beta),
        "num_samples": int(rc.rl.num_samples), "peak_lr": float(rc.optimizer.peak_lr),
        "train_pairs": args.train_pairs, "held_out_pairs": len(held), "held_out_prompts_also_in_training": overlap,
        "before": before, "runs": runs, "measure_wall_s": round(t_measure, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
                    "load_average_1m_at_end": os.getloadavg()[0]},
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for k in ("generated_chosen", "generated_rejected", "generated_mean_length", "likelihood_prefers_chosen",
              "mean_logp_chosen_minus_rejected"):
        print(f"{k:34s} before {before[k]:8.3f}" + "".join(f"   after (nll {r['nll_weight']:g}) {r['after'][k]:8.3f}"
                                                         for r in runs))
    print(f"-> {args.out}")

if __name__ == "__main__":
    main()
