"""Batch invariance from one batched program: two designs against the engine's two modes.

    python benchmarks/batch_invariance_slots.py [--out benchmarks/results/batch_invariance_slots.json]

The server's slots (`serving.Scheduler`) run every row in one batched tick program whose shapes depend
only on (slots, context), so a row's tokens do not depend on the other rows. This measures whether the
engine could get its batch invariance from one batched program instead of running each prompt as its
own batch-1 program: the two models, 8 prompts and seeds of `benchmarks/batch_invariance.py` (the
bundled model; the random 12-layer config of tests/test_batch_invariance.py), 32 new tokens, on this
machine's CPU. Per mode the wall time of a warm batch of 8 (median of
--repeats, the modes' calls interleaved so that they see the same load), and how many rows differ
from the same prompt and seed alone in that mode:

- `batched`: `Engine(batch_invariant=False).generate` (one fused program for the batch, not invariant
  by construction: the reference of the issue's 1.25x bound);
- `row_by_row`: `Engine(batch_invariant=True).generate` (the default: each row its own program);
- `slots`: a `Scheduler(slots=8, context=--context)`, the 8 requests submitted at once (each prompt
  prefilled alone into its slot, then the slots' denoising steps in one program), timed from the
  first submit to the last request's end;
- `blocks8`, `blocks4`: `Engine(batch_invariant=8 / 4)`: the rows grouped by the shapes each gets
  alone (prompt-width bucket and cache length), each group run in blocks of exactly 8 (4) rows (a
  short block filled with copies of its first row): a row's program shape then depends on the row
  alone, as a slot's does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import threading
import time

import jax
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.pipeline import load_checkpoint
from dgemma_jax.serving.scheduler import Request, Scheduler

from batch_invariance import PROMPTS, SEEDS, _random_12layer  # noqa: E402  (same models, prompts and seeds)

BLOCKS = (8, 4)


def _slots_run(sch, tok, sampler, prompts, seeds, n_new):
    """Submit every prompt at once; returns each one's generated ids (in prompt order)."""
    done, final, lock = threading.Event(), {}, threading.Lock()

    def collector(i):
        def on_event(ev):
            if ev.finish_reason is not None:
                with lock:
                    final[i] = ev.token_ids
                    if len(final) == len(prompts):
                        done.set()
        return on_event

    for i, (p, s) in enumerate(zip(prompts, seeds)):
        sch.submit(Request(tok.encode(p, add_bos=True), n_new, sampler, s, on_event=collector(i)))
    if not done.wait(600):
        raise RuntimeError("the scheduler did not finish")
    return [tuple(final[i]) for i in range(len(prompts))]


def _engine_run(engine, tok, prompts, seeds, n_new, pad_id):
    ids = [tok.encode(p, add_bos=True) for p in prompts]
    tokens = np.zeros((len(ids), max(map(len, ids))), np.int32)
    for r, x in enumerate(ids):
        tokens[r, :len(x)] = x
    out = engine.generate(tokens, np.array([len(x) for x in ids], np.int32), rng=list(seeds), max_new_tokens=n_new)
    return [tuple(int(t) for t in row if t != pad_id) for row in np.asarray(out.tokens)]


def _measure(cfg, params, sampler, tok, prompts, seeds, n, context, repeats):
    batched = Engine(cfg, params, sampler, batch_invariant=False)
    row_by_row = Engine(cfg, params, sampler)
    blocks = {n: Engine(cfg, params, sampler, batch_invariant=n) for n in BLOCKS}
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=len(prompts), context=context)
    sch.start()
    try:
        runs = {
            "batched": lambda ps, ss: _engine_run(batched, tok, ps, ss, n, sampler.pad_id),
            "row_by_row": lambda ps, ss: _engine_run(row_by_row, tok, ps, ss, n, sampler.pad_id),
            "slots": lambda ps, ss: _slots_run(sch, tok, sampler, ps, ss, n),
        }
        runs.update({f"blocks{b}": functools.partial(lambda e, ps, ss: _engine_run(e, tok, ps, ss, n, sampler.pad_id),
                                                     blocks[b]) for b in BLOCKS})
        result = {}
        for name, run in runs.items():
            alone = [run([p], [s])[0] for p, s in zip(prompts, seeds)]   # also compiles every program
            together = run(prompts, seeds)
            reordered = run(prompts[::-1], seeds[::-1])[::-1]
            result[name] = dict(rows_differing_from_alone=sum(a != b for a, b in zip(alone, together)),
                                rows_differing_reordered=sum(a != b for a, b in zip(alone, reordered)),
                                texts=[tok.decode(list(t), skip_special=True) for t in together])
        times = {k: [] for k in runs}
        load_before = os.getloadavg()[0]
        for _ in range(repeats):
            for name, run in runs.items():
                t = time.perf_counter()
                run(prompts, seeds)
                times[name].append(time.perf_counter() - t)
        for name in runs:
            result[name]["batch8_ms"] = round(1e3 * statistics.median(times[name]), 2)
    finally:
        sch.stop()
    base = result["batched"]["batch8_ms"]
    return dict(model=cfg.name, num_layers=cfg.num_layers, batch=len(prompts),
                prompt_tokens=[len(tok.encode(p, add_bos=True)) for p in prompts],
                load_average_before=round(load_before, 2), load_average_after=round(os.getloadavg()[0], 2),
                modes=result, over_batched={k: round(result[k]["batch8_ms"] / base, 3) for k in runs})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "batch_invariance_slots.json"))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=64)
    args = ap.parse_args(argv)
    out = dict(command="python benchmarks/batch_invariance_slots.py " + " ".join(argv or []),
               device=jax.devices()[0].device_kind, cpus=os.cpu_count(), machine=platform.machine(),
               new_tokens=args.new_tokens, repeats=args.repeats, slots=len(PROMPTS), blocks=BLOCKS,
               context=args.context, models={})
    cfg, params, sampler, tok = load_checkpoint(None)
    out["models"]["bundled"] = _measure(cfg, params, sampler, tok, PROMPTS, SEEDS, args.new_tokens, args.context,
                                        args.repeats)
    print(json.dumps(out["models"]["bundled"]["over_batched"]))
    _, model, texts, seeds = _random_12layer()
    out["models"]["random-12layer"] = _measure(model.config, model.params, model.engine.sampler, model.tokenizer, texts,
                                               seeds, args.new_tokens, args.context, args.repeats)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
