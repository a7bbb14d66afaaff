"""A fresh venv from a clean clone, with the README's install and test commands: no torch, and green.

Slow and needs the network (PyPI), so it runs only with DGEMMA_VENV_TEST=1:

    DGEMMA_VENV_TEST=1 python -m pytest -q -s tests/test_fresh_install.py

It clones the repository's committed HEAD, creates a venv with the interpreter running this test, runs the
README's install command in it, checks that no torch / transformers / nvidia / cuda / triton distribution
got installed, that the library generates with the bundled model and prints nothing on stderr (no libtpu
probing lines on a machine without a TPU, though `[tpu]` installs libtpu), then runs the README's test
command in the clone and requires it to pass. The install's
time and the venv's size are printed (docs/install.md quotes them).
"""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

needs_venv_test = pytest.mark.skipif(os.environ.get("DGEMMA_VENV_TEST") != "1",
                                     reason="builds a venv from PyPI (network, minutes): set DGEMMA_VENV_TEST=1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|transformers|triton|nvidia[-_].*|.*cuda.*)$", re.I)


def _block_after(text: str, marker: str) -> str:
    """The first ```bash block after the line that starts with `marker`."""
    at = text.index(marker)
    m = re.search(r"```bash\n(.*?)```", text[at:], re.S)
    return m.group(1).strip()


def readme_commands() -> tuple[str, str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return _block_after(text, "Install ("), _block_after(text, "Run the tests")


def test_readme_commands_are_what_ci_runs():
    install, test = readme_commands()
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert f"# --- README: install ---\n{install}\n" in ci
    assert f"# --- README: test ---\n{test}" in ci
    assert "ref" not in install  # the default install is torch-free


def _du(path: str) -> int:
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total


@pytest.mark.slow
@needs_venv_test
def test_fresh_venv_from_clean_clone(tmp_path):
    install, test = readme_commands()
    clone, venv = tmp_path / "clone", tmp_path / "venv"
    subprocess.run(["git", "clone", "--quiet", ROOT, str(clone)], check=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "DGEMMA_VENV_TEST", "DGEMMA_HIDE_TORCH")
           and not k.startswith(("JAX_", "XLA_"))}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    python = getattr(sys, "_base_executable", None) or sys.executable
    t0 = time.time()
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run(["bash", "-c", "python -m pip install --quiet --upgrade pip"], cwd=clone, env=env, check=True)
    subprocess.run(["bash", "-euo", "pipefail", "-c", install], cwd=clone, env=env, check=True)
    took = time.time() - t0
    names = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m; print('\\n'.join(sorted({d.metadata['Name'] for d in m.distributions()})))"],
        env=env, check=True, capture_output=True, text=True).stdout.split()
    print(f"\ninstall: {took:.0f} s (venv + pip upgrade + `{install}`), venv {_du(str(venv)) / 2**30:.2f} GiB, "
          f"{len(names)} distributions")
    bad = [n for n in names if FORBIDDEN.match(n)]
    assert not bad, f"the README's install pulled {bad}"
    assert "dgemma_jax" in {n.replace("-", "_") for n in names}
    from tests.test_cli import LIBRARY_GENERATE

    r = subprocess.run([str(venv / "bin" / "python"), "-c", LIBRARY_GENERATE], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[0] == "0122345789", r.stdout
    assert "libtpu" not in r.stderr and "TPU_" not in r.stderr and r.stderr.strip() == "", r.stderr
    t0 = time.time()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", test], cwd=clone, env=env, timeout=5400)
    print(f"tests: {time.time() - t0:.0f} s (`{test}`)")
    assert r.returncode == 0, f"`{test}` failed in the fresh venv (exit {r.returncode})"
    shutil.rmtree(venv, ignore_errors=True)
