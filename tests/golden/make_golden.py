"""Regenerate (or check) the golden files: the transformers reference's outputs for the parity tests.

    python -m tests.golden.make_golden            # rewrite every golden file
    python -m tests.golden.make_golden --check    # recompute and compare with the committed files
    python -m tests.golden.make_golden parity_tiny-2layer trace   # only these

Needs the `[ref]` extra (transformers 5.23.0 and a CPU torch 2.13.0; see docs/parity.md). Run from the
repository root. tests/test_golden_current.py (marker `ref`) runs the --check comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.golden import store  # noqa: E402

FLOAT_ATOL = 1e-4  # the reference recomputed on another CPU may differ in the last bits


def _parity(preset: str):
    from tests.reference import hf_reference as ref
    from tests.golden import parity_case as case

    with tempfile.TemporaryDirectory() as tmp:
        info = ref.numpy_checkpoint(preset, case.SEED, tmp)
        inp = case.inputs(tmp)
        arrays = case.hf_outputs(ref.load_reference(tmp), inp)
        digest = store.inputs_sha256(*case.hash_items(tmp, inp))
    arrays.update(case.checkpoint_record(info))
    return arrays, {"inputs_sha256": digest, "case": f"tests/golden/parity_case.py preset {preset}"}


def _image_prefill(preset: str):
    from tests.reference import hf_reference as ref
    from tests.golden import image_prefill_case as case

    with tempfile.TemporaryDirectory() as tmp:
        info = ref.numpy_checkpoint(preset, case.SEED, tmp)
        inp = case.inputs(tmp)
        arrays = case.hf_outputs(ref.load_reference(tmp), inp)
        digest = store.inputs_sha256(*case.hash_items(tmp, inp))
    arrays.update(case.checkpoint_record(info))
    return arrays, {"inputs_sha256": digest, "case": f"tests/golden/image_prefill_case.py preset {preset}"}


def _vision_e2e(preset: str):
    from tests.golden import vision_e2e_case as case
    from tests.reference import hf_reference as ref

    with tempfile.TemporaryDirectory() as tmp:
        info = case.make_checkpoint(preset, tmp)
        inp = case.inputs(tmp)
        arrays = case.hf_outputs(ref.load_reference(tmp), inp)
        digest = store.inputs_sha256(*case.hash_items(tmp, inp))
    arrays.update(case.checkpoint_record(info))
    return arrays, {"inputs_sha256": digest, "case": f"tests/golden/vision_e2e_case.py preset {preset}"}


def _recorded(test_file: str):
    """Run the live tests of `test_file`, recording the reference's values (tests/golden/reference_source.py)."""
    import subprocess

    from tests.golden.reference_source import RECORD_ENV, recorded

    root = os.path.dirname(os.path.dirname(store.GOLDEN_DIR))
    with tempfile.TemporaryDirectory() as tmp:
        rec = os.path.join(tmp, "recorded.npz")
        env = dict(os.environ, **{RECORD_ENV: rec})
        env.pop("DGEMMA_HIDE_TORCH", None)
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "live", test_file],
                       cwd=root, env=env, check=True)
        arrays, digest = recorded(rec)
    return arrays, {"inputs_sha256": digest, "case": f"the live tests of {test_file}"}


def _trace():
    from tests.golden import trace_case

    arrays, digest = trace_case.hf_trace()
    return arrays, {"inputs_sha256": digest, "case": "tests/golden/trace_case.py"}


def builders() -> dict:
    from tests.golden import image_prefill_case, parity_case, vision_e2e_case

    out = {parity_case.golden_name(p): (lambda p=p: _parity(p)) for p in parity_case.PRESETS}
    out.update({image_prefill_case.golden_name(p): (lambda p=p: _image_prefill(p)) for p in image_prefill_case.PRESETS})
    out.update({vision_e2e_case.golden_name(p): (lambda p=p: _vision_e2e(p)) for p in vision_e2e_case.PRESETS})
    out["sampling"] = lambda: _recorded("tests/test_sampling_hf_parity.py")
    out["chat_template"] = lambda: _recorded("tests/test_chat_template.py")
    out["config"] = lambda: _recorded("tests/test_config.py")
    out["tokenizer"] = lambda: _recorded("tests/test_tokenizer.py")
    out["bf16_reference"] = lambda: _recorded("tests/test_model_behaviour.py")
    out["images"] = lambda: _recorded("tests/test_images.py")
    out["vision"] = lambda: _recorded("tests/test_vision.py")
    out["trace"] = _trace
    return out


def build(name: str):
    arrays, meta = builders()[name]()
    meta.update(store.reference_versions())
    return arrays, meta


@dataclasses.dataclass
class Check:
    """A recomputed golden record against the committed file. `stale`: how its making differs (inputs
    hash, transformers / torch versions, entries, their shapes and dtypes); `values`: the entries whose
    values differ (integers, booleans and strings exactly, floats beyond FLOAT_ATOL); `other_cpu`: why
    the values cannot be reproduced bit for bit here, or None (torch picked other vector kernels when
    the file was made, its `cpu_capability`; files made before that was recorded say nothing)."""
    stale: list
    values: list
    other_cpu: str | None

    @property
    def current(self) -> bool:
        return not self.stale and not self.values

    @property
    def failures(self) -> list:
        """What makes the file stale: its making, or its values where they are comparable here."""
        return self.stale + ([] if self.other_cpu else self.values)


def check(name: str, arrays: dict, meta: dict) -> Check:
    if not os.path.exists(store.path_of(name)):
        return Check([f"{name}: no committed file"], [], None)
    old, old_meta = store.load(name)
    stale, values = [], []
    if old_meta.get("inputs_sha256") != meta["inputs_sha256"]:
        stale.append(f"{name}: inputs changed (sha256 {old_meta.get('inputs_sha256')} -> {meta['inputs_sha256']})")
    for lib in ("transformers", "torch"):
        if old_meta.get(lib) != meta[lib]:
            stale.append(f"{name}: made with {lib} {old_meta.get(lib)}, this is {meta[lib]}")
    if sorted(old) != sorted(arrays):
        stale.append(f"{name}: entries {sorted(set(old) ^ set(arrays))} differ")
    for k in sorted(set(old) & set(arrays)):
        a, b = np.asarray(old[k]), np.asarray(arrays[k])
        if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
            stale.append(f"{name}/{k}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        elif np.issubdtype(a.dtype, np.floating):
            d = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0
            if not d <= FLOAT_ATOL:
                values.append(f"{name}/{k}: max |difference| {d:.3e} > {FLOAT_ATOL}")
        elif not np.array_equal(a, b):
            values.append(f"{name}/{k}: differs")
    made = old_meta.get("cpu_capability")
    other_cpu = None if made == meta["cpu_capability"] else (
        f"{name} was made with torch's {made or 'unrecorded'} CPU kernels, this machine runs "
        f"{meta['cpu_capability']}: float results differ in their last bits (bfloat16 ones more) and a near "
        f"tie may pick another token")
    return Check(stale, values, other_cpu)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="golden files to make (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args(argv)
    names = args.names or list(builders())
    bad = []
    for name in names:
        arrays, meta = build(name)
        if args.check:
            c = check(name, arrays, meta)
            bad += c.failures
            print(f"{name}: " + ("current" if c.current else "STALE" if c.failures else
                                 f"inputs and versions current; values not comparable ({c.other_cpu})"))
        else:
            path = store.save(name, arrays, meta)
            print(f"wrote {os.path.relpath(path)} ({os.path.getsize(path) / 1024:.0f} KiB)")
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
