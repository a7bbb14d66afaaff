"""End-to-end training runs of the tiny recipe in subprocesses (configs/train_tiny.py):

* the loss goes down over 40 steps and the frozen router does not move;
* a run killed with SIGKILL after some checkpoints, then resumed, logs exactly the losses of the
  uninterrupted run (same data order, same rng), with metrics/checkpoints/loss curve written.

The three runs share a persistent compilation cache, so only the first one compiles.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers.kill_harness import checkpoint_steps, kill_after_checkpoints, metrics_by_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "train_tiny.py")

_SCRIPT = """
import json, sys
from dgemma_jax.training.train import load_config, train
overrides = json.loads(sys.argv[1])
train(load_config(sys.argv[2], overrides))
"""


def _start(workdir, cache, **extra):
    overrides = {"train.workdir": str(workdir), "train.compilation_cache_dir": str(cache), **extra}
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(overrides), RECIPE], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=300):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _kill_after_two_checkpoints(proc, workdir) -> int:
    """SIGKILL a training run once it has written two checkpoints; the last checkpoint's step."""
    return kill_after_checkpoints(proc, workdir, 2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("train_tiny")
    cache = base / "jax_cache"
    full = base / "full"
    _finish(_start(full, cache))
    return base, cache, full


def test_tiny_training_lowers_loss_and_keeps_router_frozen(runs):
    _, _, full = runs
    rows = metrics_by_step(full)
    assert sorted(rows) == list(range(1, 41))
    loss = np.asarray([rows[s]["loss"] for s in range(1, 41)])
    assert np.isfinite(loss).all()
    assert loss[-8:].mean() < 0.85 * loss[:5].mean(), loss
    for name in ("checkpoints", "loss_curve.png", "summary.json", "config.json", "export"):
        assert os.path.exists(os.path.join(full, name)), name

    from dgemma_jax.config import ModelConfig
    from dgemma_jax.model.api import init_params
    from dgemma_jax.training.checkpoint import load_params
    from dgemma_jax.training.train import load_config

    import jax

    rc = load_config(RECIPE)
    cfg = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in rc.model.overrides.to_dict().items()})
    from test_training import router_parameters

    init = jax.device_get(init_params(cfg, 0))
    final = load_params(os.path.join(full, "export"))
    routers = router_parameters(cfg, init)
    assert len(routers) >= 3 * cfg.num_layers
    final_routers = router_parameters(cfg, final)
    for p, x in routers.items():  # every router parameter found in the tree, not a hand-written list
        np.testing.assert_array_equal(np.asarray(final_routers[p]), np.asarray(x), err_msg=p)
    for i in range(cfg.num_layers):
        assert np.abs(np.asarray(final[f"blocks_{i}"]["attn"]["q"]) - np.asarray(init[f"blocks_{i}"]["attn"]["q"])).max() > 0


def test_kill9_then_resume_matches_uninterrupted_run(runs):
    base, cache, full = runs
    killed = base / "killed"
    resumed_from = _kill_after_two_checkpoints(_start(killed, cache, **{"train.throttle_s": 0.15}), killed)
    assert 10 <= resumed_from < 40, resumed_from

    _finish(_start(killed, cache))
    ref, got = metrics_by_step(full), metrics_by_step(killed)
    assert sorted(got) == list(range(1, 41))
    for s in range(resumed_from + 1, 41):
        for k in ("loss", "diffusion_loss", "ar_loss", "grad_norm", "mean_t", "lr"):
            assert got[s][k] == ref[s][k], (s, k, got[s][k], ref[s][k])
    for s in range(1, resumed_from + 1):
        assert got[s]["loss"] == ref[s]["loss"]
    assert max(checkpoint_steps(killed)) == 40
