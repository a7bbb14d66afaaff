"""What batch-invariant generation costs: the invariant blocks against one non-invariant batched program.

    python benchmarks/batch_invariance.py [--out benchmarks/results/batch_invariance.json]

Two models, 8 prompts of different lengths in two prompt-width buckets (so the batched program pads
every row to the longer bucket) with one seed each, on this machine's CPU, in one run: the bundled
model (digit prompts) and the random 12-layer config of tests/test_batch_invariance.py (its 8
prompts; random weights, whose near-uniform logits make the sampler sensitive to rounding).
Per model and mode, the wall time of a warm `generate` of the batch of 8 (median of --repeats, the
modes' calls interleaved so that they see the same load), of each prompt alone (summed over the 8),
how many program calls and distinct compiled programs one batch of 8 takes, and how many of the 8
rows give other tokens than the same prompt with the same seed alone (and reordered):

- `batched`: `Engine(batch_invariant=False)`: one fused program for the batch, rows padded to the
  longest prompt and cache; not invariant (the reference of issue 46's 1.25x bound). A prompt alone in
  this mode runs the program shaped by itself alone (what the invariant default ran before it batched);
- `invariant`: `Engine(batch_invariant=True)`, the default: the call's rows as one block of exactly
  their number whatever their prompt lengths, prefill in canvas-length chunks, attention in fixed key
  blocks (a prompt alone: a 1-row program);
- `blocks8`: `Engine(batch_invariant=8)`: the same programs in blocks of exactly 8 rows (a prompt
  alone fills its block with 7 copies).

`programs_per_batch` counts the fused-program calls and the compiles one batch adds (a jit's cache
size); the invariant program is the same one on a TPU (one block: one program call, its shapes fixed
by the block's widest prompt and longest cache), so a batch of 8 compiles one program there too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.pipeline import DiffusionGemma

# two prompt-width buckets (16 and 24 tokens with BOS)
PROMPTS = ["s3=", "s91=", "s4172=", "s904215=", "s31415926535=", "s8877665544332211=", "s55012=",
           "s99887766554433221="]
SEEDS = [3, 1, 4, 1, 5, 9, 2, 6]
MODES = {"batched": False, "invariant": True, "blocks8": 8}


def _random_12layer():
    """The random 12-layer model and prompts of tests/test_batch_invariance.py."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tests import test_batch_invariance as t

    from dgemma_jax import init_params

    model = DiffusionGemma(t.CFG, init_params(t.CFG, 0), t.TOK, t.SAMPLER)
    return "random-12layer", model, t.TEXTS, t.SEEDS


def _counted(eng, n):
    """The engine's fused program wrapped to count its calls; returns (calls list, compiled count fn)."""
    calls, program = [], eng.fused_program

    def counted(*a, **k):
        fn = program(*a, **k)

        def call(*x, **y):
            calls.append(tuple(y["prompt_tokens"].shape) + (y["cache"].max_length,))
            return fn(*x, **y)
        return call

    eng.fused_program = counted
    return calls, lambda: program(n)._cache_size()


