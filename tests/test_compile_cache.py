"""jax's persistent compilation cache is on by default in every entry point (dgemma_jax.compile_cache)."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from dgemma_jax import compile_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def restore_cache_dir():
    before = jax.config.jax_compilation_cache_dir
    yield
    jax.config.update("jax_compilation_cache_dir", before)
    compile_cache._forget_decision()


def test_the_directory_comes_from_jax_config_then_jax_env_then_the_project_cache(tmp_path, monkeypatch,
                                                                                restore_cache_dir):
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path / "dg"))
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "from-env"))
    assert compile_cache.enable() == str(tmp_path / "from-env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "from-env")
    monkeypatch.delenv(compile_cache.ENV)
    # a directory already in jax.config (the caller's, or jax's from the variable at import) is kept
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
    assert compile_cache.enable() == str(tmp_path / "mine")
    jax.config.update("jax_compilation_cache_dir", None)
    assert compile_cache.enable() == str(tmp_path / "dg" / "xla") == compile_cache.default_dir()
    assert compile_cache.enable(str(tmp_path / "explicit")) == str(tmp_path / "explicit")
    assert compile_cache.enable("gs://bucket/xla") == "gs://bucket/xla"  # a URL is passed as it is
    for off in ("off", "OFF", ""):
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv(compile_cache.ENV, off)
        assert compile_cache.enable() is None and jax.config.jax_compilation_cache_dir is None
        assert compile_cache.CompileCounter().summary().startswith("compilation cache off:")
    assert compile_cache.enable("off") is None


def test_a_directory_set_after_the_first_compilation_still_takes_effect(tmp_path, restore_cache_dir):
    # jax decides at the first compilation whether the cache is used: this process compiled long ago
    jax.config.update("jax_compilation_cache_dir", None)
    compile_cache._forget_decision()
    jax.jit(lambda x: x * 3)(jnp.ones(3))  # decided: no cache
    compile_cache.enable(str(tmp_path))
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        counter = compile_cache.CompileCounter()
        jax.jit(lambda x: jnp.sin(x) @ x.T + 7)(jnp.ones((5, 5)))
    finally:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)
    assert any(tmp_path.iterdir()), "nothing was written to the cache directory"
    assert counter.counts()["compiled"] >= 1


def test_engine_turns_the_cache_on_unless_told_not_to(tmp_path, monkeypatch, restore_cache_dir):
    from dgemma_jax import Engine, ModelConfig, init_params

    monkeypatch.delenv(compile_cache.ENV, raising=False)
    monkeypatch.setenv("DGEMMA_CACHE", str(tmp_path))
    cfg = ModelConfig.preset("tiny-2layer")
    params = init_params(cfg, 0)
    jax.config.update("jax_compilation_cache_dir", None)
    Engine(cfg, params, compilation_cache=False)
    assert jax.config.jax_compilation_cache_dir is None
    Engine(cfg, params)
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    Engine(cfg, params, compilation_cache=str(tmp_path / "mine"))
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")


def _generate(env):
    r = subprocess.run([sys.executable, "-m", "dgemma_jax.cli", "generate", "--prompt", "s9350814272="],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "0122345789"
    m = re.search(r"compilation cache (\S+): (\d+) program\(s\) from the cache, (\d+) compiled in ([\d.]+) s",
                  r.stderr)
    assert m, r.stderr
    return m.group(1), int(m.group(2)), int(m.group(3))


def test_a_second_start_reads_the_first_starts_programs_with_no_setting(tmp_path):
    """`dgemma generate` twice with nothing set by hand: the second start reads the fused generate
    from ~/.cache/dgemma_jax/xla (here DGEMMA_CACHE) instead of compiling it again."""
    env = {k: v for k, v in os.environ.items() if k not in (compile_cache.ENV, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")}
    env.update(DGEMMA_CACHE=str(tmp_path), PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    where, hits, compiled = _generate(env)
    assert where == str(tmp_path / "xla") and hits == 0 and compiled >= 1
    entries = sorted(os.listdir(tmp_path / "xla"))
    assert any(e.startswith("jit_generate_fused") for e in entries), entries
    where, hits2, compiled2 = _generate(env)
    assert hits2 >= 1 and compiled2 < compiled  # the fused generate (and others) came from the cache
    # every program the first start wrote is read back, none written again. jax writes only programs
    # that took over a second to compile, so a small one near that line (the finite check) may be
    # written by one start and not the other: extra entries are allowed, a missing or unread one is not
    after = sorted(os.listdir(tmp_path / "xla"))
    assert set(entries) <= set(after), (entries, after)
    assert hits2 >= len(entries), (hits2, entries)
