"""Where an engine's parameters live and how its programs run: the layer layout the parameters are
converted to once (`layers_for`), the runtime on the shardings' mesh (`runtime_for`), and the
choices of their memory layouts (`PARAM_LAYOUTS`, `Engine.place_params`)."""

from __future__ import annotations

import jax

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.layout import check_scannable, is_stacked, stack_layers, unstack_layers
from dgemma_jax.runtime import Runtime

# the server's choices of the parameters' memory layouts (`serving.runner.SlotRunner`): "compiler", the
# layouts the compiler prefers for the tick (`Engine.compile_in_compiler_layouts`); "default", as placed;
# "auto", "compiler" on a TPU
PARAM_LAYOUTS = ("auto", "default", "compiler")


def resolve_param_layouts(choice: str, platform: str | None, adapter_rows: bool) -> str:
    """One of `PARAM_LAYOUTS` made concrete: "auto" is "compiler" on a TPU without LoRA adapter rows (their
    row indices ride in the parameters' tree), else "default"; a bad choice is a ValueError naming them."""
    if choice not in PARAM_LAYOUTS:
        raise ValueError(f"param_layouts={choice!r} is invalid: one of {', '.join(PARAM_LAYOUTS)}")
    if choice == "auto":
        return "compiler" if platform == "tpu" and not adapter_rows else "default"
    if choice == "compiler" and adapter_rows:
        raise ValueError("param_layouts='compiler' with LoRA adapter rows is not supported: use 'default'")
    return choice


def layers_for(config: ModelConfig, params, layers: str, shardings=None):
    """`params` in the layer layout `layers` ("unrolled" or "scan", `model.layout`): converted once,
    here, so that no program copies weights per call. Concrete arrays are stacked by one jitted copy
    (placed like the per-layer arrays when `shardings` are given); `jax.ShapeDtypeStruct`s (AOT
    compilation) keep their shardings, with the stacked axis replicated."""
    if layers == "unrolled":
        if not is_stacked(params):
            return params
        return jax.jit(lambda p: unstack_layers(p, config))(params)
    if is_stacked(params):
        return params
    check_scannable(config)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
        return stack_layers(params, config)
    out = None if shardings is None else stack_layers(shardings.for_params(params), config)
    return jax.jit(lambda p: stack_layers(p, config), out_shardings=out)(params)


def runtime_for(runtime: Runtime | None, shardings) -> Runtime:
    """The engine's runtime: the one given (default `Runtime()`), on the shardings' mesh and rules."""
    runtime = runtime if runtime is not None else Runtime()
    if not isinstance(runtime, Runtime):
        raise ValueError(f"runtime must be a dgemma_jax.Runtime; got {type(runtime).__name__}")
    if shardings is None:
        return runtime
    if runtime.mesh is None:   # the execution choices given, on the shardings' placement (its mesh and rules)
        return runtime.replace(mesh=shardings.mesh, rules=shardings.rules)
    if runtime.mesh != shardings.mesh or runtime.rules != tuple(shardings.rules):
        raise ValueError("the runtime's mesh and rules differ from the shardings': build it with "
                         "shardings.runtime(...) or leave its mesh unset")
    return runtime