def _measure(model, prompts, seeds, n, repeats):
    cfg, sampler = model.config, model.sampler
    tokens, lengths = model.encode_batch(prompts)
    engines = {mode: Engine(cfg, model.params, sampler, batch_invariant=v) for mode, v in MODES.items()}
    res = dict(model=cfg.name, num_layers=cfg.num_layers, batch=len(prompts), prompt_lengths=lengths.tolist(),
               load_average_before=os.getloadavg()[0], modes={})
    order = list(range(len(prompts)))[::-1]
    for mode, eng in engines.items():
        calls, compiled = _counted(eng, n)
        before = compiled()
        out = np.asarray(eng.generate(tokens, lengths, rng=seeds, max_new_tokens=n).tokens)
        per_batch = dict(calls=len(calls), shapes=sorted(set(calls)), compiled=compiled() - before)
        moved = np.asarray(eng.generate(tokens[order], lengths[order], rng=[seeds[i] for i in order],
                                        max_new_tokens=n).tokens)
        alone = [np.asarray(eng.generate(tokens[i:i + 1, :lengths[i]], lengths[i:i + 1], rng=[seeds[i]],
                                         max_new_tokens=n).tokens)[0] for i in range(len(prompts))]
        res["modes"][mode] = dict(
            programs_per_batch=per_batch,
            rows_differing_from_alone=sum(not np.array_equal(out[i], alone[i]) for i in range(len(prompts))),
            rows_differing_reordered=sum(not np.array_equal(moved[order.index(i)], alone[i])
                                         for i in range(len(prompts))),
            texts=[model.tokenizer.decode_generated(a, skip_special=True) for a in alone])
    times = {m: {"batch8": [], "alone_sum": []} for m in engines}
    for _ in range(repeats):
        for mode, eng in engines.items():
            t = time.perf_counter()
            jax.block_until_ready(eng.generate(tokens, lengths, rng=seeds, max_new_tokens=n).tokens)
            times[mode]["batch8"].append(time.perf_counter() - t)
            t = time.perf_counter()
            for i in range(len(prompts)):
                jax.block_until_ready(eng.generate(tokens[i:i + 1, :lengths[i]], lengths[i:i + 1], rng=[seeds[i]],
                                                   max_new_tokens=n).tokens)
            times[mode]["alone_sum"].append(time.perf_counter() - t)
    for mode in engines:
        res["modes"][mode]["batch8_ms"] = round(1e3 * statistics.median(times[mode]["batch8"]), 2)
        res["modes"][mode]["eight_alone_ms"] = round(1e3 * statistics.median(times[mode]["alone_sum"]), 2)
        res["modes"][mode]["batch8_ms_all"] = [round(1e3 * x, 2) for x in times[mode]["batch8"]]
    base = res["modes"]["batched"]["batch8_ms"]
    res["batch8_over_batched"] = {m: round(res["modes"][m]["batch8_ms"] / base, 3) for m in engines}
    res["load_average_after"] = os.getloadavg()[0]
    print(json.dumps(res))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_invariance.json"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--models", default="bundled,random-12layer", help="which models, comma-separated")
    ap.add_argument("--tpu", default=None, metavar="TOPOLOGY",
                    help="also compile the bundled model's invariant program for a batch of 8 for this TPU topology "
                         "(compile-only devices, `perf.aot.compile_report`); with --models '' only that, added "
                         "to an existing --out file")
    args = ap.parse_args(argv)
    if args.tpu and not args.models:
        with open(args.out) as f:
            out_all = json.load(f)
        out_all["tpu"] = _tpu(args.tpu, args.new_tokens)
        with open(args.out, "w") as f:
            json.dump(out_all, f, indent=1)
        return
    n = args.new_tokens
    out_all = dict(command=" ".join(["python benchmarks/batch_invariance.py", *(sys.argv[1:] if argv is None else argv)]),
                   device=jax.devices()[0].device_kind, cpus=os.cpu_count(), machine=platform.machine(),
                   new_tokens=n, repeats=args.repeats, models={})
    for name, model, prompts, seeds in (("bundled", DiffusionGemma.from_pretrained(None), PROMPTS, SEEDS),
                                        _random_12layer()):
        if name not in args.models.split(","):
            continue
        out_all["models"][name] = _measure(model, prompts, seeds, n, args.repeats)
        _write(args.out, out_all)   # after each model: a long run keeps what it measured
    if args.tpu:
        out_all["tpu"] = _tpu(args.tpu, n)
    _write(args.out, out_all)


def _write(path: str, out: dict):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def _tpu(topology: str, n: int) -> dict:
    """The bundled model's batch-invariant generate program for one block of 8 rows (the batch's
    widest prompt bucket, 24, and its cache, 128 slots at most for these prompts) compiled for a TPU:
    the one program such a batch runs there."""
    from dgemma_jax.perf.aot import compile_report

    model = DiffusionGemma.from_pretrained(None)
    t = time.perf_counter()
    report = compile_report(model.config, topology, batch=8, context=128, prompt=24, programs=("generate",),
                            max_new_tokens=n, sampler=model.sampler)
    entry = report["programs"]["generate"]
    return dict(topology=topology, batch=8, prompt_width=24, cache_length=128, programs_compiled=1,
                fits=entry["fits"], compile_seconds=entry.get("compile_seconds"),
                total_bytes=entry.get("total_bytes"), wall_seconds=round(time.perf_counter() - t, 1),
                calls_per_batch_of_8=_tpu_calls(model, n))


def _tpu_calls(model, n: int) -> dict:
    """How a TPU engine runs the batch of 8 (program calls, distinct program shapes) per mode, from its
    plan (`Engine._blocks`; nothing runs): the default runs row by row there (`rows_share_programs`)."""
    from dgemma_jax.runtime import Runtime

    tokens, lengths = model.encode_batch(PROMPTS)
    out = {}
    for mode, value in MODES.items():
        if value is False:
            out[mode] = dict(calls=1, shapes=1)
            continue
        eng = Engine(model.config, model.params, model.sampler, batch_invariant=value,
                     runtime=Runtime(platform="tpu"), compilation_cache=False)
        rows = eng._prepare_rows(tokens, lengths, SEEDS, n, None, None, None)
        blocks = [(b[1][0].shape, b[1][3].max_length) for b in eng._blocks(rows)]
        out[mode] = dict(calls=len(blocks), shapes=len({(shape, cache) for shape, cache in blocks}))
    return out


if __name__ == "__main__":
    main()
