"""How far a prompt's first-pass logits move between alone and a batch of 8 (the batched program's shapes).

    PYTHONPATH=. python benchmarks/batch_invariance_logits.py

The random 12-layer config and 8 prompts of tests/test_batch_invariance.py, float32 and int8: prefill +
one denoiser pass over one random canvas per row, each prompt alone (its own prompt width and cache
length) and in the batch of 8 (right-padded to the longest, cache of 48); the max |difference| of each
row's logits -> benchmarks/results/batch_invariance_logits.json.
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dgemma_jax as dg  # noqa: E402
from tests import test_batch_invariance as t  # noqa: E402

cfg = t.CFG
params = dg.init_params(cfg, 0)
tokens, lengths, _ = t._ids(range(8))
canvas = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, cfg.canvas_length), dtype=np.int32)
out = {}
for q in (None, "int8"):
    p = params if q is None else dg.quantize_params(cfg, params)
    def logits(tok, ln, cv, s, p=p):
        cache = dg.init_cache(cfg, tok.shape[0], s)
        _, cache = dg.prefill(p, cfg, tok, ln, cache, logits="none")
        return np.asarray(dg.denoise(p, cfg, cv, cache))
    batch = logits(tokens, lengths, canvas, 48)
    d = []
    for i in range(8):
        n = int(lengths[i])
        alone = logits(tokens[i:i+1, :n], lengths[i:i+1], canvas[i:i+1], n + 16)
        d.append(float(np.abs(alone[0] - batch[i]).max()))
    out["float32" if q is None else "int8"] = d
    print(q, d, flush=True)
out["what"] = "max |logits alone - logits in the batch of 8| per prompt (prompt order of TEXTS)"
with open(os.path.join(os.path.dirname(__file__), "results", "batch_invariance_logits.json"), "w") as f:
    json.dump(out, f, indent=1)
