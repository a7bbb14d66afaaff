"""The benchmarks' shared readers and writer: a compiled program's cost and memory
(dgemma_jax/perf/compiled.py) and the results JSON / markdown (dgemma_jax/perf/report.py)."""

import json

import jax
import jax.numpy as jnp

from dgemma_jax.engine.programs import compiled_memory
from dgemma_jax.perf import compiled, report


def test_cost_and_memory_of_a_compiled_matmul():
    a, b = jnp.ones((32, 16)), jnp.ones((16, 8))
    prog, times = compiled.compile_timed(jax.jit(lambda x, y: x @ y), a, b)
    c = compiled.cost(prog)
    assert set(c) == {"flops", "bytes_accessed", "transcendentals"}
    assert c["flops"] == 2 * 32 * 16 * 8 and c["bytes_accessed"] > 0
    assert compiled.memory is compiled_memory  # the engine's reader, not a copy
    mem = compiled.memory(prog)
    assert mem["argument_size_in_bytes"] == (32 * 16 + 16 * 8) * 4 and mem["total_bytes"] > 0
    assert times["total_s"] >= times["compile_s"] > 0


def test_table_and_write(tmp_path):
    lines = report.table(("", "ms", "note"), [("a", "1.0", ""), ("b", 2, "x")], "lrl")
    assert lines == ["| | ms | note |", "|---|---:|---|", "| a | 1.0 | |", "| b | 2 | x |"]
    assert report.ms(0.0123) == "12.3" and report.ms(None) == "—" and report.pct(0.5) == "50.0%"
    out = tmp_path / "r" / "res.json"
    md = report.write({"x": 1, "odd": {1, 2}}, str(out), "# title")
    assert md == str(tmp_path / "r" / "res.md")
    assert json.loads(out.read_text()) == {"x": 1, "odd": repr({1, 2})}
    assert (tmp_path / "r" / "res.md").read_text() == "# title\n"
    assert report.write({}, None) is None


def test_machine_info_names_the_commit_and_date():
    m = report.machine_info()
    for key in ("date_utc", "cpu_model", "nproc", "python", "jax", "jaxlib", "git_commit", "env"):
        assert key in m, key
    assert m["jax"] == jax.__version__
