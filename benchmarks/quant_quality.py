"""Weight-only int8 and int4 (`dgemma_jax.model.quant`) against the float weights: logits, tokens, accuracy, bytes.

    JAX_PLATFORMS=cpu python benchmarks/quant_quality.py            # writes benchmarks/results/quant_quality.json
    JAX_PLATFORMS=cpu python benchmarks/quant_quality.py --per-kind 100 --out /tmp/q.json

For each model (random configs with every norm / scale / scalar moved away from 1, as
tests/test_model_behaviour.py draws them, and the bundled model), for int8 with the tied embedding
kept float (the default) and with it quantized too, and for int4 (group-wise scales, embedding float):
* logits of the causal pass (prefill, every prompt position) and of the first and a second
  (self-conditioned) denoising pass: max / median |int8 - float|, top-1 agreement, mean KL(float ||
  int8) of the softmax;
* the same for the float weights rounded to bfloat16 (the checkpoint dtype of the real model): a
  reference perturbation, so the int8 error reads against one known to be harmless;
* generate-level token agreement (`Engine.generate`, same prompts and seed);
* parameter bytes float32 / bfloat16 / int8 (also of the 26B, from shapes alone);
* the bundled model: held-out exact match per input kind, float vs int8 (`kind_problems(sort, kind, n,
  seed=12345)`, the sampler it ships with, as docs/bundled_model.md measured it);
* the bundled image model: held-out exact match per task (pictures of digits to sort / read,
  `image_tasks.heldout_examples`), float vs int8 (tower float) vs int4 (tower int4, the default) vs
  int4 with the tower float. `--vision-only` runs this part alone and merges it into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dgemma_jax.config import ModelConfig  # noqa: E402
from dgemma_jax.engine import Engine  # noqa: E402
from dgemma_jax.model import api  # noqa: E402
from dgemma_jax.model.cache import init_cache  # noqa: E402
from dgemma_jax.model.layers import itemsize  # noqa: E402
from dgemma_jax.model.quant import param_bytes, quantize_params, quantized_shapes  # noqa: E402
from tests.reference.random_params import random_params  # noqa: E402

EVAL_SEED = 12345


def compare(ref: np.ndarray, got: np.ndarray, mask: np.ndarray | None = None) -> dict:
    """Logit error of `got` against `ref` [..., V] over the positions where `mask` is True."""
    ref, got = ref.reshape(-1, ref.shape[-1]).astype(np.float64), got.reshape(-1, got.shape[-1]).astype(np.float64)
    if mask is not None:
        keep = mask.reshape(-1)
        ref, got = ref[keep], got[keep]
    err = np.abs(ref - got)
    lp = ref - ref.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = got - got.max(-1, keepdims=True)
    lq = lq - np.log(np.exp(lq).sum(-1, keepdims=True))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"max_abs": float(err.max()), "median_abs": float(np.median(err)),
            "logit_scale_max_abs": float(np.abs(ref).max()),
            "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max()), "positions": int(ref.shape[0])}


def passes(cfg, params, tokens, lengths, canvas):
    """(prefill logits [B, T, V], first denoise logits [B, L, V], self-conditioned denoise logits)."""
    b, t = tokens.shape
    cache = init_cache(cfg, b, t + canvas.shape[1])
    pre, cache = api.prefill(params, cfg, tokens, lengths, cache)
    first = api.denoise(params, cfg, canvas, cache)
    second = api.denoise(params, cfg, canvas, cache, first)
    return [np.asarray(x) for x in (pre, first, second)]


def logit_report(cfg, variants: dict, tokens, lengths, canvas) -> dict:
    ref = passes(cfg, variants["float"], tokens, lengths, canvas)
    mask = np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]
    out = {}
    for name, params in variants.items():
        if name == "float":
            continue
        got = passes(cfg, params, tokens, lengths, canvas)
        out[name] = {"prefill": compare(ref[0], got[0], mask), "denoise_first": compare(ref[1], got[1]),
                     "denoise_self_conditioned": compare(ref[2], got[2])}
    return out


def token_agreement(cfg, variants: dict, tokens, lengths, sampler, max_new: int) -> dict:
    outs = {name: np.asarray(Engine(cfg, p, sampler).generate(tokens, lengths, rng=0, max_new_tokens=max_new).tokens)
            for name, p in variants.items()}
    ref = outs["float"]
    return {name: {"token_agreement": float((o == ref).mean()), "rows_identical": float((o == ref).all(-1).mean()),
                   "tokens": int(o.size)}
            for name, o in outs.items() if name != "float"}


def variants_of(cfg, params) -> dict:
    return {"float": params,
            "int8": quantize_params(cfg, params),
            "int8_with_embedding": quantize_params(cfg, params, embedding=True),
            "int4": quantize_params(cfg, params, "int4"),
            "bf16_rounded_reference": jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(x.dtype), params)}


def byte_report(cfg, variants) -> dict:
    f = variants["float"]
    return {"float32": param_bytes(jax.tree.map(lambda x: x.astype(jnp.float32), f)),
            "bfloat16": param_bytes(jax.tree.map(lambda x: x.astype(jnp.bfloat16), f)),
            "int8": param_bytes(variants["int8"]), "int8_with_embedding": param_bytes(variants["int8_with_embedding"]),
            "int4": param_bytes(variants["int4"])}


def shape_bytes(tree) -> int:
    return int(sum(np.prod(s.shape) * itemsize(s.dtype) for s in jax.tree.leaves(tree)))


def random_config_report(name: str, seed: int, batch: int = 4, prompt: int = 24) -> dict:
    cfg = ModelConfig.preset(name)
    params = random_params(cfg, seed)
    v = variants_of(cfg, params)
    rng = np.random.default_rng(seed + 100)
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lengths = jnp.asarray(rng.integers(prompt // 2, prompt + 1, (batch,)), jnp.int32)
    canvas = jnp.asarray(rng.integers(2, cfg.vocab_size, (batch, cfg.canvas_length)), jnp.int32)
    from dgemma_jax.sampling.config import SamplerConfig

    sampler = SamplerConfig.for_model(cfg).replace(max_denoising_steps=8)
    return {"config": name, "seed": seed, "batch": batch, "prompt": prompt,
            "bytes": byte_report(cfg, v),
            "logits": logit_report(cfg, v, tokens, lengths, canvas),
            "generate": token_agreement(cfg, v, tokens, lengths, sampler, 2 * cfg.canvas_length)}


def bundled_report(per_kind: int) -> dict:
    from dgemma_jax.training import bundled
    from dgemma_jax.training.evaluate import evaluate_exact_match, pad_prompts
    from dgemma_jax.training.tasks import DIGIT_KINDS, kind_problems

    cfg, params, sampler, tok = bundled.load_bundled()
    meta = bundled.load_metadata()
    lay = meta["layout"]
    task = meta["category_eval"]["task"]
    v = variants_of(cfg, params)
    pairs = [p for kind in DIGIT_KINDS for p in kind_problems(task, kind, 16, EVAL_SEED + 7)]
    tokens, lengths = pad_prompts([[tok.bos_id] + tok.encode(p) for p, _ in pairs], lay["prompt_length"], cfg.pad_id)
    rng = np.random.default_rng(3)
    canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (len(pairs), cfg.canvas_length)), jnp.int32)
    report = {"bytes": byte_report(cfg, v),
              "logits": logit_report(cfg, v, jnp.asarray(tokens), jnp.asarray(lengths), canvas),
              "generate": token_agreement(cfg, v, tokens, lengths, sampler,
                                          lay["num_canvases"] * lay["canvas_length"])}
    kw = dict(prompt_width=lay["prompt_length"], max_new_tokens=lay["num_canvases"] * lay["canvas_length"],
              batch_size=100, seed=EVAL_SEED)
    acc = {}
    for name in ("float", "int8", "int8_with_embedding", "int4"):
        engine = Engine(cfg, v[name], sampler)
        rows = {}
        t0 = time.time()
        for kind in DIGIT_KINDS:
            r = evaluate_exact_match(cfg, v[name], sampler, tok, kind_problems(task, kind, per_kind, EVAL_SEED),
                                     engine=engine, **kw)
            rows[kind] = {"n": r["n"], "correct": r["correct"], "accuracy": r["accuracy"],
                          "mean_steps_per_canvas": r["mean_steps_per_canvas"],
                          "failures": [f"{f['prompt']} -> {f['output']} (want {f['target']})" for f in r["failures"][:3]]}
        total = sum(x["correct"] for x in rows.values())
        acc[name] = {"kinds": rows, "correct": total, "n": per_kind * len(DIGIT_KINDS),
                     "accuracy": total / (per_kind * len(DIGIT_KINDS)), "seconds": time.time() - t0}
        print(f"  bundled {name}: {total}/{per_kind * len(DIGIT_KINDS)} "
              + " ".join(f"{k}={x['correct']}" for k, x in rows.items()), flush=True)
    report["heldout_accuracy"] = {"per_kind": per_kind, "seed": EVAL_SEED, "sampler": "the bundled model's own",
                                  "results": acc}
    return report


def vision_bundled_report(n: int) -> dict:
    """Held-out exact match of the bundled image model per task, n pictures each, per weight variant."""
    from dgemma_jax.io.bundled import VISION_NAME
    from dgemma_jax.model.quant import vision_quantized
    from dgemma_jax.training import bundled, image_tasks
    from dgemma_jax.training.evaluate import evaluate_exact_match

    cfg, params, sampler, tok = bundled.load_bundled(VISION_NAME)
    meta = bundled.load_metadata(VISION_NAME)
    lay = meta["layout"]
    variants = {"float": params, "int8": quantize_params(cfg, params, "int8"),
                "int4": quantize_params(cfg, params, "int4"),
                "int4_tower_float": quantize_params(cfg, params, "int4", vision=False)}
    kw = dict(prompt_width=lay["prompt_length"], max_new_tokens=lay["num_canvases"] * lay["canvas_length"],
              batch_size=100, seed=EVAL_SEED)
    tasks = image_tasks.tasks_from_config(meta["image_tasks"])
    problems = {t.op: image_tasks.heldout_examples([t], n, EVAL_SEED) for t in tasks}
    acc = {}
    for name, p in variants.items():
        rows, t0 = {}, time.time()
        engine = Engine(cfg, p, sampler)
        for op, probs in problems.items():
            r = evaluate_exact_match(cfg, p, sampler, tok, [(q, a) for _, q, a in probs], engine=engine,
                                     images=[im for im, _, _ in probs], **kw)
            rows[op] = {"n": r["n"], "correct": r["correct"], "accuracy": r["accuracy"],
                        "mean_steps_per_canvas": r["mean_steps_per_canvas"]}
        acc[name] = {"tasks": rows, "tower_quantized": vision_quantized(p), "param_bytes": param_bytes(p),
                     "seconds": time.time() - t0}
        print(f"  bundled image model {name}: " + " ".join(f"{op}={x['correct']}/{x['n']}" for op, x in rows.items()),
              flush=True)
    return {"model": VISION_NAME, "per_task": n, "seed": EVAL_SEED, "sampler": "the bundled model's own",
            "results": acc}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "quant_quality.json"))
    ap.add_argument("--per-kind", type=int, default=500, help="held-out bundled problems per input kind")
    ap.add_argument("--configs", default="tiny-6layer:1,tiny-2layer:2,bench:3",
                    help="random configs as preset:seed, comma separated")
    ap.add_argument("--per-task", type=int, default=500, help="held-out pictures per task of the bundled image model")
    ap.add_argument("--vision-only", action="store_true",
                    help="measure only the bundled image model and merge it into an existing --out")
    args = ap.parse_args(argv)
    t0 = time.time()
    if args.vision_only:
        with open(args.out) as f:
            out = json.load(f)
        out["bundled_image_model"] = vision_bundled_report(args.per_task)
        out["bundled_image_model"].update(date=time.strftime("%Y-%m-%d"), seconds=time.time() - t0)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"merged the bundled image model into {args.out} in {time.time() - t0:.0f} s")
        return
    out = {"what": __doc__.split("\n\n")[0], "machine": f"{os.cpu_count()} CPU cores (shared), jax {jax.__version__}",
           "backend": jax.default_backend(), "random_configs": [], "date": time.strftime("%Y-%m-%d")}
    big = ModelConfig.preset("diffusiongemma-26b-a4b")
    bf16 = shape_bytes(api.param_shapes(big))
    out["diffusiongemma_26b_bytes"] = {
        "bfloat16": bf16, "int8": shape_bytes(quantized_shapes(big)),
        "int8_with_embedding": shape_bytes(quantized_shapes(big, embedding=True)),
        "int4": shape_bytes(quantized_shapes(big, "int4")),
        "embedding_bfloat16": big.vocab_size * big.hidden_size * 2}
    print(json.dumps(out["diffusiongemma_26b_bytes"]), flush=True)
    for item in args.configs.split(","):
        name, seed = item.split(":")
        r = random_config_report(name, int(seed))
        out["random_configs"].append(r)
        print(name, json.dumps({k: {p: (m["max_abs"], m["top1_agreement"], m["kl_mean"]) for p, m in x.items()}
                                for k, x in r["logits"].items()}), json.dumps(r["generate"]), flush=True)
    out["bundled"] = bundled_report(args.per_kind)
    out["bundled_image_model"] = vision_bundled_report(args.per_task)
    print("bundled", json.dumps({k: {p: (m["max_abs"], m["top1_agreement"], m["kl_mean"]) for p, m in x.items()}
                                 for k, x in out["bundled"]["logits"].items()}), json.dumps(out["bundled"]["generate"]))
    out["seconds"] = time.time() - t0
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
