"""TPU AOT compile-and-fit from this CPU machine (needs the [tpu] extra: jax[tpu] / libtpu)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("libtpu")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "compile", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_small_config_compiles_for_v5e_8(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-8", "--mesh", "expert=4,tensor=2", "--context", "64",
             "--prompt", "16", "--programs", "denoise_step,commit,generate", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["chips"] == 8 and rep["fits"]
    assert rep["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 4}
    for name in ("denoise_step", "commit", "generate"):
        p = rep["programs"][name]
        assert p["fits"] and p["flops"] > 0 and p["bytes_accessed"] > 0
        assert 0 < p["hbm_bytes"] <= p["bytes_accessed"]
        assert 0 < p["total_bytes"] < rep["hbm_limit_bytes"]
    assert rep["projection"]["per_canvas_ms"] > rep["projection"]["denoise_step_ms"]
    assert "projected" in r.stdout and "not a measurement" in r.stdout
    # the step is held against what it must do: useful FLOPs and required bytes per chip
    step = rep["programs"]["denoise_step"]
    assert step["useful_flops"] > 0 and step["required_bytes"] > step["required_param_bytes"] > 0
    assert step["flops_ratio"] == pytest.approx(step["flops"] / step["useful_flops"])
    assert step["hbm_bytes_ratio"] == pytest.approx(step["hbm_bytes"] / step["required_bytes"])
    assert 0 < rep["projection"]["roofline_step_ms"] <= rep["projection"]["denoise_step_ms"]


def test_compile_prints_a_progress_line_per_program_and_no_libtpu_noise():
    # `dgemma compile` was silent for the ~10 minutes the 26B's programs take, and loading libtpu for
    # the topology printed five probing error lines on a machine without a TPU
    import re

    from dgemma_jax.backends import tpu_chips

    r = _run("--preset", "tiny-2layer", "--topology", "v5e-4", "--context", "64", "--prompt", "16",
             "--programs", "prefill,denoise_step")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    if tpu_chips() == 0:
        assert len(lines) == 2, r.stderr
    progress = [ln for ln in lines if ln.startswith("[")]
    assert len(progress) == 2, r.stderr
    for i, (line, name) in enumerate(zip(progress, ("prefill", "denoise_step"))):
        assert re.fullmatch(rf"\[{i + 1}/2\] compiling {name} \.\.\. \d+\.\d s, \d+\.\d\d GB per chip", line), line


def test_default_mesh_puts_every_chip_on_the_model(tmp_path):
    from dgemma_jax.perf.aot import compile_report

    rep = compile_report("tiny-2layer", "v5e-4", context=64, prompt=16, programs=("denoise_step",))
    assert rep["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 4} and rep["fits"]


def test_tpu_step_attends_to_the_cache_through_the_kernel():
    """Compiled for TPU, the global layer's attention is the Pallas kernel (model/flash.py),
    run per head shard; its FLOPs, which the compiler cannot see, are counted from its shapes and
    account for what the compiler no longer counts."""
    from dgemma_jax import ModelConfig
    from dgemma_jax.perf.aot import compile_report

    cfg = ModelConfig.preset("tiny-6layer", global_head_dim=128, canvas_length=128)
    reps = {mode: compile_report(cfg, "v5e-8", mesh="expert=4,tensor=2", context=256, prompt=16, attn_kernel=mode,
                                 programs=("denoise_step",))["programs"]["denoise_step"]
            for mode in ("auto", "xla")}
    kernel, xla = reps["auto"], reps["xla"]
    # the global layer (the sliding layers' head_dim 16 keeps XLA); 4 query heads over tensor=2: 2 per chip;
    # 128 canvas queries over 256 slots and the 128 canvas keys, head_dim 128
    assert kernel["kernel_flops"] == 4 * 1 * 128 * 2 * 128 * (256 + 128)
    assert kernel["flops"] == kernel["hlo_dot_flops"] + kernel["kernel_flops"]
    assert xla["kernel_flops"] == 0 and xla["flops"] == xla["hlo_dot_flops"]
    assert kernel["flops"] == pytest.approx(xla["flops"], rel=0.02)


def test_the_cache_kernel_moves_no_statistics_through_hbm():
    """The denoiser's cache attention (model/flash.py) reads the [batch, kv head, slot, head dim] cache
    as it lies and keeps its running max, sum and accumulator on chip: compiled for a v5e-1 (two kv heads
    a sliding layer, so a cache in another order would need a copy), the kernel calls move nothing
    through HBM here (their operands are prefetched to VMEM). Measured: 0 bytes; 9.4 MB with splash
    attention, whose statistics and float32 accumulator are HBM outputs."""
    from dgemma_jax import ModelConfig
    from dgemma_jax.perf.aot import compile_report

    cfg = ModelConfig.preset("tiny-6layer", global_head_dim=128, head_dim=128, canvas_length=128, sliding_window=128)
    step = compile_report(cfg, "v5e-1", context=256, prompt=16, batch=2,
                          programs=("denoise_step",))["programs"]["denoise_step"]
    # every layer through the kernel: 2 rows x 128 queries x 4 heads x 128 dims x (256 slots + 128 canvas
    # keys) x 4, six layers
    assert step["kernel_flops"] == 6 * 4 * 2 * 128 * 4 * 128 * (256 + 128)
    assert step["hbm_bytes_by_op"].get("custom-call", 0) < 1e6, step["hbm_bytes_by_op"]
    assert step["hbm_bytes_by_op"].get("copy", 0) == 0, step["hbm_bytes_by_op"]


def test_the_commit_in_the_next_steps_pass_reads_the_weights_once():
    """`commit_step` (a canvas's commit and the next canvas's first step, `generate.commit_and_first_step`)
    compiled for a v5e-1 at one row, where a step is bound by reading the weights: it moves the step's
    HBM bytes (the commit adds its FLOPs, not a second read of the weights; as two passes it moved
    1.45x), and the projection prices a canvas as 15 steps and that pass. Measured: 126.7 MB against
    the step's 126.8 (the commit alone 57.6)."""
    from dgemma_jax import ModelConfig
    from dgemma_jax.perf.aot import compile_report

    cfg = ModelConfig.preset("tiny-6layer", num_layers=2, layer_types=("sliding", "global"), hidden_size=1024,
                             moe_intermediate_size=512, num_experts=16, intermediate_size=1024, dtype="bfloat16",
                             param_dtype="bfloat16", canvas_length=128)
    rep = compile_report(cfg, "v5e-1", context=512, prompt=32, programs=("denoise_step", "commit_step"))
    step, fused = rep["programs"]["denoise_step"], rep["programs"]["commit_step"]
    assert step["hbm_bytes"] > 0.9 * step["required_param_bytes"]   # the step reads its weights
    assert fused["hbm_bytes"] < 1.02 * step["hbm_bytes"], (fused["hbm_bytes"], step["hbm_bytes"])
    assert fused["flops"] > 1.3 * step["flops"]                        # and does the commit's work too
    proj = rep["projection"]
    assert proj["commit"].startswith("with a step")
    assert proj["per_canvas_ms"] == pytest.approx(1e3 * (15 * step["projected_seconds"] + fused["projected_seconds"]))


