"""How fast could a denoise step be if it were nothing but its matrix products?

`step_gemms` lists every matrix product of one denoise step at its real shape (the canvas's
projections, attention products, dense MLP, top-k experts with each expert holding exactly its mean
share of the pairs, router, self-conditioning MLP and the head's vocab chunks). `time_gemms` times
each distinct shape alone, in JAX (jitted, XLA:CPU) and in torch, best of `reps`, minus the
framework's own per-call cost (a trivial call's best time). Summing count x time gives the step's
"GEMM ceiling": the time of a step with no softmax, sampling, norms, gathers, copies or padding, whose
products all run at the speed the library reaches on those shapes alone. Useful FLOPs / that time /
the machine's peak is the largest fraction of peak any step built on that library's matmuls could show.
"""

from __future__ import annotations

import time


def _gemm(group, count, batch, m, k, n):
    """`m` may be fractional (an expert's mean share of the pairs): timed at the nearest whole row count,
    counted at its exact useful FLOPs."""
    return {"group": group, "count": int(count), "batch": int(batch), "m": max(1, int(round(m))), "k": int(k),
            "n": int(n), "flops": 2 * int(count) * int(batch) * m * int(k) * int(n)}


def step_gemms(cfg, context: int, canvas: int, chunk: int, batch: int = 1):
    """The matrix products of one denoise step (canvas rows attending to `context` cached tokens).

    Rows are batch x canvas. Attention: per kv head, its query heads' rows times the keys a query sees
    (sliding: the layer's whole ring cache, `model.cache.ring_size`, + the canvas, as `Attention.denoise`
    reads it; global: the whole context + the canvas). Experts: each of
    the E experts gets rows x top_k / E pairs (perfectly even routing: no buffer padding).
    """
    from dgemma_jax.model.cache import ring_size

    rows = batch * canvas
    d, n_heads = cfg.hidden_size, cfg.num_heads
    out = []
    for i in range(cfg.num_layers):
        hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        glob = cfg.is_global(i)
        keys = context + canvas if glob else ring_size(cfg, context) + canvas
        out.append(_gemm("qkvo_proj", 1, 1, rows, d, n_heads * hd))
        out.append(_gemm("qkvo_proj", 1 if glob else 2, 1, rows, d, kv * hd))  # k (and v unless K = V)
        out.append(_gemm("qkvo_proj", 1, 1, rows, n_heads * hd, d))
        g = n_heads // kv
        out.append(_gemm("attention", 1, batch * kv, g * canvas, hd, keys))  # q k^T
        out.append(_gemm("attention", 1, batch * kv, g * canvas, keys, hd))  # p v
        out.append(_gemm("dense_mlp", 1, 1, rows, d, 2 * cfg.intermediate_size))
        out.append(_gemm("dense_mlp", 1, 1, rows, cfg.intermediate_size, d))
        out.append(_gemm("router", 1, 1, rows, d, cfg.num_experts))
        share = rows * cfg.top_k / cfg.num_experts
        out.append(_gemm("experts_topk", 1, cfg.num_experts, share, d, 2 * cfg.moe_intermediate_size))
        out.append(_gemm("experts_topk", 1, cfg.num_experts, share, cfg.moe_intermediate_size, d))
    out.append(_gemm("sc_mlp", 1, 1, rows, d, 2 * cfg.intermediate_size))
    out.append(_gemm("sc_mlp", 1, 1, rows, cfg.intermediate_size, d))
    chunks = cfg.vocab_size // chunk
    out.append(_gemm("head_logits", chunks, 1, rows, d, chunk))
    out.append(_gemm("sc_soft_embedding", chunks, 1, rows, chunk, d))
    return out


def _shape_key(g):
    return (g["batch"], g["m"], g["k"], g["n"])


def samples(fn, reps: int, warm: int = 2) -> list[float]:
    """Seconds of `reps` calls of fn() after `warm` untimed ones (fn must block until its result is ready)."""
    for _ in range(warm):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _best(fn, reps):
    return min(samples(fn, reps))


def time_gemms(gemms, reps: int = 30, with_torch: bool = True):
    """Best seconds per call of each distinct (batch, m, k, n), for JAX and torch, less each side's
    trivial-call time. Returns {"jax": {key: s}, "torch": {key: s}, "call_overhead_s": {...}}; without
    torch (with_torch=False: an install without the [ref] extra) the "torch" entries are absent."""
    import jax
    import jax.numpy as jnp

    mm = jax.jit(lambda a, b: jnp.matmul(a, b))
    tiny = jnp.ones((1, 1), jnp.float32)
    jax_call = _best(lambda: mm(tiny, tiny).block_until_ready(), reps * 4)
    out = {"jax": {}, "call_overhead_s": {"jax": jax_call}}
    if with_torch:
        import torch  # deferred: the [ref] extra, absent from the default install

        ttiny = torch.ones(1, 1)
        out["torch"] = {}
        out["call_overhead_s"]["torch"] = _best(lambda: torch.mm(ttiny, ttiny), reps * 4)
    for key in sorted({_shape_key(g) for g in gemms}):
        b, m, k, n = key
        shape_a, shape_b = ((m, k), (k, n)) if b == 1 else ((b, m, k), (b, k, n))
        a = jax.random.normal(jax.random.key(0), shape_a, jnp.float32)
        w = jax.random.normal(jax.random.key(1), shape_b, jnp.float32)
        out["jax"][key] = max(_best(lambda: mm(a, w).block_until_ready(), reps) - jax_call, 1e-7)
        if not with_torch:
            continue
        ta, tw = torch.randn(*shape_a), torch.randn(*shape_b)
        fn = torch.mm if b == 1 else torch.bmm
        out["torch"][key] = max(_best(lambda: fn(ta, tw), reps) - out["call_overhead_s"]["torch"], 1e-7)
    return out


