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
    r = _run("--preset", "tiny-6layer", "--topology", "v5e-8", "--mesh", "expert=4,tensor=2", "--context", "64",
             "--prompt", "16", "--programs", "denoise_step,commit,generate", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["chips"] == 8 and rep["fits"]
    assert rep["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 4}
    for name in ("denoise_step", "commit", "generate"):
        p = rep["programs"][name]
        assert p["fits"] and p["flops"] > 0 and p["bytes_accessed"] > 0
        assert 0 < p["total_bytes"] < rep["hbm_limit_bytes"]
    assert rep["projection"]["per_canvas_ms"] > rep["projection"]["denoise_step_ms"]
    assert "projected" in r.stdout and "not a measurement" in r.stdout
    # the step is held against what it must do: useful FLOPs and required bytes per chip
    step = rep["programs"]["denoise_step"]
    assert step["useful_flops"] > 0 and step["required_bytes"] > step["required_param_bytes"] > 0
    assert step["flops_ratio"] == pytest.approx(step["flops"] / step["useful_flops"])
    assert 0 < rep["projection"]["roofline_step_ms"] <= rep["projection"]["denoise_step_ms"]


def test_default_mesh_puts_every_chip_on_the_model(tmp_path):
    from dgemma_jax.parallel.aot import compile_report

    rep = compile_report("tiny-2layer", "v5e-4", context=64, prompt=16, programs=("denoise_step",))
    assert rep["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 4} and rep["fits"]


def test_program_that_does_not_fit_exits_nonzero_with_the_fix():
    r = _run("--preset", "bench", "--topology", "v5e-1", "--mesh", "", "--batch", "64", "--context", "200000",
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
    r = _run("--preset", "tiny-6layer", "--topology", "v5e-8", "--mesh", "fsdp=4,tensor=2", "--rules", "training",
             "--batch", "8", "--context", "64", "--prompt", "16", "--programs", "lora_step", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    step = rep["programs"]["lora_step"]
    assert step["fits"] and step["flops"] > 0 and rep["rules"] == "training"