def test_program_that_does_not_fit_exits_nonzero_with_the_fix():
    # 64 rows x 262,144 slots of the global layer's cache alone are ~19.5 GB, over the v5e's 15.75 (the five
    # sliding layers hold rings of window + canvas slots, model/cache.py)
    r = _run("--preset", "bench", "--topology", "v5e-1", "--mesh", "", "--batch", "64", "--context", "262144",
             "--prompt", "16", "--programs", "commit")
    assert r.returncode == 3
    assert "does not fit" in r.stdout
    assert "more chips" in r.stderr and "shorter --context" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_topology_is_a_usage_error():
    r = _run("--preset", "tiny-6layer", "--topology", "v9-8")
    assert r.returncode == 2 and "unknown --topology" in r.stderr and "Traceback" not in r.stderr


def test_lora_training_step_compiles_for_v5e_8(tmp_path):
    out = tmp_path / "lora.json"
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-8", "--mesh", "fsdp=4,tensor=2", "--rules", "training",
             "--batch", "8", "--context", "64", "--prompt", "16", "--programs", "lora_step", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    step = rep["programs"]["lora_step"]
    assert step["fits"] and step["flops"] > 0 and rep["rules"] == "training"


def _tpu_compiled(fn, *args, donate=()):
    import jax

    from dgemma_jax.perf.aot import tpu_devices

    dev = tpu_devices("v5e-1")[0]
    shard = jax.sharding.SingleDeviceSharding(dev)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=shard) for a in args]
    return jax.jit(fn, donate_argnums=donate).lower(*specs).compile()


