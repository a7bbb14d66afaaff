#!/usr/bin/env python
"""dgemma_jax vs Hugging Face transformers on the CPU: one process, same random weights, side by side.

    python benchmarks/bench_cpu.py [--quick] [--out benchmarks/results/bench_cpu.json]
    dgemma bench -- [--quick] [--out ...]

Config: the shared "bench" preset (6 layers = 5 sliding + 1 global, hidden 512, 16 experts top-4,
vocab 32768, window 256, canvas 256), prompt 512 tokens, batch 1, float32, a FIXED 16 denoising steps
per canvas (early stop made impossible: stability_threshold=17 > 16 steps), no EOS, 2 canvases.

Both sides use the weights of one randomly initialised HF model (`hf_reference.build_preset("bench")`,
drawn with sane scales), saved to safetensors and read back with `dgemma_jax.load_hf`.

Writes all raw samples and derived numbers as JSON (--out) and a markdown summary next to it (.md).
See benchmarks/README.md for what each number means. Statistic: the minimum over repetitions
(least disturbed by other processes) is the headline; every sample is kept in the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # never touch an accelerator from this benchmark

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, HERE):  # the package, and this folder's modules when run through `dgemma bench` (runpy)
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402

from gemm_ceiling import gemm_ceiling, gemm_ceiling_markdown, samples  # noqa: E402
from dgemma_jax.perf import report  # noqa: E402
from dgemma_jax.perf import compiled  # noqa: E402
from dgemma_jax.perf.report import loadavg, machine_info, ms, pct, table  # noqa: E402
from dgemma_jax.perf.roofline import causal_pass_flops, denoise_step_flops_by_part  # noqa: E402
from dgemma_jax.sampling.fused import vocab_chunk  # noqa: E402

PROMPT_LEN = 512
CANVAS = 256
STEPS = 16
MAX_NEW = 512
N_CANVAS = MAX_NEW // CANVAS
T_MAX, T_MIN, ENTROPY_BOUND, CONFIDENCE = 0.8, 0.4, 0.1, 0.005  # the released sampler settings
STABILITY = STEPS + 1  # history never fills within 16 steps -> never "stable" -> never stops early


# ====================================================================== small utilities
def now():
    return time.perf_counter()


def summary(samples):
    s = sorted(float(x) for x in samples)
    return {"samples_s": [float(x) for x in samples], "n": len(s), "min_s": s[0],
            "median_s": s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2]),
            "mean_s": sum(s) / len(s), "max_s": s[-1]}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class RSSMonitor:
    """Samples this process's resident set size (/proc/self/statm) every `interval` s: per-phase peaks."""

    def __init__(self, interval=0.05):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.phases = {}
        self._cur = None
        self._peak = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.available = os.path.exists("/proc/self/statm")
        if self.available:
            self._t = threading.Thread(target=self._run, daemon=True)
            self._t.start()

    def rss(self):
        if not self.available:
            return 0
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.page

    def _run(self):
        while not self._stop.wait(self.interval):
            r = self.rss()
            with self._lock:
                self._peak = max(self._peak, r)

    def start(self, name):
        r = self.rss()
        with self._lock:
            self._cur, self._start, self._peak = name, r, r
            self._cpu0 = cpu_times()

    def end(self):
        r = self.rss()
        cpu1 = cpu_times()
        with self._lock:
            peak = max(self._peak, r)
            self.phases[self._cur] = {"start_rss_mb": self._start / 2**20, "peak_rss_mb": peak / 2**20,
                                      "end_rss_mb": r / 2**20,
                                      "peak_above_start_mb": (peak - self._start) / 2**20,
                                      **cpu_share(self._cpu0, cpu1)}
            self._cur = None

    def stop(self):
        self._stop.set()


def pin_cores(n):
    """Pin every thread of this process to the first n CPUs it may use (before XLA/torch start their pools)."""
    allowed = sorted(os.sched_getaffinity(0))
    if n < 1 or n > len(allowed):
        raise SystemExit(f"--cores must be in [1, {len(allowed)}]")
    cpus = set(allowed[:n])
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass
    return sorted(cpus)


def cpu_times():
    """(wall s, machine busy CPU s, this process's CPU s) from /proc, or None where unavailable."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        busy = (sum(v[:8]) - v[3] - v[4]) / tick  # all but idle and iowait (guest time is inside user)
        own = (int(st[11]) + int(st[12])) / tick  # utime + stime of all our threads
        return time.time(), busy, own
    except (OSError, ValueError, IndexError):
        return None


def cpu_share(a, b):
    """How busy the machine's cores were during a phase, and how much of that was other processes."""
    if a is None or b is None or b[0] <= a[0]:
        return {}
    n = os.cpu_count() or 1  # /proc/stat covers every core of the machine
    wall = b[0] - a[0]
    busy, own = b[1] - a[1], b[2] - a[2]
    return {"wall_s": wall, "machine_busy_cores": busy / wall, "own_cores": own / wall,
            "other_processes_cores": max(busy - own, 0.0) / wall, "cores": n}


def maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# ====================================================================== setup
def build_models(seed, with_hf: bool = True):
    """The HF reference model and the same weights read by dgemma_jax; without the reference side
    (--skip-hf: no torch, the default install) dgemma_jax's own `init_params` weights and hf=None."""
    import dgemma_jax
    from dgemma_jax.config import ModelConfig

    t0 = now()
    if not with_hf:
        import jax

        cfg = ModelConfig.preset("bench")
        params = dgemma_jax.init_params(cfg, seed)
        n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
        return None, cfg, params, tempfile.mkdtemp(prefix="dgemma_bench_"), {
            "setup_s": now() - t0, "param_count_jax": n_params, "param_count": cfg.param_count(),
            "weights": "dgemma_jax.init_params(ModelConfig.preset('bench'), seed) (--skip-hf: no torch)"}
    import torch  # deferred: the [ref] extra, absent from the default install

    from tests.reference.hf_reference import build_preset, save_reference

    torch.manual_seed(seed)
    hf = build_preset("bench", seed=seed).eval()
    tmp = tempfile.mkdtemp(prefix="dgemma_bench_")
    save_reference(hf, tmp)
    cfg, params = dgemma_jax.load_hf(tmp, dtype="float32")
    ref = ModelConfig.preset("bench")
    fields = ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "num_kv_heads", "global_head_dim",
              "num_global_kv_heads", "intermediate_size", "num_experts", "top_k", "moe_intermediate_size",
              "sliding_window", "layer_types", "canvas_length", "dtype")
    bad = {f: (getattr(cfg, f), getattr(ref, f)) for f in fields if getattr(cfg, f) != getattr(ref, f)}
    if bad:
        raise SystemExit(f"the loaded config differs from ModelConfig.preset('bench'): {bad}")
    cfg = cfg.replace(name="bench")
    n_params = sum(int(np.prod(x.shape)) for x in __import__("jax").tree_util.tree_leaves(params))
    return hf, cfg, params, tmp, {"setup_s": now() - t0, "param_count_jax": n_params,
                                  "param_count": cfg.param_count(), "checkpoint_dir": tmp}


# ====================================================================== matmul peak
def matmul_peak(shapes, reps, with_torch: bool = True):
    """Best f32 GFLOP/s of jitted (JAX) and torch.mm (torch threads) matmuls [m, k] x [k, n]; JAX alone
    without torch (with_torch=False: torch_best_gflops None).

    shapes: (m, k, n) tuples: large squares plus the model's own shapes (a canvas of 256 rows times a
    512 x 2048 head chunk). On a loaded machine this is a lower bound of the true peak."""
    import jax
    import jax.numpy as jnp

    if with_torch:
        import torch  # deferred: the [ref] extra, absent from the default install
    out = {"jax": {}, "torch": {}}
    mm = jax.jit(lambda a, b: a @ b)
    for (m, k, n), r in zip(shapes, reps):
        name = f"{m}x{k}x{n}"
        flops = 2 * m * k * n
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32)
        b = jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
        fns = [("jax", lambda: mm(a, b).block_until_ready())]
        if with_torch:
            ta, tb = torch.randn(m, k), torch.randn(k, n)
            fns.append(("torch", lambda: torch.mm(ta, tb)))
        for side, fn in fns:
            s = summary(samples(fn, r, warm=1))
            s["gflops_best"] = flops / s["min_s"] / 1e9
            out[side][name] = s
    out["jax_best_gflops"] = max(v["gflops_best"] for v in out["jax"].values())
    out["torch_best_gflops"] = max(v["gflops_best"] for v in out["torch"].values()) if with_torch else None
    out["peak_gflops"] = max(out["jax_best_gflops"], out["torch_best_gflops"] or 0.0)
    return out


