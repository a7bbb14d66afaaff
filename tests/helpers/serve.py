"""A real `dgemma serve` process on 127.0.0.1 for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m dgemma_jax.cli serve ...` on a free loopback port; waits for /health."""

    def __init__(self, *args: str, startup_s: float = 300.0, env: dict | None = None, cwd: str | None = None):
        """cwd: run the server from that checkout (another revision's worktree); default this one."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dgemma_jax.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *args]
        self.log_path = f"/tmp/dgemma_serve_{self.port}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, **(env or {})}
        if cwd is not None:   # that checkout's package first (python -m puts the cwd first on sys.path)
            env["PYTHONPATH"] = os.pathsep.join([cwd] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the server did not come up in {startup_s} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-4000:]

    def client(self, timeout: float = 120):
        """The official `openai` client for this server (no retries)."""
        import openai  # deferred: only the tests that talk to the server need it

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def module_server(*args: str):
    """A module-scoped pytest fixture: a `ServerProcess` with `args`, stopped after the module."""
    import pytest  # deferred: benchmarks import this module without pytest

    @pytest.fixture(scope="module")
    def server():
        srv = ServerProcess(*args)
        yield srv
        srv.stop()

    return server