def test_hbm_traffic_counts_what_crosses_hbm():
    """The HBM count of small TPU programs whose traffic is known: a matmul reads its operands and
    writes its result once; a slice taken inside a fusion reads the slice, not the whole array."""
    import jax
    import jax.numpy as jnp

    from dgemma_jax.perf.hbm_traffic import hbm_traffic

    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16)
    compiled = _tpu_compiled(lambda x, w: x @ w, x, w)
    need = 2 * (256 * 4096 + 4096 * 8192 + 256 * 8192)
    traffic = hbm_traffic(compiled.as_text())
    got = traffic["total"]
    assert need <= got <= 1.1 * need, (got, need)
    assert sum(traffic["by_scope"].values()) == pytest.approx(got) == pytest.approx(sum(traffic["by_op"].values()))
    assert any("dot_general" in scope for scope in traffic["by_scope"])
    counted = compiled.cost_analysis()
    counted = (counted[0] if isinstance(counted, (list, tuple)) else counted)["bytes accessed"]
    assert counted >= got

    # 1/16 of a long [rows, 1024] array, sliced at a run-time offset, times a small matrix
    cache = jax.ShapeDtypeStruct((65536, 1024), jnp.bfloat16)
    small = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    start = jax.ShapeDtypeStruct((), jnp.int32)
    compiled = _tpu_compiled(lambda c, m, s: jax.lax.dynamic_slice_in_dim(c, s, 4096) @ m, cache, small, start)
    need = 2 * (4096 * 1024 + 1024 * 1024 + 4096 * 1024)
    got = hbm_traffic(compiled.as_text())["total"]
    assert need * 0.99 <= got <= 1.5 * need, (got, need)  # far below the whole array (128 MiB)


def test_hbm_traffic_counts_an_update_in_place_by_the_rows_it_writes():
    """A KV-cache write: rows scattered (or a block written) into a large buffer, in a loop, update the
    buffer in place, so they cost the rows, not a read and a write of the whole buffer; where the
    buffer must be copied first (not donated), the copy is counted."""
    import jax
    import jax.numpy as jnp

    from dgemma_jax.perf.hbm_traffic import hbm_traffic

    cache = jax.ShapeDtypeStruct((65536, 1024), jnp.bfloat16)  # 128 MiB
    rows = jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16)
    start = jax.ShapeDtypeStruct((), jnp.int32)

    def scatter(c, u, s):
        return jax.lax.fori_loop(0, 4, lambda i, c: c.at[s + 256 * i + jnp.arange(256)].set(u, mode="drop"), c)

    def block(c, u, s):
        return jax.lax.fori_loop(0, 4, lambda i, c: jax.lax.dynamic_update_slice_in_dim(c, u + i, s + 256 * i, 0), c)

    whole = 2 * 65536 * 1024 * 2
    for fn in (scatter, block):
        got = hbm_traffic(_tpu_compiled(fn, cache, rows, start, donate=(0,)).as_text())["total"]
        assert got < 0.02 * whole, (fn.__name__, got)  # ~ the rows read and written, not 256 MiB
        copied = hbm_traffic(_tpu_compiled(fn, cache, rows, start).as_text())["total"]
        assert copied >= whole, (fn.__name__, copied)  # the parameter's copy into the output


def test_hbm_traffic_reads_loops_and_branches_like_cost_analysis():
    """A loop body counts once and a conditional its largest branch; a module without an ENTRY is
    an error that says so."""
    import jax
    import jax.numpy as jnp

    from dgemma_jax.perf.hbm_traffic import hbm_traffic

    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((128, 4096), jnp.bfloat16)
    one = hbm_traffic(_tpu_compiled(lambda x, w: x @ w, x, w).as_text())["total"]
    loop = hbm_traffic(_tpu_compiled(
        lambda x, w: jax.lax.fori_loop(0, 4, lambda i, y: (y @ w).astype(y.dtype), x), x, w).as_text())["total"]
    assert 0.9 * one <= loop <= 2.0 * one  # not 4x
    flag = jax.ShapeDtypeStruct((), jnp.bool_)
    branch = hbm_traffic(_tpu_compiled(
        lambda f, x, w: jax.lax.cond(f, lambda: x @ w, lambda: x @ w[:, ::-1] + 1), flag, x, w).as_text())["total"]
    assert 0.9 * one <= branch <= 2.0 * one  # the larger branch, not both
    with pytest.raises(ValueError, match="no ENTRY"):
        hbm_traffic("HloModule m\n")


