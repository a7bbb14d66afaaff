"""Reading and writing the golden files (torch-free).

A golden file is a compressed .npz in this folder holding the reference's outputs as arrays plus one
`__meta__` entry: a JSON string with the transformers / torch versions that made it, the command that
regenerates it, and `inputs_sha256`, a hash of every input the reference was given (weights included,
as rebuilt by `tests.reference.random_checkpoint`). A test recomputes that hash from its own inputs
before comparing, so a golden file can never silently be compared against different inputs.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np

GOLDEN_DIR = os.path.dirname(os.path.abspath(__file__))
REGENERATE = "python -m tests.golden.make_golden   # needs: pip install -e \".[test,ref]\" (see the README)"


def path_of(name: str) -> str:
    return os.path.join(GOLDEN_DIR, f"{name}.npz")


def inputs_sha256(*items) -> str:
    """A hash of arrays, strings, numbers and (nested) lists/tuples/dicts of them: dtype, shape and bytes."""
    h = hashlib.sha256()

    def feed(x):
        if isinstance(x, dict):
            for k in sorted(x):
                feed(str(k))
                feed(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"seq{len(x)}".encode())
            for y in x:
                feed(y)
        elif isinstance(x, str):
            h.update(b"s" + x.encode())
        else:
            a = np.ascontiguousarray(np.asarray(x))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())

    for item in items:
        feed(item)
    return h.hexdigest()


def save(name: str, arrays: dict, meta: dict) -> str:
    meta = dict(meta, regenerate=REGENERATE)
    out = {k: np.asarray(v) for k, v in arrays.items()}
    out["__meta__"] = np.asarray(json.dumps(meta, sort_keys=True))
    path = path_of(name)
    np.savez_compressed(path, **out)
    return path


def load(name: str) -> tuple[dict, dict]:
    """(arrays, meta) of a golden file."""
    with np.load(path_of(name), allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files if k != "__meta__"}
        meta = json.loads(str(f["__meta__"]))
    return arrays, meta


def check_inputs(meta: dict, *items) -> None:
    got = inputs_sha256(*items)
    assert got == meta["inputs_sha256"], (
        f"the inputs differ from those the golden file was made from (sha256 {got} != {meta['inputs_sha256']}); "
        f"if the change is intended, regenerate: {REGENERATE}")


def reference_versions() -> dict:
    import torch
    import transformers

    # the vector kernels torch's CPU build picked on this machine ("AVX512", "AVX2", ...): float32 results,
    # and bfloat16 ones more, differ in their last bits between them, and a near tie can flip a token
    return {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
