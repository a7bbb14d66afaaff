"""PNG figures (matplotlib, Agg backend; skipped with a warning when matplotlib is missing).

Paths are local paths or gs:// URLs (a training run's work directory may be either): files are read
and written through etils.epath, as orbax writes the checkpoints beside them."""

from __future__ import annotations

import json
import os
import warnings
from typing import Sequence

from etils import epath


def _plt():
    try:
        import matplotlib  # deferred: with pyplot ~0.4 s to import; only drawing a figure needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # deferred too, and after use("Agg"): pyplot picks its backend on import
        return plt
    except ImportError:  # pragma: no cover
        warnings.warn("matplotlib is not installed: no PNG figures (pip install matplotlib)")
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    path = epath.Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a killed writer
            continue
    return rows


def _save(fig, out_png) -> None:
    with epath.Path(out_png).open("wb") as f:  # a local path or a gs:// URL
        fig.savefig(f, format="png", dpi=110)


def plot_loss_curve(metrics_path: str, out_png: str, keys: Sequence[str] = ("loss", "diffusion_loss", "ar_loss"),
                    eval_path: str | None = None) -> str | None:
    """Training losses (and eval accuracy on a second axis when eval_path has rows) vs step."""
    plt = _plt()
    rows = read_jsonl(metrics_path)
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r]
        if pts:
            ax.plot(*zip(*pts), label=k, lw=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ev = read_jsonl(eval_path) if eval_path else []
    ev = [r for r in ev if "accuracy" in r]
    if ev:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ev], [r["accuracy"] for r in ev], "k.--", label="eval exact match")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("exact-match accuracy")
        ax2.legend(loc="lower left")
    ax.legend(loc="upper right")
    ax.set_title("DiffusionGemma training")
    fig.tight_layout()
    _save(fig, out_png)
    plt.close(fig)
    return os.fspath(out_png)


def plot_step_sweep(rows: Sequence[dict], out_png: str, title: str = "") -> str | None:
    """Accuracy, mean denoising steps per canvas and tokens per forward vs max_denoising_steps."""
    plt = _plt()
    if plt is None or not rows:
        return None
    x = [r["max_denoising_steps"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].plot(x, [r["accuracy"] for r in rows], "o-")
    axes[0].set_ylabel("exact-match accuracy")
    axes[0].set_ylim(0, 1.02)
    axes[1].plot(x, [r["mean_steps_per_canvas"] for r in rows], "o-", label="used")
    axes[1].plot(x, x, ":", c="gray", label="budget")
    axes[1].set_ylabel("mean denoising steps / canvas")
    axes[1].legend()
    axes[2].plot(x, [r["tokens_per_forward"] for r in rows], "o-")
    axes[2].set_ylabel("tokens per forward pass")
    for a in axes:
        a.set_xscale("log", base=2)
        a.set_xticks(x)
        a.set_xticklabels([str(v) for v in x])
        a.set_xlabel("max_denoising_steps")
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _save(fig, out_png)
    plt.close(fig)
    return os.fspath(out_png)


def plot_tokens_per_forward(rows: Sequence[dict], out_png: str, canvas_length: int, title: str = "") -> str | None:
    """Tokens per forward pass vs max_denoising_steps, with the canvas length as the ceiling."""
    plt = _plt()
    if plt is None or not rows:
        return None
    x = [r["max_denoising_steps"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(v) for v in x], [r["tokens_per_forward"] for r in rows], color="tab:blue")
    ax.axhline(canvas_length, ls=":", c="gray", label=f"canvas length {canvas_length}")
    for i, r in enumerate(rows):
        ax.text(i, r["tokens_per_forward"], f"{r['tokens_per_forward']:.2f}\nacc {r['accuracy']:.2f}",
                ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("max_denoising_steps")
    ax.set_ylabel("generated tokens per decoder pass")
    ax.set_title(title or "tokens per forward pass")
    ax.legend()
    fig.tight_layout()
    _save(fig, out_png)
    plt.close(fig)
    return os.fspath(out_png)