def test_the_servers_slot_programs_compile_for_v6e_8(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--preset", "tiny-6layer", "--topology", "v6e-8", "--mesh", "expert=4,tensor=2", "--context", "64",
             "--prompt", "16", "--batch", "4", "--programs", "denoise_step,commit,slot_tick,prefill_slot",
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["fits"] and rep["batch"] == 4
    for name in ("slot_tick", "prefill_slot"):
        p = rep["programs"][name]
        assert p["fits"] and p["flops"] > 0 and 0 < p["total_bytes"] < rep["hbm_limit_bytes"]
    # one step refines a canvas in each of the 4 slots
    proj = rep["projection"]
    assert proj["rows"] == 4
    assert proj["tokens_per_second_all_rows"] == pytest.approx(4 * proj["tokens_per_second"])


def test_compile_works_without_jax_platforms_set(tmp_path):
    """The CLI drops JAX's TPU probe on machines without a TPU (libtpu's noise), but `compile` needs
    the TPU plugin registered: with JAX_PLATFORMS unset, as users run it, a program with the Pallas
    cache-attention kernel must still lower ('tpu_custom_call for an unknown platform tpu' before)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "compile", "--preset", "bench", "--topology",
                        "v6e-8", "--context", "512", "--prompt", "16", "--programs", "denoise_step",
                        "--out", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "r.json").read_text())["programs"]["denoise_step"]["fits"]


def test_int8_weights_halve_what_the_step_must_read_and_collectives_are_priced(tmp_path):
    reports = {}
    for quant in (None, "int8"):
        out = tmp_path / f"{quant}.json"
        extra = ["--quantize", quant] if quant else []
        r = _run("--preset", "bench", "--topology", "v6e-8", "--dtype", "bfloat16", "--context", "1024",
                 "--prompt", "256", "--programs", "denoise_step", "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr[-2000:]
        reports[quant] = json.loads(out.read_text())
    bf16, int8 = (reports[k]["programs"]["denoise_step"] for k in (None, "int8"))
    assert reports["int8"]["quantize"] == "int8" and "weights int8" in r.stdout
    # int8 kernels: one byte a weight plus per-channel scales; the router, norms and the tied
    # embedding stay bf16, so the required parameter bytes fall to between 1/2 and 3/4 of bf16's
    ratio = int8["required_param_bytes"] / bf16["required_param_bytes"]
    assert 0.5 < ratio < 0.75, ratio
    assert int8["hbm_bytes"] < bf16["hbm_bytes"]
    # the expert-parallel step sums partial outputs over the 8 chips every layer: two all-reduces per
    # layer, after the attention and after the feed-forward (the dense MLP's partial output summed in
    # the experts' psum: XLA:TPU does not merge two psums itself)
    layers = 6  # the bench preset
    for step in (bf16, int8):
        reduces = step["collectives_by_kind"]["all-reduce"]
        in_layers = [c for c in step["collectives"] if c["kind"] == "all-reduce" and "blocks_N" in c["scope"]]
        assert sum(c["count"] for c in in_layers) == 2 * layers, in_layers
        assert not any("_ffw/dense_mlp" in c["scope"] for c in in_layers), in_layers
        assert reduces["count"] >= 2 * layers
        assert step["ici_seconds"] > 0
        assert step["projected_seconds_with_ici"] == pytest.approx(step["projected_seconds"] + step["ici_seconds"])
    p = reports["int8"]["projection"]
    assert p["denoise_step_ms_with_ici"] > p["denoise_step_ms"]


def test_an_image_prompt_compiles_with_the_vision_tower_for_v5e_8():
    from dgemma_jax.config import ModelConfig, VisionConfig
    from dgemma_jax.perf.aot import compile_report

    base = ModelConfig.preset("tiny-6layer").replace(dtype="bfloat16", param_dtype="bfloat16")
    tower = VisionConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=4, head_dim=8,
                         position_embedding_size=64)
    cfg = base.replace(vision=tower, image_token_id=base.vocab_size - 1, boi_token_id=base.vocab_size - 2,
                       eoi_token_id=base.vocab_size - 3)
    rep = compile_report(cfg, "v5e-8", context=1024, prompt=320, programs=("prefill", "prefill_images"), images=1)
    text, image = rep["programs"]["prefill"], rep["programs"]["prefill_images"]
    assert rep["images"] == 1 and rep["vision_param_bytes"] > 0 and rep["fits"]
    # the tower's work (2520 patches through its layer, then pooling and the projection) is on top of the text pass
    assert image["flops"] > text["flops"] and image["total_bytes"] > text["total_bytes"]
    with pytest.raises(ValueError, match="cannot hold 2 image"):
        compile_report(cfg, "v5e-8", context=1024, prompt=320, programs=("prefill_images",), images=2)
    # the server's image prefill: one slot's chunk with its image, into a 2-slot cache
    rep = compile_report(cfg, "v5e-8", batch=2, context=1024, prompt=320, programs=("prefill_slot", "prefill_slot_images"),
                         images=1)
    text, image = rep["programs"]["prefill_slot"], rep["programs"]["prefill_slot_images"]
    assert image["flops"] > text["flops"] and image["fits"]


def test_compiler_options_reach_the_tpu_compiler_and_are_recorded(tmp_path):
    # an option name XLA does not know comes back from the TPU compiler itself, as one line
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-4", "--context", "64", "--prompt", "16",
             "--programs", "denoise_step", "--xla-option", "xla_tpu_no_such_option=true")
    assert r.returncode == 2, r.stderr[-2000:]
    assert "No such compile option" in r.stderr and "xla_tpu_no_such_option" in r.stderr
    assert "Traceback" not in r.stderr
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-4", "--xla-option", "novalue")
    assert r.returncode == 2 and "KEY=VALUE" in r.stderr and "Traceback" not in r.stderr
    out = tmp_path / "r.json"
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-4", "--context", "64", "--prompt", "16",
             "--programs", "denoise_step", "--xla-option", "xla_tpu_enable_latency_hiding_scheduler=true",
             "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["compiler_options"] == {"xla_tpu_enable_latency_hiding_scheduler": "true"} and rep["fits"]


def test_explain_memory_lists_what_is_live_at_each_programs_peak(tmp_path):
    out = tmp_path / "r.json"
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-1", "--context", "1024", "--prompt", "256", "--batch", "2",
             "--programs", "denoise_step,slot_tick", "--explain-memory", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    for name in ("denoise_step", "slot_tick"):
        e = rep["programs"][name]
        peak = e["memory_peak"]
        assert 0 < peak["bytes_by_kind"]["parameter"] <= e["memory"]["argument_size_in_bytes"]
        assert peak["peak_bytes"] == sum(peak["bytes_by_kind"].values()) <= e["total_bytes"]
        assert 0 < len(peak["largest"]) <= 3 and all(b["kind"] != "parameter" for b in peak["largest"])
        lines = r.stdout.split(f"{name}: at its memory peak", 1)[1].splitlines()
        assert len([ln for ln in lines[1:4] if "MiB" in ln]) == len(peak["largest"]), r.stdout
    r = _run("--preset", "tiny-2layer", "--topology", "v5e-1", "--explain-memory", "-1")
    assert r.returncode == 2 and "--explain-memory must be >= 0" in r.stderr and "Traceback" not in r.stderr


def test_the_lora_rl_step_and_its_rollout_compile_for_v5p_8(tmp_path):
    out = tmp_path / "rl.json"
    r = _run("--preset", "tiny-2layer", "--topology", "v5p-8", "--mesh", "fsdp=2,expert=2", "--rules", "training",
             "--batch", "8", "--context", "48", "--prompt", "16",
             "--programs", "rl_step,prefill,denoise_step,commit,generate", "--layers", "scan", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    # the layout benchmarks/aot_rl.py compiles the 26B's in (a recipe's model.overrides.layers)
    assert rep["fits"] and rep["chips"] == 4 and rep["layers"] == "scan"
    for name in ("rl_step", "prefill", "denoise_step", "commit", "generate"):
        assert rep["programs"][name]["fits"] and rep["programs"][name]["flops"] > 0
    # the update donates the old state: adapters and moments are aliased into the new one
    assert rep["programs"]["rl_step"]["memory"]["alias_size_in_bytes"] > 0
    q = rep["rl"]
    assert q["rows"] == 8 and q["canvases"] == 2 and q["options"]["num_samples"] == 1
    assert q["update_seconds"] == rep["programs"]["rl_step"]["projected_seconds"] > 0
    assert q["rollout_seconds"] == pytest.approx(rep["programs"]["prefill"]["projected_seconds"]
                                                 + 2 * rep["projection"]["per_canvas_ms"] / 1e3)
    assert q["step_seconds"] == pytest.approx(q["rollout_seconds"] + q["update_seconds"])
    assert q["rollout_with_training_state_bytes"] == (rep["programs"]["generate"]["total_bytes"] + rep["programs"]
                                                      ["rl_step"]["memory"]["argument_size_in_bytes"])
    assert q["rollout_with_training_state_fits"] and q["fits"]
    assert "RL step projected" in r.stdout and "not a measurement" in r.stdout


def test_parameters_in_the_compilers_layouts_and_the_defaults_hold_no_weight_relayout_copy():
    """param_formats="compiler" compiles an engine program with its parameters in the layouts the TPU compiler
    prefers. On 3 layers of the bench config, the int4 serving tick for a v5e-1 with the Pallas grouped matmul
    (the 26B's: benchmarks/results/param_formats_int4_v5e-1.json), the default layouts made a relayout copy of
    a weight at the program's start while the cache was stored [batch, slot, kv head, head dim] (measured:
    temporaries 19.3 vs 16.5 MB, traffic 48.5 vs 46.7 MB); with the cache in the attention kernel's order
    neither layout makes one (`perf.memory_peak`), and the default layouts move no more than the compiler's.
    Since the tick commits in the pass of its first tick, the program holds that tick and the plain one
    (measured: traffic 65.3 MB either way, temporaries 21.5 MB default vs 22.3 compiler; a relayout copy
    added ~7 MB of temporaries and ~9 MB of traffic to the default layouts' program). The prefill, compiled
    for the tick's layouts as `dgemma serve` runs it (serving.runner), moves the same either way (24.4 MB)."""
    from dgemma_jax.config import ModelConfig
    from dgemma_jax.perf.aot import compile_report

    cfg = ModelConfig.preset("bench", vocab_size=4096, num_layers=3, layer_types=("sliding", "sliding", "global"))
    got, traffic = {}, {}
    for mode in ("default", "compiler"):
        rep = compile_report(cfg, "v5e-1", context=512, prompt=32, batch=2, programs=("slot_tick", "prefill_slot"),
                             quantize="int4", layers="unrolled", explain_memory=40, moe_dispatch="gmm",
                             param_formats=mode)
        assert rep["param_formats"] == mode and rep["fits"]
        tick = rep["programs"]["slot_tick"]
        copies = [b for b in tick["memory_peak"]["largest"] if b["op"].startswith("copy of params")]
        got[mode] = (tick["memory"]["temp_size_in_bytes"], sum(b["bytes"] for b in copies), len(copies))
        traffic[mode] = (tick["hbm_bytes"], rep["programs"]["prefill_slot"]["hbm_bytes"])
    assert got["default"][2] == 0 and got["compiler"][2] == 0, got   # no weight relaid out (default: 1 before)
    assert got["default"][0] <= got["compiler"][0] and traffic["default"][0] <= traffic["compiler"][0] + 1e6, \
        (got, traffic)
    assert got["default"][0] < 24e6 and traffic["default"][0] < 70e6, (got, traffic)   # measured 21.5 / 65.3 MB
    assert traffic["compiler"][1] == traffic["default"][1], traffic
    assert rep["param_formats_from"] == "slot_tick" and "projected_seconds" in rep["programs"]["prefill_slot"]
    with pytest.raises(ValueError, match="param_formats='fast' is invalid"):
        compile_report(cfg, "v5e-1", context=512, prompt=32, programs=("slot_tick",), param_formats="fast")
