"""How well the bundled digit-sorting model fills the missing middle of a sorted digit string.

    python benchmarks/infill_digits.py [--cases 100] [--out benchmarks/results/infill_digits.json]

Each case is a fresh sort problem (`training.tasks.Task("sort", 9, 16)` drawn from a seed the training
never used): prompt "s<digits>=", answer the sorted digits. The answer is cut at two random points
into prefix | middle | suffix (the middle at least one digit, the suffix at least one); the prefix goes
at the end of the prompt, the suffix to `DiffusionGemma.generate(..., suffix=)`, and the case counts as
correct when the returned middle is exactly the missing one (so prefix + middle + suffix is the sorted
string). The middle's budget is 16 tokens: all 17 lengths 0..16 are tried (`Engine.infill`). Also
recorded: how often the chosen length is the true one, and how often the cut falls on a canvas
boundary (prefix of 0 or 8 digits: the layouts the model was trained on) and the accuracy there.
Runs on this machine's CPU (wall time includes compilation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np

from dgemma_jax.pipeline import DiffusionGemma
from dgemma_jax.training.tasks import Task


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--data-seed", type=int, default=20261205)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "infill_digits.json"))
    args = ap.parse_args()
    model = DiffusionGemma.from_pretrained()
    tok = model.tokenizer
    rng = np.random.default_rng(args.data_seed)
    task = Task("sort", 9, 16)
    rows, t0 = [], time.perf_counter()
    for i in range(args.cases):
        prompt, answer = task.sample(rng)
        a = int(rng.integers(0, len(answer) - 1))
        b = int(rng.integers(a + 1, len(answer)))
        prefix, middle, suffix = answer[:a], answer[a:b], answer[b:]
        ids = tok.encode(prompt + prefix, add_bos=True)
        out = model.engine.infill(np.asarray([ids], np.int32), suffixes=[tok.encode(suffix)], rng=i,
                                  max_new_tokens=16)
        got = tok.decode(out.middles[0], skip_special=True)
        rows.append(dict(prompt=prompt, prefix=prefix, middle=middle, suffix=suffix, got=got, correct=got == middle,
                         chosen_length=int(out.lengths[0]), true_length=len(middle), steps=int(out.steps[0])))
        print(f"{i}: {prompt}{prefix} | {middle} | {suffix} -> {got} {'ok' if got == middle else 'WRONG'}", flush=True)
    wall = time.perf_counter() - t0
    aligned = [r for r in rows if len(r["prefix"]) in (0, 8)]
    result = {
        "what": "bundled dgemma-tiny-digits: the missing middle of a sorted digit string, by infill (suffix pinned "
                "on the canvas, middle lengths 0..16 tried, the most likely by the causal pass kept)",
        "cases": len(rows),
        "accuracy": sum(r["correct"] for r in rows) / len(rows),
        "length_chosen_right": sum(r["chosen_length"] == r["true_length"] for r in rows) / len(rows),
        "canvas_aligned_cases": len(aligned),
        "canvas_aligned_accuracy": (sum(r["correct"] for r in aligned) / len(aligned)) if aligned else None,
        "wall_s_total_incl_compile": round(wall, 1),
        "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)",
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