# ====================================================================== dgemma_jax
def jax_pieces(cfg, params, prompt, quick, res):
    import jax
    import jax.numpy as jnp

    import functools

    from dgemma_jax.engine import Engine
    from dgemma_jax.model.api import prefill
    from dgemma_jax.model.cache import init_cache
    from dgemma_jax.model.transformer import Transformer
    from dgemma_jax.runtime import Runtime
    from dgemma_jax.sampling import ops
    from dgemma_jax.sampling.config import SamplerConfig
    from dgemma_jax.sampling.fused import head_sample_stats
    from dgemma_jax.sampling.loop import Canvas, denoise_canvas, init_state, initial_canvas, row_keys

    sampler = SamplerConfig(canvas_length=CANVAS, max_denoising_steps=STEPS, t_max=T_MAX, t_min=T_MIN,
                            entropy_bound=ENTROPY_BOUND, confidence_threshold=CONFIDENCE,
                            stability_threshold=STABILITY, eos_ids=(), pad_id=0)
    out = {"sampler": {k: getattr(sampler, k) for k in ("canvas_length", "max_denoising_steps", "t_max", "t_min",
                                                        "entropy_bound", "confidence_threshold",
                                                        "stability_threshold", "eos_ids", "pad_id")},
           "moe_dispatch_resolved": Runtime().dispatch()}
    res["dgemma_jax"] = out
    compile_ = out.setdefault("compile", {})
    memory = out.setdefault("memory", {})
    cost = out.setdefault("xla_cost", {})
    cache_len = PROMPT_LEN + (N_CANVAS - 1) * CANVAS  # what Engine.generate allocates: 768
    engine = Engine(cfg, params, sampler)
    # the causal pass with its logits (the AR decode below needs them) and the canvas loop from a given
    # start: the public pure functions under jits of our own, as a library user writes them; the
    # denoise step is the engine's own program
    own_prefill = jax.jit(prefill, static_argnames=("config", "logits"), donate_argnames=("cache",))
    canvas_loop = jax.jit(functools.partial(denoise_canvas, config=cfg, sampler=sampler))
    step_program = engine.programs.denoise_step

    def engine_step(params, cache, keys, state):
        return step_program(params, cache=cache, context_end=cache.lengths, keys=keys, state=state)
    tokens = jnp.asarray(prompt[None], jnp.int32)
    n512 = jnp.array([PROMPT_LEN], jnp.int32)

    def fresh(length=cache_len, batch=1):
        c = init_cache(cfg, batch, length)
        return jax.block_until_ready(c)

    def copy_cache(c):
        return jax.block_until_ready(jax.tree_util.tree_map(jnp.copy, c))

    # ---------------------------------------------------------------- prefill (512 tokens)
    log("jax: prefill 512")
    c_pre, compile_["prefill_512"] = compiled.compile_timed(own_prefill, params, cfg, tokens, n512, fresh(), logits="none")
    memory["prefill_512"] = compiled.memory(c_pre)
    cost["prefill_512"] = compiled.cost(c_pre)
    ts = []
    for i in range(1 + (2 if quick else 4)):
        c = fresh()
        t0 = now()
        _, base = own_prefill(params, cfg, tokens, n512, c, logits="none")
        jax.block_until_ready(base)
        if i:
            ts.append(now() - t0)
    out["prefill_512"] = summary(ts)
    base = copy_cache(base)  # cache holding the 512 prompt tokens (never donated below)
    assert int(base.lengths[0]) == PROMPT_LEN

    # ---------------------------------------------------------------- commit (256 tokens into 512)
    log("jax: commit 256")
    canvas_tok = jnp.asarray(np.random.default_rng(7).integers(3, cfg.vocab_size, (1, CANVAS)), jnp.int32)
    n256 = jnp.array([CANVAS], jnp.int32)
    c_com, compile_["commit_256"] = compiled.compile_timed(own_prefill, params, cfg, canvas_tok, n256,
                                                           copy_cache(base), logits="none")
    memory["commit_256"] = compiled.memory(c_com)
    cost["commit_256"] = compiled.cost(c_com)
    ts = []
    for i in range(1 + (2 if quick else 4)):
        c = copy_cache(base)
        t0 = now()
        _, c2 = own_prefill(params, cfg, canvas_tok, n256, c, logits="none")
        jax.block_until_ready(c2)
        if i:
            ts.append(now() - t0)
        assert int(c2.lengths[0]) == PROMPT_LEN + CANVAS
    out["commit_256"] = summary(ts)

    # ---------------------------------------------------------------- AR-style 1-token decode step
    log("jax: AR 1-token decode")
    one = jnp.asarray([[5]], jnp.int32)
    n1 = jnp.array([1], jnp.int32)
    c_ar, compile_["ar_decode_1"] = compiled.compile_timed(own_prefill, params, cfg, one, n1, copy_cache(base),
                                                                   logits="last")
    memory["ar_decode_1"], cost["ar_decode_1"] = compiled.memory(c_ar), compiled.cost(c_ar)
    c = copy_cache(base)
    ts = []
    for i in range(1 + (8 if quick else 24)):
        t0 = now()
        logits, c = own_prefill(params, cfg, one, n1, c, logits="last")
        jax.block_until_ready(logits)
        if i:
            ts.append(now() - t0)
    assert logits.shape == (1, cfg.vocab_size)
    out["ar_decode_1"] = summary(ts)
    out["ar_decode_1"]["context_range"] = [PROMPT_LEN, int(c.lengths[0])]

    # ---------------------------------------------------------------- step, canvas loop and model math
    # Compiled ahead of time, then measured in interleaved rounds (canvas loop, Python step loop, model
    # math, ...) so that load changes on a shared machine hit every variant alike. Every call is blocked
    # on (a streaming driver reads each step anyway); a piece's time = sum of its calls / number of calls.
    log("jax: compile denoise step, canvas loop and model-math pieces")
    keys = row_keys(jnp.asarray(0), 1)
    start = initial_canvas(keys, CANVAS, cfg.vocab_size)
    state0 = jax.block_until_ready(init_state(cfg, sampler, start))
    model = Transformer(cfg, Runtime())

    @jax.jit
    def trunk(params, canvas, cache, soft):
        return model.apply({"params": params}, canvas, cache.lengths, cache, soft, method="denoise_features")

    @jax.jit
    def trunk_head(params, canvas, cache, soft):
        return model.apply({"params": params}, canvas, cache.lengths, cache, soft, method="denoise")

    @jax.jit
    def forward_with_sc(params, canvas, cache, soft, temp):
        """The model's whole forward as the reference's forward computes it: trunk, head logits, and
        the next step's self-conditioning input softmax(logits / T) @ E (materialised [B, L, V])."""
        logits = model.apply({"params": params}, canvas, cache.lengths, cache, soft, method="denoise")
        return logits, model.apply({"params": params}, logits / temp, method="soft_embed")

    @jax.jit
    def head_sampler(h, embedding, temp, keys):
        return head_sample_stats(h, embedding, cfg.final_logit_softcap, temp, keys, cfg.embed_scale)

    @jax.jit
    def sampler_rest(entropy, sampled, argmax, history, key):
        """Everything in the step after the head pass: accept, renoise, stop decision, history."""
        accept = ops.entropy_bound_accept(entropy, sampler.entropy_bound)
        noise = ops.uniform_tokens(key, (1, CANVAS), cfg.vocab_size)
        canvas = ops.renoise(sampled, accept, noise)
        stop = ops.stop_decision(argmax, history, entropy.mean(-1), sampler.confidence_threshold)
        return canvas, stop, ops.push_history(history, argmax)

    first = Canvas(state0, keys)
    progs = [("denoise_step", step_program, dict(cache=base, context_end=base.lengths, keys=keys, state=state0))]
    if not quick:  # quick mode takes the fused per-step time from the fused generate instead
        progs.append(("denoise_canvas", canvas_loop, dict(cache=base, canvas=first)))
    for name, fn, kw in progs:
        comp, compile_[name] = compiled.compile_timed(fn, params, **kw)
        memory[name], cost[name] = compiled.memory(comp), compiled.cost(comp)
    st = jax.block_until_ready(engine_step(params, base, keys, state0))
    soft = st.soft  # a realistic self-conditioning input for the model-math pieces
    margs = (params, start, base, soft)
    for name, fn in (("trunk", trunk), ("trunk_plus_head_logits", trunk_head)):
        comp, compile_[name] = compiled.compile_timed(fn, *margs)
        memory[name], cost[name] = compiled.memory(comp), compiled.cost(comp)
    h = jax.block_until_ready(trunk(*margs))
    jax.block_until_ready(trunk_head(*margs))
    temp = ops.temperature(sampler, 3)
    fargs = margs + (temp,)
    comp, compile_["forward_with_sc"] = compiled.compile_timed(forward_with_sc, *fargs)
    memory["forward_with_sc"], cost["forward_with_sc"] = compiled.memory(comp), compiled.cost(comp)
    jax.block_until_ready(forward_with_sc(*fargs))
    skeys = jax.vmap(lambda k: jax.random.split(jax.random.fold_in(k, 3)))(keys)
    hargs = (h, params["embedding"], temp, skeys[:, 0])
    comp, compile_["head_sampler_pass"] = compiled.compile_timed(head_sampler, *hargs)
    memory["head_sampler_pass"], cost["head_sampler_pass"] = compiled.memory(comp), compiled.cost(comp)
    # The same pass with one vocab chunk (no scan): XLA counts a scan body only once, this one exactly.
    one_chunk = jax.jit(lambda h, e, t, k: head_sample_stats(h, e, cfg.final_logit_softcap, t, k, cfg.embed_scale,
                                                             chunk=cfg.vocab_size))
    cost["head_sampler_pass_one_chunk"] = compiled.cost(one_chunk.lower(*hargs).compile())
    stats, _ = jax.block_until_ready(head_sampler(*hargs))
    rargs = (stats.entropy, stats.sampled, stats.argmax, state0.history, skeys[0, 1])
    jax.block_until_ready(sampler_rest(*rargs))
    if not quick:
        fs = jax.block_until_ready(canvas_loop(params, cache=base, canvas=first)).state  # warm-up
        assert int(fs.steps[0]) == STEPS, f"early stop fired: {int(fs.steps[0])} steps"

    def timed(fn, *args):
        t0 = now()
        r = jax.block_until_ready(fn(*args))
        return now() - t0, r

    # One round = the fused canvas loop (full mode), then n_iter iterations of [one step of the separately
    # jitted step chain, trunk + head logits, trunk, fused head/sampler pass, sampler rest], so that the
    # differences between pieces are taken between calls made seconds apart.
    rounds = 1 if quick else 2
    n_iter = 8 if quick else STEPS
    names = ("denoise_step", "trunk_plus_head_logits", "forward_with_sc", "trunk", "head_sampler_pass",
             "sampler_rest")
    rec = {k: [] for k in ("denoise_canvas",) + names}
    samples = {k: [] for k in names}
    for r in range(rounds):
        log(f"jax: interleaved round {r + 1}/{rounds}: {'canvas loop, ' if not quick else ''}{n_iter} x "
            f"[step, trunk + head, forward with SC, trunk, head/sampler pass, sampler rest]")
        if not quick:
            t, fs = timed(lambda: canvas_loop(params, cache=base, canvas=first).state)
            assert int(fs.steps[0]) == STEPS
            rec["denoise_canvas"].append(t)
        st = state0
        per = {k: [] for k in names}
        for _ in range(n_iter):
            t, st = timed(engine_step, params, base, keys, st)
            per["denoise_step"].append(t)
            per["trunk_plus_head_logits"].append(timed(trunk_head, *margs)[0])
            per["forward_with_sc"].append(timed(forward_with_sc, *fargs)[0])
            per["trunk"].append(timed(trunk, *margs)[0])
            per["head_sampler_pass"].append(timed(head_sampler, *hargs)[0])
            per["sampler_rest"].append(sum(timed(sampler_rest, *rargs)[0] for _ in range(5)) / 5)
        assert int(st.step) == n_iter and int(st.steps[0]) == n_iter and bool(st.done.all()) == (n_iter == STEPS)
        for k in names:
            rec[k].append(sum(per[k]) / n_iter)  # per-call mean of this round
            samples[k] += per[k]
    if not quick:
        out["denoise_canvas"] = summary(rec["denoise_canvas"])
    out["pieces"] = {k: summary(rec[k]) for k in names}
    out["pieces"]["per_call_samples"] = samples
    out["pieces"]["calls_per_round"] = n_iter

    return {"cfg": cfg, "params": params, "prompt": prompt, "quick": quick, "res": res, "engine": engine,
            "tokens": tokens, "keys": keys, "sampler": sampler, "fresh": fresh, "base": base,
            "trunk_head": trunk_head}


