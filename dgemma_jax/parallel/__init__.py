"""Meshes, logical-axis sharding rules, multi-host start-up and the `--profile` trace (AOT reports live in
`dgemma_jax.perf`).

Submodules load lazily (the model imports only `parallel.rules`, through `dgemma_jax.runtime`).
"""

import importlib

_EXPORTS = {
    "make_mesh": "mesh", "parse_mesh": "mesh",
    "RULE_SETS": "rules", "LOGICAL_AXES": "rules", "rules_for": "rules", "check_rules": "rules", "spec_for": "rules",
    "Shardings": "shardings", "fetch": "shardings",
    "initialize": "distributed", "is_main_process": "distributed", "main_print": "distributed",
    "profile": "profiling",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"dgemma_jax.parallel.{_EXPORTS[name]}"), name)
    raise AttributeError(name)
