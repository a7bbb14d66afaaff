"""Does the default engine's batch invariance hold beyond the tested models? (issue 46)

    PYTHONPATH=. python benchmarks/batch_invariance_configs.py [--out benchmarks/results/batch_invariance_configs.json]

`Engine(batch_invariant=True)` (the default) can run a call's rows as one program of exactly their number;
what keeps a row's bits independent of the others is built in for the prompt width (prefill in
canvas-length passes) and the cache length (attention over fixed key blocks), but for the row count
it rests on the matmuls' per-row results not depending on how many rows they hold, which a lone
XLA:CPU matmul does not promise (`batch_invariance_ops.json`). This script measures it on random
models of several widths, canvas lengths, dtypes and quantizations: 6 prompts of random tokens and
lengths 3-50, each alone, all 6 together and 3 of them reordered, two canvases each; a row "differs"
when its tokens are not those it gets alone. Random weights make the logits near uniform, so the
sampler turns any rounding difference into other tokens. The engine batches a call's rows by default
only where no row differed here (`engine.rows_share_programs`: float32 activations on a CPU); this
script makes every config batch them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

from dgemma_jax import ModelConfig, init_params
from dgemma_jax.engine import Engine
from dgemma_jax.engine import engine as engine_lib
from dgemma_jax.sampling import SamplerConfig

LENGTHS = [3, 7, 12, 20, 33, 50]
SEEDS = [5, 6, 7, 8, 9, 10]
SUBSET = [4, 0, 2]

# a wider model (4 layers, 8 experts, canvas 32) in float32, bfloat16 and with int4 weights
WIDE = dict(hidden_size=256, num_layers=4, layer_types=(), head_dim=64, global_head_dim=64, intermediate_size=1024,
            num_experts=8, moe_intermediate_size=256, sliding_window=32, canvas_length=32, vocab_size=1024)
CONFIGS = {
    "tiny-2layer (hidden 64, canvas 16)": (dict(), None),
    "tiny-2layer, canvas 8": (dict(canvas_length=8), None),
    "hidden 256, 4 layers, canvas 32": (WIDE, None),
    "hidden 256, 4 layers, canvas 32, bfloat16": (dict(WIDE, dtype="bfloat16", param_dtype="bfloat16"), None),
    "hidden 256, 4 layers, canvas 32, int4": (WIDE, "int4"),
    "hidden 512, 2 layers, canvas 64, 16 experts top 4": (dict(hidden_size=512, head_dim=64, global_head_dim=128,
                                                               num_heads=8, num_kv_heads=4, intermediate_size=1024,
                                                               num_experts=16, top_k=4, moe_intermediate_size=256,
                                                               sliding_window=64, canvas_length=64,
                                                               vocab_size=4096), None),
}


def _measure(overrides: dict, quantize) -> dict:
    cfg = ModelConfig.preset("tiny-2layer", **overrides)
    sampler = SamplerConfig(canvas_length=cfg.canvas_length, max_denoising_steps=6, eos_ids=(1,))
    eng = Engine(cfg, init_params(cfg, 0), sampler, quantize=quantize)
    rng = np.random.default_rng(0)
    tokens = np.zeros((len(LENGTHS), max(LENGTHS)), np.int32)
    for r, n in enumerate(LENGTHS):
        tokens[r, :n] = rng.integers(3, cfg.vocab_size, n)
    lengths = np.array(LENGTHS, np.int32)
    new = 2 * cfg.canvas_length
    t = time.perf_counter()
    alone = [np.asarray(eng.generate(tokens[i:i + 1, :n], lengths[i:i + 1], rng=[SEEDS[i]],
                                     max_new_tokens=new).tokens)[0] for i, n in enumerate(LENGTHS)]
    both = np.asarray(eng.generate(tokens, lengths, rng=SEEDS, max_new_tokens=new).tokens)
    sub = np.asarray(eng.generate(tokens[SUBSET], lengths[SUBSET], rng=[SEEDS[i] for i in SUBSET],
                                  max_new_tokens=new).tokens)
    return dict(rows=len(LENGTHS), distinct_answers=len({a.tobytes() for a in alone}),
                differ_in_batch_of_6=sum(not np.array_equal(both[i], alone[i]) for i in range(len(LENGTHS))),
                differ_in_batch_of_3=sum(not np.array_equal(sub[r], alone[i]) for r, i in enumerate(SUBSET)),
                seconds=round(time.perf_counter() - t, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "batch_invariance_configs.json"))
    args = ap.parse_args(argv)
    # what `batch_invariant=True` would run for every config if it always batched a call's rows (the
    # engine decides per dtype and device from these results, `rows_share_programs`)
    engine_lib.rows_share_programs = lambda config, runtime: True
    out = dict(command=" ".join(["python benchmarks/batch_invariance_configs.py",
                                 *(sys.argv[1:] if argv is None else argv)]),
               device=f"{jax.devices()[0].device_kind}, jax {jax.__version__}", cpus=os.cpu_count(), configs={})
    for name, (overrides, quantize) in CONFIGS.items():
        out["configs"][name] = _measure(overrides, quantize)
        print(name, out["configs"][name], flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
