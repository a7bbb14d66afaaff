"""How a program runs, as one explicit, frozen value: the `Runtime`.

`ModelConfig` says what the checkpoint computes; a `Runtime` says how this program computes it:
the platform it is compiled for, the mesh and logical-axis rules it is laid out on, the MoE
dispatch, the attention kernel and key block, and rematerialisation. The engine and the trainer
build one and pass it to every pass explicitly (a static argument of their jits); model code reads
only what it is given, so a call shows everything it will trace. Without a mesh every placement
helper below is the identity and the model math never depends on one.

    rt = Runtime()                                   # this process's default backend, one device
    rt = Runtime(platform="tpu", mesh=mesh, rules=rules_for("latency"), moe_dispatch="ragged")
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dgemma_jax.config import RUNTIME_CHOICES
from dgemma_jax.axis_rules import axes_of, check_rules, spec_for

MOE_DISPATCH = ("auto", "dense", "ragged", "capacity", "gmm")
ATTN_KERNELS = ("auto", "xla", "pallas")
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
LAYER_LAYOUTS = ("auto", "unrolled", "scan")
COMMIT_PASSES = ("auto", "fused", "separate")
# what Runtime(layers="auto") runs per platform. XLA:CPU runs the unrolled step faster
# (benchmarks/results/scan_layers.json); on TPU the scan compiles in about half the time but each call
# moves 1.02-1.25x the unrolled program's HBM bytes (benchmarks/results/compile_time.json): a program
# that runs for long (the library's, a server's) stays unrolled
LAYER_DEFAULTS = {"cpu": "unrolled", "gpu": "unrolled", "cuda": "unrolled", "rocm": "unrolled", "tpu": "unrolled"}
# what each entry point runs on TPU when left to "auto" (docs/tpu.md, "Which layout each entry point
# runs"): the scan where the compile time it saves at a cold start outweighs its per-call cost over
# the life of the persistent compilation cache (a one-shot command; a Colab session, whose cache goes
# with it), unrolled where the programs run for hours (a server; training; the library's default)
ENTRY_LAYERS = {"generate": "scan", "chat": "scan", "notebook": "scan", "serve": "unrolled"}




def resolve_layers(layers: str, platform: str, entry: str | None = None) -> str:
    """The one place the layer layout "auto" becomes "unrolled" or "scan": for entry point `entry`
    ("generate", "chat", "serve", "notebook", ...; None = the library) on `platform`, `ENTRY_LAYERS`
    on TPU, the platform's default (`LAYER_DEFAULTS`) elsewhere and for the library. An explicit
    layout is returned as it is. `Runtime` resolves its own `layers` with it when built, so a program
    and the model's passes only ever see a concrete layout (parameters and caches are converted to it
    where they enter the engine, `engine.placement.layers_for`)."""
    if layers not in LAYER_LAYOUTS:
        raise ValueError(f"layers={layers!r} is invalid: must be one of {LAYER_LAYOUTS}")
    if layers != "auto":
        return layers
    if platform == "tpu" and entry is not None:
        return ENTRY_LAYERS.get(entry, LAYER_DEFAULTS["tpu"])
    return LAYER_DEFAULTS.get(platform, "unrolled")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Execution choices (none of them part of the checkpoint). Hashable: a static jit argument.

    platform: the backend programs are compiled for (default: this process's default backend; "tpu"
      when compiling ahead of time for a TPU topology from a CPU machine).
    mesh, rules: the device mesh and the logical-axis rule set (`axis_rules.rules_for`: pairs or a
      mapping, checked against the mesh: an unknown logical or mesh axis is an error); None / () =
      one device, no placement constraints.
    moe_dispatch: "auto" (capacity buffers on CPU, grouped matmuls elsewhere: on TPU the Pallas kernel
      for int4 experts, `dispatch`), "dense", "ragged", "capacity" or "gmm" (the Pallas grouped-matmul
      kernel, model/gmm.py; off TPU in Pallas's interpreter; in bfloat16 projected slower than "ragged"
      on the 26B's serving tick, so "auto" keeps "ragged" there).
      moe_capacity_factor, moe_shard_rows_factor: their buffer sizes.
    attn_kernel: how the denoiser's canvas attends to the cache where the mask allows: "auto" = the
      fused Pallas kernel (model/flash.py) when compiling for TPU, XLA elsewhere; "xla"; "pallas" =
      the kernel on any backend (interpreted off TPU).
    attn_key_block: keys per block when attending over a longer key set (blocks merged by
      log-sum-exp, so no score array larger than one block is live).
    attn_fixed_blocks: attend over key blocks of `attn_key_block` keys always, even where one block
      would hold them all (what batch invariance needs: a row's blocks are then the same whatever the
      cache length its batch gets, and the blocks beyond its keys add exact zeros, `Engine`'s
      `batch_invariant`).
    remat: recompute each block in the backward pass (training memory).
    commit_pass: how `generate_fused` commits a canvas: "fused" = in one pass over the layers with the
      next canvas's first step (`loop.commit_and_step`: the weights read once for both, so the commit
      costs its FLOPs only where a step is bound by reading them; the first canvas's step carries a
      commit of no tokens); "separate" = its own causal pass (`generate.canvas_end`); "auto" = "fused"
      on an accelerator, "separate" on CPU, where a pass is bound by its FLOPs and the fused one
      would add the first canvas's empty commit to every call (`fuse_commit`). The server's tick
      (`slots.slot_tick`) follows it too: its committing tick writes the owed canvases in its step's
      pass, or (separate; and always with per-row LoRA adapters) with the commit's pass before it.
    layers: how the layers are laid out in the program (`model.scanned`, `model.layout`): "unrolled" (one traced
      block per layer), "scan" (a `lax.scan` over the repeated layer group, 5 sliding + 1 global on
      the 26B: one group compiled instead of 30 layers; parameters and cache stacked per group
      position) or "auto", resolved when the Runtime is built, for the platform it is built with
      (`resolve_layers`: `LAYER_DEFAULTS`, "unrolled" everywhere), so `layers` reads "unrolled" or
      "scan" afterwards and the model never decides. The entry points resolve "auto" for themselves
      on TPU (`resolve_layers(..., entry=)`, `ENTRY_LAYERS`); the measurements behind that table are
      in benchmarks/results/compile_time.json and docs/tpu.md. The engine converts its parameters
      and caches to this layout once, where they enter it; parameters in the other layout handed
      straight to the model's passes are converted inside the program (a copy).
    observer: an object with `kernel_call(name, flops)`, told of every fused kernel call as it is
      traced (the perf reports count the FLOPs compilers do not see); compared by identity.
    """

    platform: str | None = None
    mesh: Mesh | None = None
    rules: tuple = ()
    moe_dispatch: str = "auto"
    moe_capacity_factor: float = 1.25
    moe_shard_rows_factor: float = 1.25
    attn_kernel: str = "auto"
    attn_key_block: int = 4096
    attn_fixed_blocks: bool = False
    remat: bool = False
    observer: Any = None
    layers: str = "auto"
    commit_pass: str = "auto"

    def __post_init__(self):
        if self.platform is None:
            object.__setattr__(self, "platform", jax.default_backend())

        def bad(field, value, why):
            raise ValueError(f"Runtime.{field}={value!r} is invalid: {why}")

        if self.platform not in PLATFORMS:
            bad("platform", self.platform, f"must be one of {PLATFORMS}")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            bad("mesh", self.mesh, "must be a jax.sharding.Mesh (see dgemma_jax.parallel.make_mesh) or None")
        # normalized and checked: a typo in a rule is an error naming it, not a silently replicated dimension
        object.__setattr__(self, "rules", check_rules(self.rules, self.mesh, where="Runtime.rules"))
        if self.moe_dispatch not in MOE_DISPATCH:
            bad("moe_dispatch", self.moe_dispatch, f"must be one of {MOE_DISPATCH}")
        for f in ("moe_capacity_factor", "moe_shard_rows_factor"):
            if not getattr(self, f) > 0:
                bad(f, getattr(self, f), "must be > 0")
        if not (isinstance(self.attn_key_block, int) and not isinstance(self.attn_key_block, bool)
                and self.attn_key_block >= 1):
            bad("attn_key_block", self.attn_key_block, "must be a positive int")
        if self.attn_kernel not in ATTN_KERNELS:
            bad("attn_kernel", self.attn_kernel, f"must be one of {ATTN_KERNELS}")
        if not isinstance(self.attn_fixed_blocks, bool):
            bad("attn_fixed_blocks", self.attn_fixed_blocks, "must be True or False")
        if not isinstance(self.remat, bool):
            bad("remat", self.remat, "must be True or False")
        if self.layers not in LAYER_LAYOUTS:
            bad("layers", self.layers, f"must be one of {LAYER_LAYOUTS}")
        if self.commit_pass not in COMMIT_PASSES:
            bad("commit_pass", self.commit_pass, f"must be one of {COMMIT_PASSES}")
        # "auto" resolved here, once (`resolve_layers`): `layers` is always "unrolled" or "scan" after this
        object.__setattr__(self, "layers", resolve_layers(self.layers, self.platform))

    def replace(self, **changes) -> "Runtime":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived choices
    def dispatch(self, int4: bool = False) -> str:
        """The MoE dispatch strategy to run: `moe_dispatch`, or what "auto" stands for on this platform:
        "capacity" on CPU; on TPU the grouped-matmul kernel ("gmm") for int4 expert kernels (`int4`), which
        it reads as stored (XLA's grouped matmul sums their groups through HBM in float32: the 26B's
        one-chip int4 tick projects 76.0 -> 43.2 ms with the kernel, docs/tpu.md), else "ragged"."""
        if self.moe_dispatch != "auto":
            return self.moe_dispatch
        if self.platform == "cpu":
            return "capacity"
        return "gmm" if int4 and self.platform == "tpu" else "ragged"

    def fuse_commit(self) -> bool:
        """Whether `generate_fused` and the server's tick commit a canvas in one pass with the next
        step (`commit_pass`)."""
        if self.commit_pass != "auto":
            return self.commit_pass == "fused"
        return self.platform != "cpu"

    @property
    def kernel_interpreted(self) -> bool:
        """Pallas kernels run in the interpreter off TPU."""
        return self.platform != "tpu"

    def use_kernel(self) -> bool:
        """Whether the attention kernel is wanted where its mask allows (see `attn_kernel`)."""
        return self.attn_kernel == "pallas" or (self.attn_kernel == "auto" and self.platform == "tpu")

    def local(self) -> "Runtime":
        """The same choices without placement: what runs inside a per-shard (`shard_map`) body."""
        return self if self.mesh is None else self.replace(mesh=None, rules=())

    def kernel_call(self, name: str, flops: float) -> None:
        if self.observer is not None:
            self.observer.kernel_call(name, flops)

    def observed_times(self, times: float) -> "Runtime":
        """This runtime with its observer told `times` x each kernel call's FLOPs: a call traced once in
        a loop body that runs n times (times = n), or in each of n branches of which one runs (1 / n)."""
        if self.observer is None or times == 1:
            return self
        return self.replace(observer=_Times(self.observer, times))

    # ------------------------------------------------------------------ placement
    def shards(self, size: int, logical: str) -> int:
        """How many pieces a dimension of `size` named `logical` is split into on this mesh (1 without one)."""
        if self.mesh is None:
            return 1
        axes = self.spec((size,), (logical,))[0]
        return math.prod(self.mesh.shape[a] for a in axes_of(axes))

    def spec(self, shape: tuple, logical: tuple) -> PartitionSpec:
        """The mesh axes of an array of `shape` whose axes have the logical names `logical`: the one
        place logical names become mesh axes (the rules; a dimension they do not divide stays
        whole). Needs a mesh."""
        if self.mesh is None:
            raise ValueError("this Runtime has no mesh: placement needs one (Runtime(mesh=...), or Shardings)")
        return spec_for(shape, logical, self.rules, self.mesh)

    def sharding(self, shape: tuple, logical: tuple) -> NamedSharding:
        """`spec` as a NamedSharding on the mesh."""
        return NamedSharding(self.mesh, self.spec(shape, logical))

    def constrain(self, x: jax.Array, logical: tuple) -> jax.Array:
        """Pin x's sharding to the mesh axes its logical axis names map to (identity without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(x.shape, logical))


def split_choices(fields: dict) -> tuple[dict, dict]:
    """(ModelConfig fields, Runtime choices) of a dict that may mix both: a recipe's
    `model.overrides`, or a config stored by a version whose ModelConfig held the choices."""
    model = {k: v for k, v in fields.items() if k not in RUNTIME_CHOICES}
    return model, {k: v for k, v in fields.items() if k in RUNTIME_CHOICES}


class _Times:
    """An observer wrapper: each kernel call's FLOPs times `times` (`Runtime.observed_times`)."""

    def __init__(self, observer, times: float):
        self.observer, self.times = observer, times

    def kernel_call(self, name: str, flops: float) -> None:
        self.observer.kernel_call(name, flops * self.times)
