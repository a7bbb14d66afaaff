"""The benchmarks' report writer: the machine a result was measured on, the results JSON, the
markdown next to it, and the table and number formats the markdown uses.

    res = {"machine": machine_info(), ...}
    write(res, "benchmarks/results/x.json", markdown="| a | b |\n...")  # x.json and x.md
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

import jax
import jaxlib
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "XLA_FLAGS", "JAX_PLATFORMS",
            "TF_CPP_MIN_LOG_LEVEL", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")


def git_commit(repo: str = REPO) -> str:
    """HEAD of the checkout at `repo`, or "" outside one."""
    try:
        return subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def _cpu() -> tuple[str, list[str]]:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags") and not flags:
                    flags = [x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "fma", "amx"))]
    except OSError:
        pass
    return model, flags


def _mem_total_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / 2**20
    except OSError:
        return None


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(repo: str = REPO) -> dict:
    """The machine, versions, thread settings, git commit and date. torch / transformers: their installed
    versions (None without the `[ref]` extra), read from the package metadata without importing them."""
    cpu_model, flags = _cpu()
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_model": cpu_model,
        "cpu_flags": flags,
        "nproc": os.cpu_count(),
        "nproc_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gb": _mem_total_gb(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "torch": _installed("torch"),
        "transformers": _installed("transformers"),
        "env": {k: os.environ.get(k) for k in ENV_VARS},
        "git_commit": git_commit(repo),
    }


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def ms(seconds) -> str:
    """Seconds as milliseconds, one decimal ("—" for none)."""
    return "—" if seconds is None else f"{1e3 * seconds:,.1f}"


def pct(fraction) -> str:
    """A fraction as a percentage, one decimal ("—" for none)."""
    return "—" if fraction is None else f"{100 * fraction:.1f}%"


def table(header, rows, align=None) -> list[str]:
    """A markdown table's lines: header, rule, rows (an empty cell renders as "| |").
    align: "l" or "r" per column (default: the first left, the rest right)."""
    align = align or "l" + "r" * (len(header) - 1)

    def line(cells):
        return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"

    return [line(header), "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"] + [line(r) for r in rows]


def write(res: dict, out: str | None, markdown: str | None = None, md_path: str | None = None) -> str | None:
    """Write `res` as JSON to `out` (values JSON cannot hold as their repr) and `markdown`, when given, to
    `md_path` (default: `out` with .md). Returns the markdown's path (None when nothing was written)."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1, default=repr)
    if markdown is None or not (out or md_path):
        return None
    md_path = md_path or os.path.splitext(out)[0] + ".md"
    with open(md_path, "w") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return md_path
