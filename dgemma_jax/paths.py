"""Where dgemma_jax keeps files on this machine."""

from __future__ import annotations

import os


def cache_root() -> str:
    """The project's cache directory: $DGEMMA_CACHE, else $XDG_CACHE_HOME/dgemma_jax, else
    ~/.cache/dgemma_jax (remote checkpoints are mirrored under <it>/checkpoints, compiled programs
    kept under <it>/xla)."""
    root = os.environ.get("DGEMMA_CACHE")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "dgemma_jax")
    return root
