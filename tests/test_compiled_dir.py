"""Compiled programs kept in a directory: `dgemma compile --save DIR`, `dgemma serve|generate --compiled DIR`
(dgemma_jax.compile_cache: jax's serialized executables under DIR/xla plus DIR/manifest.json)."""

import json
import os
import re
import shutil
import subprocess
import sys

import jax
import pytest

from dgemma_jax import ModelConfig, compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUMMARY = re.compile(r"compilation cache (\S+): (\d+) program\(s\) from the cache, (\d+) compiled")


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in (compile_cache.ENV, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", **extra)
    return env


def _dgemma(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dgemma_jax.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env or _env(), cwd=ROOT)


def _generate(directory, *extra):
    r = _dgemma("generate", "--prompt", "s9350814272=", "--compiled", str(directory), *extra)
    return r, SUMMARY.search(r.stderr)


@pytest.fixture
def restore_cache_settings():
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes", "jax_persistent_cache_enable_xla_caches")
    before = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    compile_cache._forget_decision()


def test_a_directory_is_refused_for_another_model_mesh_or_version_naming_the_field(tmp_path,
                                                                                 restore_cache_settings):
    devices = jax.devices()
    cfg = ModelConfig.preset("tiny-2layer")
    ident = compile_cache.identity(cfg, devices[:8], mesh={"expert": 8}, rules="latency", quantize=None)
    assert compile_cache.use_compiled_dir(str(tmp_path), ident) == str(tmp_path / "xla")
    assert json.loads((tmp_path / "manifest.json").read_text())["identity"]["mesh"] == {"expert": 8}
    compile_cache.use_compiled_dir(str(tmp_path), dict(ident))  # the same: taken
    cases = [
        ("mesh", compile_cache.identity(cfg, devices[:8], mesh={"data": 2, "expert": 4}, rules="latency",
                                        quantize=None)),
        ("model", compile_cache.identity(ModelConfig.preset("tiny-6layer"), devices[:8], mesh={"expert": 8},
                                         rules="latency", quantize=None)),
        ("model_sha256", compile_cache.identity(cfg.replace(rms_norm_eps=1e-5), devices[:8], mesh={"expert": 8},
                                                rules="latency", quantize=None)),
        ("devices", compile_cache.identity(cfg, devices[:4], mesh={"expert": 8}, rules="latency", quantize=None)),
        ("libtpu", {**ident, "libtpu": "0.0.1"}),
        ("rules", compile_cache.identity(cfg, devices[:8], mesh={"expert": 8}, rules="serving", quantize=None)),
    ]
    for field, other in cases:
        with pytest.raises(compile_cache.CompiledDirMismatch, match=rf"compiled for {field}=.*this run has {field}="):
            compile_cache.use_compiled_dir(str(tmp_path), other)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        compile_cache.use_compiled_dir(str(tmp_path / "empty"), ident, create=False)


@pytest.mark.slow
def test_generate_reads_its_programs_back_from_a_copied_directory_and_refuses_another_model(tmp_path):
    first, m = _generate(tmp_path / "a")
    assert first.returncode == 0 and first.stdout.strip() == "0122345789", first.stderr[-2000:]
    # an empty directory: every entry in it was compiled by this run (a program the run compiles from two
    # call sites may read back the entry its first compile wrote, so reads are not always 0)
    assert m and int(m.group(3)) >= len(os.listdir(tmp_path / "a" / "xla")) > 0
    # the directory moved elsewhere: the cache keys do not depend on its path
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    again, m = _generate(tmp_path / "b")
    assert again.returncode == 0 and again.stdout == first.stdout
    assert m and m.group(1) == str(tmp_path / "b" / "xla") and int(m.group(2)) >= 1, again.stderr
    refused = _dgemma("generate", "--prompt", "s9350814272=", "--compiled", str(tmp_path / "b"),
                      "--quantize", "int8")
    assert refused.returncode == 2
    # one error line, after at most the load report's lines (a load past 3 s is announced: a loaded CI
    # machine quantizing the bundled model to int8 took that long)
    *report, error = refused.stderr.strip().splitlines()
    assert all(line.startswith(("dgemma: loading ", "dgemma: loaded ")) for line in report), refused.stderr
    assert error.startswith("dgemma: error: --compiled") and "quantize=None" in error
    assert "quantize='int8'" in error
    # damaged executables: recompiled with a warning, the same answer. Every damaged entry's program is
    # compiled again; a program the run compiles twice (it compiles some identical programs from two
    # call sites) may then read the entry it rewrote, so reads from the cache are not required to be 0
    entries = os.listdir(tmp_path / "b" / "xla")
    for name in entries:
        (tmp_path / "b" / "xla" / name).write_bytes(b"not an executable")
    damaged, m = _generate(tmp_path / "b")
    assert damaged.returncode == 0 and damaged.stdout == first.stdout, damaged.stderr[-2000:]
    assert "Error reading persistent compilation cache entry" in damaged.stderr
    assert m and int(m.group(3)) >= len(entries), damaged.stderr[-2000:]


@pytest.mark.slow
def test_compile_save_writes_the_same_cache_keys_in_two_processes(tmp_path):
    """The TPU programs `dgemma compile --save` writes have the same cache keys from two processes and
    two directories (so a TPU host with the same software would look them up under those keys), with
    their sizes and compile seconds in the manifest and the report."""
    pytest.importorskip("libtpu")
    manifests = []
    for d in ("one", "two"):
        r = _dgemma("compile", "--preset", "tiny-2layer", "--topology", "v5e-8", "--programs", "slot_tick,prefill_slot",
                    "--batch", "2", "--context", "256", "--prompt", "32", "--save", str(tmp_path / d),
                    "--out", str(tmp_path / f"{d}.json"))
        assert r.returncode == 0, r.stderr[-2000:]
        assert "saved slot_tick: 1 executable(s)" in r.stderr
        manifests.append(json.loads((tmp_path / d / "manifest.json").read_text()))
        report = json.loads((tmp_path / f"{d}.json").read_text())
        assert report["programs"]["slot_tick"]["saved"]["cache_keys"]
    one, two = manifests
    assert one["identity"] == two["identity"] and one["identity"]["device_kind"].startswith("TPU")
    assert one["identity"]["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8}
    for name in ("slot_tick", "prefill_slot"):
        a, b = one["programs"][name], two["programs"][name]
        assert a["cache_keys"] == b["cache_keys"] and len(a["cache_keys"]) == 1
        assert a["cache_keys"][0].startswith(f"jit_{name}-")
        assert a["bytes"] > 10_000 and b["bytes"] > 10_000 and a["compile_s"] > 0
        # The file sizes may differ by a byte or two: a cache entry stores the compile time next to the
        # executable, compressed. The executables themselves must be the same bytes (jax compares
        # them the same way before it overwrites an entry).
        key = a["cache_keys"][0]
        assert _executable(tmp_path / "one" / "xla" / key) == _executable(tmp_path / "two" / "xla" / key)


def _executable(path):
    """The serialized executable in a persistent-cache entry, without the compile time stored with it."""
    from jax._src import compilation_cache as cc  # deferred: private jax module, this test only
    executable, _ = cc.extract_executable_and_time(cc.decompress_executable(path.read_bytes()))
    return executable
