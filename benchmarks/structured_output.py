"""Structured output's cost and validity (engine/structured.py, llguidance masks, the DINGO decoder).

    python benchmarks/structured_output.py [--cases 40] [--seeds 16] [--out benchmarks/results/structured_output.json]

Three parts, on this machine's CPU:
1. bundled dgemma-tiny-digits, digit sorting ("s<digits>=" -> the sorted digits), without a
   constraint (`Engine.generate`) and with the regex "0*1*2*3*4*5*6*7*8*9*" (sorted digits: the
   constraint enforces the task's form, not its answer) under each constraint decoder ("prefix":
   left to right; "dingo": the DP over positions x DFA states), the three modes in turns per case:
   accuracy, answers of the regex's form, denoising steps per canvas, wall time per canvas (after a
   warm-up), and per step the host time of the constraint (walk, forced tokens, masks, repair scores,
   the DP) against the step's own time (dispatch to the argmax, and the top-k for "dingo", on the host).
2. a random-weight model (tiny-2layer, vocab 400) with a byte-level BPE (tests/helpers/subword_tokenizer.py)
   over the JSON schemas and regexes of tests/test_structured.py, `--seeds` seeds each, under both
   decoders (a schema's DFA from its regex): how many answers end ("stop") and validate
   (jsonschema / re.fullmatch), how many run out of budget ("length"), repairs and forced (fixed-text)
   tokens per answer, steps per canvas, constraint and step ms per step, wall ms per canvas.
3. the mask at Gemma's vocabulary size: a synthetic 262,144-token byte-level vocabulary (the 400 BPE
   pieces plus random ASCII / UTF-8 pieces), the nested schema compiled for it; the time of one
   `compute_bitmask` (+ unpacking) and of `validate_tokens` over a 256-token canvas at states along
   an answer, next to the 26B denoising step of benchmarks/results/aot_26b_v6e-8.json (a compiler
   projection for v6e-8, batch 1: not a measurement); and DINGO's DP over a 256-position canvas with
   32 word-piece candidates per position for two regexes (first call, and again with the token lift cached).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import sys
import tempfile
import time

import jsonschema
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dgemma_jax import ModelConfig, init_params  # noqa: E402
from dgemma_jax.engine.dingo import DINGO_TOP_K, viterbi  # noqa: E402
from dgemma_jax.engine.grammar import allowed_tokens, compile_grammar  # noqa: E402
from dgemma_jax.io.tokenizer import load_tokenizer  # noqa: E402
from dgemma_jax.pipeline import DiffusionGemma  # noqa: E402
from dgemma_jax.sampling import SamplerConfig  # noqa: E402
from dgemma_jax.training.tasks import Task  # noqa: E402
from tests.helpers.subword_tokenizer import subword_tokenizer_json  # noqa: E402
from tests.test_structured import REGEXES, SCHEMAS  # noqa: E402

SORTED = "0*1*2*3*4*5*6*7*8*9*"
DECODERS = ("prefix", "dingo")
DP_REGEXES = (r"([a-z]+ )+[a-z]+\.", r"[a-z ]{0,40}")   # few states; a counted repeat (a state per count)
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _per_step_ms(outs):
    steps = sum(int(o.steps.sum()) for o in outs)
    return (round(1e3 * sum(float(o.constraint_s.sum()) for o in outs) / steps, 3),
            round(1e3 * sum(float(o.step_s.sum()) for o in outs) / steps, 3), steps)


def bundled(cases: int) -> dict:
    model = DiffusionGemma.from_pretrained()
    tok, eng = model.tokenizer, model.engine
    grammar = model.grammar(regex=SORTED)
    rng = np.random.default_rng(20261206)
    task = Task("sort", 9, 16)
    problems = [task.sample(rng) for _ in range(cases)]
    for prompt, _ in problems:   # warm-up: every prompt bucket's programs compiled for every mode before timing
        warm = np.asarray([tok.encode(prompt, add_bos=True)], np.int32)
        eng.generate(warm, rng=0, max_new_tokens=24)
        for dec in DECODERS:
            eng.generate_structured(warm, grammars=grammar, rng=0, max_new_tokens=24, constraint_decoder=dec)
    modes = ["none"] + [f"regex_{d}" for d in DECODERS]
    rows = {k: [] for k in modes}
    wall = dict.fromkeys(modes, 0.0)
    outs = {d: [] for d in DECODERS}
    for i, (prompt, answer) in enumerate(problems):
        ids = np.asarray([tok.encode(prompt, add_bos=True)], np.int32)
        for mode in modes[i % 3:] + modes[:i % 3]:   # side by side, in turns: what runs first pays for the last
            dec = mode[len("regex_"):] if mode != "none" else None
            t0 = time.perf_counter()
            if dec is None:
                out = eng.generate(ids, rng=i, max_new_tokens=24)
                wall[mode] += time.perf_counter() - t0
                text = tok.decode_generated(np.asarray(out.tokens)[0], skip_special=True)
                canvases = int((np.asarray(out.steps)[0] > 0).sum()) if np.asarray(out.steps).ndim == 2 else None
                rows[mode].append(dict(correct=text == answer, form=bool(re.fullmatch(SORTED, text)),
                                       steps=int(np.asarray(out.steps)[0].sum()), canvases=canvases))
                continue
            s = eng.generate_structured(ids, grammars=grammar, rng=i, max_new_tokens=24, constraint_decoder=dec)
            wall[mode] += time.perf_counter() - t0
            outs[dec].append(s)
            text = tok.decode(s.tokens[0], skip_special=True)
            rows[mode].append(dict(correct=text == answer, form=bool(re.fullmatch(SORTED, text)),
                                   finish=s.finish_reasons[0], steps=int(s.steps[0].sum()),
                                   canvases=max(1, int((s.steps[0] > 0).sum())), repairs=int(s.repairs[0])))
    result = {}
    for k, rs in rows.items():
        canvases = sum(r["canvases"] for r in rs if r["canvases"] is not None) or None
        result[k] = {"accuracy": sum(r["correct"] for r in rs) / len(rs),
                     "sorted_form": sum(r["form"] for r in rs) / len(rs),
                     "steps_per_canvas": round(sum(r["steps"] for r in rs) / canvases, 2) if canvases else None,
                     "wall_ms_per_canvas": round(1e3 * wall[k] / canvases, 2) if canvases else None,
                     "wall_ms_per_answer": round(1e3 * wall[k] / len(rs), 2)}
    for dec in DECODERS:
        c_ms, s_ms, _ = _per_step_ms(outs[dec])
        rs = rows[f"regex_{dec}"]
        result[f"regex_{dec}"].update(constraint_ms_per_step=c_ms, step_ms_per_step=s_ms,
                                      repairs_per_answer=round(sum(r["repairs"] for r in rs) / cases, 2),
                                      stop=sum(r["finish"] == "stop" for r in rs) / cases)
    return {"what": "bundled dgemma-tiny-digits, digit sorting, max_new_tokens 24, unconstrained vs the regex "
                    f"{SORTED!r} with each constraint decoder (prefix: left to right; dingo: the DP)",
            "cases": cases, **result}


def _noise_row(eng, tok, tokens, lengths, grammar, budget, check, decoder):
    t0 = time.perf_counter()
    out = eng.generate_structured(tokens, lengths, grammars=grammar, rng=list(range(len(tokens))),
                                  max_new_tokens=budget, constraint_decoder=decoder)
    wall = time.perf_counter() - t0
    valid = 0
    for ids, reason in zip(out.tokens, out.finish_reasons):
        if reason == "stop":
            try:
                check(tok.decode(ids, skip_special=True))
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
    c_ms, s_ms, steps = _per_step_ms([out])
    n = len(tokens)
    canvases = int(sum(max(1, int((row > 0).sum())) for row in out.steps))
    return {"answers": n, "valid": valid, "length": out.finish_reasons.count("length"),
            "tokens_per_answer": round(float(np.mean([len(t) for t in out.tokens])), 1),
            "steps_per_answer": round(steps / n, 1), "steps_per_canvas": round(steps / canvases, 2),
            "repairs_per_answer": round(float(out.repairs.mean()), 1),
            "forced_per_answer": round(float(out.forced.mean()), 1),
            "constraint_ms_per_step": c_ms, "step_ms_per_step": s_ms,
            "wall_ms_per_answer": round(1e3 * wall / n, 1), "wall_ms_per_canvas": round(1e3 * wall / canvases, 1)}


def noise(seeds: int, tmp: str) -> dict:
    path = os.path.join(tmp, "tokenizer.json")
    subword_tokenizer_json(path)
    tok = load_tokenizer(path)
    cfg = dataclasses.replace(ModelConfig.preset("tiny-2layer"), vocab_size=400)
    model = DiffusionGemma(cfg, init_params(cfg, 0), tok, SamplerConfig(canvas_length=16, max_denoising_steps=4,
                                                                         eos_ids=(1,)))
    prompts = ["A record:", "JSON please"] * (seeds // 2)
    tokens, lengths = model.encode_batch(prompts)
    eng = model.engine
    for dec in DECODERS:   # warm-up: both budgets' programs compiled for both decoders before timing
        for kw, budget in (({"json_schema": SCHEMAS["numbers"]}, 96), ({"regex": REGEXES[0]}, 32)):
            eng.generate_structured(tokens, lengths, grammars=model.grammar(**kw), rng=list(range(len(prompts))),
                                    max_new_tokens=budget, constraint_decoder=dec)
    rows = {}
    for name, kw, budget, check in ([(n, {"json_schema": s}, 96, lambda t, s=s: jsonschema.validate(json.loads(t), s))
                                     for n, s in SCHEMAS.items()]
                                    + [(f"regex {r}", {"regex": r}, 32,
                                        lambda t, r=r: None if re.fullmatch(r, t) else (_ for _ in ()).throw(
                                            ValueError(t))) for r in REGEXES]):
        grammar = model.grammar(**kw)
        rows[name] = {dec: _noise_row(eng, tok, tokens, lengths, grammar, budget, check, dec) for dec in DECODERS}
        rows[name]["dingo"]["dfa_states"] = len(grammar.dfa.fsm.states) if grammar.dfa is not None else None
        print(name, rows[name], flush=True)
    summary = {}
    for dec in DECODERS:
        rs = [r[dec] for r in rows.values() if dec in r]
        total = sum(r["answers"] for r in rs)
        summary[dec] = {"grammars": len(rs), "valid_rate": round(sum(r["valid"] for r in rs) / total, 4),
                        "length_rate": round(sum(r["length"] for r in rs) / total, 4)}
    return {"what": "random-weight tiny-2layer (vocab 400, canvas 16, 4 steps) with a byte-level BPE: answers are "
                    "noise, validity comes from the constraint; both decoders (dingo: the DFA of the regex, or of "
                    "the schema's regex from outlines-core)", "seeds_per_grammar": len(prompts), "summary": summary,
            "grammars": rows}


def big_vocab(tmp: str, vocab: int = 262_144) -> dict:
    import llguidance as llg
    path = os.path.join(tmp, "tokenizer.json")
    subword_tokenizer_json(path)
    small = json.load(open(path))
    rng = np.random.default_rng(0)
    pieces = set(small["model"]["vocab"])
    alphabet = [chr(c) for c in range(0x21, 0x7f)] + ["Ġ", "é", "ü", "ñ", "ø", "ß"]
    while len(pieces) < vocab:
        pieces.add("".join(rng.choice(alphabet, int(rng.integers(2, 9)))))
    vocab_map = dict(small["model"]["vocab"])
    for p in sorted(pieces - set(vocab_map)):
        vocab_map[p] = len(vocab_map)
    small["model"]["vocab"] = vocab_map
    small["model"]["merges"] = []
    big = os.path.join(tmp, "big.json")
    json.dump(small, open(big, "w"))
    t0 = time.perf_counter()
    tok = load_tokenizer(big)
    grammar = compile_grammar(tok, len(vocab_map), (1,), json_schema=SCHEMAS["nested_required_optional"])
    setup = time.perf_counter() - t0
    m = grammar.matcher()
    answer = tok.encode('{"name":"Alice","age":31,"address":{"city":"Paris","zip":"75001"}}')
    mask_ms, validate_ms = [], []
    canvas = np.asarray(answer * 8)[:256].tolist()
    for t in answer:
        t0 = time.perf_counter()
        allowed_tokens(m, len(vocab_map))
        mask_ms.append(1e3 * (time.perf_counter() - t0))
        t0 = time.perf_counter()
        m.validate_tokens(canvas)
        validate_ms.append(1e3 * (time.perf_counter() - t0))
        if not m.consume_token(t):
            break
    dp = {}
    for regex in DP_REGEXES:   # DINGO's DP at this vocabulary: a 256-position canvas, k = 32 candidates per position
        dfa = compile_grammar(tok, len(vocab_map), (1,), regex=regex).dfa
        words = np.asarray([i for i in range(len(vocab_map)) if re.fullmatch(r" ?[a-z]+", dfa.text(i) or "")])
        rng = np.random.default_rng(1)
        ids = np.stack([rng.choice(words, DINGO_TOP_K, replace=False) for _ in range(256)])
        lp = np.sort(np.log(rng.dirichlet(np.ones(DINGO_TOP_K), size=256)), axis=1)[:, ::-1]
        eos = np.log(np.full(256, 1e-3))
        t0 = time.perf_counter()
        viterbi(dfa, dfa.initial, ids, lp, eos, 1, final=True)
        cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        _, covered, _, complete = viterbi(dfa, dfa.initial, ids, lp, eos, 1, final=True)
        dp[regex] = {"dfa_states": len(dfa.fsm.states), "dp_ms_first": round(1e3 * cold, 1),
                     "dp_ms_cached": round(1e3 * (time.perf_counter() - t0), 1), "covered": covered,
                     "complete": complete}
    proj = json.load(open(os.path.join(RESULTS, "aot_26b_v6e-8.json")))["projection"]
    return {"what": f"llguidance at a {len(vocab_map)}-token byte-level vocabulary (synthetic), the nested schema",
            "llguidance": llg.__version__ if hasattr(llg, "__version__") else None,
            "tokenizer_and_compile_s": round(setup, 2), "states": len(mask_ms),
            "mask_ms_median": round(float(np.median(mask_ms)), 3),
            "mask_ms_p90": round(float(np.percentile(mask_ms, 90)), 3), "mask_ms_max": round(float(np.max(mask_ms)), 3),
            "validate_256_ms_median": round(float(np.median(validate_ms)), 3),
            "denoise_step_ms_26b_v6e8_projection": round(proj["denoise_step_ms"], 3),
            "dingo_dp_256_positions_top32": dp,
            "note": "the projection is from the TPU compiler's cost analysis (aot_26b_v6e-8.json), not a measurement"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--out", default=os.path.join(RESULTS, "structured_output.json"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    result = {"machine": f"{platform.machine()} CPU, {os.cpu_count()} cores (shared)"}

    def save():   # after each part, so that a failure later keeps what ran
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    with tempfile.TemporaryDirectory() as tmp:
        result["bundled"] = bundled(args.cases)
        print(json.dumps(result["bundled"], indent=1), flush=True)
        save()
        result["noise"] = noise(args.seeds, tmp)
        save()
        result["vocab_262k"] = big_vocab(tmp)
        print(json.dumps(result["vocab_262k"], indent=1), flush=True)
        save()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
