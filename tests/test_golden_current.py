"""The committed golden files (tests/golden/*.npz) are what the transformers reference gives now.

Regenerates each file in memory with tests/golden/make_golden.py and compares it with the committed
one (same inputs hash, transformers / torch versions, entries, shapes; integers/booleans equal, floats
within make_golden.FLOAT_ATOL where this machine's torch runs the CPU kernels the file was made with).
When this fails after an intended change: `python -m tests.golden.make_golden` and commit the files.
"""

import pytest

pytestmark = pytest.mark.ref
pytest.importorskip("transformers")
pytest.importorskip("torch")

from tests.golden import make_golden  # noqa: E402


@pytest.mark.parametrize("name", list(make_golden.builders()))
def test_golden_file_is_current(name):
    """Inputs, versions and entries always; the values where they can be reproduced bit for bit: on
    a machine whose torch picks the CPU kernels the file was made with. On another (an AVX2 machine
    recomputing a file made with AVX-512 kernels) the float32 logits differ by up to ~1e-3 after a
    few self-conditioned denoise steps, bfloat16 ones by an ulp, and a near tie can flip a committed
    token: the value comparison is then reported as skipped, not passed."""
    arrays, meta = make_golden.build(name)
    regenerate = [f"regenerate: {make_golden.store.REGENERATE}"]
    diffs = make_golden.differences(name, arrays, meta)
    assert not diffs, "\n".join(diffs + regenerate)
    values = make_golden.value_differences(name, arrays)
    if values and (other_cpu := make_golden.made_on_another_cpu(name, meta)):
        pytest.skip(f"values not comparable: {other_cpu} ({len(values)} entries differ)")
    assert not values, "\n".join(values + regenerate)


def test_every_golden_file_has_a_builder():
    import glob
    import os

    committed = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(make_golden.store.GOLDEN_DIR, "*.npz"))}
    assert committed == set(make_golden.builders())
