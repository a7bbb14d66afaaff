"""The benchmark's GEMM list covers exactly the denoise step's useful FLOPs (the shared FLOP model,
dgemma_jax/perf/roofline.py), and the ceiling sums it right."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gemm_ceiling  # noqa: E402

from dgemma_jax import ModelConfig  # noqa: E402
from dgemma_jax.perf.roofline import denoise_step_flops_by_part  # noqa: E402


@pytest.mark.parametrize("name,context", [("bench", 512), ("bench", 100), ("tiny-6layer", 40),
                                          ("diffusiongemma-26b-a4b", 4096)])
def test_step_gemms_cover_the_analytic_flops(name, context):
    cfg = ModelConfig.preset(name)
    chunk = 2048 if cfg.vocab_size % 2048 == 0 else cfg.vocab_size
    gemms = gemm_ceiling.step_gemms(cfg, context, 256, chunk)
    ref = denoise_step_flops_by_part(cfg, 1, context, canvas=256)
    by_group = {}
    for g in gemms:
        by_group[g["group"]] = by_group.get(g["group"], 0) + g["flops"]
    for group, flops in by_group.items():
        assert flops == pytest.approx(ref[group], rel=1e-12), group
    assert sum(by_group.values()) == pytest.approx(ref["total"], rel=1e-12)


def test_ceiling_sums_count_times_time():
    gemms = [gemm_ceiling._gemm("a", 3, 1, 10, 20, 30), gemm_ceiling._gemm("b", 1, 4, 8, 8, 8)]
    timings = {"jax": {(1, 10, 20, 30): 1e-3, (4, 8, 8, 8): 2e-3}, "torch": {(1, 10, 20, 30): 5e-4, (4, 8, 8, 8): 5e-4},
               "call_overhead_s": {"jax": 0.0, "torch": 0.0}}
    r = gemm_ceiling.ceiling(gemms, timings, peak_gflops=1.0)
    assert r["jax"]["ms"] == pytest.approx(5.0) and r["torch"]["ms"] == pytest.approx(2.0)
    useful = (3 * 10 * 20 * 30 + 4 * 8 * 8 * 8) * 2
    assert r["useful_gflop"] == pytest.approx(useful / 1e9)
    assert r["jax"]["pct_of_peak"] == pytest.approx(100 * useful / 5e-3 / 1e9)
    assert r["jax"]["groups"]["a"]["ms"] == pytest.approx(3.0)
    assert r["shapes"][0]["jax_ms_per_call"] == pytest.approx(1.0)
    assert r["shapes"][1]["torch_ms_per_call"] == pytest.approx(0.5)


@pytest.mark.ref
def test_time_gemms_times_every_distinct_shape_on_both_sides():
    pytest.importorskip("torch")  # the benchmark times torch's GEMMs next to JAX's
    gemms = [gemm_ceiling._gemm("a", 2, 1, 16, 32, 8), gemm_ceiling._gemm("b", 1, 3, 4, 8, 16),
             gemm_ceiling._gemm("c", 5, 1, 16, 32, 8)]  # the first shape again: timed once
    t = gemm_ceiling.time_gemms(gemms, reps=3)
    for side in ("jax", "torch"):
        assert set(t[side]) == {(1, 16, 32, 8), (3, 4, 8, 16)}
        assert all(0 < v < 1.0 for v in t[side].values())
        assert t["call_overhead_s"][side] > 0
    r = gemm_ceiling.ceiling(gemms, t, peak_gflops=100.0)
    assert r["jax"]["ms"] == pytest.approx(1e3 * (7 * t["jax"][(1, 16, 32, 8)] + t["jax"][(3, 4, 8, 16)]))


def test_without_torch_the_jax_side_is_timed_and_tabled(monkeypatch):
    """`bench_cpu.py --skip-hf` on the default install (no torch): the matmul peak, the GEMM timings and
    the ceiling table take JAX's side alone, and nothing imports torch."""
    monkeypatch.setitem(sys.modules, "torch", None)   # `import torch` raises ImportError
    import bench_cpu

    gemms = [gemm_ceiling._gemm("a", 2, 1, 16, 32, 8), gemm_ceiling._gemm("b", 1, 3, 4, 8, 16)]
    t = gemm_ceiling.time_gemms(gemms, reps=2, with_torch=False)
    assert "torch" not in t and set(t["jax"]) == {(1, 16, 32, 8), (3, 4, 8, 16)}
    r = gemm_ceiling.ceiling(gemms, t, peak_gflops=100.0)
    assert "torch" not in r and r["shapes"][0]["torch_ms_per_call"] is None and r["jax"]["ms"] > 0
    md = "\n".join(gemm_ceiling.gemm_ceiling_markdown(r, step_s=0.01))
    assert "| - | - |" in md and "torch nan ms" in md
    peak = bench_cpu.matmul_peak([(16, 32, 8)], [2], with_torch=False)
    assert peak["torch"] == {} and peak["torch_best_gflops"] is None
    assert peak["peak_gflops"] == peak["jax_best_gflops"] > 0
    with pytest.raises(ImportError):
        gemm_ceiling.time_gemms(gemms, reps=2)   # the torch side asked for: torch is needed
