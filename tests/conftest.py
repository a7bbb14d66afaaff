import os

# Tests run on the CPU; 8 fake devices let sharding tests build real meshes.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pytest_configure(config):
    config.addinivalue_line("markers", "ref: needs transformers+torch (the [ref] extra)")
    config.addinivalue_line("markers", "slow: longer end-to-end tests")
