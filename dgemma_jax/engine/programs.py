"""The engine's jitted programs (`Programs`), the cache that shares them between engines
(`ProgramCache`), and what a compiled program needs on its device (`compiled_memory`)."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

from dgemma_jax.sampling.config import SamplerConfig


@dataclasses.dataclass(frozen=True)
class Programs:
    """An engine's jitted programs: the pure functions of `dgemma_jax.sampling` with config, sampler
    and runtime bound (call them with keywords, params first). Programs that write the cache take it
    donated (the slot tick its canvas too) unless the engine's `donate=False`.

    prefill(params, tokens=, lengths=, cache=, images=None) -> cache: the causal pass over prompts
    commit(params, cache=, tokens=, active=) -> cache: the causal pass over canvases
    canvas_start(keys=, index=, finished=, seed_canvas=None, pinned=None) -> `loop.Canvas`
    denoise_step(params, cache=, context_end=, keys=, state=, seed=None, pinned=None, knobs=None) -> LoopState
    canvas_end(params, cache=, argmax=, finished=, last=) -> (tokens, finished, cache)
    canvas_step(params, cache=, keys=, index=, last=, finished=, seed_canvas=None, pinned=None): one canvas
    commit_step(params, cache=, tokens=, active=, canvas=) -> (LoopState, cache): a canvas's commit and the
      next canvas's first step in one pass (`generate.commit_and_first_step`, what `generate_fused` runs
      where the runtime fuses the commit)
    prefill_slot(params, cache=, slot=, tokens= [1, W], length= [1], start=, images=None) -> cache
    slot_tick(params, cache=, state=, keys=, canvas_index=, begin=, active=, last=, keep=, knobs=,
      max_ticks=, seed=None, pinned=None, hold=None, end=None) -> `slots.TickOutput`
      (`Engine.new_slots` gives the first state)
    read_row(cache, slot) -> a batch-1 cache: one slot's row (a preempted request's, for the host)
    write_row(cache, slot, row) -> cache: that row written back into a slot
    """

    sampler: SamplerConfig
    prefill: Any
    commit: Any
    canvas_start: Any
    denoise_step: Any
    canvas_end: Any
    canvas_step: Any
    commit_step: Any
    prefill_slot: Any
    slot_tick: Any
    read_row: Any
    write_row: Any


# ---------------------------------------------------------------------- functional API


class ProgramCache:
    """Jitted programs by key (program, config, sampler, runtime, donated arguments), shared by the
    engines that use this cache; past `size` entries the least recently used is dropped, and with it
    its compiled executables and the mesh its runtime holds (an engine keeps the programs it has
    already taken). `ProgramCache.shared` is the engines' default."""

    shared: "ProgramCache"

    def __init__(self, size: int = 64):
        if size < 1:
            raise ValueError(f"a ProgramCache holds at least one program; got size={size}")
        self.size = size
        self._jits: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, make):
        """The program under `key`, made by `make()` when absent."""
        if key in self._jits:
            self._jits.move_to_end(key)
            return self._jits[key]
        fn = self._jits[key] = make()
        while len(self._jits) > self.size:
            self._jits.popitem(last=False)
        return fn

    def __len__(self) -> int:
        return len(self._jits)


ProgramCache.shared = ProgramCache()


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes")


def compiled_memory(compiled) -> dict[str, int]:
    """What a compiled program needs on its device (XLA's memory analysis), with `total_bytes`:
    arguments + outputs - the outputs aliased to (donated) arguments + temporaries + code. Empty where
    the backend has no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    mem = {f: int(getattr(m, f, 0)) for f in MEMORY_FIELDS}
    mem["total_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
                          + mem["temp_size_in_bytes"] + mem["generated_code_size_in_bytes"])
    return mem
