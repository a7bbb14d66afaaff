"""Quantizing while loading (`load_hf(..., quantize=)`, `load_checkpoint(quantize=)`, `--quantize` on the
CLI, `dgemma convert --quantize`): each kernel is quantized right after it is read, so the float model is
never whole.

The measurement runs in fresh processes (peak RSS, /proc VmHWM: on the CPU the "device" arrays are host
memory too, so this bounds both) on a Hugging Face checkpoint of ~600 MB written here by `save_hf` with
the real `safetensors` library: kernels dominate it, as they do the 26B."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dgemma_jax import ModelConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# kernels dominate: 6 layers x 32 experts of 512 -> 2 x 1024 -> 512 (~302 M weights, ~600 MB in bf16)
BIG = dict(vocab_size=1024, hidden_size=512, num_layers=6, num_heads=4, head_dim=64, num_kv_heads=2,
           global_head_dim=64, num_global_kv_heads=1, intermediate_size=512, num_experts=32, top_k=2,
           moe_intermediate_size=1024, sliding_window=16, canvas_length=16, eos_ids=(1,),
           dtype="bfloat16", param_dtype="bfloat16")

MEASURE = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

from dgemma_jax.io.hf import load_hf
from dgemma_jax.model.quant import param_bytes, quantize_params
mode = sys.argv[2]
# warm up the quantize programs on small arrays, so the measured peak is the load's, not the imports'
_, small = load_hf(sys.argv[3], quantize=None if mode == "after" else mode)
jax.block_until_ready(small)
del small
base = hwm()
if mode == "after":   # the old way: the whole float model, then quantized
    cfg, params = load_hf(sys.argv[1])
    params = quantize_params(cfg, params, "int4")
else:
    cfg, params = load_hf(sys.argv[1], quantize=mode)
jax.block_until_ready(params)
leaves = jax.tree.leaves(params)
print(json.dumps({"rise": hwm() - base, "bytes": param_bytes(params),
                  "dtypes": sorted({str(x.dtype) for x in leaves})}))
"""


CONVERT = r"""
import json, os, sys, warnings
import jax

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

import dgemma_jax.io.convert as convert
from dgemma_jax.cli import main
warnings.simplefilter("ignore")  # no tokenizer in these checkpoints: a DgemmaWarning, not the point here
src, dst, small, mode = sys.argv[1:5]
at_save = []
save_model = convert.save_model
def save_after_noting_the_peak(*args, **kwargs):  # the read-and-quantize phase ends here
    at_save.append(hwm())
    return save_model(*args, **kwargs)
convert.save_model = save_after_noting_the_peak
# warm up: the quantize programs and orbax's writer on a small checkpoint
assert main(["convert", small, dst + "_warm", "--quantize", mode, "--quiet"]) == 0
base = hwm()
assert main(["convert", src, dst, "--quantize", mode, "--quiet"]) == 0
print(json.dumps({"read": at_save[-1] - base, "total": hwm() - base}))
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from dgemma_jax import init_params, save_hf

    d = tmp_path_factory.mktemp("streaming")
    cfg = ModelConfig.preset("tiny-6layer", **BIG)
    save_hf(init_params(cfg, 0), cfg, d / "big")
    small = ModelConfig.preset("tiny-2layer", dtype="bfloat16", param_dtype="bfloat16")
    save_hf(init_params(small, 0), small, d / "small")
    return cfg, d / "big", d / "small"


def _measure(path, mode, small):
    r = subprocess.run([sys.executable, "-c", MEASURE, str(path), mode, str(small)], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_quantizing_load_never_holds_the_float_model(checkpoints):
    """Peak RSS rise of loading the ~600 MB bf16 checkpoint (621 MB of float parameters, the largest
    tensor 67 MB): quantizing while loading stays under the quantized parameters + 6 x the largest float
    tensor (its host slices, its device array, the quantize program's float32 input and temporaries, and
    what the allocator keeps of them) + 100 MB; quantizing after a float load (the old way) rises past the
    float model's bytes, so the bound separates the two. Measured here (2026-12-04, loaded 2-core machine):
    int4 while loading 487 MB (161 MB quantized: 4.9 x the largest tensor over), int8 610 MB (313 MB: 4.4
    x), int4 after a float load 911 MB."""
    cfg, big, small = checkpoints
    from dgemma_jax.model.api import param_shapes

    shapes = param_shapes(cfg)
    import jax

    float_bytes = sum(int(np.prod(s.shape)) * 2 for s in jax.tree.leaves(shapes))
    largest = max(int(np.prod(s.shape)) * 2 for s in jax.tree.leaves(shapes))
    assert float_bytes > 550e6 and largest < float_bytes / 8
    got = {mode: _measure(big, mode, small) for mode in ("int4", "int8", "after")}
    print(json.dumps({"float_bytes": float_bytes, "largest_tensor_bytes": largest, **got}))
    for mode in ("int4", "int8"):
        assert f"int{mode[-1]}" in got[mode]["dtypes"]
        bound = got[mode]["bytes"] + 6 * largest + 100e6
        assert got[mode]["rise"] <= bound, (mode, got[mode]["rise"], bound)
    assert got["after"]["rise"] > float_bytes  # the float model was whole: what the streamed load avoids


def test_convert_quantize_streams_a_hugging_face_checkpoint(checkpoints, tmp_path):
    """`dgemma convert SRC DST --quantize int4` quantizes each tensor as it is read (it used to read the
    whole float model first, then quantize: a peak past the float model's 621 MB). Peak RSS rise, in two
    phases: reading and quantizing stays under the streamed load's bound (the quantized parameters + 6 x
    the largest float tensor + 100 MB); writing adds at most one more copy of the quantized parameters
    (orbax copies the arrays to host buffers before writing) + 100 MB. The checkpoint it writes holds
    exactly the parameters of a quantizing load. Measured here (2026-12-04, 2-core machine): read 440-490
    MB, total 660-790 MB, for 161 MB of int4 parameters."""
    import jax

    from dgemma_jax.io.hf import load_hf
    from dgemma_jax.io.model_dir import load_model
    from dgemma_jax.model.api import param_shapes
    from dgemma_jax.model.quant import param_bytes

    cfg, big, small = checkpoints
    shapes = jax.tree.leaves(param_shapes(cfg))
    float_bytes = sum(int(np.prod(s.shape)) * 2 for s in shapes)
    largest = max(int(np.prod(s.shape)) * 2 for s in shapes)
    dst = tmp_path / "q4"
    r = subprocess.run([sys.executable, "-c", CONVERT, str(big), str(dst), str(small), "int4"], capture_output=True,
                       text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    _, want = load_hf(big, quantize="int4")
    _, params, _ = load_model(dst)
    quantized = param_bytes(want)
    print(json.dumps({"convert_int4_rise": got, "quantized_bytes": quantized, "float_bytes": float_bytes}))
    assert got["read"] <= quantized + 6 * largest + 100e6, (got, quantized)
    assert got["total"] <= 2 * quantized + 6 * largest + 200e6, (got, quantized)
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    flat_got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    assert len(flat_want) == len(flat_got)
    for path, w in flat_want:
        g = flat_got[path]
        assert g.dtype == w.dtype, path
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=jax.tree_util.keystr(path))
