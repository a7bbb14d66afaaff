"""`dgemma serve` listens while it compiles: /health says "starting" (503) with each program's progress,
requests get 503 with Retry-After, and both turn into answers once the programs are ready."""

import os
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.serving.scheduler import Scheduler
from dgemma_jax.serving.handler import STARTING_RETRY_AFTER_S
from dgemma_jax.serving.server import create_app
from tests.helpers.serve import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = {"model": "m", "prompt": "s9350814272=", "seed": 0, "max_tokens": 16}


@pytest.fixture(scope="module")
def bundled():
    return load_bundled()


def _held_scheduler(bundled, fail=False):
    """A scheduler whose round compile waits for `gate` (and then fails, with fail=True)."""
    cfg, params, sampler, tok = bundled
    sch = Scheduler.for_model(cfg, params, tok, sampler, slots=2, context=64)
    gate = threading.Event()
    compile_tick = sch.runner.compile_tick

    def held(args):
        gate.wait(120)
        if fail:
            raise RuntimeError("out of memory compiling the tick (a test)")
        return compile_tick(args)

    sch.runner.compile_tick = held
    return sch, gate


def test_health_says_starting_and_requests_get_retry_after_until_the_programs_are_ready(bundled):
    sch, gate = _held_scheduler(bundled)
    sch.start(wait=False)
    client = TestClient(create_app(sch, "m"))
    deadline = time.monotonic() + 60
    while sch.runner.programs["slot_tick"]["state"] != "compiling" and time.monotonic() < deadline:
        time.sleep(0.02)
    r = client.get("/health")
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "starting" and body["ready"] is False
    assert set(body["programs"]) == {"slot_tick", "read_row", "write_row"} | {
        f"prefill_slot_{w}" for w in sch.prefill_widths}   # read / write_row: a preempted request's cache row
    assert body["programs"]["slot_tick"]["state"] == "compiling"
    r = client.post("/v1/completions", json=PROMPT)
    assert r.status_code == 503 and r.headers["retry-after"] == str(STARTING_RETRY_AFTER_S)
    assert r.json()["error"]["code"] == "starting" and "compiling" in r.json()["error"]["message"]
    gate.set()
    assert sch.ready.wait(120)
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert all(p["state"] == "ready" and p["seconds"] >= 0 for p in r.json()["programs"].values())
    r = client.post("/v1/completions", json=PROMPT)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "0122345789"
    sch.stop()


def test_a_failed_compile_turns_health_to_failed(bundled):
    sch, gate = _held_scheduler(bundled, fail=True)
    sch.start(wait=False)
    gate.set()
    deadline = time.monotonic() + 60
    while sch.error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    client = TestClient(create_app(sch, "m"))
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "failed"
    r = client.post("/v1/completions", json=PROMPT)
    assert r.status_code == 503 and "failed to start" in r.json()["error"]["message"]
    with pytest.raises(RuntimeError, match="out of memory"):  # start(wait=True) raises it
        sch2, gate2 = _held_scheduler(bundled, fail=True)
        gate2.set()
        sch2.start()


def test_the_command_listens_before_its_programs_are_compiled(tmp_path):
    """`dgemma serve` prints that it listens before it prints that it is ready; /health answers while it
    compiles (503 "starting", never a refused connection after the listening line) and then 200."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_COMPILATION_CACHE_DIR="off")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_jax.cli", "serve", "--port", str(port), "--slots", "2"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert seen and seen[-1] == (200, "ok"), seen
        assert set(seen[:-1]) <= {(503, "starting")}, seen
        text = (tmp_path / "serve.log").read_text()
        assert text.index("listening on") < text.index(" ready: "), text
        assert "program(s) from the cache" in text
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()
