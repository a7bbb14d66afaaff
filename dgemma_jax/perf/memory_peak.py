"""What a compiled program holds at its memory peak, read from XLA's own buffer assignment.

`memory_analysis()` gives totals (arguments, temporaries); when a program does not fit, the question
is which buffers make up the peak. XLA answers it in the files it dumps after optimization:
`*-live-range.txt` lists every value live at the peak of its heap simulation with its bytes,
`*-buffer-assignment.txt` each value's shape and the allocation it sits in (a parameter, the
temporaries, the output), and the optimized HLO each instruction's `op_name` (the jax scope and
primitive that made it). `compile_with_peak` compiles with those dumps switched on, into a temporary
directory, and `read_peak` joins them.

Used by `dgemma compile --explain-memory N` (perf.aot). The files are XLA's debugging output, not a
stable interface: a dump without the peak section is a RuntimeError that says so.
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
from typing import Any

__all__ = ["compile_with_peak", "read_peak"]

_PEAK_HEADER = re.compile(r"\s*Live ranges at \d+ \(peak\):")
_PEAK_LINE = re.compile(r"\s+(\S+?)(\{[^}]*\})?: (\d+) bytes")
_ALLOCATION = re.compile(r"allocation \d+: size \d+, (.*)")
_VALUE = re.compile(r" value: <\d+ (\S+?)(\{[^}]*\})? @\d+> \(size=\d+,offset=\d+\): (\S+)")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*? ([a-z][a-z0-9-]*)\(%?([^,) ]*)")
# instructions that only move or relabel a value: a copy's origin is looked up through them
_MOVES = ("copy", "copy-start", "copy-done", "async-start", "async-done", "custom-call", "bitcast",
          "get-tuple-element")
_OP_NAME = re.compile(r"op_name=\"([^\"]*)\"")


def _kind(allocation: str) -> str:
    if re.match(r"color [1-9]", allocation):  # another memory space (TPU: VMEM, SMEM, ...), not device memory
        return "on_chip"
    if allocation.startswith("parameter"):
        return "parameter"
    if "preallocated-temp" in allocation:
        return "temporary"
    if "output" in allocation or "live-out" in allocation:
        return "output"
    return "other"


def _key(name: str, index: str | None) -> str:
    """A value's name as both files can be joined on: `x` and `x{}` are the same (non-tuple) value."""
    return name if index in (None, "", "{}") else name + index


def _read_module(prefix: str, top: int) -> dict[str, Any]:
    in_peak, live = False, []
    with open(prefix + "-live-range.txt") as f:
        for line in f:
            if not in_peak:
                in_peak = bool(_PEAK_HEADER.match(line))
                continue
            m = _PEAK_LINE.match(line)
            if not m:
                break
            live.append((m.group(1), m.group(2), int(m.group(3))))
    if not in_peak:
        raise RuntimeError(f"{prefix}-live-range.txt has no 'Live ranges at N (peak)' section: this XLA "
                           "does not report its memory peak")
    shapes, kinds, kind = {}, {}, "other"
    with open(prefix + "-buffer-assignment.txt") as f:
        for line in f:
            m = _ALLOCATION.match(line)
            if m:
                kind = _kind(m.group(1))
                continue
            m = _VALUE.match(line)
            if m:
                key = _key(m.group(1), m.group(2))
                shapes[key], kinds[key] = m.group(3), kind
    ops, source = {}, {}
    hlo = prefix + ".txt"
    if os.path.exists(hlo):
        with open(hlo) as f:
            for line in f:
                m = _INSTRUCTION.match(line)
                if not m or m.group(1) in ops:
                    continue
                op = _OP_NAME.search(line)
                ops[m.group(1)] = op.group(1) if op else ("parameter " + m.group(1) if m.group(2) == "parameter" else "")
                if m.group(2) in _MOVES:
                    source[m.group(1)] = m.group(3)
    named = dict(ops)
    for name in [n for n in ops if not ops[n] and n in source]:  # a copy XLA inserted: named by what it copies
        origin, hops = source[name], 0
        while not named.get(origin) and origin in source and hops < 16:
            origin, hops = source[origin], hops + 1
        ops[name] = f"copy of {named.get(origin) or origin}"
    buffers = []
    for name, index, size in live:
        key = _key(name, index)
        buffers.append({"name": name + (index or ""), "bytes": size, "shape": shapes.get(key, ""),
                        "kind": kinds.get(key, "other"), "op": ops.get(name, "")})
    buffers.sort(key=lambda b: -b["bytes"])
    by_kind: dict[str, int] = {}
    for b in buffers:
        by_kind[b["kind"]] = by_kind.get(b["kind"], 0) + b["bytes"]
    on_chip = by_kind.pop("on_chip", 0)
    return {"peak_bytes": sum(by_kind.values()), "bytes_by_kind": by_kind, "on_chip_bytes": on_chip,
            "largest": [b for b in buffers if b["kind"] not in ("parameter", "on_chip")][:top]}


def read_peak(dump_dir: str, top: int = 12) -> dict[str, Any]:
    """The memory peak of the program XLA dumped into `dump_dir` (with xla_dump_hlo_as_text).

    Returns {"peak_bytes": every value in device memory live at the peak, summed; "bytes_by_kind": that
    sum split into "parameter", "temporary", "output" (and "other"); "on_chip_bytes": values XLA placed
    in another memory space (a TPU's VMEM), not counted above; "largest": the `top` largest
    non-parameter buffers in device memory live at the peak, each {"name", "bytes", "shape", "kind",
    "op"} (op: the jax op_name that made it; for a copy XLA inserted, "copy of" what it copies)}. When
    the directory holds several programs (helpers compiled alongside), the one with the highest peak.
    """
    prefixes = [p[: -len("-buffer-assignment.txt")]
                for p in glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))]
    if not prefixes:
        raise RuntimeError(f"no buffer assignment dumped in {dump_dir}: was the program compiled with "
                           "xla_dump_to and xla_dump_hlo_as_text?")
    return max((_read_module(p, top) for p in prefixes), key=lambda r: r["peak_bytes"])


def compile_with_peak(lowered, compiler_options: dict[str, Any] | None = None, top: int = 12):
    """(compiled, read_peak(...)): compile a `jax.stages.Lowered` with XLA's dumps in a temporary directory.

    When the compiler refuses the program (XLA:TPU: RESOURCE_EXHAUSTED, it does not fit), the error is
    raised with the peak it had assigned as its `memory_peak` attribute, where the dump has one.
    """
    with tempfile.TemporaryDirectory(prefix="dgemma-peak-") as d:
        options = {**(compiler_options or {}), "xla_dump_to": d, "xla_dump_hlo_as_text": True}
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:
            try:
                e.memory_peak = read_peak(d, top)
            except (RuntimeError, OSError):
                pass  # no dump to read: the error as it is
            raise
        return compiled, read_peak(d, top)
