"""The device side of the server: the slots' KV cache and canvas state, the engine's slot tick and
slot prefill compiled ahead of time for the server's shapes, and the calls that run them. The
scheduler (`serving/scheduler.py`) decides what runs; the runner runs it and hands back host arrays."""

from __future__ import annotations

import concurrent.futures
import functools
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.engine.placement import resolve_param_layouts
from dgemma_jax.engine.programs import compiled_memory
from dgemma_jax.sampling import slots as slots_lib


class TickResult(NamedTuple):
    """What one call of the tick program tells the host (numpy, one transfer): ticks run; per slot
    [N] whether its canvas settled, its tokens [N, L] (EOS-truncated), whether they end in EOS, its
    denoising steps, whether it met non-finite logits; the canvases' argmax [N, L] when asked for
    (previews), else None; per slot [N] whether its row is still owed a commit after the call
    (`SlotRunner.owed`)."""

    ticks: int
    settled: np.ndarray
    tokens: np.ndarray
    eos: np.ndarray
    steps: np.ndarray
    nonfinite: np.ndarray
    argmax: np.ndarray | None
    owed: np.ndarray


class SavedRow(NamedTuple):
    """A slot's row in host memory (`SlotRunner.save_row`): its cache row, and the canvas [L] it is
    still owed (written by the tick after it is restored), or None."""

    row: Any
    owed: np.ndarray | None


