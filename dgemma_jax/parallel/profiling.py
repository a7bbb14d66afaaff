"""`--profile DIR`: a jax.profiler trace of a command's work, for TensorBoard's profile plugin (xprof).

    with profile("/tmp/prof"):          # DIR/plugins/profile/<run>/<host>.xplane.pb
        engine.generate(...)
    # tensorboard --logdir /tmp/prof    (pip install tensorboard-plugin-profile), or xprof /tmp/prof

The trace holds XLA's host and device activity (compilation, program launches, device ops on TPU and
GPU, host threads) without Python function tracing: on the bundled model's `dgemma generate` that
tracing made the command ~1.5x slower and its trace 12x larger (46 vs 3.8 MB; docs/tpu.md).

DIR may be a local directory or a gs:// URL (the profiler writes through TensorFlow's file system
layer, which reads GCS credentials like gcloud). On a multi-host pod only process 0 traces (its
own devices): one trace per run, as process 0 alone writes the commands' other output.
"""

from __future__ import annotations

import contextlib
import os
import sys

import jax


@contextlib.contextmanager
def profile(log_dir: str | None):
    """Trace the block into `log_dir` with `jax.profiler.trace` (nothing when `log_dir` is empty, and
    nothing on processes other than 0). Enter it after `parallel.initialize()`: starting a trace
    starts JAX's backends."""
    if not log_dir or jax.process_index() != 0:
        yield
        return
    try:  # an unwritable place is one clear line before anything runs, not the profiler's traceback
        os.makedirs(log_dir, exist_ok=True)
        probe = os.path.join(log_dir, ".dgemma_write_check")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"--profile {log_dir}: cannot write there ({e.strerror or e}); give a writable directory") \
            from None
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python function events (see the module docstring)
    with jax.profiler.trace(log_dir, profiler_options=options):
        yield
    print(f"[profile written to {log_dir}: tensorboard --logdir {log_dir}]", file=sys.stderr, flush=True)
