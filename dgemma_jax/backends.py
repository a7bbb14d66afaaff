"""Choosing JAX's backends before the first computation.

With libtpu installed (the `[tpu]` extra) JAX probes for a TPU at its first computation, and on a
machine without one libtpu prints about five error lines (host bounds, worker hostnames, a source
location trace) before JAX falls back to the CPU. `skip_absent_tpu()` removes that probe when the
machine has no TPU chip, so that a command's own output is all the user sees: importing `dgemma_jax`
runs it, so the library is as quiet as the CLI. `quiet_libtpu_load()` drops the same lines where
libtpu is loaded on purpose (AOT compilation for a TPU topology).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile

import jax

try:  # JAX's private probe modules: in another JAX layout the checks below answer 'cannot tell'
    from jax._src import hardware_utils
except ImportError:  # pragma: no cover - another JAX layout
    hardware_utils = None
try:
    from jax._src import xla_bridge
except ImportError:  # pragma: no cover
    xla_bridge = None


def tpu_chips() -> int | None:
    """TPU chips on this machine as JAX itself counts them (PCI devices of Google's vendor id);
    None where that probe is not available."""
    if hardware_utils is None:  # pragma: no cover - another JAX layout
        return None
    try:
        return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])
    except Exception:  # pragma: no cover - a probe that cannot read /sys
        return None


def skip_absent_tpu() -> bool:
    """Stop JAX from starting its TPU backend when no TPU chip is present and the user named no
    platforms (JAX_PLATFORMS / jax_platforms). Must run before JAX initialises its backends; returns
    whether the TPU backend was skipped. "tpu" stays a known platform (its registration is kept, its
    factory answers "no TPU here" without loading libtpu), so TPU lowering rules still register (Pallas)
    and AOT compilation for a TPU topology (`dgemma compile`), which loads libtpu on its own, is
    unaffected."""
    if os.environ.get("JAX_PLATFORMS"):
        return False
    if tpu_chips() != 0:  # a TPU is present, or we cannot tell: keep JAX's behaviour
        return False
    if xla_bridge is None:  # pragma: no cover
        return False
    if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
        return False
    factories = getattr(xla_bridge, "_backend_factories", None)
    if not isinstance(factories, dict) or "tpu" not in factories:
        return False
    registration = factories["tpu"]
    if getattr(registration.factory, "_dgemma_no_tpu", False):
        return True  # skipped already (an earlier import)
    try:
        factories["tpu"] = dataclasses.replace(registration, factory=_no_tpu_here, fail_quietly=True)
    except TypeError:  # pragma: no cover - another JAX layout
        return False
    return True


def _no_tpu_here():
    """The TPU backend's factory on a machine without a TPU chip: JAX records 'no backend' quietly."""
    return None


_no_tpu_here._dgemma_no_tpu = True


@contextlib.contextmanager
def quiet_libtpu_load():
    """Around code that loads libtpu on purpose (compile-only TPU devices for AOT compilation): on a
    machine without a TPU chip the probing lines libtpu writes to the process's stderr (file
    descriptor 2, below Python) are dropped; they are written out after all when the block fails or
    the machine has a TPU, so nothing that explains an error is lost."""
    if tpu_chips() != 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                captured.seek(0)
                sys.stderr.write(captured.read().decode("utf-8", "replace"))
                sys.stderr.flush()
