"""The layer-group scan prototype (benchmarks/scan_layers.py) computes the same trunk as the unrolled layers."""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import scan_layers  # noqa: E402


def test_scanned_groups_equal_the_unrolled_layers():
    cfg = scan_layers.group_config(2, preset="tiny-6layer")  # the benchmark runs the bench widths
    assert cfg.num_layers == 12 and cfg.layer_types[5] == cfg.layer_types[11] == "global"
    unrolled, scanned, to_stacked = scan_layers.trunk_programs(cfg)
    blocks, x, ce, keys, values = scan_layers.cpu_inputs(cfg, context=40, canvas=16)
    sb, sk, sv = to_stacked(blocks, keys, values)
    assert sk[5].shape == (2,) + keys[5].shape  # stacked per group position: layers 5 and 11
    np.testing.assert_array_equal(np.asarray(sk[5][1]), np.asarray(keys[11]))
    a = np.asarray(jax.jit(unrolled)(blocks, x, ce, keys, values))
    b = np.asarray(jax.jit(scanned)(sb, x, ce, sk, sv))
    assert np.isfinite(a).all() and np.abs(a - x).max() > 1e-3  # the layers did something
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=2e-4 * np.abs(a).max())
    # a scan that reused group 0's weights for every group would differ
    wrong = [jax.tree.map(lambda t: t.at[1].set(t[0]), p) for p in sb]
    c = np.asarray(jax.jit(scanned)(wrong, x, ce, sk, sv))
    assert np.abs(c - a).max() > 1e-2 * np.abs(a).max()
