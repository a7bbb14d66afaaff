"""The server's compiled programs: the engine's slot tick and slot prefill, compiled ahead of time for
the server's shapes (one prefill per chunk width, and per image shape on first use), with what each
needs on its device."""

from __future__ import annotations

from typing import Any

import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.engine.programs import compiled_memory


class SlotPrograms:
    """Compiled `slot_tick` and `prefill_slot` programs of one engine. `memory` holds each compiled
    program's device memory (`compiled_memory`) by name; `image_compiles` counts the image prefills
    compiled on first use (a new image shape)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.memory: dict[str, dict[str, int]] = {}
        self.image_compiles = 0
        self._prefills: dict[Any, Any] = {}

    def compile_tick(self, args: dict):
        """The tick compiled for these arguments (`Scheduler._tick_args`)."""
        compiled = self.engine.programs.slot_tick.lower(self.engine.params, **args).compile()
        self.memory["slot_tick"] = compiled_memory(compiled)
        return compiled

    def prefill(self, width: int, cache, images=None):
        """The compiled prefill of a chunk of `width` tokens into `cache`'s rows; with images
        (pixel_values, position_ids) one program per (width, images' shapes), compiled on first use."""
        key = width if images is None else (width, tuple(images[0].shape), tuple(images[1].shape))
        if key in self._prefills:
            return self._prefills[key]
        kw = dict(cache=cache, slot=np.int32(0), tokens=np.zeros((1, width), np.int32), length=np.ones((1,), np.int32),
                  start=np.int32(0))
        name = f"prefill_slot_{width}"
        if images is not None:
            kw["images"] = images
            name += f"_images_{images[0].shape[0]}x{images[0].shape[1]}"
            self.image_compiles += 1
        compiled = self.engine.programs.prefill_slot.lower(self.engine.params, **kw).compile()
        self.memory[name] = compiled_memory(compiled)
        self._prefills[key] = compiled
        return compiled

