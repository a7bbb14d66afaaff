"""What merging LoRA adapters into a bfloat16 base costs in logits, against an all-float32 reference.

    JAX_PLATFORMS=cpu python benchmarks/lora_merge_bf16.py      # writes benchmarks/results/lora_merge_bf16.json

Model: a random config (`tests.reference.random_params`: norms / scales U(0.5, 1.5), embedding N(0, 1),
kernels N(0, 0.15)) whose base weights are rounded to bfloat16 (the checkpoint dtype), with adapters on
every group (attention, mlp, experts, self-conditioning; rank 8, alpha 16): A as `init_lora` draws it, B
random, scaled per kernel so that rms((alpha/r) A @ B) / rms(W) is the stated update ratio (LoRA's
trained updates are a small fraction of the kernel; the ratio sweep covers 0.3% to 10%).

Reference: the same model all in float32 (the bf16 base values upcast, W + (alpha/r) A @ B formed in
float32 and never rounded, float32 activations). Against it, the logits (causal pass over every valid
prompt position, and the first denoising pass) of:
* unmerged_bf16: the bf16 model running the adapters unmerged (x W + (alpha/r)(x A) B, adapters
  float32, `forward_adapters`): bf16's own rounding noise, what training and an unmerged export see;
* merged_float32_then_cast: `lora.merge` into the bf16 base (sum in float32, one rounding to bf16),
  run in bf16: what a merged bf16 export serves;
* merged_base_dtype: A @ B and the sum in bf16 (the merge the issue described), run in bf16;
* merged_float32_then_cast_f32_compute: the merged bf16 weights with float32 activations: the
  merge's weight rounding alone.
Reported per variant: max and median |logit - reference| and the reference's logit scale (max |logit|
and its standard deviation).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dgemma_jax.config import ModelConfig  # noqa: E402
from dgemma_jax.model import api  # noqa: E402
from dgemma_jax.model.cache import init_cache  # noqa: E402
from dgemma_jax.training import lora as lora_lib  # noqa: E402
from tests.reference.random_params import random_params  # noqa: E402

GROUPS = ("attention", "mlp", "experts", "self_conditioning")


def adapters_at(cfg, params, ratio: float, rank: int, alpha: float, seed: int):
    """Adapters whose update (alpha/r) A @ B has rms `ratio` x rms(W) on every adapted kernel."""
    lora = lora_lib.init_lora(cfg, params, jax.random.key(seed), rank, GROUPS)
    rng = np.random.default_rng(seed)
    out: dict = {}
    for p, ab in lora_lib._lora_leaves(lora).items():
        w = lora_lib._get(params, p)
        b = jnp.asarray(rng.normal(0, 1, ab["b"].shape), jnp.float32)
        d = lora_lib.delta(cfg, p, w.shape, ab["a"], b, alpha / rank)
        b = b * (ratio * float(jnp.sqrt(jnp.mean(jnp.square(w.astype(jnp.float32))))) /
                 float(jnp.sqrt(jnp.mean(jnp.square(d)))))
        lora_lib._set(out, p, {"a": ab["a"], "b": b})
    return out


def base_dtype_merge(cfg, params, lora, alpha: float, rank: int):
    """The merge in the kernel's dtype: A @ B, the scale and the sum all in bf16."""
    leaves = lora_lib._lora_leaves(lora)

    def fold(path, w):
        p = lora_lib.path_str(path)
        if p not in leaves:
            return w
        a, b = leaves[p]["a"].astype(w.dtype), leaves[p]["b"].astype(w.dtype)
        return w + lora_lib.delta(cfg, p, w.shape, a, b, alpha / rank)

    return jax.tree_util.tree_map_with_path(fold, params)


def logits(cfg, params, tokens, lengths, canvas, adapters=None):
    """(causal logits [B, T, V], first denoising logits [B, L, V]) as float64 numpy."""
    b, t = tokens.shape
    cache = init_cache(cfg, b, t + canvas.shape[1])
    pre, cache = api.encode_pass(params, cfg, tokens, jnp.zeros((b,), jnp.int32), lengths, cache, "all",
                                 adapters=adapters)
    den = api.denoise_logits(params, cfg, canvas, lengths, cache, adapters=adapters)
    return np.asarray(pre, np.float64), np.asarray(den, np.float64)


