import os
import tempfile

# Tests run on the CPU; 8 fake devices let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# One persistent compilation cache for this test session, shared with the subprocesses the CLI,
# multi-process and resume tests start: each distinct program compiles once per session.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dgemma_jax_xla_cache_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_configure(config):
    config.addinivalue_line("markers", "ref: needs transformers+torch (the [ref] extra)")
    config.addinivalue_line("markers", "slow: longer end-to-end tests")
