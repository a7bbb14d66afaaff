"""Where a test's reference values come from: the golden file (default, no torch) or transformers now.

A test asks `hf.value(key, compute, *inputs)`: `compute()` runs the reference on `inputs` (needs torch);
`key` names the result. Live, the value is computed (and, when DGEMMA_GOLDEN_RECORD names a file, recorded
there with the hash of `inputs`: that is how make_golden.py writes the golden file). From the golden file,
the stored value is returned after checking that `inputs` hash to what the reference was given.
A value is an array or a dict of arrays.
"""

from __future__ import annotations

import json
import os

import numpy as np

from tests.golden import store

RECORD_ENV = "DGEMMA_GOLDEN_RECORD"


class LiveReference:
    source = "live"

    def __init__(self, record_path: str | None = None):
        self.record_path = record_path
        self.arrays, self.hashes = {}, {}

    def value(self, key, compute, *inputs):
        out = compute()
        # copies: a reference may later update in place the tensors whose numpy views it returned
        out = {k: np.array(v) for k, v in out.items()} if isinstance(out, dict) else np.array(out)
        if self.record_path:
            digest = store.inputs_sha256(*inputs)
            assert self.hashes.setdefault(key, digest) == digest, f"golden key {key} used for different inputs"
            if isinstance(out, dict):
                self.arrays.update({f"{key}/{k}": v for k, v in out.items()})
            else:
                self.arrays[key] = out
        return out

    def flush(self):
        if self.record_path:
            arrays = dict(self.arrays, __inputs_by_key__=np.asarray(json.dumps(self.hashes, sort_keys=True)))
            np.savez_compressed(self.record_path, **arrays)


class GoldenReference:
    source = "golden"

    def __init__(self, name: str):
        self.name = name
        self.arrays, self.meta = store.load(name)
        self.hashes = json.loads(str(self.arrays.pop("__inputs_by_key__")))

    def value(self, key, compute, *inputs):
        del compute
        assert key in self.hashes, f"{self.name}.npz has no entry {key!r}; regenerate: {store.REGENERATE}"
        got = store.inputs_sha256(*inputs)
        assert got == self.hashes[key], (
            f"{key}: the inputs differ from those the golden file was made from; if intended, regenerate: "
            f"{store.REGENERATE}")
        if key in self.arrays:
            return self.arrays[key]
        prefix = key + "/"
        return {k[len(prefix):]: v for k, v in self.arrays.items() if k.startswith(prefix)}


def recorded(path: str) -> tuple[dict, str]:
    """(arrays, inputs sha256) of a file a recording LiveReference wrote."""
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    return arrays, store.inputs_sha256(str(arrays["__inputs_by_key__"]))


def record_path() -> str | None:
    return os.environ.get(RECORD_ENV) or None
