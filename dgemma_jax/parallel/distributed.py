"""Multi-host start-up: `jax.distributed.initialize()` and process-0-only output."""

from __future__ import annotations

import os
import sys
from typing import Callable

import jax
import numpy as np


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None) -> None:
    """Join a multi-process run when there is one.

    Explicit arguments (or DGEMMA_COORDINATOR / DGEMMA_NUM_PROCESSES / DGEMMA_PROCESS_ID) start a
    CPU/GPU cluster (gloo collectives on CPU); on a multi-host TPU VM slice jax auto-detects the
    cluster. A single host needs nothing. Must run before any other jax call.
    """
    coordinator_address = coordinator_address or os.environ.get("DGEMMA_COORDINATOR")
    if num_processes is None and os.environ.get("DGEMMA_NUM_PROCESSES"):
        num_processes = int(os.environ["DGEMMA_NUM_PROCESSES"])
    if process_id is None and os.environ.get("DGEMMA_PROCESS_ID"):
        process_id = int(os.environ["DGEMMA_PROCESS_ID"])
    if coordinator_address:
        if num_processes is None or process_id is None:
            raise ValueError("a coordinator address needs num_processes and process_id too "
                             "(or DGEMMA_NUM_PROCESSES / DGEMMA_PROCESS_ID)")
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    elif _multi_host_tpu():
        jax.distributed.initialize()  # multi-host TPU VM slice: auto-detected
    else:
        return
    if num_processes != 1:
        native_stdout_to_stderr()


def native_stdout_to_stderr() -> None:
    """Keep file descriptor 1 for Python's own output.

    Native libraries of a multi-process run write status lines to the C-level stdout (gloo prints
    "0 is connected to 1 peer ranks..." when its collectives connect, at a moment of its choosing), which
    would land in the middle of an answer a user pipes on. After this call fd 1 points at stderr and
    `sys.stdout` writes to a duplicate of the original stdout, so `print` still reaches the user's pipe
    and native chatter goes to the log stream.
    """
    sys.stdout.flush()
    original = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(original, "w", buffering=1, encoding=sys.stdout.encoding or "utf-8",
                           errors=getattr(sys.stdout, "errors", None) or "strict")


def _multi_host_tpu() -> bool:
    """True on a TPU VM slice with several hosts (TPU_WORKER_HOSTNAMES lists more than one host)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    names = [h for h in hosts.split(",") if h]
    return len(names) > 1 and all(h.strip() and " " not in h.strip() for h in names)


def is_main_process() -> bool:
    return jax.process_index() == 0


def read_on_main_process(read: Callable[[], str]) -> str:
    """`read()` called on process 0 alone, its text returned on every process. Input that only the first host
    has (`dgemma chat`'s and `dgemma generate`'s stdin: a launcher gives it to host 0) becomes the same on every
    host, so that all of them run the same programs; the others never touch their stdin. One process: read()."""
    if jax.process_count() == 1:
        return read()
    from jax.experimental import multihost_utils  # deferred: only a multi-process run needs it

    data = read().encode() if is_main_process() else b""
    n = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
    buf = np.zeros(max(64, 1 << max(n - 1, 0).bit_length()), np.uint8)  # padded to a power of two: few programs
    buf[:len(data)] = np.frombuffer(data, np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n]).decode()


def main_print(*args, **kwargs) -> None:
    """print() on process 0 only."""
    if is_main_process():
        print(*args, **kwargs)
