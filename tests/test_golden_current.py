"""The committed golden files (tests/golden/*.npz) are what the transformers reference gives now.

Regenerates each file in memory with tests/golden/make_golden.py and compares it with the committed
one (same inputs hash, same entries, integers/booleans equal, floats within make_golden.FLOAT_ATOL).
When this fails after an intended change: `python -m tests.golden.make_golden` and commit the files.
"""

import pytest

pytestmark = pytest.mark.ref
pytest.importorskip("transformers")
pytest.importorskip("torch")

from tests.golden import make_golden  # noqa: E402


@pytest.mark.parametrize("name", list(make_golden.builders()))
def test_golden_file_is_current(name):
    arrays, meta = make_golden.build(name)
    diffs = make_golden.differences(name, arrays, meta)
    assert not diffs, "\n".join(diffs + [f"regenerate: {make_golden.store.REGENERATE}"])


def test_every_golden_file_has_a_builder():
    import glob
    import os

    committed = {os.path.basename(p)[:-4] for p in glob.glob(os.path.join(make_golden.store.GOLDEN_DIR, "*.npz"))}
    assert committed == set(make_golden.builders())
