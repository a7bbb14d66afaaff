"""What a compiled program costs and needs, as XLA reports it: the one reader the AOT reports
(`perf.aot`) and the benchmarks use.

`cost(compiled)`: `cost_analysis()`'s FLOPs, bytes accessed and transcendentals (a loop body is
counted once; a Pallas kernel's FLOPs not at all). `memory(compiled)`: the memory analysis, which
the engine reads too and therefore keeps (`engine.programs.compiled_memory`). `compile_timed`: lower and
compile, with the seconds each took.
"""

from __future__ import annotations

import time

from dgemma_jax.engine.programs import MEMORY_FIELDS, compiled_memory as memory

__all__ = ["COST_FIELDS", "MEMORY_FIELDS", "compile_timed", "cost", "memory"]

COST_FIELDS = {"flops": "flops", "bytes_accessed": "bytes accessed", "transcendentals": "transcendentals"}


def cost(compiled) -> dict[str, float]:
    """{"flops", "bytes_accessed", "transcendentals"} of a compiled program (0.0 where XLA gives none)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):  # older jax: one dict per device program
        ca = ca[0] if ca else {}
    ca = ca or {}
    return {ours: float(ca.get(theirs, 0.0)) for ours, theirs in COST_FIELDS.items()}


def compile_timed(jitted, *args, **kwargs):
    """(compiled, {"lower_s", "compile_s", "total_s"}): AOT lower and compile `jitted` for these arguments."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, {"lower_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}