def jax_generate_setup(ctx):
    """AOT-compile the fused generate (512 new tokens) and run it once as the warm-up."""
    import jax.numpy as jnp

    out = ctx["res"]["dgemma_jax"]
    log("jax: fused generate, 512 new tokens: AOT compile + warm-up call")
    lens = jnp.array([PROMPT_LEN], jnp.int32)
    c_gen, out["compile"]["generate_fused_512"] = compiled.compile_timed(
        ctx["engine"].fused_program(MAX_NEW), ctx["params"],
        prompt_tokens=ctx["tokens"], prompt_lengths=lens, cache=ctx["fresh"](), keys=ctx["keys"], seed_canvas=None,
        pinned=None)
    out["memory"]["generate_fused_512"] = compiled.memory(c_gen)
    out["xla_cost"]["generate_fused_512"] = compiled.cost(c_gen)
    out["generate_512"] = {}
    out["generate_512"]["first_call_after_aot_s"] = jax_generate_once(ctx)
    out["generate_512_runs"] = []


def jax_generate_once(ctx):
    import jax

    t0 = now()
    g = ctx["engine"].generate(ctx["tokens"], None, rng=0, max_new_tokens=MAX_NEW)
    jax.block_until_ready(g.tokens)
    t = now() - t0
    steps = np.asarray(g.steps)
    assert g.tokens.shape == (1, MAX_NEW) and int(g.num_canvases) == N_CANVAS, (g.tokens.shape, g.num_canvases)
    assert (steps == STEPS).all(), f"early stop fired: steps per canvas {steps.tolist()}"
    out = ctx["res"]["dgemma_jax"]
    out["generate_512"]["steps_per_canvas"] = steps.tolist()
    out["generate_512"]["tokens_head"] = np.asarray(g.tokens[0, :8]).tolist()
    return t


def jax_generate_finish(ctx):
    out = ctx["res"]["dgemma_jax"]
    extra = out.pop("generate_512")
    out["generate_512"] = summary(out.pop("generate_512_runs"))
    out["generate_512"].update(extra)


def jax_batch_scaling(ctx):
    """One canvas (256 new tokens) per row at each batch size.

    Each batch size is AOT-compiled and the small host-side helpers (cache allocation, key split) are
    warmed; the fused generate is then timed without a separate warm-up run (a run at batch 8 costs
    ~8 canvases); batches 1 and 2 get a second run in full mode (the minimum is kept).
    """
    import jax
    import jax.numpy as jnp


    engine, prompt, quick = ctx["engine"], ctx["prompt"], ctx["quick"]
    bs = ctx["res"]["dgemma_jax"].setdefault("batch_scaling", {})
    for b in ctx["res"]["config"]["batches"]:
        log(f"jax: batch scaling, batch {b}, {CANVAS} new tokens")
        tb = jnp.asarray(np.repeat(prompt[None], b, 0), jnp.int32)
        kb = jax.random.split(jax.random.key(0), b)  # distinct streams (row_keys(0, b) repeats one)
        lb = jnp.full((b,), PROMPT_LEN, jnp.int32)
        comp, ct = compiled.compile_timed(engine.fused_program(CANVAS), ctx["params"],
                       prompt_tokens=tb, prompt_lengths=lb, cache=engine.new_cache(b, PROMPT_LEN), keys=kb,
                       seed_canvas=None, pinned=None)
        jax.block_until_ready(engine.new_cache(b, PROMPT_LEN))
        ts = []
        for _ in range(1 if (quick or b > 2) else 2):
            t0 = now()
            gb = engine.generate(tb, None, rng=0, max_new_tokens=CANVAS)
            jax.block_until_ready(gb.tokens)
            ts.append(now() - t0)
        assert (np.asarray(gb.steps) == STEPS).all()
        s = summary(ts)
        s.update(compile_s=ct["total_s"], tokens=b * CANVAS, tokens_per_s=b * CANVAS / s["min_s"],
                 memory=compiled.memory(comp), xla_flops=compiled.cost(comp)["flops"])
        bs[str(b)] = s


