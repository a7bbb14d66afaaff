"""Where does a denoise step's time go? Every XLA:CPU operation of the compiled step, attributed to
the model code that produced it.

`bench_cpu.py` times the step and its pieces; `gemm_ceiling.py` times the step's matrix products
alone at their shapes. This script looks inside the real step: it runs the engine's `denoise_step` program
(trunk, fused head/sampler pass, acceptance, renoise, stop test) at the `bench` config with random
weights, records an XLA profiler trace, and charges each executed operation (an XLA:CPU thunk: a
fusion, a library matrix product, a sort, ...) to

- a **part of the model**, read from the operation's HLO `op_name` metadata (the JAX/Flax scope
  that emitted it; for a fusion without its own metadata, that of its computation's root, else of
  the nearest operand that has one), and
- **products or other**: whether the operation runs a `dot` (a matrix product, with whatever XLA
  fused into it) or not (softmax, exp/tanh, norms, gathers, sampling, copies).

Times are the durations of the leaf operations (control flow such as the MoE buffer-size `switch`
or the head's vocab-chunk loop is not counted itself, only what runs inside it), summed over the
executor's threads and divided by the number of steps: "thread ms per step". On 2 cores the sum can
exceed the wall time when independent operations overlap; both are reported.

    python benchmarks/step_profile.py --out benchmarks/results/step_profile_amd_epyc.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling benchmark modules

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from gemm_ceiling import samples  # noqa: E402
from dgemma_jax.perf import report  # noqa: E402

# (part, op_name pattern), first match wins; op_name is the scope path JAX writes into the HLO
PARTS = (
    ("head and sampler pass (vocab chunks)", r"head_sampler_pass"),
    ("experts: products and gating", r"/moe/experts_"),
    ("MoE router", r"/moe/router"),
    ("MoE other", r"/moe/"),
    ("self-conditioning MLP", r"sc_mlp|sc_norm"),
    ("dense MLP", r"/dense_mlp"),
    ("attention q/k/v/o projections", r"attn\._qkv/qkv_proj|attn\._out/o_proj"),
    ("attention q/k norms and rope", r"attn\._qkv"),
    ("attention scores, softmax, values", r"attn\.|/attn/"),
    ("layer norms and residuals", r"_norm|blocks_\d+\.denoise/add|_ffw/(add|mul)"),
    ("trunk: embedding and the rest", r"Transformer\."),
    ("sampler: accept, renoise, stop test, history", r"."),
)
CONTAINERS = ("conditional", "while", "call")


def hlo_index(hlo: str) -> dict[str, dict]:
    """{instruction name: {"opcode", "op_name", "product"}} from a compiled module's text.

    A fusion's or custom call's op_name falls back to its called computation's root (else the last
    instruction there that has one, else the nearest operand's); "product" is
    True for a dot or an instruction whose called computation holds a dot."""
    comps: dict[str, dict] = {}
    inst: dict[str, dict] = {}
    cur = None
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{\s*$", line)
        if m:
            cur = comps.setdefault(m.group(1), {"root_op_name": None, "any_op_name": None, "has_dot": False})
            continue
        m = re.match(r"\s*(ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
        if not m:
            continue
        root, name, opcode = m.group(1), m.group(2), m.group(3)
        om = re.search(r'op_name="([^"]*)"', line)
        calls = re.findall(r"(?:calls|to_apply|body|condition|branch_computations)=\{?%?([\w.\-]+)", line)
        args = line.split(f" {opcode}(", 1)[1].split(")", 1)[0]
        inst[name] = {"opcode": opcode, "op_name": om.group(1) if om else None, "calls": calls,
                      "operands": re.findall(r"%([\w.\-]+)", args)}
        if cur is not None:
            if opcode == "dot":
                cur["has_dot"] = True
            if om:
                cur["any_op_name"] = om.group(1)
                if root:
                    cur["root_op_name"] = om.group(1)
    for rec in inst.values():
        called = [comps[c] for c in rec.pop("calls") if c in comps]
        if rec["op_name"] is None:  # the root's scope, else the last scope inside
            rec["op_name"] = next((c["root_op_name"] or c["any_op_name"] for c in called
                                   if c["root_op_name"] or c["any_op_name"]), None)
        rec["product"] = rec["opcode"] == "dot" or (rec["opcode"] in ("fusion", "custom-call")
                                                    and any(c["has_dot"] for c in called))
    for rec in inst.values():  # still none (XLA dropped it): the scope of the nearest operand that has one
        frontier, seen = rec["operands"], set()
        while rec["op_name"] is None and frontier:
            nxt = []
            for o in frontier:
                if o in inst and o not in seen:
                    seen.add(o)
                    if inst[o]["op_name"] and inst[o]["opcode"] != "parameter":
                        rec["op_name"] = inst[o]["op_name"]
                        break
                    nxt += inst[o]["operands"]
            frontier = nxt[:64]
    for rec in inst.values():
        del rec["operands"]
    return inst


def part_of(op_name: str | None, opcode: str = "") -> str:
    if not op_name:
        return "copies XLA inserted (no source)" if opcode == "copy" else "unattributed"
    for part, pattern in PARTS:
        if re.search(pattern, op_name):
            return part
    return "unattributed"


def thunk_times(trace_dir: str) -> collections.Counter:
    """Nanoseconds per event name on the XLA:CPU executor threads of the trace in `trace_dir`."""
    from jax.profiler import ProfileData

    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise SystemExit(f"no profiler trace was written under {trace_dir}")
    out: collections.Counter = collections.Counter()
    for plane in ProfileData.from_file(files[0]).planes:
        for line in plane.lines:
            if line.name.startswith("tf_XLA"):
                for ev in line.events:
                    out[ev.name] += ev.duration_ns
    return out


def attribute(times: collections.Counter, index: dict[str, dict], calls: int) -> dict:
    """Leaf operations' thread ms per call, by part and by products/other."""
    parts: dict[str, dict] = {}
    for name, ns in times.items():
        rec = index.get(name)
        if rec is None or rec["opcode"] in CONTAINERS:
            continue  # executor bookkeeping events, or control flow around counted leaves
        row = parts.setdefault(part_of(rec["op_name"], rec["opcode"]), {"products_ms": 0.0, "other_ms": 0.0, "ops": 0})
        row["products_ms" if rec["product"] else "other_ms"] += ns / calls / 1e6
        row["ops"] += 1
    total_p = sum(r["products_ms"] for r in parts.values())
    total_o = sum(r["other_ms"] for r in parts.values())
    return {"parts": dict(sorted(parts.items(), key=lambda kv: -(kv[1]["products_ms"] + kv[1]["other_ms"]))),
            "products_ms": total_p, "other_ms": total_o, "leaf_ms": total_p + total_o}


