"""`--profile DIR` writes a trace that TensorBoard's profile plugin reads (xprof, its backend)."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_generate_profile_is_a_trace_tensorboard_reads(tmp_path):
    raw_to_tool_data = pytest.importorskip("xprof.convert.raw_to_tool_data", reason="xprof is in the [test] extra")
    out = tmp_path / "prof"
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", "s9350814272=", "--quiet",
                        "--profile", str(out)], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "0122345789"  # profiling changes nothing the command prints
    assert f"[profile written to {out}: tensorboard --logdir {out}]" in r.stderr
    # TensorBoard's layout: LOGDIR/plugins/profile/<run>/<host>.xplane.pb
    (xplane,) = glob.glob(str(out / "plugins" / "profile" / "*" / "*.xplane.pb"))
    # converted as the profile plugin's trace viewer does: the generation's fused program ran in it
    data, content_type = raw_to_tool_data.xspace_to_tool_data([xplane], "trace_viewer", {})
    assert content_type == "application/json"
    events = json.loads(data)["traceEvents"]
    ran = {e["name"] for e in events if e.get("ph") == "X"}
    assert "PjitFunction(generate_fused)" in ran, sorted(ran)[:50]
    # without Python function tracing (its events are named "$file.py:line function")
    assert not [n for n in ran if n.startswith("$")]


def test_no_profile_flag_writes_nothing_and_only_process_zero_traces(tmp_path, monkeypatch):
    import jax

    from dgemma_jax.parallel import profile

    with profile(None):
        pass
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # another host of a pod
    with profile(str(tmp_path / "p")):
        pass
    assert not (tmp_path / "p").exists()