class SlotRunner:
    """The slots' cache and state and the compiled `slot_tick` and `prefill_slot` programs of one engine.

    `programs` holds each start-up program's progress ("pending", "compiling", "ready" with its
    seconds, "failed"); `memory` each compiled program's device memory (`compiled_memory`) by name;
    `image_compiles` counts the image prefills compiled on first use (a new image shape).

    param_layouts: where the engine's parameters are laid out for the server: "compiler" re-lays them out
    at start-up in the layouts the compiler prefers for the tick (`Engine.compile_in_compiler_layouts`:
    on a TPU the tick otherwise re-lays the attention weights out at every call; the prefills then take
    the tick's layouts), "default" leaves them as placed, "auto" (default) is "compiler" on a TPU
    without LoRA adapter rows, else "default".

    owed, owed_tokens: [N] rows owed a commit and [N, L] their canvases: a canvas that settled and goes
    into its row is written by the next tick call, with that tick's step (`slots.slot_tick`'s
    `commit`); until then nothing else may write or read the row (`owes`)."""

    def __init__(self, engine: Engine, slots: int, context: int, prefill_widths: tuple[int, ...],
                 param_layouts: str = "auto"):
        self.param_layouts = resolve_param_layouts(param_layouts, engine.runtime.platform, engine.adapter_rows)
        self.engine, self.slots, self.context = engine, int(slots), int(context)
        self.prefill_widths = tuple(sorted(set(prefill_widths)))
        self.programs: dict[str, dict[str, Any]] = {"slot_tick": {"state": "pending"}}
        self.programs.update({f"prefill_slot_{w}": {"state": "pending"} for w in self.prefill_widths})
        self.programs.update({"read_row": {"state": "pending"}, "write_row": {"state": "pending"}})
        self.memory: dict[str, dict[str, int]] = {}
        self.image_compiles = 0
        self.cache = None
        self.state = None
        self.slot_adapter = np.zeros(self.slots, np.int32)   # each slot's LoRA adapter (0: the base model)
        self.owed = np.zeros(self.slots, bool)
        self.owed_tokens = np.zeros((self.slots, engine.sampler.canvas_length), np.int32)
        self._tick = None
        self._prefills: dict[Any, Any] = {}
        self._read_row = self._write_row = None

    # ------------------------------------------------------------------ start-up
    def start(self, tick_args: dict) -> None:
        """Allocate the slots' cache and state, then compile the tick (for `tick_args`, the
        scheduler's idle arguments) and the prefill widths side by side (XLA compiles them in
        parallel threads), each program's progress in `programs`. Raises what a compile raised. With
        `param_layouts` "compiler" the tick compiles first, alone, and the parameters move to its
        layouts before the other programs compile for them."""
        self.cache = self.engine.new_cache(self.slots, self.context)
        self.state = self.engine.new_slots(self.slots)
        jobs = {"slot_tick": functools.partial(self.compile_tick, tick_args)}
        if self.param_layouts == "compiler":
            self._tick = self._timed("slot_tick", functools.partial(self._compile_tick_in_its_layouts, tick_args))
            del jobs["slot_tick"]
        jobs.update({f"prefill_slot_{w}": functools.partial(self.prefill_program, w) for w in self.prefill_widths})
        jobs.update(read_row=self._compile_read_row, write_row=self._compile_write_row)
        with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="dgemma-compile") as pool:
            done = {name: pool.submit(self._timed, name, job) for name, job in jobs.items()}
        for future in done.values():
            future.result()
        if "slot_tick" in done:
            self._tick = done["slot_tick"].result()
        self._read_row, self._write_row = done["read_row"].result(), done["write_row"].result()

    def progress(self) -> str:
        """Start-up progress in words: "1 of 3 programs compiled"."""
        ready = sum(p["state"] == "ready" for p in self.programs.values())
        return f"{ready} of {len(self.programs)} programs compiled"

    def _timed(self, name: str, compile_fn):
        self.programs[name] = {"state": "compiling"}
        t0 = time.perf_counter()
        try:
            out = compile_fn()
        except BaseException:
            self.programs[name] = {"state": "failed"}
            raise
        self.programs[name] = {"state": "ready", "seconds": round(time.perf_counter() - t0, 2)}
        return out

    def compile_tick(self, args: dict):
        """The tick compiled for these arguments (the scheduler's, without the cache and state)."""
        compiled = self.engine.programs.slot_tick.lower(self.engine.params_for(self.slot_adapter), cache=self.cache,
                                                        state=self.state, **self._owed_args(), **args).compile()
        self.memory["slot_tick"] = compiled_memory(compiled)
        return compiled

    def _compile_tick_in_its_layouts(self, args: dict):
        """The tick compiled with the parameters in the layouts the compiler prefers for it, and the
        engine's parameters moved to them; a callable run as the compiled tick is."""
        formats, compiled, call = self.engine.compile_in_compiler_layouts(
            self.engine.programs.slot_tick, dict(cache=self.cache, state=self.state, **self._owed_args(), **args))
        self.engine.place_params(formats)
        self.memory["slot_tick"] = compiled_memory(compiled)
        return call

    def _compile_read_row(self):
        compiled = self.engine.programs.read_row.lower(self.cache, np.int32(0)).compile()
        self.memory["read_row"] = compiled_memory(compiled)
        return compiled

    def _compile_write_row(self):
        row = jax.eval_shape(slots_lib.read_row, self.cache, np.int32(0))
        row = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), row)
        compiled = self.engine.programs.write_row.lower(self.cache, np.int32(0), row).compile()
        self.memory["write_row"] = compiled_memory(compiled)
        return compiled

    def prefill_program(self, width: int, images=None):
        """The compiled prefill of a chunk of `width` tokens into one slot's row; with images
        (pixel_values, position_ids) one program per (width, images' shapes), compiled on first use."""
        key = width if images is None else (width, tuple(images[0].shape), tuple(images[1].shape))
        if key in self._prefills:
            return self._prefills[key]
        kw = dict(cache=self.cache, slot=np.int32(0), tokens=np.zeros((1, width), np.int32),
                  length=np.ones((1,), np.int32), start=np.int32(0))
        name = f"prefill_slot_{width}"
        if images is not None:
            kw["images"] = images
            name += f"_images_{images[0].shape[0]}x{images[0].shape[1]}"
            self.image_compiles += 1
        compiled = self.engine.programs.prefill_slot.lower(self.engine.params_for(self.slot_adapter[:1]), **kw).compile()
        self.memory[name] = compiled_memory(compiled)
        self._prefills[key] = compiled
        return compiled

    # ------------------------------------------------------------------ running
    def prefill(self, slot: int, tokens: np.ndarray, length: int, start: int, images=None) -> None:
        """One prompt chunk, tokens [1, W] (its first `length` valid), into slot `slot`'s row from
        position `start`; images: the chunk's `ImageBatch`, or None."""
        kw = dict(cache=self.cache, slot=np.int32(slot), tokens=tokens, length=np.asarray([length], np.int32),
                  start=np.int32(start))
        width = tokens.shape[1]
        params = self.engine.params_for(self.slot_adapter[slot:slot + 1])
        if images is None:
            self.cache = self.prefill_program(width)(params, **kw)
            return
        pixels = self.engine.place(np.asarray(images.pixel_values, np.float32), np.asarray(images.position_ids, np.int32))
        self.cache = self.prefill_program(width, pixels)(params, images=tuple(pixels), **kw)

    def owes(self, slot: int) -> bool:
        """Whether slot `slot`'s row is still owed a settled canvas (the next tick call writes it)."""
        return bool(self.owed[slot])

    def forget_owed(self, slot: int) -> None:
        """Slot `slot`'s row is no longer owed its canvas (a new prompt keeps none of it)."""
        self.owed[slot] = False

    def save_row(self, slot: int) -> SavedRow:
        """Slot `slot`'s cache row (its keys, values and length) copied to host memory (numpy), with the
        canvas it is still owed. The slot keeps both: its row may be reused for a prefix."""
        return SavedRow(jax.device_get(self._read_row(self.cache, np.int32(slot))),
                        self.owed_tokens[slot].copy() if self.owed[slot] else None)

    def restore_row(self, slot: int, saved: SavedRow) -> None:
        """Put a row `save_row` gave (from any slot) into slot `slot`, owed what it was owed."""
        self.cache = self._write_row(self.cache, np.int32(slot), saved.row)
        self.owed[slot] = saved.owed is not None
        if saved.owed is not None:
            self.owed_tokens[slot] = saved.owed

    def _owed_args(self) -> dict:
        return dict(commit=self.owed.copy(), commit_tokens=self.owed_tokens.copy())

    def tick(self, args: dict, previews: bool) -> TickResult:
        """One call of the compiled tick on the slots' cache and state (both replaced by its output); the
        rows owed a commit go in with it, and the canvases it leaves owed are kept for the next call."""
        out = self._tick(self.engine.params_for(self.slot_adapter), cache=self.cache, state=self.state,
                         **self._owed_args(), **args)
        self.cache, self.state = out.cache, out.state
        fetched = (out.ticks, out.settled, out.tokens, out.eos, out.steps, out.nonfinite, out.owed, out.committed)
        fetched += (out.argmax,) if previews else ()
        ticks, settled, tokens, eos, steps, nonfinite, owed, committed, *argmax = jax.device_get(fetched)   # one transfer
        self.owed &= ~committed
        self.owed |= owed
        self.owed_tokens[owed] = tokens[owed]
        return TickResult(int(ticks), settled, tokens, eos, steps, nonfinite, argmax[0] if previews else None,
                          self.owed.copy())
