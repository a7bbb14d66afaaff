"""Writes tests/golden/qwix_int4.npz: int4 kernels quantized by qwix (google/qwix 0.1.8), the other side's
own quantized arrays, for tests/test_quant_int4.py to read with dgemma_jax's int4 path.

Run with a python that has qwix (not a dgemma_jax dependency):
    python -m venv /tmp/qwix && /tmp/qwix/bin/pip install qwix==0.1.8
    /tmp/qwix/bin/python tests/golden/qwix_int4_case.py

For each kernel: the float weights, qwix's int4 values (stored as int8: npz has no int4), qwix's bfloat16
scales (stored as float32, exact) and qwix's own dequantization (float32). qwix's layout is this project's:
values shaped like the kernel, scales with the tiled (contracted) axis counted in tiles; its convention
differs (absmax / 7.5 over [-8, 7], where dgemma_jax uses absmax / 7 over [-7, 7]).
"""

import os

import jax.numpy as jnp
import numpy as np
import qwix

# name: (shape, contracted axis, tile) as the model's kernels: attention q [D, N, H], the experts' down [E, F, D]
CASES = {"q": ((256, 4, 16), 0, 128), "moe_down": ((2, 704, 16), 1, 64)}

out = {"qwix_version": np.array("0.1.8")}
rng = np.random.default_rng(2026)
for name, (shape, axis, tile) in CASES.items():
    w = jnp.asarray(rng.normal(0.0, 0.05, shape).astype(np.float32))
    qa = qwix.quantize(w, jnp.int4, channelwise_axes=tuple(i for i in range(len(shape)) if i != axis),
                       tiled_axes={axis: tile}, scale_dtype=jnp.bfloat16)
    out[f"{name}/w"] = np.asarray(w)
    out[f"{name}/values"] = np.asarray(qa.qvalue).astype(np.int8)
    out[f"{name}/scale"] = np.asarray(qa.scale).astype(np.float32)
    out[f"{name}/dequantized"] = np.asarray(qwix.dequantize(qa)).astype(np.float32)
    out[f"{name}/axis"] = np.array(axis)
np.savez_compressed(os.path.join(os.path.dirname(os.path.abspath(__file__)), "qwix_int4.npz"), **out)
print("wrote qwix_int4.npz:", sorted(out))