# ====================================================================== transformers
class HFTimer:
    """Instance-attribute wrappers (perf_counter around calls) on the HF model: generate() binds them at call time."""

    def __init__(self, model):
        self.events = []
        self._installed = []
        self._wrap(model, "_denoising_step", "step")
        self._wrap(model, "forward", "decoder_forward")
        self._wrap(model.model.encoder, "forward", "encoder")
        self._wrap(model.lm_head, "forward", "head_matmul")
        self._wrap(model.model.decoder.self_conditioning, "forward", "sc_mlp")
        for layer in model.model.decoder.layers:
            self._wrap(layer, "forward", "decoder_layer")

    def _wrap(self, obj, attr, kind):
        orig = getattr(obj, attr)
        events = self.events

        def wrapped(*a, **k):
            t0 = time.perf_counter()
            r = orig(*a, **k)
            events.append((kind, t0, time.perf_counter()))
            return r

        setattr(obj, attr, wrapped)
        self._installed.append((obj, attr))

    def remove(self):
        for obj, attr in self._installed:
            delattr(obj, attr)
        self._installed = []

    def of(self, kind):
        return [(a, b) for k, a, b in self.events if k == kind]


def hf_kwargs(vocab, max_new):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    return dict(max_new_tokens=max_new, max_denoising_steps=STEPS,
                sampler_config=EntropyBoundSamplerConfig(entropy_bound=ENTROPY_BOUND), t_min=T_MIN, t_max=T_MAX,
                stability_threshold=STABILITY, confidence_threshold=CONFIDENCE,
                eos_token_id=vocab,  # an id outside the vocabulary: never generated, no row stops
                pad_token_id=0)


def hf_generate(model, prompt, batch, max_new, seed=0):
    import torch

    ids = torch.from_numpy(np.repeat(prompt[None], batch, 0).astype(np.int64))
    vocab = model.config.text_config.vocab_size
    timer = HFTimer(model)
    torch.manual_seed(seed)
    try:
        t0 = now()
        with torch.no_grad():
            o = model.generate(ids, **hf_kwargs(vocab, max_new))
        t1 = now()
    finally:
        timer.remove()
    n_canvas = max_new // CANVAS
    steps = timer.of("step")
    fwd = timer.of("decoder_forward")
    enc = timer.of("encoder")
    assert tuple(o.sequences.shape) == (batch, PROMPT_LEN + max_new), tuple(o.sequences.shape)
    assert len(steps) == STEPS * n_canvas and len(fwd) == STEPS * n_canvas, \
        f"expected {STEPS * n_canvas} denoise steps, saw {len(steps)} (early stop fired?)"
    assert len(enc) == n_canvas, len(enc)  # prefill + (n_canvas - 1) commits

    def inside(kind, a, b):
        return sum(e1 - e0 for e0, e1 in timer.of(kind) if e0 >= a and e1 <= b)

    step_s = [b - a for a, b in steps]
    fwd_s = [b - a for a, b in fwd]
    layers_s = [inside("decoder_layer", a, b) for a, b in fwd]
    head_s = [inside("head_matmul", a, b) for a, b in fwd]
    sc_s = [inside("sc_mlp", a, b) for a, b in fwd]
    r = {
        "batch": batch, "max_new_tokens": max_new, "total_s": t1 - t0,
        "per_canvas_s": (t1 - t0) / n_canvas, "tokens_per_s": batch * max_new / (t1 - t0),
        "prefill_s": enc[0][1] - enc[0][0],
        "commit_s": [b - a for a, b in enc[1:]],
        "step": summary(step_s),
        "decoder_forward": summary(fwd_s),
        "sampler": summary([s - f for s, f in zip(step_s, fwd_s)]),
        "decoder_layers_sum": summary(layers_s),
        "head_matmul": summary(head_s),
        "sc_mlp": summary(sc_s),
        "forward_other": summary([f - l - h - c for f, l, h, c in zip(fwd_s, layers_s, head_s, sc_s)]),
        "first_canvas_s": (enc[1][0] - t0) if len(enc) > 1 else (t1 - t0),  # prefill + 16 steps of canvas 1
        "tokens_per_forward": o.tokens_per_forward.tolist() if o.tokens_per_forward is not None else None,
        "tokens_head": o.sequences[0, PROMPT_LEN:PROMPT_LEN + 8].tolist(),
    }
    return r


def hf_warmup(model, prompt, res):
    import torch

    out = {"torch_threads": torch.get_num_threads(), "attn_implementation": model.config._attn_implementation,
           "generate_kwargs": {k: (repr(v) if not isinstance(v, (int, float, str)) else v)
                               for k, v in hf_kwargs(model.config.text_config.vocab_size, MAX_NEW).items()},
           "generate_512_runs": []}
    res["transformers"] = out
    log("hf: warm-up generate (1 canvas, 2 steps)")
    ids = torch.from_numpy(prompt[None].astype(np.int64))
    kw = hf_kwargs(model.config.text_config.vocab_size, CANVAS)
    kw["max_denoising_steps"] = 2
    kw["stability_threshold"] = 3
    t0 = now()
    with torch.no_grad():
        model.generate(ids, **kw)
    out["warm_up_s"] = now() - t0


def hf_finish(res):
    out = res["transformers"]
    runs = out["generate_512_runs"]
    out["generate_512"] = min(runs, key=lambda r: r["total_s"])
    out["generate_512_total"] = summary([r["total_s"] for r in runs])


def hf_batch_scaling(model, prompt, res):
    out = res["transformers"]
    best = out["generate_512"]
    bs = out.setdefault("batch_scaling", {})
    bs["1"] = {"derived_from": "the 512-token run: prefill + canvas 1 (time until the commit pass starts)",
               "min_s": best["first_canvas_s"], "tokens": CANVAS, "tokens_per_s": CANVAS / best["first_canvas_s"]}
    for b in res["config"]["hf_batches"]:
        if b == 1:
            continue
        log(f"hf: batch scaling, batch {b}, {CANVAS} new tokens")
        r = hf_generate(model, prompt, b, CANVAS)
        bs[str(b)] = {"min_s": r["total_s"], "tokens": b * CANVAS, "tokens_per_s": b * CANVAS / r["total_s"],
                      "step_median_s": r["step"]["median_s"], "decoder_forward_median_s":
                      r["decoder_forward"]["median_s"], "sampler_median_s": r["sampler"]["median_s"],
                      "prefill_s": r["prefill_s"]}


