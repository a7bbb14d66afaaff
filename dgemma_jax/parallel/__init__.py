"""Placement on a mesh, one floor above the model: meshes, the parameters' and cache's shardings, multi-host
start-up and the `--profile` trace (AOT reports live in `dgemma_jax.perf`).

The logical-axis rules the model and the runtime read (`dgemma_jax.axis_rules`) sit below the model,
beside `dgemma_jax.runtime`; they are re-exported here. Submodules load lazily.
"""

import importlib

_EXPORTS = {
    "make_mesh": "mesh", "parse_mesh": "mesh",
    "RULE_SETS": "axis_rules", "LOGICAL_AXES": "axis_rules", "rules_for": "axis_rules", "check_rules": "axis_rules",
    "spec_for": "axis_rules",
    "Shardings": "shardings", "fetch": "shardings",
    "initialize": "distributed", "is_main_process": "distributed", "main_print": "distributed",
    "profile": "profiling",
}

_MODULE = {"axis_rules": "dgemma_jax.axis_rules"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_MODULE.get(_EXPORTS[name], f"dgemma_jax.parallel.{_EXPORTS[name]}")), name)
    raise AttributeError(name)
