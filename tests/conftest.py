import json
import os
import sys
import tempfile

import pytest

# DGEMMA_HIDE_TORCH=1: behave as an install without the [ref] extra (no torch, no transformers), even
# in a venv that has them: `import torch` / `import transformers` raise ImportError, so the live
# reference tests skip and the golden-file tests must pass on their own.
HIDDEN_MODULES = ("torch", "transformers", "torchvision", "torchaudio")


class _HideModules:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN_MODULES:
            raise ModuleNotFoundError(f"{name} is hidden by DGEMMA_HIDE_TORCH=1", name=name)
        return None


if os.environ.get("DGEMMA_HIDE_TORCH") == "1":
    sys.meta_path.insert(0, _HideModules())

# Tests run on the CPU; 8 fake devices let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# One persistent compilation cache for this test session, shared with the subprocesses the CLI,
# multi-process and resume tests start: each distinct program compiles once per session.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dgemma_jax_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


SLOW_LIST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_tests.txt")
# Seconds each module took in a measured full run (`--module-seconds-out`), read to order a full run:
# `pytest_xdist_make_scheduler` hands whole modules to the xdist workers (a module's fixtures are built
# once, not once per worker) in collection order, so the longest go first and the run ends on short ones.
MODULE_SECONDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "module_seconds.json")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="run every tier (CI does): the default run leaves out the tests marked slow "
                          "and those listed in tests/slow_tests.txt")
    parser.addoption("--module-seconds-out", default=None, metavar="PATH",
                     help="write each module's seconds (setup + call + teardown, summed) as JSON to PATH "
                          "(a full run's written to tests/module_seconds.json orders later full runs)")


def pytest_configure(config):
    config.addinivalue_line("markers", "ref: needs transformers+torch (the [ref] extra)")
    config.addinivalue_line("markers", "slow: longer end-to-end tests (run with --full, or -m slow)")
    config.addinivalue_line("markers", "golden: compares with reference outputs stored in tests/golden (no torch)")


def _slow_prefixes() -> list[str]:
    with open(SLOW_LIST) as f:
        return [line.split("#")[0].strip() for line in f if line.split("#")[0].strip()]


def pytest_collection_modifyitems(config, items):
    """Tiers: the tests in tests/slow_tests.txt (module paths or node ids, measured as the slow ones)
    get the `slow` marker; a plain `pytest -q` deselects them, `--full` (or any explicit `-m`) keeps
    them."""
    prefixes = _slow_prefixes()
    for item in items:
        nodeid = item.nodeid
        if any(nodeid == p or nodeid.startswith(p + "::") or nodeid.startswith(p + "[") for p in prefixes):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--full") or config.option.markexpr:
        _longest_modules_first(items)
        return
    keep, slow = [], []
    for item in items:
        (slow if item.get_closest_marker("slow") else keep).append(item)
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = keep


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`-n N` (pytest-xdist's default "load" distribution): whole modules to each worker, in collection
    order (`--dist loadfile --no-loadscope-reorder`); an explicit other --dist is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False
    return LoadFileScheduling(config, log)


def _longest_modules_first(items) -> None:
    """Order the modules by their measured seconds (`MODULE_SECONDS`), longest first, each kept whole
    and in its own order; a module not measured goes last (re-measure after adding a long one)."""
    try:
        with open(MODULE_SECONDS) as f:
            seconds = json.load(f)
    except FileNotFoundError:
        return
    items.sort(key=lambda item: -seconds.get(item.nodeid.split("::")[0], 0.0))  # stable


_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_sessionfinish(session):
    path = session.config.getoption("--module-seconds-out")
    # under xdist the controller sees every worker's reports; a worker writes nothing
    if path and not hasattr(session.config, "workerinput"):
        with open(path, "w") as f:
            json.dump({m: round(t, 1) for m, t in sorted(_MODULE_SECONDS.items(), key=lambda kv: -kv[1])}, f,
                      indent=0)
            f.write("\n")


def _memory_map_count() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return None


def _memory_map_limit() -> int | None:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module.

    Every XLA:CPU executable keeps hundreds of memory mappings (its JIT-linked code) for as long as a
    jit cache holds it. One pytest process compiles thousands of programs, and without this the count
    climbs past Linux's `vm.max_map_count` (65530 by default) near the end of the suite, where thread
    creation fails ("can't start new thread" inside orbax, or an abort inside XLA). Measured: test_engine
    alone leaves ~21k mappings; after `jax.clear_caches()` + gc the next module starts at ~0.8k. Programs
    a later module needs again come back from the persistent compilation cache."""
    yield
    import gc

    import jax

    before = _memory_map_count()
    jax.clear_caches()
    gc.collect()
    limit = _memory_map_limit()
    if before is not None and limit and before > 0.8 * limit:
        pytest.fail(f"this test module left {before} memory mappings (vm.max_map_count is {limit}); "
                    f"split the module or release its compiled programs (jax.clear_caches(), drop engines) "
                    f"so that the process does not run out of mappings", pytrace=False)
