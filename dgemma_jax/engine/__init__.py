"""Compiled entry points: the one place that knows about `jax.jit`, buffer donation, shardings and
AOT compilation.

Everything the engine compiles is the pure code of `dgemma_jax.model` and `dgemma_jax.sampling`
(traceable only: the host loops over the compiled programs are here), given its `Runtime` (mesh and
rules, platform, MoE dispatch, attention kernel) as a static argument: one code path with or without
a mesh. By concern:
  engine.py     `Engine` (generate, stream, steps; the server's slots) and the one-call `generate`
  programs.py   `Programs` (the jitted pieces), `ProgramCache` (shared, bounded), `compiled_memory`
  drivers.py    the streaming drivers over those programs (`iter_canvases`, `iter_steps`; host loops)
  rows.py       a batch run as single rows or blocks and merged back (batch invariance)
  infill.py     the infill layout and the driver that tries middle lengths
  inputs.py     host checks of what goes in (`prepare_inputs`, images) and token budgets
  outputs.py    what a result says beyond its tokens (cut short, non-finite rows)
  placement.py  the parameters' layer layout and the runtime on a mesh
"""

from dgemma_jax.engine.engine import Engine, generate
from dgemma_jax.engine.programs import ProgramCache, Programs

__all__ = ["Engine", "ProgramCache", "Programs", "generate"]
