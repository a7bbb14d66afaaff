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
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dgemma_jax.config import RUNTIME_CHOICES
from dgemma_jax.parallel.rules import CACHE_AXES, check_rules, spec_for

MOE_DISPATCH = ("auto", "dense", "ragged", "capacity")
ATTN_KERNELS = ("auto", "xla", "splash")
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
LAYER_LAYOUTS = ("auto", "unrolled", "scan")
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


# Activations up to about this many bytes the TPU compiler keeps on chip between the ops of a layer;
# larger ones go through HBM, and some of the layer's code is written differently for them
# (`moe.dispatch_ragged`'s sum, `Runtime.expert_parallel`'s all-reduce). Measured on the 26B's serving
# tick for v6e-8: a [tokens, hidden] float32 of 23 MB (8 slots) stayed on chip, 92 MB (32 slots) did
# not; the line between is not measured.
ON_CHIP_BYTES = 32 * 2 ** 20


def layers_for_entry(entry: str, platform: str) -> str:
    """The layer layout entry point `entry` ("generate", "chat", "serve", "notebook", ...) runs on
    `platform` when the user leaves it to "auto": `ENTRY_LAYERS` on TPU, the platform's default elsewhere."""
    if platform == "tpu":
        return ENTRY_LAYERS.get(entry, LAYER_DEFAULTS["tpu"])
    return LAYER_DEFAULTS.get(platform, "unrolled")


