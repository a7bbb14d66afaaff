"""Compiled entry points: the one place that knows about `jax.jit`, buffer donation, shardings and
AOT compilation.

Everything the engine runs is the pure code of `dgemma_jax.model` and `dgemma_jax.sampling`, given
its `Runtime` (mesh and rules, platform, MoE dispatch, attention kernel) as a static argument: one
code path with or without a mesh. By concern:
  engine.py     `Engine` (generate, stream, steps; the server's slots) and the one-call `generate`
  programs.py   `Programs` (the jitted pieces), `ProgramCache` (shared, bounded), `compiled_memory`
  inputs.py     host checks of what goes in (`prepare_inputs`, images) and token budgets
  outputs.py    what a result says beyond its tokens (cut short, non-finite rows)
  placement.py  the parameters' layer layout and the runtime on a mesh
"""

from dgemma_jax.engine.engine import Engine, generate
from dgemma_jax.engine.programs import ProgramCache, Programs

__all__ = ["Engine", "ProgramCache", "Programs", "generate"]
