"""What setup.py and the README promise about the install matches what the pinned dependencies need."""

import os
import re
from importlib.metadata import PackageNotFoundError, metadata

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _minimum(spec: str) -> tuple[int, ...]:
    m = re.search(r">=\s*(\d+(?:\.\d+)*)", spec or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else (0,)


def test_python_requires_is_what_the_pinned_dependencies_need():
    # setup.py and the README said Python 3.10+, but jax, jaxlib, flax and orbax-checkpoint at the
    # pinned versions declare Requires-Python >= 3.11 (`pip install .` on 3.10 fails)
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    ours = _minimum(re.search(r"python_requires\s*=\s*\"([^\"]+)\"", setup_py).group(1))
    needs = {}
    for dist in ("jax", "jaxlib", "flax", "orbax-checkpoint", "optax", "ml-collections"):
        try:
            needs[dist] = _minimum(metadata(dist).get("Requires-Python"))
        except PackageNotFoundError:
            pytest.skip(f"{dist} is not installed")
    assert ours >= max(needs.values()), (ours, needs)
    version = ".".join(map(str, ours))
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"Python {version}+" in readme
    assert not re.search(r"Python 3\.(\d+)\+", readme.replace(f"Python {version}+", "")), \
        "the README states another Python version"
