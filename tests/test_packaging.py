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


def _imported_top_level(paths) -> set[str]:
    import ast

    names = set()
    for path in paths:
        tree = ast.parse(open(path).read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.split(".")[0])
    return names


def _declared_distributions() -> set[str]:
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    setup_py = setup_py.replace("{JAX_VERSION}", "")
    return {re.split(r"[\[<>=!~ ]", spec)[0].lower().replace("_", "-")
            for spec in re.findall(r"f?\"([A-Za-z0-9_.\-]+(?:\[[a-z,]+\])?(?:[<>=!~].*?)?)\"", setup_py)}


def test_every_third_party_import_is_declared_in_setup_py():
    # CI once failed at collection: the tests imported httpx, which the local venv had only because
    # an older openai depended on it (openai 3.x brings httpx2). Whatever the package or its tests
    # import directly must be declared directly.
    import sys
    from importlib.metadata import packages_distributions

    files = []
    for top in ("dgemma_jax", "tests", "benchmarks", "scripts"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, top)):
            files += [os.path.join(dirpath, n) for n in names if n.endswith(".py")]
    local = {"dgemma_jax", "tests", "helpers", "conftest"} | {
        os.path.splitext(n)[0] for top in ("tests", "benchmarks", "scripts")
        for n in os.listdir(os.path.join(ROOT, top))}
    declared = _declared_distributions() | {"jaxlib"}  # jax pins jaxlib to its own version
    dists = packages_distributions()
    missing = {}
    for name in sorted(_imported_top_level(files) - set(sys.stdlib_module_names) - local):
        owners = {d.lower().replace("_", "-") for d in dists.get(name, [])}
        if not owners:
            continue  # not installed here: an optional dependency behind a guarded import
        if not owners & declared:
            missing[name] = sorted(owners)
    assert not missing, f"imported but not declared in setup.py (module: distributions): {missing}"



def _pip_installs(text: str) -> list[str]:
    """What follows `pip install` (or `uv pip install`) on each line that has one."""
    return re.findall(r"pip install ([^\n&]*)", text)


def _project_extras(text: str) -> set[str]:
    """The extras of the project (`.[a,b]`) that the file's pip install lines install."""
    return {e for line in _pip_installs(text) for m in re.findall(r"\.\[([\w,]+)\]", line) for e in m.split(",")}


def test_the_container_image_pins_jax_as_setup_py_and_installs_what_the_launch_scripts_do():
    # launch/Dockerfile (gke_xpk.sh --docker-image): the same jax[tpu] pin as setup.py's [tpu] extra and the
    # same extras as the install step of tpu_vm.sh and gke_xpk.sh, so the image runs what a pod installs
    setup_py = open(os.path.join(ROOT, "setup.py")).read()
    jax_version = re.search(r'^JAX_VERSION = "([^"]+)"', setup_py, re.M).group(1)
    assert re.search(r'^ *"tpu": \[f"jax\[tpu\]==\{JAX_VERSION\}"', setup_py, re.M)
    dockerfile = open(os.path.join(ROOT, "launch", "Dockerfile")).read()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"^ARG JAX_VERSION=(\S+)$", dockerfile, re.M).group(1) == jax_version
    (install,) = _pip_installs(dockerfile)
    assert re.findall(r"jax\[(\w+)\]==(\S+?)[\"' ]", install) == [("tpu", "${JAX_VERSION}")]
    assert _project_extras(dockerfile) == {"tpu"}
    for script in ("tpu_vm.sh", "gke_xpk.sh"):
        assert _project_extras(open(os.path.join(ROOT, "launch", script)).read()) == {"tpu"}, script
    assert re.search(r'^ENTRYPOINT \["dgemma"\]$', dockerfile, re.M)
