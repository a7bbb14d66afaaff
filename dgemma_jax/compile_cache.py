"""jax's persistent compilation cache, on by default, and a count of what it saved.

Every entry point (the `dgemma` commands, the server, `Engine` and `DiffusionGemma`, the notebook)
calls `enable()` before it compiles: a program compiled once is then read back from the cache on the
next start instead of being compiled again (the bundled model's `dgemma generate`: 6.1 s -> ~3 s).

The one setting is jax's own `JAX_COMPILATION_CACHE_DIR` (a local directory, or `gs://...` shared by
the hosts of a pod); without it the cache is `$DGEMMA_CACHE/xla` (`~/.cache/dgemma_jax/xla` by
default, beside the checkpoint mirror). `JAX_COMPILATION_CACHE_DIR=off` (or empty) turns it off.
A cache directory already set in `jax.config` (by the caller, or a `--compiled` directory) is kept.

`CompileCounter` counts, through `jax.monitoring`, the programs read from the cache and the ones
compiled (with their compile seconds), so that a start can say what it cost::

    counter = CompileCounter()
    ... compile ...
    print(counter.summary())   # "compilation cache ~/.cache/dgemma_jax/xla: 3 programs from the cache, ..."
"""

from __future__ import annotations

import json
import os
import threading

import jax
from jax import monitoring

from dgemma_jax.paths import cache_root

ENV = "JAX_COMPILATION_CACHE_DIR"
OFF = ("", "off", "none", "0", "false")

XLA_CACHES_DEFAULT = "xla_gpu_per_fusion_autotune_cache_dir"  # jax's default jax_persistent_cache_enable_xla_caches
_HIT = "/jax/compilation_cache/cache_hits"
_COMPILE = "/jax/core/compile/backend_compile_duration"


def default_dir() -> str:
    """The cache directory when JAX_COMPILATION_CACHE_DIR is not set: `$DGEMMA_CACHE/xla`."""
    return os.path.join(cache_root(), "xla")


def enable(directory: str | None = None) -> str | None:
    """Turn jax's persistent compilation cache on (idempotent); returns its directory, None when off.

    Args:
      directory: the cache directory; None: the one jax.config already has (jax reads
        JAX_COMPILATION_CACHE_DIR into it at import; a `--compiled` directory sets it too), else
        JAX_COMPILATION_CACHE_DIR as set now, else `default_dir()`. "off" turns the cache off.
    Returns:
      The directory in use (a path or URL), or None when the cache is off.
    """
    if directory is None:
        directory = jax.config.jax_compilation_cache_dir or os.environ.get(ENV)
        if directory is None:
            directory = default_dir()
    if directory.strip().lower() in OFF:
        if jax.config.jax_compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            _forget_decision()
        return None
    if "://" not in directory:
        directory = os.path.abspath(os.path.expanduser(directory))
    if jax.config.jax_persistent_cache_enable_xla_caches == XLA_CACHES_DEFAULT:
        # jax's default turns on XLA:GPU's autotune cache under the cache directory, whose path then
        # enters every program's cache key: a directory copied elsewhere (or the same programs saved to
        # two directories) would never hit. Not used on TPU or CPU.
        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
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


# ---------------------------------------------------------------------------- compiled-program directories
# `dgemma compile ... --save DIR` and `dgemma serve|generate --compiled DIR`: a directory of compiled
# programs made for one (model config, devices, mesh, shapes, software versions). Its executables are
# jax's own serialized cache entries under DIR/xla (jax writes and reads them, a damaged one is
# recompiled with a warning); DIR/manifest.json says what they were compiled for and lists them.
MANIFEST = "manifest.json"


class CompiledDirMismatch(ValueError):
    """A --compiled directory made for another model, devices, mesh, shapes or software."""


def software() -> dict:
    """The versions a serialized executable depends on (jax, jaxlib, libtpu when installed, dgemma_jax)."""
    import importlib.metadata as md  # deferred: only compiled-program directories need package versions

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"jax": version("jax"), "jaxlib": version("jaxlib"), "libtpu": version("libtpu"),
            "dgemma_jax": version("dgemma_jax")}


def identity(config, devices, *, mesh: dict | None, rules: str | None, quantize: str | None,
             layers: str = "unrolled") -> dict:
    """What a directory's programs were compiled for: the model config (its name and a hash of every
    field), the devices (kind and count), the mesh's axis sizes, the sharding rules, the weights'
    quantization, the layer layout and `software()`. Shapes (slots, context, prompt widths) are not
    part of it: they are in each program's cache key, so a run with other shapes compiles (and adds)
    its own programs."""
    import dataclasses  # deferred with the line below: only compiled-program directories hash configs
    import hashlib

    fields = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
    return {"model": config.name, "model_sha256": hashlib.sha256(fields.encode()).hexdigest()[:16],
            "device_kind": devices[0].device_kind, "devices": len(devices), "mesh": dict(mesh or {}),
            "rules": rules if mesh else None, "quantize": quantize, "layers": layers, **software()}


def use_compiled_dir(directory: str, ident: dict, *, create: bool = True) -> str:
    """Turn the compilation cache to `directory`/xla after checking that its manifest was written for
    `ident`; a directory without a manifest gets one (create=True) and fills as programs compile.

    Raises:
      CompiledDirMismatch: naming the first field that differs and both values.
    """
    path = os.path.join(directory, MANIFEST)
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f).get("identity", {})
        for key in sorted(set(saved) | set(ident)):
            if _norm(saved.get(key)) != _norm(ident.get(key)):
                raise CompiledDirMismatch(
                    f"--compiled {directory} holds programs compiled for {key}={saved.get(key)!r}, but this run "
                    f"has {key}={ident.get(key)!r}: compile them again (dgemma compile ... --save, or a run with "
                    "--compiled pointing at an empty directory), or drop --compiled")
    elif create:
        _write_manifest(directory, {"identity": ident, "programs": {}})
    else:
        raise FileNotFoundError(f"--compiled {directory}: no {MANIFEST} there (not a compiled-program directory)")
    # every program goes into the directory, however fast it compiled
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return enable(os.path.join(directory, "xla"))


def record_program(directory: str, name: str, compile_s: float, before: set[str]) -> dict:
    """Add program `name` to the manifest: the cache entries that appeared since `before` (a listing of
    DIR/xla taken before it compiled), their bytes, and its compile seconds. Returns its entry."""
    xla = os.path.join(directory, "xla")
    new = sorted(set(_entries(xla)) - before)
    entry = {"cache_keys": new, "bytes": sum(os.path.getsize(os.path.join(xla, k)) for k in new),
             "compile_s": round(float(compile_s), 2)}
    with open(os.path.join(directory, MANIFEST)) as f:
        manifest = json.load(f)
    manifest["programs"][name] = entry
    _write_manifest(directory, manifest)
    return entry


def entries(directory: str) -> set[str]:
    """The cache entries now in a compiled-program directory."""
    return set(_entries(os.path.join(directory, "xla")))


def _entries(xla: str) -> list[str]:
    return [n for n in os.listdir(xla) if not n.startswith(".")] if os.path.isdir(xla) else []


def _norm(value):
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _write_manifest(directory: str, manifest: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{MANIFEST}.tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, os.path.join(directory, MANIFEST))