# ====================================================================== parity sanity check
def parity_check(hf, ctx, threads, reps):
    """One denoiser pass on both sides from the same prompt, canvas and weights: |logit diff|.

    Reuses the compiled dgemma_jax pieces (the cache holding the prompt, `denoise` with a zero
    self-conditioning input, which equals none: SC MLP(RMSNorm(0)) = 0)."""
    import jax.numpy as jnp

    from tests.reference.hf_reference import denoiser_logits, encoder_logits

    cfg, prompt = ctx["cfg"], ctx["prompt"]
    canvas = np.random.default_rng(3).integers(0, cfg.vocab_size, (CANVAS,))
    _, hc = encoder_logits(hf, prompt)
    ref = denoiser_logits(hf, hc, canvas)
    # Contention probe: one HF decoder pass at `threads` and at 1 torch thread, interleaved. On an
    # oversubscribed machine the OpenMP barriers of the multi-threaded pass stall and it gets slower than
    # the single-threaded one; on a quiet machine it is faster.
    import torch

    probe = {str(threads): [], "1": []}
    repeat = {str(threads): 0.0, "1": 0.0}  # the reference's own run-to-run spread, per thread count
    for _ in range(reps):
        for nt in (threads, 1):
            torch.set_num_threads(nt)
            t0 = now()
            again = denoiser_logits(hf, hc, canvas)
            probe[str(nt)].append(now() - t0)
            repeat[str(nt)] = max(repeat[str(nt)], float(np.abs(again - ref).max()))
    torch.set_num_threads(threads)
    soft0 = jnp.zeros((1, CANVAS, cfg.hidden_size), jnp.float32)
    runs = [np.asarray(ctx["trunk_head"](ctx["params"], jnp.asarray(canvas[None], jnp.int32), ctx["base"], soft0)[0])
            for _ in range(2)]
    ours = runs[0]
    diff = np.abs(ours - ref)
    per_pos = diff.max(-1)
    return {"max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
            "median_position_max_diff": float(np.median(per_pos)),
            "positions_with_max_diff_over_0.01": int((per_pos > 0.01).sum()), "positions": int(per_pos.size),
            "logit_std": float(ref.std()), "argmax_agreement": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
            "hf_repeat_max_diff_by_threads": repeat, "jax_repeat_max_diff": float(np.abs(runs[1] - runs[0]).max()),
            "hf_decoder_pass_thread_probe": {k: summary(v) for k, v in probe.items()}}


# ====================================================================== derived numbers + report
def derive(res):
    """Headline numbers. JAX: best repetition (a per-step number = a loop's total / its calls). HF: the best
    generate run; per-step numbers are that run's mean over its 32 denoising steps (same definition)."""
    j, h = res.get("dgemma_jax"), res.get("transformers")
    peak = res["matmul_peak"]["peak_gflops"] * 1e9
    fl = res["flops"]
    f512 = fl["denoise_step_context_512"]
    step_flops = f512["total"]
    d = {}
    if j:
        gen_s = j["generate_512"]["min_s"]
        pre, com = j["prefill_512"]["min_s"], j["commit_256"]["min_s"]
        fused_step_gen = (gen_s - pre - com * (N_CANVAS - 1)) / (STEPS * N_CANVAS)
        canvas_measured = "denoise_canvas" in j
        fused_step = j["denoise_canvas"]["min_s"] / STEPS if canvas_measured else fused_step_gen
        p = j["pieces"]
        step_sep = p["denoise_step"]["min_s"]
        math_s = p["trunk_plus_head_logits"]["min_s"]
        fwd_s = p["forward_with_sc"]["min_s"] if "forward_with_sc" in p else None  # older JSONs lack it
        trunk_s, hs_s, rest_s = p["trunk"]["min_s"], p["head_sampler_pass"]["min_s"], p["sampler_rest"]["min_s"]
        xc = j["xla_cost"]
        xla_step = xc["denoise_step"].get("flops", 0)
        xla_step_corr = xla_step - xc["head_sampler_pass"].get("flops", 0) \
            + xc["head_sampler_pass_one_chunk"].get("flops", 0)
        d["jax"] = {
            "per_canvas_s": gen_s / N_CANVAS, "tokens_per_s": MAX_NEW / gen_s, "total_s": gen_s,
            "prefill_512_s": pre, "commit_256_s": com,
            "step_fused_from_generate_s": fused_step_gen,
            "step_fused_canvas_loop_s": fused_step,
            "step_fused_source": "the canvas loop (denoise_canvas) / 16" if canvas_measured
            else "fused generate: (total - prefill - commit) / 32 (quick mode)",
            "after_trunk_s": hs_s + rest_s,
            "step_separately_jitted_s": step_sep,
            "trunk_s": trunk_s, "head_logits_s": math_s - trunk_s,
            "head_sampler_pass_s": hs_s, "sampler_rest_s": rest_s,
            "model_math_trunk_plus_head_s": math_s,
            "loop_overhead_vs_model_math_pct": 100 * (fused_step / math_s - 1),
            "model_forward_with_sc_s": fwd_s,
            "loop_overhead_vs_forward_with_sc_pct": (100 * (fused_step / fwd_s - 1)) if fwd_s else None,
            "loop_overhead_vs_sum_of_pieces_pct": 100 * (fused_step / (trunk_s + hs_s + rest_s) - 1),
            "fused_vs_separately_jitted_step_pct": 100 * (fused_step / step_sep - 1),
            "step_gflops": step_flops / fused_step / 1e9,
            "step_fraction_of_peak": step_flops / fused_step / peak,
            "trunk_fraction_of_peak": f512["trunk"] / trunk_s / peak,
            "head_logits_fraction_of_peak": f512["head_logits"] / max(math_s - trunk_s, 1e-9) / peak,
            "head_sampler_fraction_of_peak": (f512["head_logits"] + f512["sc_soft_embedding"]) / hs_s / peak,
            "prefill_fraction_of_peak": fl["prefill_512"]["total"] / pre / peak,
            "commit_fraction_of_peak": fl["commit_256"]["total"] / com / peak,
            "xla_step_flops_raw": xla_step,
            "xla_step_flops_scan_corrected": xla_step_corr,
            "ar_decode_1_s": j["ar_decode_1"]["min_s"],
            "ar_tokens_per_s": 1 / j["ar_decode_1"]["min_s"],
            "ar_gb_per_s_weights": res["setup"]["param_count_jax"] * 4 / j["ar_decode_1"]["min_s"] / 1e9,
            "denoise_positions_per_s": CANVAS / fused_step,
            "parallelism_ratio_per_pass": (CANVAS / fused_step) * j["ar_decode_1"]["min_s"],
            "step_time_over_ar_time": fused_step / j["ar_decode_1"]["min_s"],
            "denoise_effective_tokens_per_s_16_steps": CANVAS / (STEPS * fused_step + com),
            "effective_speedup_vs_ar_16_steps": (CANVAS / (STEPS * fused_step + com)) * j["ar_decode_1"]["min_s"],
            "compile_s": {k: v["total_s"] for k, v in j["compile"].items()},
            "first_call_minus_steady_generate_s": j["generate_512"]["first_call_after_aot_s"] - gen_s,
        }
        bs = j.get("batch_scaling", {})
        if bs:
            b1 = bs.get("1", {}).get("tokens_per_s")
            d["jax"]["batch_scaling"] = {b: {"tokens_per_s": v["tokens_per_s"], "s": v["min_s"],
                                             "speedup_vs_b1": (v["tokens_per_s"] / b1) if b1 else None}
                                         for b, v in bs.items()}
    if h:
        g = h["generate_512"]
        step = g["step"]["mean_s"]
        d["hf"] = {
            "per_canvas_s": g["per_canvas_s"], "tokens_per_s": g["tokens_per_s"], "total_s": g["total_s"],
            "prefill_512_s": g["prefill_s"], "commit_256_s": g["commit_s"][0] if g["commit_s"] else None,
            "step_s": step, "step_median_s": g["step"]["median_s"],
            "decoder_forward_s": g["decoder_forward"]["mean_s"], "sampler_s": g["sampler"]["mean_s"],
            "decoder_layers_s": g["decoder_layers_sum"]["mean_s"], "head_matmul_s": g["head_matmul"]["mean_s"],
            "sc_mlp_s": g["sc_mlp"]["mean_s"], "forward_other_s": g["forward_other"]["mean_s"],
            "trunk_s": g["decoder_layers_sum"]["mean_s"] + g["sc_mlp"]["mean_s"],
            "after_trunk_s": step - g["decoder_layers_sum"]["mean_s"] - g["sc_mlp"]["mean_s"],
            "step_fraction_of_peak": step_flops / step / peak,
            "forward_fraction_of_peak": step_flops / g["decoder_forward"]["mean_s"] / peak,
            "trunk_fraction_of_peak": (f512["trunk"] - f512["sc_mlp"]) / g["decoder_layers_sum"]["mean_s"] / peak,
            "prefill_fraction_of_peak": fl["prefill_512"]["total"] / g["prefill_s"] / peak,
        }
        if "batch_scaling" in h:
            b1 = h["batch_scaling"].get("1", {}).get("tokens_per_s")
            d["hf"]["batch_scaling"] = {b: {"tokens_per_s": v["tokens_per_s"], "s": v["min_s"],
                                            "speedup_vs_b1": v["tokens_per_s"] / b1 if b1 else None}
                                        for b, v in h["batch_scaling"].items()}
    if j and h:
        dj, dh = d["jax"], d["hf"]
        d["ratio_hf_over_jax"] = {
            "per_canvas": dh["per_canvas_s"] / dj["per_canvas_s"],
            "per_step_fused": dh["step_s"] / dj["step_fused_canvas_loop_s"],
            "per_step_fused_from_generate": dh["step_s"] / dj["step_fused_from_generate_s"],
            "per_step_separately_jitted": dh["step_s"] / dj["step_separately_jitted_s"],
            "trunk": dh["trunk_s"] / dj["trunk_s"],
            "after_trunk": dh["after_trunk_s"] / dj["after_trunk_s"],
            "prefill_512": dh["prefill_512_s"] / dj["prefill_512_s"],
            "commit_256": (dh["commit_256_s"] / dj["commit_256_s"]) if dh["commit_256_s"] else None,
        }
        if "batch_scaling" in dj and "batch_scaling" in dh:
            d["ratio_hf_over_jax"]["batch"] = {b: dj["batch_scaling"][b]["tokens_per_s"]
                                               / dh["batch_scaling"][b]["tokens_per_s"]
                                               for b in dh["batch_scaling"] if b in dj["batch_scaling"]}
    return d


