"""jax's persistent compilation cache, on by default, and a count of what it saved.

Every entry point (the `dgemma` commands, the server, `Engine` and `DiffusionGemma`, the notebook)
calls `enable()` before it compiles: a program compiled once is then read back from the cache on the
next start instead of being compiled again (the bundled model's `dgemma generate`: 6.1 s -> ~3 s).

The one setting is jax's own `JAX_COMPILATION_CACHE_DIR` (a local directory, or `gs://...` shared by
the hosts of a pod); without it the cache is `$DGEMMA_CACHE/xla` (`~/.cache/dgemma_jax/xla` by
default, beside the checkpoint mirror). `JAX_COMPILATION_CACHE_DIR=off` (or empty) turns it off.
A cache directory the caller already set through `jax.config` is kept as it is.

`CompileCounter` counts, through `jax.monitoring`, the programs read from the cache and the ones
compiled (with their compile seconds), so that a start can say what it cost::

    counter = CompileCounter()
    ... compile ...
    print(counter.summary())   # "compilation cache ~/.cache/dgemma_jax/xla: 3 programs from the cache, ..."
"""

from __future__ import annotations

import os
import threading

import jax
from jax import monitoring

from dgemma_jax.paths import cache_root

ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = ("", "off", "none", "0", "false")

_HIT = "/jax/compilation_cache/cache_hits"
_COMPILE = "/jax/core/compile/backend_compile_duration"


def default_dir() -> str:
    """The cache directory when JAX_COMPILATION_CACHE_DIR is not set: `$DGEMMA_CACHE/xla`."""
    return os.path.join(cache_root(), "xla")


def enable(directory: str | None = None) -> str | None:
    """Turn jax's persistent compilation cache on (idempotent); returns its directory, None when off.

    Args:
      directory: the cache directory; None: JAX_COMPILATION_CACHE_DIR, else a directory already set in
        `jax.config`, else `default_dir()`. "off" (or JAX_COMPILATION_CACHE_DIR=off) turns it off.
    Returns:
      The directory in use (a path or URL), or None when the cache is off.
    """
    if directory is None:
        env = os.environ.get(ENV)
        if env is not None:
            directory = env
        else:
            directory = jax.config.jax_compilation_cache_dir or default_dir()
    if directory.strip().lower() in OFF:
        if jax.config.jax_compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            _forget_decision()
        return None
    if "://" not in directory:
        directory = os.path.abspath(os.path.expanduser(directory))
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        _forget_decision()
    return directory


def _forget_decision() -> None:
    """jax decides at a process's first compilation whether the persistent cache is in use and keeps
    that answer; a directory set after something was compiled needs the decision taken again."""
    try:  # jax's private module, imported only here: the one place that needs it
        from jax._src import compilation_cache
    except ImportError:  # pragma: no cover - another jax layout
        return
    compilation_cache.reset_cache()


def current_dir() -> str | None:
    """The persistent cache directory jax uses now (None: off)."""
    return jax.config.jax_compilation_cache_dir or None


class CompileCounter:
    """Programs read from the persistent cache and programs compiled, from the time it is made.

    jax reports both through `jax.monitoring`; listeners cannot be removed, so one module-level pair
    feeds every counter (a counter reads the totals' difference since it was made)."""

    def __init__(self):
        _listen()
        with _LOCK:
            self._start = dict(_TOTALS)

    def counts(self) -> dict:
        """{"cache_hits": programs read from the cache, "compiled": programs compiled,
        "compile_s": their seconds of compilation}."""
        with _LOCK:
            return {k: _TOTALS[k] - self._start[k] for k in _TOTALS}

    def summary(self) -> str:
        c = self.counts()
        where = current_dir()
        head = f"compilation cache {where}" if where else "compilation cache off"
        return (f"{head}: {c['cache_hits']} program(s) from the cache, {c['compiled']} compiled in "
                f"{c['compile_s']:.1f} s")


_LOCK = threading.Lock()
_TOTALS = {"cache_hits": 0, "compiled": 0, "compile_s": 0.0}
_LISTENING = False
# jax times every backend compilation, a program read from the cache included, and reports the cache
# hit inside that span, in the same thread: a hit marks the span it falls in, which then is not counted
# as compiled.
_SPAN = threading.local()


def _on_event(event: str, **_) -> None:
    if event == _HIT:
        _SPAN.hit = True
        with _LOCK:
            _TOTALS["cache_hits"] += 1


def _on_duration(event: str, seconds: float, **_) -> None:
    if event != _COMPILE:
        return
    if getattr(_SPAN, "hit", False):
        _SPAN.hit = False
        return
    with _LOCK:
        _TOTALS["compiled"] += 1
        _TOTALS["compile_s"] += float(seconds)


def _listen() -> None:
    global _LISTENING
    with _LOCK:
        if _LISTENING:
            return
        _LISTENING = True
    monitoring.register_event_listener(_on_event)
    monitoring.register_event_duration_secs_listener(_on_duration)