def ceiling(gemms, timings, peak_gflops: float):
    """Per side: the GEMM-only step time, its useful-FLOP rate and fraction of peak, per group."""
    useful = sum(g["flops"] for g in gemms)
    res = {"useful_gflop": useful / 1e9, "call_overhead_ms": {k: v * 1e3 for k, v in timings["call_overhead_s"].items()},
           "shapes": [dict(g, shape=f"{g['batch']}x{g['m']}x{g['k']}x{g['n']}",
                           jax_ms_per_call=timings["jax"][_shape_key(g)] * 1e3,
                           torch_ms_per_call=timings["torch"][_shape_key(g)] * 1e3 if "torch" in timings else None)
                      for g in gemms]}
    for side in [s for s in ("jax", "torch") if s in timings]:
        groups = {}
        total = 0.0
        for g in gemms:
            t = g["count"] * timings[side][_shape_key(g)]
            total += t
            acc = groups.setdefault(g["group"], {"ms": 0.0, "gflop": 0.0})
            acc["ms"] += t * 1e3
            acc["gflop"] += g["flops"] / 1e9
        for acc in groups.values():
            acc["pct_of_peak"] = 100.0 * acc["gflop"] / (acc["ms"] / 1e3) / peak_gflops
        res[side] = {"ms": total * 1e3, "gflops": useful / total / 1e9,
                     "pct_of_peak": 100.0 * useful / total / 1e9 / peak_gflops, "groups": groups}
    return res


def gemm_ceiling(cfg, context: int, canvas: int, chunk: int, peak_gflops: float, reps: int = 30,
                 with_torch: bool = True):
    gemms = step_gemms(cfg, context, canvas, chunk)
    return ceiling(gemms, time_gemms(gemms, reps, with_torch), peak_gflops)


def gemm_ceiling_markdown(gc, step_s):
    """The GEMM-ceiling table: the step's products, each timed alone, JAX (XLA:CPU) vs torch."""
    from dgemma_jax.perf.report import ms, table

    j = gc["jax"]
    t = gc.get("torch")   # absent in a run without torch (bench_cpu.py --skip-hf)

    def torch_cols(g):
        return (f"{g['ms']:.1f}", f"{g['pct_of_peak']:.1f}%") if g else ("-", "-")

    rows = []
    for group, g in j["groups"].items():
        counts = {}
        for s in gc["shapes"]:
            if s["group"] == group:
                counts[s["shape"]] = counts.get(s["shape"], 0) + s["count"]
        shapes = [f"{c} x {shape}" for shape, c in counts.items()]
        rows.append((group, ", ".join(shapes), f"{g['gflop']:.2f}", f"{g['ms']:.1f}", f"{g['pct_of_peak']:.1f}%",
                     *torch_cols(t and t["groups"][group])))
    rows.append(("**sum: a step that is nothing but its products**", "", f"{gc['useful_gflop']:.2f}",
                 f"**{j['ms']:.1f}**", f"**{j['pct_of_peak']:.1f}%**", *torch_cols(t)))
    L = ["## GEMM ceiling of the denoise step (each matrix product at its own shape, timed alone)", ""]
    L += table(("products", "calls per step x shape (batch x m x k x n)", "useful GFLOP", "XLA:CPU ms", "% of peak",
                "torch ms", "% of peak"), rows, "llrrrrr")
    L.append("")
    L.append(f"Expert rows are the exact mean share (perfectly even routing, no buffer padding); times are the best "
             f"of the repetitions less the framework's trivial-call time (JAX {gc['call_overhead_ms']['jax']:.3f} "
             f"ms, torch {gc['call_overhead_ms'].get('torch', float('nan')):.3f} ms), with the operands hot in cache. "
             f"So the XLA:CPU "
             f"column is about the fastest a step built on XLA:CPU's matrix products could run at these shapes: "
             f"{j['pct_of_peak']:.1f}% of peak with zero time for softmax, sampling, norms, routing and weight "
             f"streaming. The fused step measured above takes {ms(step_s)} ms, "
             f"{step_s * 1e3 - j['ms']:.1f} ms over that ceiling.")
    L.append("")
    return L


if __name__ == "__main__":  # a quick look: python benchmarks/gemm_ceiling.py
    import os
    import sys

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from dgemma_jax import ModelConfig
    from dgemma_jax.sampling.fused import vocab_chunk

    cfg = ModelConfig.preset("bench")
    peak = float(sys.argv[1]) if len(sys.argv) > 1 else float("nan")
    r = gemm_ceiling(cfg, 512, 256, vocab_chunk(cfg.vocab_size), peak)
    for side in ("jax", "torch"):
        s = r[side]
        print(f"{side}: {s['ms']:.1f} ms, {s['gflops']:.0f} GFLOP/s, {s['pct_of_peak']:.1f}% of {peak}")
        for k, v in s["groups"].items():
            print(f"   {k:18s} {v['ms']:7.2f} ms {v['gflop']:6.2f} GFLOP {v['pct_of_peak']:5.1f}%")
    print("useful", round(r["useful_gflop"], 2), "call overhead ms", r["call_overhead_ms"])