def markdown(res):
    d = res["derived"]
    m = res["machine"]
    c = res["config"]
    la0 = ", ".join(f"{x:.2f}" for x in res["load_average_start"] or [])
    la1 = ", ".join(f"{x:.2f}" for x in res.get("load_average_end") or [])
    L = ["# dgemma_jax vs transformers on the CPU (`bench` preset)", ""]
    L.append(f"{m['date_utc']} · {m['cpu_model']} ({', '.join(m['cpu_flags'][:6])}) · nproc {m['nproc']} · "
             f"jax {m['jax']} · torch {m['torch']} ({res.get('transformers', {}).get('torch_threads', '?')} threads) "
             f"· transformers {m['transformers']} · mode {'quick' if c['quick'] else 'full'} · "
             f"commit {m['git_commit'][:10]} · {res['wall_s']:.0f} s"
             + (f" · **pinned to CPUs {m['pinned_cpus']}** (both sides)" if m.get("pinned_cpus") else ""))
    L.append("")
    L.append(f"Load average (1, 5, 15 min) at start {la0}; at end {la1}. The machine has {m['nproc']} cores.")
    ph = res.get("rss_phases", {})
    other = [(k, v["other_processes_cores"]) for k, v in ph.items() if "other_processes_cores" in v]
    if other:
        L.append("Cores used by OTHER processes during each phase (from /proc/stat minus this process): "
                 + ", ".join(f"{k} {x:.2f}" for k, x in other) + ".")
    probe = res.get("parity", {}).get("hf_decoder_pass_thread_probe")
    if probe and len(probe) == 2:
        (k2, a), (k1, b) = list(probe.items())
        L.append(f"Contention probe: one HF decoder pass takes {ms(a['min_s'])} ms (median {ms(a['median_s'])}) at "
                 f"{k2} torch threads and {ms(b['min_s'])} ms (median {ms(b['median_s'])}) at {k1}. On an "
                 "oversubscribed machine PyTorch's OpenMP barriers stall and the multi-threaded pass becomes "
                 "slower than the single-threaded one (XLA's thread pool degrades far less), which inflates the "
                 "transformers times and the ratios below; quote only runs where other processes used ~0 cores.")
    L.append("")
    L.append(f"Config: 6 layers (5 sliding + 1 global), hidden 512, 16 experts top-4, vocab 32768; prompt "
             f"{PROMPT_LEN}, batch 1, float32, {STEPS} denoising steps per canvas (early stop impossible, checked on "
             f"both sides), no EOS, {N_CANVAS} canvases of {CANVAS} = {MAX_NEW} new tokens. Same weights on both "
             "sides.")
    if "parity" in res:
        p = res["parity"]
        L.append(f"Same-weights check, one denoiser pass over a random canvas: per position, the max |JAX - HF "
                 f"logit| has median {p['median_position_max_diff']:.1e}; {p['positions_with_max_diff_over_0.01']} "
                 f"of {p['positions']} positions exceed 0.01 (overall max {p['max_abs_logit_diff']:.2f}, logit std "
                 f"{p['logit_std']:.2f}; isolated positions, possibly near-tie top-4 routing decisions: not "
                 f"verified); argmax agreement {100 * p['argmax_agreement']:.1f}%.")
        if "hf_repeat_max_diff_by_threads" in p:
            rep = p["hf_repeat_max_diff_by_threads"]
            L.append(f"Repeatability: the same pass repeated gives max |logit difference| "
                     f"{', '.join(f'{v:.1e} at {k} torch thread(s)' for k, v in rep.items())} on the transformers "
                     f"side and {p['jax_repeat_max_diff']:.1e} on the dgemma_jax side.")
    L.append("")
    dj, dh, r = d.get("jax"), d.get("hf"), d.get("ratio_hf_over_jax", {})
    if dj and dh:
        rows = [(f"**per canvas** (total / {N_CANVAS}), ms", ms(dh["per_canvas_s"]), ms(dj["per_canvas_s"]),
                 f"**{r['per_canvas']:.2f}x**"),
                (f"tokens / s ({MAX_NEW} tokens incl. prefill)", f"{dh['tokens_per_s']:.1f}",
                 f"{dj['tokens_per_s']:.1f}",
                 f"{dj['tokens_per_s'] / dh['tokens_per_s']:.2f}x"),
                (f"**denoise step**, ms (JAX: {dj['step_fused_source']})", ms(dh["step_s"]),
                 ms(dj["step_fused_canvas_loop_s"]), f"**{r['per_step_fused']:.2f}x**")]
        if not dj["step_fused_source"].startswith("fused generate"):
            rows.append((f"denoise step, ms (JAX: (generate - prefill - commit) / {STEPS * N_CANVAS})", "",
                         ms(dj["step_fused_from_generate_s"]), f"{r['per_step_fused_from_generate']:.2f}x"))
        rows += [("denoise step, ms (JAX: separately jitted step in a Python loop)", "",
                  ms(dj["step_separately_jitted_s"]), f"{r['per_step_separately_jitted']:.2f}x"),
                 ("· trunk: embedding, SC MLP, 6 layers, ms", ms(dh["trunk_s"]), ms(dj["trunk_s"]),
                  f"{r['trunk']:.2f}x"),
                 ("· after the trunk: head, softcap, temperature, sampling, argmax, entropy, acceptance, SC soft "
                  "embedding, ms", ms(dh["after_trunk_s"]), ms(dj["after_trunk_s"]), f"{r['after_trunk']:.2f}x"),
                 (f"prefill {PROMPT_LEN} tokens, ms", ms(dh["prefill_512_s"]), ms(dj["prefill_512_s"]),
                  f"{r['prefill_512']:.2f}x")]
        if r.get("commit_256"):
            rows.append((f"commit {CANVAS} tokens (into {PROMPT_LEN}), ms", ms(dh["commit_256_s"]),
                         ms(dj["commit_256_s"]), f"{r['commit_256']:.2f}x"))
        rows.append(("denoise step useful FLOPs / time / machine peak", pct(dh["step_fraction_of_peak"]),
                     pct(dj["step_fraction_of_peak"]), ""))
        L += ["## Side by side, batch 1", ""] + table(("", "transformers", "dgemma_jax", "transformers / dgemma_jax"),
                                                     rows)
        L.append("")
        L.append(f"transformers' step split (hooks, mean of {STEPS * N_CANVAS} steps): decoder forward "
                 f"{ms(dh['decoder_forward_s'])} ms = decoder layers "
                 f"{ms(dh['decoder_layers_s'])} ms, lm_head matmul {ms(dh['head_matmul_s'])} ms, self-conditioning "
                 f"MLP {ms(dh['sc_mlp_s'])} ms, rest of forward (SC softmax + soft-embedding matmul, embedding, "
                 f"softcap) {ms(dh['forward_other_s'])} ms; sampler = step - forward (softmax, multinomial, "
                 f"argmax, 2 entropies, sort) {ms(dh['sampler_s'])} ms. Its forward includes the SC soft "
                 f"embedding; dgemma_jax computes "
                 f"that inside its fused head/sampler pass instead.")
        L.append("")
    if dj:
        fl = res["flops"]["denoise_step_context_512"]
        peak = res["matmul_peak"]["peak_gflops"] * 1e9
        L += [f"## dgemma_jax denoise step breakdown (batch 1, context {PROMPT_LEN})", "",
              "| piece | ms | useful GFLOP | % of peak |", "|---|---:|---:|---:|"]

        def row(name, t, flops):
            L.append(f"| {name} | {ms(t)} | {flops / 1e9:.2f} | {pct(flops / t / peak) if flops and t else ''} |")

        row("trunk: embed + SC MLP + 6 layers + final norm", dj["trunk_s"], fl["trunk"])
        row("head logits matmul + softcap, materialised (model math - trunk)", dj["head_logits_s"],
            fl["head_logits"])
        row("fused head + sampler pass (logits, sample, argmax, entropy, SC soft embedding; vocab chunks)",
            dj["head_sampler_pass_s"], fl["head_logits"] + fl["sc_soft_embedding"])
        row("sampler rest (entropy-bound accept, renoise, stop test, history)", dj["sampler_rest_s"], 0)
        row("model math alone: trunk + head logits (jitted `denoise`)", dj["model_math_trunk_plus_head_s"],
            fl["trunk"] + fl["head_logits"])
        if dj.get("model_forward_with_sc_s"):
            row("model forward as the reference computes it: trunk + head logits + SC softmax(logits / T) @ E "
                "(jitted, materialised)", dj["model_forward_with_sc_s"], fl["total"])
        row("separately jitted step (the engine's `denoise_step`, Python loop)", dj["step_separately_jitted_s"],
            fl["total"])
        if not dj["step_fused_source"].startswith("fused generate"):
            row(f"fused canvas `lax.while_loop` (`denoise_canvas`) / {STEPS}", dj["step_fused_canvas_loop_s"],
                fl["total"])
        row(f"fused generate: (total - prefill - commit) / {STEPS * N_CANVAS}", dj["step_fused_from_generate_s"],
            fl["total"])
        L.append("")
        L.append(f"Fused loop ({dj['step_fused_source']}) per step vs the model math alone (trunk + head logits): "
                 f"{dj['loop_overhead_vs_model_math_pct']:+.1f}% (the step also runs the sampler and the SC soft "
                 f"embedding); vs the sum of its pieces (trunk + fused head/sampler pass + sampler rest): "
                 f"{dj['loop_overhead_vs_sum_of_pieces_pct']:+.1f}%; fused loop vs the separately jitted step: "
                 f"{dj['fused_vs_separately_jitted_step_pct']:+.1f}%.")
        if dj.get("loop_overhead_vs_forward_with_sc_pct") is not None:
            L.append("")
            L.append(f"Fused loop per step vs the model's whole forward as the reference computes it (trunk, head "
                     f"logits and the next step's SC soft embedding, jitted once, no sampler): "
                     f"{dj['loop_overhead_vs_forward_with_sc_pct']:+.1f}% (the loop adds sampling, entropy, "
                     f"acceptance, renoising and the stop test, and saves the [B, L, V] buffers).")
        L.append("")
        mp = res["matmul_peak"]
        L.append(f"Machine f32 matmul peak: JAX {mp['jax_best_gflops']:.1f} GFLOP/s, torch "
                 f"{mp['torch_best_gflops'] or float('nan'):.1f} GFLOP/s "
                 f"(best of m x k x n = {', '.join(mp['jax'])}); peak = "
                 f"the larger "
                 f"(a lower bound of the true peak on a loaded machine). Useful "
                 f"FLOPs of one denoise step (analytic, 2 x MACs): {fl['total'] / 1e9:.2f} GFLOP = trunk "
                 f"{fl['trunk'] / 1e9:.2f} (projections {fl['qkvo_proj'] / 1e9:.2f}, attention "
                 f"{fl['attention'] / 1e9:.2f}, dense MLP {fl['dense_mlp'] / 1e9:.2f}, top-4 experts "
                 f"{fl['experts_topk'] / 1e9:.2f}, SC MLP {fl['sc_mlp'] / 1e9:.2f}) + head logits "
                 f"{fl['head_logits'] / 1e9:.2f} + SC soft embedding {fl['sc_soft_embedding'] / 1e9:.2f}. "
                 f"XLA cost_analysis of the jitted step: {dj['xla_step_flops_raw'] / 1e9:.2f} GFLOP raw (the "
                 f"vocab-chunk scan body counted once), {dj['xla_step_flops_scan_corrected'] / 1e9:.2f} GFLOP with "
                 f"the head pass counted in full (XLA also counts the MoE capacity buffers, not just the top-4 "
                 f"work). The fused step runs at {dj['step_gflops']:.1f} GFLOP/s = "
                 f"{pct(dj['step_fraction_of_peak'])} of peak; trunk {pct(dj['trunk_fraction_of_peak'])}, "
                 f"head/sampler pass {pct(dj['head_sampler_fraction_of_peak'])}, prefill "
                 f"{pct(dj['prefill_fraction_of_peak'])}.")
        L.append("")
        if res.get("gemm_ceiling"):
            L += gemm_ceiling_markdown(res["gemm_ceiling"], dj["step_fused_canvas_loop_s"])
        canvas_s = STEPS * dj["step_fused_canvas_loop_s"] + dj["commit_256_s"]
        L += ["## AR-style decode vs denoise (dgemma_jax, batch 1)", ""] + table(("", "ms per pass", "positions / s"), [
            (f"1-token causal decode, cache holding {PROMPT_LEN}+ (`prefill`, logits='last')",
             ms(dj["ar_decode_1_s"]), f"{dj['ar_tokens_per_s']:.1f}"),
            (f"{CANVAS}-token denoise step (fused loop)", ms(dj["step_fused_canvas_loop_s"]),
             f"{dj['denoise_positions_per_s']:.1f}"),
            (f"a canvas: {STEPS} steps + commit", ms(canvas_s),
             f"{dj['denoise_effective_tokens_per_s_16_steps']:.1f} (tokens)")])
        L.append("")
        L.append(f"Parallelism ratio per pass: a denoise step costs {dj['step_time_over_ar_time']:.1f}x a 1-token "
                 f"decode but covers {CANVAS} positions: {dj['parallelism_ratio_per_pass']:.1f}x the positions per "
                 f"second. At {STEPS} steps + commit per canvas, generated tokens/s = "
                 f"{dj['effective_speedup_vs_ar_16_steps']:.2f}x an AR decoder's. (The 1-token decode streams the "
                 f"weights at ~{dj['ar_gb_per_s_weights']:.1f} GB/s; the denoise step is compute-bound.)")
        L.append("")
        bsj = dj.get("batch_scaling", {})
        bsh = dh.get("batch_scaling", {}) if dh else {}
        if bsj:
            rows = []
            for b in sorted(set(bsj) | set(bsh), key=int):
                cells = [b]
                for side in (bsj.get(b), bsh.get(b)):
                    if side:
                        up = f"{side['speedup_vs_b1']:.2f}x" if side.get("speedup_vs_b1") else "—"
                        cells += [f"{side['s']:.2f}", f"{side['tokens_per_s']:.1f}", up]
                    else:
                        cells += ["—", "—", "—"]
                rb = r.get("batch", {}).get(b)
                cells.append(f"{rb:.2f}x" if rb else "—")
                rows.append(cells)
            L += [f"## Batch scaling (fused generate, {CANVAS} new tokens = 1 canvas, same prompt per row)", ""]
            L += table(("batch", "dgemma_jax s", "dgemma_jax tok/s", "vs b=1", "transformers s", "transformers tok/s",
                        "vs b=1", "JAX / HF"), rows, "r" * 8)
            if bsh.get("1", {}).get("derived_from"):
                L.append("")
                L.append("transformers at batch 1: prefill + first canvas of the 512-token run (until its commit "
                         "pass starts).")
            L.append("")
        jj = res["dgemma_jax"]

        def mb(mem, field):
            return f"{mem.get(field, 0) / 2**20:.1f}"

        rows = [(k, f"{v['total_s']:.1f}", mb(jj["memory"].get(k, {}), "argument_size_in_bytes"),
                 mb(jj["memory"].get(k, {}), "temp_size_in_bytes"),
                 f"{jj['xla_cost'].get(k, {}).get('flops', 0) / 1e9:.2f}") for k, v in jj["compile"].items()]
        rows += [(f"generate_fused_256, batch {b}", f"{v['compile_s']:.1f}",
                  mb(v.get("memory", {}), "argument_size_in_bytes"),
                  mb(v.get("memory", {}), "temp_size_in_bytes"), f"{(v.get('xla_flops') or 0) / 1e9:.2f}")
                 for b, v in jj.get("batch_scaling", {}).items()]
        L += ["## Compile time and memory (dgemma_jax)", ""] + table(
            ("program", "AOT lower + compile s", "XLA arguments MB", "XLA temp MB", "XLA GFLOP (raw)"), rows)
        L.append("")
        L.append(f"First fused-generate call after its AOT compile minus the steady state: "
                 f"{dj['first_call_minus_steady_generate_s']:+.2f} s. Process max RSS {res['max_rss_mb']:.0f} MB; "
                 "per-phase peak RSS (sampled every 50 ms; the model weights of both sides stay resident): "
                 + ", ".join(f"{k} {v['peak_rss_mb']:.0f} MB (+{v['peak_above_start_mb']:.0f})"
                             for k, v in res["rss_phases"].items()) + ".")
        L.append("")
    return "\n".join(L)