class DenseBeside(NamedTuple):
    """A dense MLP that runs beside the experts (`Runtime.expert_parallel`): its input x [N, D], its
    kernels by name (plain or int8 pairs), their logical axes by name, and mlp(x, **kernels) -> [N, D]."""

    x: jax.Array
    kernels: dict
    axes: dict
    mlp: Callable


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Execution choices (none of them part of the checkpoint). Hashable: a static jit argument.

    platform: the backend programs are compiled for (default: this process's default backend; "tpu"
      when compiling ahead of time for a TPU topology from a CPU machine).
    mesh, rules: the device mesh and the logical-axis rule set (`parallel.rules.rules_for`: pairs or a
      mapping, checked against the mesh: an unknown logical or mesh axis is an error); None / () =
      one device, no placement constraints.
    moe_dispatch: "auto" (capacity buffers on CPU, grouped matmuls elsewhere), "dense", "ragged"
      or "capacity" (model/moe.py). moe_capacity_factor, moe_shard_rows_factor: their buffer sizes.
    attn_kernel: how the denoiser's canvas attends to the cache where the mask allows: "auto" = the
      fused Pallas kernel (model/flash.py) when compiling for TPU, XLA elsewhere; "xla"; "splash" =
      the kernel on any backend (interpreted off TPU).
    attn_key_block: keys per block when attending over a longer key set (blocks merged by
      log-sum-exp, so no score array larger than one block is live).
    remat: recompute each block in the backward pass (training memory).
    layers: how the layers are laid out in the program (`model.layout`): "unrolled" (one traced
      block per layer), "scan" (a `lax.scan` over the repeated layer group, 5 sliding + 1 global on
      the 26B: one group compiled instead of 30 layers; parameters and cache stacked per group
      position) or "auto" = the platform's default (`LAYER_DEFAULTS`: "unrolled" everywhere). The
      entry points pick their own on TPU (`ENTRY_LAYERS`, `layers_for_entry`); the measurements behind
      that table are in benchmarks/results/compile_time.json and docs/tpu.md.
      The engine converts its parameters and caches to this layout once; the model itself runs
      stacked parameters scanned and unrolled ones unrolled under "auto", and converts (a copy
      inside the program) when the layout is named explicitly and differs from the parameters'.
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
    remat: bool = False
    observer: Any = None
    layers: str = "auto"

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
        if not isinstance(self.remat, bool):
            bad("remat", self.remat, "must be True or False")
        if self.layers not in LAYER_LAYOUTS:
            bad("layers", self.layers, f"must be one of {LAYER_LAYOUTS}")

    def replace(self, **changes) -> "Runtime":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived choices
    @property
    def dispatch(self) -> str:
        """The MoE dispatch strategy "auto" stands for on this platform."""
        if self.moe_dispatch != "auto":
            return self.moe_dispatch
        return "capacity" if self.platform == "cpu" else "ragged"

    @property
    def layer_layout(self) -> str:
        """The layer layout "auto" stands for on this platform (`LAYER_DEFAULTS`)."""
        if self.layers != "auto":
            return self.layers
        return LAYER_DEFAULTS.get(self.platform, "unrolled")

    @property
    def kernel_interpreted(self) -> bool:
        """Pallas kernels run in the interpreter off TPU."""
        return self.platform != "tpu"

    def use_kernel(self) -> bool:
        """Whether the attention kernel is wanted where its mask allows (see `attn_kernel`)."""
        return self.attn_kernel == "splash" or (self.attn_kernel == "auto" and self.platform == "tpu")

    def local(self) -> "Runtime":
        """The same choices without placement: what runs inside a per-shard (`shard_map`) body."""
        return self if self.mesh is None else self.replace(mesh=None, rules=())

    def kernel_call(self, name: str, flops: float) -> None:
        if self.observer is not None:
            self.observer.kernel_call(name, flops)

    # ------------------------------------------------------------------ placement
    def shards(self, size: int, logical: str) -> int:
        """How many pieces a dimension of `size` named `logical` is split into on this mesh (1 without one)."""
        if self.mesh is None:
            return 1
        axes = spec_for((size,), (logical,), self.rules, self.mesh)[0]
        return math.prod(self.mesh.shape[a] for a in _axes(axes))

    def constrain(self, x: jax.Array, logical: tuple) -> jax.Array:
        """Pin x's sharding to the mesh axes its logical axis names map to (identity without a mesh)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(
            x, NamedSharding(self.mesh, spec_for(x.shape, logical, self.rules, self.mesh)))

    def expert_parallel(self, fn, z, weights, experts, gate_up, down, adapters=None, dense=None):
        """Run the MoE dispatch `fn` per shard: each device serves only the experts it holds and the
        outputs are summed over those mesh axes.

        fn(rt, z, weights, experts, gate_up, down, adapters, offset=, shards=) -> [N, D] float32 partial
        output for the local experts [offset, offset + E_local). `adapters` (per-expert LoRA pairs,
        every leaf [E, ., .], or None) are split over the experts exactly like the kernels. Tokens (z
        [N, D], weights / experts [N, k]) are split like the batch and replicated over the model axes,
        so no expert weight ever moves (with FSDP the weights' `embed` dimension is gathered per layer,
        as for every FSDP layer). Each expert is whole on one shard (gate_up [E, D, 2F] keeps gate and
        up side by side). gate_up / down may be int8 pairs {"int8", "scale"} (every leaf [E, ., .]):
        split over the experts like float kernels. Without a mesh this is just `fn(...)` with all experts local.

        dense: optional `DenseBeside`, a dense MLP that runs beside the experts (Gemma 4's parallel
        dense and MoE branches). Where the dense kernels' hidden units are split over exactly
        the experts' mesh axes (and nothing else is split), the dense MLP runs inside the same
        per-shard body on its hidden-unit slices and both partial outputs are summed in one all-reduce
        (one collective per layer instead of two: each costs a latency on the inter-chip links); then
        this returns (experts' output, dense output). Elsewhere (no mesh, FSDP, other splits) it
        returns (experts' output, None) and the caller runs the dense MLP as any layer.
        """
        if self.mesh is None:
            y = fn(self, z, weights, experts, gate_up, down, adapters)
            return y if dense is None else (y, None)
        mesh, rules = self.mesh, self.rules
        tok = _axes(spec_for(z.shape[:1], ("batch",), rules, mesh)[0])
        n_experts = jax.tree.leaves(gate_up)[0].shape[0]  # a float kernel, or an int8 pair's values and scales
        ex = tuple(a for a in _axes(spec_for((n_experts,), ("experts",), rules, mesh)[0]) if a not in tok)
        dense_specs = None if dense is None else self._dense_beside_experts(dense.kernels, dense.axes, ex)
        if dense is not None and dense_specs is None:  # the caller's, partitioned by XLA
            return self.expert_parallel(fn, z, weights, experts, gate_up, down, adapters), None
        if not (tok or ex):
            return fn(self, z, weights, experts, gate_up, down, adapters)
        shards = 1
        for a in ex:
            shards *= mesh.shape[a]
        e_local = n_experts // shards
        inner = self.local()  # no logical constraints inside the per-shard body

        def body(z, weights, experts, gate_up, down, adapters, dense_x, dense_kernels):
            index = jnp.zeros((), jnp.int32)
            for a in ex:
                index = index * mesh.shape[a] + jax.lax.axis_index(a)
            y = fn(inner, z, weights, experts, gate_up, down, adapters, offset=index * e_local, shards=shards)
            if dense_kernels is None:
                return jax.lax.psum(y, ex) if ex else y
            # this shard's hidden units give a partial sum too: both reduced as one array, one
            # all-reduce (XLA keeps two psums, or one psum of a tuple, as two collectives on TPU);
            # in the activation dtype, as XLA:TPU reduces the experts' float32 partial anyway
            # past ON_CHIP_BYTES stacked on a new leading axis, not side by side: concatenated along the
            # hidden axis, the compiler laid the reduced [N, 2D] out column-major (the concatenation then
            # free) and every layer copied both halves back to row-major, in float32, for the norms after
            # it; below, the concatenation stays on chip and the stack would be written out
            yd = dense.mlp(dense_x, **dense_kernels)
            if 2 * yd.size * yd.dtype.itemsize > ON_CHIP_BYTES:
                both = jax.lax.psum(jnp.stack([y.astype(yd.dtype), yd]), ex)
                return both[0], both[1]
            both = jax.lax.psum(jnp.concatenate([y.astype(yd.dtype), yd], axis=-1), ex)
            return both[:, :y.shape[-1]], both[:, y.shape[-1]:]

        t = _spec(tok)
        kernel = P(_spec(ex), None, None)
        rows = P(t, None)
        dense_x, dense_kernels = (None, None) if dense is None else (dense.x, dense.kernels)
        return jax.shard_map(
            body, mesh=mesh, check_vma=False,
            in_specs=(rows, rows, rows, _kernel_specs(gate_up, kernel), _kernel_specs(down, kernel),
                      None if adapters is None else jax.tree.map(lambda _: kernel, adapters),
                      None if dense is None else rows, dense_specs),
            out_specs=rows if dense is None else (rows, rows))(
                z, weights, experts, gate_up, down, adapters, dense_x, dense_kernels)

    def _dense_beside_experts(self, kernels, axes, ex):
        """The per-shard in_specs of a dense MLP's kernels when they can run inside the experts'
        body: every leaf split only along its "mlp" dimension and over exactly the mesh axes `ex`
        (then each shard's output is a partial sum over `ex`, like the experts'); else None."""
        if not ex:
            return None
        specs = {}
        for name, kernel in kernels.items():
            logical = axes[name]
            leaf_specs = []
            for leaf in jax.tree.leaves(kernel):
                spec = spec_for(leaf.shape, logical, self.rules, self.mesh)
                entries = tuple(spec) + (None,) * (leaf.ndim - len(spec))
                for entry, name_ in zip(entries, logical):
                    if entry is not None and (name_ != "mlp" or set(_axes(entry)) != set(ex)):
                        return None
                if leaf.shape[logical.index("mlp")] > 1 and entries[logical.index("mlp")] is None:
                    return None  # the hidden units replicated: no partial sum to add
                leaf_specs.append(spec)
            specs[name] = jax.tree.unflatten(jax.tree.structure(kernel), leaf_specs)
        return specs

    def head_parallel(self, fn, q, k, v, valid):
        """Run the attention kernel `fn(q, k, v, valid, rt=) -> (out, lse)` per head shard.

        q [B, T, N, H]; k, v [B, S, K, H] (cache layout); valid [B, S]. A Pallas kernel is one opaque
        call the partitioner cannot split, so on a mesh it runs inside a `shard_map` over the batch
        and head axes, each device on its own query heads and the KV heads they read. Returns None
        when the layout does not allow it (query and KV heads split over different mesh axes, or the
        cache split along its slots or head_dim): the caller then keeps the XLA path. Without a mesh
        this is just `fn(...)`.
        """
        if self.mesh is None:
            return fn(q, k, v, valid, rt=self)
        mesh, rules = self.mesh, self.rules
        qs = spec_for(q.shape, ("batch", None, "heads", None), rules, mesh)
        ks = spec_for(k.shape, CACHE_AXES, rules, mesh)
        if ks[1] is not None or ks[3] is not None or _axes(qs[0]) != _axes(ks[0]) or _axes(qs[2]) != _axes(ks[2]):
            return None
        inner = self.local()
        return jax.shard_map(
            lambda q, k, v, valid: fn(q, k, v, valid, rt=inner), mesh=mesh, check_vma=False,
            in_specs=(qs, ks, ks, P(qs[0], None)),
            out_specs=(qs, P(qs[0], None, qs[2])))(q, k, v, valid)


def _kernel_specs(tree, kernel: P):
    """in_specs of an expert kernel's tree: every [E, ., .] leaf split like `kernel`; the scalar group
    index of a scanned layer's per-group kernel (`model.layout.PerGroup`) replicated."""
    return jax.tree.map(lambda x: kernel if x.ndim else P(), tree)


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec(axes: tuple):
    if not axes:
        return None
    return axes if len(axes) != 1 else axes[0]


def split_choices(fields: dict) -> tuple[dict, dict]:
    """(ModelConfig fields, Runtime choices) of a dict that may mix both: a recipe's
    `model.overrides`, or a config stored by a version whose ModelConfig held the choices."""
    model = {k: v for k, v in fields.items() if k not in RUNTIME_CHOICES}
    return model, {k: v for k, v in fields.items() if k in RUNTIME_CHOICES}