def errors(ref, got, mask) -> dict:
    out = {}
    for name, r, g, m in (("prefill", ref[0], got[0], mask), ("denoise_first", ref[1], got[1], None)):
        e = np.abs(r - g)
        if m is not None:
            e, r = e[m], r[m]
        out[name] = {"max_abs": float(e.max()), "median_abs": float(np.median(e)), "rms": float(np.sqrt((e ** 2).mean())),
                     "logit_scale_max_abs": float(np.abs(r).max()), "logit_std": float(r.std())}
    return out


def base_params(cfg, init: str, seed: int):
    """float32 params: "init" (`init_params`, the model's own initialisation) or "random"
    (`tests.reference.random_params`: every norm and scale away from 1, a larger logit scale)."""
    return api.init_params(cfg, jax.random.key(seed)) if init == "init" else random_params(cfg, seed)


def run(preset: str, init: str, ratios, rank: int, alpha: float, seed: int, batch: int = 4, prompt: int = 24) -> dict:
    cfg32 = ModelConfig.preset(preset).replace(dtype="float32", param_dtype="float32")
    cfg16 = cfg32.replace(dtype="bfloat16", param_dtype="bfloat16")
    base16 = jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.bfloat16), base_params(cfg32, init, seed))
    base32 = jax.tree.map(lambda x: x.astype(jnp.float32), base16)  # the bf16 values, exactly
    rng = np.random.default_rng(seed + 1)
    tokens = jnp.asarray(rng.integers(2, cfg32.vocab_size, (batch, prompt)), jnp.int32)
    lengths = jnp.asarray(rng.integers(prompt // 2, prompt + 1, (batch,)), jnp.int32)
    canvas = jnp.asarray(rng.integers(0, cfg32.vocab_size, (batch, cfg32.canvas_length)), jnp.int32)
    mask = np.arange(prompt)[None, :] < np.asarray(lengths)[:, None]
    rows = []
    for ratio in ratios:
        lora = adapters_at(cfg32, base32, ratio, rank, alpha, seed + 2)
        ref = logits(cfg32, lora_lib.merge(cfg32, base32, lora, alpha, rank), tokens, lengths, canvas)
        merged = lora_lib.merge(cfg16, base16, lora, alpha, rank)
        variants = {
            "unmerged_bf16": logits(cfg16, base16, tokens, lengths, canvas,
                                    lora_lib.forward_adapters(cfg16, base16, lora, alpha, rank)),
            "merged_float32_then_cast": logits(cfg16, merged, tokens, lengths, canvas),
            "merged_base_dtype": logits(cfg16, base_dtype_merge(cfg16, base16, lora, alpha, rank), tokens, lengths,
                                        canvas),
            "merged_float32_then_cast_f32_compute": logits(
                cfg32, jax.tree.map(lambda x: x.astype(jnp.float32), merged), tokens, lengths, canvas),
        }
        row = {"update_ratio": ratio, **{k: errors(ref, v, mask) for k, v in variants.items()}}
        noise = row["unmerged_bf16"]["prefill"]["max_abs"]
        row["merged_over_unmerged_noise_prefill_max"] = row["merged_float32_then_cast"]["prefill"]["max_abs"] / noise
        row["base_dtype_over_unmerged_noise_prefill_max"] = row["merged_base_dtype"]["prefill"]["max_abs"] / noise
        rows.append(row)
        print(f"{preset} ({init}) ratio {ratio}: unmerged bf16 {noise:.4f}, merged f32->bf16 "
              f"{row['merged_float32_then_cast']['prefill']['max_abs']:.4f}, base-dtype merge "
              f"{row['merged_base_dtype']['prefill']['max_abs']:.4f} (max |logit err|, prefill; scale "
              f"{row['unmerged_bf16']['prefill']['logit_scale_max_abs']:.2f})", flush=True)
    return {"preset": preset, "params": init, "rank": rank, "alpha": alpha, "groups": list(GROUPS), "seed": seed,
            "batch": batch, "prompt": prompt, "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", default="tiny-6layer")
    ap.add_argument("--inits", default="init,random", help="base weights: init (init_params), random (random_params)")
    ap.add_argument("--ratios", default="0.003,0.01,0.03,0.1")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "lora_merge_bf16.json"))
    args = ap.parse_args(argv)
    t0 = time.time()
    ratios = [float(r) for r in args.ratios.split(",")]
    result = {"benchmark": "lora_merge_bf16", "command": "python benchmarks/lora_merge_bf16.py " + " ".join(argv or
                                                                                                   sys.argv[1:]),
              "backend": jax.default_backend(), "machine": platform.processor() or platform.machine(),
              "models": [run(p, i, ratios, args.rank, args.alpha, args.seed) for p in args.presets.split(",")
                         for i in args.inits.split(",")]}
    result["seconds"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