# ====================================================================== main
def parse_args(argv):
    argv = [a for a in argv if a != "--"]  # `dgemma bench -- --quick` passes the separator through
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions, no separate canvas-loop program, batches 1,2, no HF batch scaling")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "bench_cpu.json"),
                    help="JSON results (default: benchmarks/results/bench_cpu.json, the committed results; "
                         "`dgemma bench` writes to a scratch path unless given --out)")
    ap.add_argument("--md", default=None, help="markdown summary path (default: --out with .md)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default 2, or --cores when given)")
    ap.add_argument("--cores", type=int, default=None,
                    help="pin the whole process (both sides) to this many CPUs: a fair comparison that stays "
                         "meaningful when other processes occupy the remaining cores")
    ap.add_argument("--batches", default=None, help="dgemma_jax batch sizes (default 1,2,4,8; quick 1,2)")
    ap.add_argument("--hf-batches", default="1,8", help="transformers batch sizes (full mode only)")
    ap.add_argument("--skip-hf", action="store_true", help="dgemma_jax only")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown of an earlier run's JSON")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.render:
        with open(args.render) as f:
            md = markdown(json.load(f))
        report.write({}, None, md + "\n", args.md or os.path.splitext(args.render)[0] + ".md")
        print(md)
        return 0
    pinned = pin_cores(args.cores) if args.cores else None
    if args.threads is None:
        args.threads = args.cores or 2
    if not args.skip_hf:  # torch: the [ref] extra, absent from the default install
        import torch

        torch.set_num_threads(args.threads)
    import jax

    t_start = now()
    rss = RSSMonitor()
    batches = [int(x) for x in (args.batches or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    res = {"config": {"quick": args.quick, "model": "ModelConfig.preset('bench') / hf_reference.build_preset('bench')",
                      "prompt_len": PROMPT_LEN, "canvas": CANVAS, "steps": STEPS, "max_new_tokens": MAX_NEW,
                      "batches": batches, "hf_batches": [int(x) for x in args.hf_batches.split(",")],
                      "seed": args.seed, "dtype": "float32"},
           "load_average_start": loadavg()}
    res["machine"] = machine_info()
    res["machine"]["pinned_cpus"] = pinned
    if not args.skip_hf:  # the reference side's thread pools (the package's machine record never imports torch)
        import torch

        res["machine"].update(torch_threads=torch.get_num_threads(), torch_interop_threads=torch.get_num_interop_threads())
    res["config"]["cores"] = args.cores
    res["config"]["torch_threads"] = args.threads
    log(f"machine: {res['machine']['cpu_model']}, nproc {res['machine']['nproc']}, load {res['load_average_start']}")

    rss.start("setup")
    hf, cfg, params, tmp, info = build_models(args.seed, with_hf=not args.skip_hf)
    rss.end()
    res["setup"] = info
    res["config"]["model_config"] = {k: (list(v) if isinstance(v, tuple) else v)
                                     for k, v in cfg.__dict__.items()}
    prompt = np.random.default_rng(1000 + args.seed).integers(3, cfg.vocab_size, (PROMPT_LEN,)).astype(np.int32)
    res["flops"] = {  # dgemma_jax/perf/roofline.py: the useful FLOPs (2 x multiply-accumulates)
        "denoise_step_context_512": denoise_step_flops_by_part(cfg, 1, PROMPT_LEN, CANVAS),
        "denoise_step_context_768": denoise_step_flops_by_part(cfg, 1, PROMPT_LEN + CANVAS, CANVAS),
        "prefill_512": causal_pass_flops(cfg, 1, 0, PROMPT_LEN),
        "commit_256": causal_pass_flops(cfg, 1, PROMPT_LEN, CANVAS),
        "ar_decode_1": causal_pass_flops(cfg, 1, PROMPT_LEN, 1, head_tokens=1),
    }

    log("matmul peak")
    rss.start("matmul_peak")
    q = args.quick
    res["matmul_peak"] = matmul_peak([(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (256, 512, 2048),
                                      (256, 2048, 512)],
                                     [10 if q else 30, 3 if q else 6, 1 if q else 3, 20 if q else 60, 20 if q else 60],
                                     with_torch=not args.skip_hf)
    rss.end()
    log(f"peak {res['matmul_peak']['peak_gflops']:.1f} GFLOP/s")
    log("GEMM ceiling: the denoise step's matrix products at their own shapes, each timed alone")
    rss.start("gemm_ceiling")
    res["gemm_ceiling"] = gemm_ceiling(cfg, PROMPT_LEN, CANVAS, vocab_chunk(cfg.vocab_size),
                                       res["matmul_peak"]["peak_gflops"], reps=10 if q else 30,
                                       with_torch=not args.skip_hf)
    rss.end()

    rss.start("dgemma_jax_pieces")
    ctx = jax_pieces(cfg, params, prompt, args.quick, res)
    rss.end()
    if not args.skip_hf:
        log("parity check (one denoiser pass on both sides)")
        rss.start("parity")
        res["parity"] = parity_check(hf, ctx, args.threads, 2 if args.quick else 3)
        rss.end()
        log(f"parity {({k: v for k, v in res['parity'].items() if k != 'hf_decoder_pass_thread_probe'})}")
    rss.start("dgemma_jax_generate_compile")
    jax_generate_setup(ctx)
    rss.end()
    if not args.skip_hf:
        rss.start("transformers_warm_up")
        hf_warmup(hf, prompt, res)
        rss.end()
    # The headline runs alternate between the two sides, so that load changes hit both alike.
    rss.start("headline_generate_512_both")
    for r in range(1 if args.quick else 2):
        log(f"headline round {r + 1}: dgemma_jax generate {MAX_NEW}")
        res["dgemma_jax"]["generate_512_runs"].append(jax_generate_once(ctx))
        if not args.skip_hf:
            log(f"headline round {r + 1}: transformers generate {MAX_NEW}")
            res["transformers"]["generate_512_runs"].append(hf_generate(hf, prompt, 1, MAX_NEW, seed=r))
    rss.end()
    jax_generate_finish(ctx)
    if not args.skip_hf:
        hf_finish(res)
    rss.start("dgemma_jax_batch_scaling")
    jax_batch_scaling(ctx)
    rss.end()
    if not args.skip_hf and not args.quick:
        rss.start("transformers_batch_scaling")
        hf_batch_scaling(hf, prompt, res)
        rss.end()
    rss.stop()
    res["load_average_end"] = loadavg()
    res["max_rss_mb"] = maxrss_mb()
    res["rss_phases"] = rss.phases
    res["derived"] = derive(res)
    res["wall_s"] = now() - t_start

    md = markdown(res)
    md_path = report.write(res, args.out, md + "\n", args.md)
    print(md)
    log(f"wrote {args.out} and {md_path} ({res['wall_s']:.0f} s)")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    del jax
    return 0


if __name__ == "__main__":
    sys.exit(main())
