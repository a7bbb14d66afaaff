"""`--mesh` / `--rules` on the commands that run the model, weights read straight into their shards, and
native stdout kept out of a multi-process run's answer (the runs over several processes under
jax.distributed go through the launch scripts' simulation: tests/test_launch_simulation.py)."""

import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import NamedSharding

import dgemma_jax as dg
from dgemma_jax.pipeline import load_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "s9350814272="


def _cli(*args, devices=8, env_extra=None, stdin=None):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "dgemma_jax.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, stdin=subprocess.PIPE if stdin is not None else None,
                            text=True, env=env, cwd=ROOT)


def _answer(proc, stdin=None):
    out, err = proc.communicate(stdin, timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out.splitlines()


def test_a_checkpoint_is_read_into_the_meshs_shards():
    mesh = dg.parallel.make_mesh("expert=4", devices=jax.devices()[:4])
    cfg, params, _, _ = load_checkpoint(None, mesh=mesh)
    experts = params["blocks_0"]["moe"]["gate_up"]
    assert isinstance(experts.sharding, NamedSharding) and experts.sharding.mesh.shape["expert"] == 4
    assert experts.sharding.spec[0] in ("expert", ("expert",))  # whole experts over the expert axis
    assert len({s.device for s in experts.addressable_shards}) == 4


def test_diffusiongemma_on_a_mesh_answers_as_on_one_device():
    one = dg.DiffusionGemma.from_pretrained(None).generate(["s31415926535=", PROMPT], seed=4)
    meshed = dg.DiffusionGemma.from_pretrained(None, mesh="expert=4,data=2")
    assert meshed.engine.shardings is not None and dict(meshed.engine.shardings.mesh.shape)["expert"] == 4
    assert meshed.generate(["s31415926535=", PROMPT], seed=4) == one
    with pytest.raises(ValueError, match="mesh .* or shardings, not both"):
        dg.DiffusionGemma.from_pretrained(None, mesh="expert=2", shardings=meshed.engine.shardings)


@pytest.mark.slow
def test_generate_and_chat_take_a_mesh_and_answer_as_on_one_device():
    plain = _answer(_cli("generate", "--prompt", PROMPT, "--quiet"))
    assert plain == ["0122345789"]
    assert _answer(_cli("generate", "--prompt", PROMPT, "--quiet", "--mesh", "data=2,expert=4")) == plain
    assert _answer(_cli("generate", "--prompt", PROMPT, "--quiet", "--mesh", "expert=8", "--quantize", "int8")) == plain
    chat = _answer(_cli("chat", "--quiet", stdin=""), "s31415926535=\ns705182936=\n")
    assert _answer(_cli("chat", "--quiet", "--mesh", "expert=8", stdin=""), "s31415926535=\ns705182936=\n") == chat
    assert len(chat) == 2
    bad = _cli("generate", "--prompt", PROMPT, "--mesh", "expert=3")
    _, err = bad.communicate(timeout=300)
    assert bad.returncode == 2 and err.startswith("dgemma: error:") and "expert" in err


NATIVE_CHATTER = r"""
import ctypes, os, sys
from dgemma_jax.parallel import distributed
distributed.native_stdout_to_stderr()
libc = ctypes.CDLL(None)
libc.printf(b"0 is connected to 1 peer ranks (native printf)\n")
libc.fflush(None)
os.write(1, b"raw fd 1 write\n")
print("the answer")
sys.stdout.flush()
"""


def test_native_stdout_chatter_goes_to_stderr_and_the_answer_to_stdout():
    """What a multi-process run does to fd 1 (gloo's connection lines are printed by C code at a moment of
    its choosing, and once landed inside a piped answer): C-level writes reach stderr, print() stdout."""
    proc = subprocess.run([sys.executable, "-c", NATIVE_CHATTER], capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "the answer\n"
    assert "0 is connected to 1 peer ranks (native printf)" in proc.stderr
    assert "raw fd 1 write" in proc.stderr