def profile(compiled, args, calls: int, trace_dir: str) -> dict:
    """Time `calls` calls of a compiled program (wall), then trace `calls` more and attribute them."""
    walls = samples(lambda: jax.block_until_ready(compiled(*args)), calls, warm=1)
    jax.profiler.start_trace(trace_dir)
    try:
        for _ in range(calls):
            jax.block_until_ready(compiled(*args))
    finally:
        jax.profiler.stop_trace()
    res = attribute(thunk_times(trace_dir), hlo_index(compiled.as_text()), calls)
    res["wall_ms_median"] = float(np.median(walls) * 1e3)
    res["calls"] = calls
    return res


def step_program(preset: str = "bench", context: int = 512, canvas: int = 256, seed: int = 0):
    """(compiled step, its array args): the real denoise step on a prefilled cache, with the
    state one step in (a realistic self-conditioning input)."""
    from dgemma_jax.config import ModelConfig
    from dgemma_jax.engine import Engine
    from dgemma_jax.model.api import init_params
    from dgemma_jax.sampling.config import SamplerConfig
    from dgemma_jax.sampling.loop import init_state, initial_canvas, row_keys

    cfg = ModelConfig.preset(preset)
    sampler = SamplerConfig(canvas_length=canvas, max_denoising_steps=16, stability_threshold=17, eos_ids=())
    params = init_params(cfg, seed)
    programs = Engine(cfg, params, sampler).programs
    prompt = jnp.asarray(np.random.default_rng(seed).integers(3, cfg.vocab_size, (1, context)), jnp.int32)
    cache = programs.prefill(params, tokens=prompt, lengths=jnp.array([context], jnp.int32),
                             cache=Engine(cfg, params, sampler).new_cache(1, context + canvas))
    keys = row_keys(jnp.asarray(seed), 1)
    state = init_state(cfg, sampler, initial_canvas(keys, canvas, cfg.vocab_size))
    step = jax.jit(lambda p, c, k, s: programs.denoise_step(p, cache=c, context_end=c.lengths, keys=k, state=s)).lower(
        params, cache, keys, state).compile()
    return step, (params, cache, keys, step(params, cache, keys, state))


def markdown(res: dict) -> str:
    r = res["step"]
    lines = [f"Denoise step profile ({res['config']['preset']} config, context {res['config']['context']}, "
             f"canvas {res['config']['canvas']}, {r['calls']} traced steps): wall {r['wall_ms_median']:.1f} ms "
             f"per step, leaf operations {r['leaf_ms']:.1f} thread ms = products {r['products_ms']:.1f} "
             f"+ other {r['other_ms']:.1f}.", ""]
    lines += report.table(("part", "products, ms", "other, ms", "operations"),
                          [(part, f"{row['products_ms']:.1f}", f"{row['other_ms']:.1f}", row["ops"])
                           for part, row in r["parts"].items()])
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--calls", type=int, default=10, help="steps timed, then as many traced")
    ap.add_argument("--out", default=None, help="JSON path (the markdown table goes next to it as .md)")
    args = ap.parse_args(argv)
    step, step_args = step_program(args.preset, args.context, args.canvas)
    with tempfile.TemporaryDirectory(prefix="dgemma_profile_") as d:
        res = {"config": {"preset": args.preset, "context": args.context, "canvas": args.canvas},
               "machine": report.machine_info(),
               "step": profile(step, step_args, args.calls, d)}
    text = markdown(res)
    print(text)
    report.write(res, args.out, text)
    return res


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
