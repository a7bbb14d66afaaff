"""The code passes the project's linter (ruff, configured in ruff.toml): CI runs this test."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or os.path.join(os.path.dirname(sys.executable), "ruff")
    assert os.path.exists(ruff), "ruff is not installed: pip install -e '.[test]'"
    r = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
