"""What the image parity tests (tests/test_image_prefill.py, tests/test_vision_e2e.py) share: their two
sources per preset and the logit comparison."""

from __future__ import annotations

import numpy as np
import pytest

TOL = 2e-3   # max |logit difference|, float32
GAP = 1e-3   # argmax must agree wherever the reference's top-2 gap exceeds this


def sources(presets) -> list:
    """(preset, "golden") for the default tier, (preset, "live") with marker `ref`, for each preset."""
    return [pytest.param((p, "golden"), id=f"{p}-golden") for p in presets] + [
        pytest.param((p, "live"), id=f"{p}-live", marks=pytest.mark.ref) for p in presets]


def compare_logits(name: str, ours, theirs, tol: float = TOL, gap: float = GAP) -> float:
    """Assert max |ours - theirs| <= tol and argmax agreement where the top-2 gap > gap; the max diff."""
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    assert ours.shape == theirs.shape, f"{name}: shape {ours.shape} != {theirs.shape}"
    diff = float(np.abs(ours - theirs).max())
    top2 = np.sort(theirs, axis=-1)[..., -2:]
    clear = (top2[..., 1] - top2[..., 0]) > gap
    agree = (ours.argmax(-1) == theirs.argmax(-1))[clear]
    print(f"{name}: max|dlogit|={diff:.2e}, argmax agreement {agree.mean():.4f} over {clear.sum()} clear positions")
    assert diff <= tol, f"{name}: max |logit difference| {diff:.3e} > {tol}"
    assert agree.all(), f"{name}: argmax differs at {(~agree).sum()} positions with a top-2 gap > {gap}"
    return diff
