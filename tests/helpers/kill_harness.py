"""The kill -9 harness the resume tests share (test_training_resume, test_training_chat,
test_training_rl_runs, test_training_pod): a run's logged metrics by step, its checkpoints' steps, and
SIGKILL of a running training process once it has written some checkpoints."""

import json
import os
import signal
import time


def metrics_by_step(workdir) -> dict[int, dict]:
    """metrics.jsonl of a run's workdir as {step: row}."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {r["step"]: r for r in map(json.loads, f.read().splitlines()) if r}


def checkpoint_steps(workdir) -> list[int]:
    """The steps of the checkpoints under workdir/checkpoints, ascending ([] before the first)."""
    d = os.path.join(workdir, "checkpoints")
    return sorted(int(n) for n in os.listdir(d) if n.isdigit()) if os.path.isdir(d) else []


def kill_after_checkpoints(proc, workdir, count: int, timeout: float = 240) -> int:
    """SIGKILL `proc` (a subprocess.Popen of a training run, output piped) once `count` checkpoints are in
    workdir; asserts it was still running and died of the signal. Returns the last checkpoint's step."""
    deadline = time.time() + timeout
    while len(checkpoint_steps(workdir)) < count:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.time() < deadline, f"{count} checkpoint(s) did not appear in {timeout:.0f} s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return max(checkpoint_steps(workdir))
