"""Ahead-of-time compilation for TPU topologies from a CPU machine ("compile-and-fit").

With `jax[tpu]` installed, jax builds compile-only TPU devices for a named topology. We lower the
engine's programs with every argument a `jax.ShapeDtypeStruct` carrying its sharding (nothing is
allocated), compile them with the TPU compiler, and read per-chip memory and cost:

    report = compile_report("diffusiongemma-26b-a4b", "v5e-8", mesh="expert=8", context=32768)

Per-step figures come from the step program and per-canvas projections multiply by the step count.
Projections use the roofline of shared/spec/performance.md: time = max(flops / peak, bytes /
bandwidth), with the bytes the program moves through HBM (`hbm_traffic`: cost_analysis's byte count
also includes reads of what the compiler staged on chip; both are reported). `flops` is the
compiled HLO's matrix products with every loop counted per trip (`hlo_flops.dot_flops`:
cost_analysis counts a loop body once, so a scanned program's or the vocabulary-chunked head's
`compiler_flops` undercount), a loop of skipped blocks (the ragged MoE's per-shard blocks) one
trip (`hlo_dot_flops_upper_bound` counts them all), plus the Pallas kernels' FLOPs, which no
compiler count sees: those are counted from the kernels' traced shapes (`kernel_flops`). A kernel
is one opaque call: its operands and results are its HBM traffic, i.e. the projection assumes it
streams them once at HBM bandwidth. `flops_ratio` holds `flops` against the step's useful FLOPs
(`perf.roofline`).

What is compiled is the engine's own programs (`Engine.programs`, `Engine.fused_program`), built
with a `Runtime` for the TPU platform on the topology's mesh: the same jits a TPU user runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from dgemma_jax.backends import quiet_libtpu_load
from dgemma_jax.config import ModelConfig, VisionConfig
from dgemma_jax.engine import Engine
from dgemma_jax.engine.programs import compiled_memory
from dgemma_jax.io.images import BOI_TOKEN_ID, EOI_TOKEN_ID, IMAGE_TOKEN_ID, ImageSettings
from dgemma_jax.model.api import param_shapes
from dgemma_jax.model.layout import stack_layers, unstack_layers
from dgemma_jax.model.quant import quantized_shapes
from dgemma_jax.parallel.mesh import make_mesh
from dgemma_jax.parallel.shardings import Shardings
from dgemma_jax.perf import roofline
from dgemma_jax.perf import collectives as coll
from dgemma_jax.perf.compiled import cost
from dgemma_jax.perf.hbm_traffic import hbm_traffic
from dgemma_jax.perf.hlo_flops import dot_flops
from dgemma_jax.perf.memory_peak import compile_with_peak
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.generate import canvas_start
from dgemma_jax.sampling.loop import RowKnobs, init_state, row_keys
from dgemma_jax.sampling.slots import idle_slots
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.objective import ObjectiveConfig
from dgemma_jax.training.optim import make_optimizer
from dgemma_jax.training.step import LoraSpec, init_train_state, make_rl_update, make_train_step


PROJECTION_LABEL = ("projection from the TPU compiler (the compiled HLO's matrix-product FLOPs, loops counted per "
                    "trip, plus the Pallas kernels'; the compiled program's HBM traffic, a Pallas kernel's operands "
                    "and results moved once at HBM bandwidth), not a measurement")


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str                 # jax topology descriptor, e.g. "v5e:2x4"
    chip_config: str
    host_bounds: tuple[int, int, int]
    chips: int
    hbm_bytes: float          # per chip, as the compiler counts it
    hbm_bw: float             # bytes/s per chip
    bf16_flops: float         # peak FLOP/s per chip
    ici_bytes_per_s: float = 0.0  # bidirectional inter-chip bandwidth per chip (all its ports)
    ici_ports: int = 4

    @property
    def ring_bytes_per_s(self) -> float:
        """One bidirectional ring's bandwidth through a chip: one port's share (`perf.collectives`)."""
        return self.ici_bytes_per_s / self.ici_ports


# user-facing name -> topology descriptor (performance.md §1 for bandwidth and peak; ICI: the bidirectional
# inter-chip bandwidth per chip and its ports from the Cloud TPU system architecture pages; v4: not priced)
TOPOLOGIES: dict[str, Topology] = {
    "v5e-1": Topology("v5e:1x1", "default", (1, 1, 1), 1, 15.75e9, 819e9, 197e12, 400e9, 4),
    "v5e-4": Topology("v5e:2x2", "default", (2, 2, 1), 4, 15.75e9, 819e9, 197e12, 400e9, 4),
    "v5e-8": Topology("v5e:2x4", "default", (2, 4, 1), 8, 15.75e9, 819e9, 197e12, 400e9, 4),
    "v5e-16": Topology("v5e:4x4", "default", (2, 2, 1), 16, 15.75e9, 819e9, 197e12, 400e9, 4),
    "v6e-1": Topology("v6e:1x1", "default", (1, 1, 1), 1, 31.25e9, 1640e9, 918e12, 800e9, 4),
    "v6e-4": Topology("v6e:2x2", "default", (2, 2, 1), 4, 31.25e9, 1640e9, 918e12, 800e9, 4),
    "v6e-8": Topology("v6e:2x4", "default", (2, 4, 1), 8, 31.25e9, 1640e9, 918e12, 800e9, 4),
    "v6e-16": Topology("v6e:4x4", "default", (2, 2, 1), 16, 31.25e9, 1640e9, 918e12, 800e9, 4),
    "v5p-8": Topology("v5:2x2x1", "megacore", (2, 2, 1), 4, 95.74e9, 2765e9, 459e12, 1200e9, 6),
    "v5p-16": Topology("v5:2x2x2", "megacore", (2, 2, 1), 8, 95.74e9, 2765e9, 459e12, 1200e9, 6),
    "v4-8": Topology("v4:2x2x1", "megacore_dense", (2, 2, 1), 4, 31.75e9, 1200e9, 275e12),
    "v4-16": Topology("v4:2x2x2", "megacore_dense", (2, 2, 1), 8, 31.75e9, 1200e9, 275e12),
}


def topology(name: str) -> Topology:
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown TPU topology {name!r}; known: {', '.join(TOPOLOGIES)}")
    return TOPOLOGIES[name]


def tpu_devices(name: str):
    """Compile-only devices of the named topology (needs the `[tpu]` extra: jax[tpu])."""
    topo = topology(name)
    # compile-only use: several processes may load libtpu at once (no chips are claimed)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies  # deferred: it probes for libtpu, needed only for a TPU compile
    except ImportError as e:  # pragma: no cover
        raise RuntimeError("jax.experimental.topologies is unavailable in this jax") from e
    try:
        with quiet_libtpu_load():  # no libtpu probing lines on a machine without a TPU
            desc = topologies.get_topology_desc(platform="tpu", topology_name=topo.name,
                                                chip_config_name=topo.chip_config,
                                                chips_per_host_bounds=topo.host_bounds, num_slices=1,
                                                wrap=(False, False, False))
    except Exception as e:
        raise RuntimeError(f"cannot build compile-only TPU devices for {name} ({topo.name}): {e}. "
                           "Install the TPU extra: pip install -e '.[tpu]'") from e
    return desc.devices


def _abstract(tree, shardings):
    return jax.tree.map(lambda s, n: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=n), tree, shardings)


def abstract_params(config: ModelConfig, shardings, quantize: str | None = None):
    """The parameters as sharded ShapeDtypeStructs: float, or with int8 kernels (`model.quant`)."""
    if quantize is None:
        return _abstract(param_shapes(config), shardings.params)
    shapes = quantized_shapes(config, quantize)
    return _abstract(shapes, shardings.for_params(shapes))


def with_released_vision(config: ModelConfig) -> ModelConfig:
    """`config` with the released checkpoint's vision tower (spec: 27 layers, width 1152, patch 16,
    pooling 3, standardized) and image ids, unless it has a tower already."""
    if config.vision is not None:
        return config
    return config.replace(vision=VisionConfig(standardize=True), image_token_id=IMAGE_TOKEN_ID,
                          boi_token_id=BOI_TOKEN_ID, eoi_token_id=EOI_TOKEN_ID)


def program_inputs(config: ModelConfig, sampler, shardings, batch: int, context: int, prompt: int,
                   quantize: str | None = None, images: int = 0, layers: str = "unrolled"):
    """ShapeDtypeStructs (with shardings) for every program argument; quantize: "int8" params;
    images: that many images at the released processor's default budget (280 soft tokens) for the
    "prefill_images" program; layers: the parameters' and cache's layer layout ("unrolled" or
    "scan", `model.layout`)."""
    rep = shardings.replicated
    rep_tree = lambda t: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), t)  # noqa: E731
    params = abstract_params(config, shardings, quantize)
    if layers == "scan":
        params = stack_layers(params, config)
    cache = _abstract(shardings.cache_shape(batch, context, layers), shardings.cache(batch, context, layers))
    keys = rep_tree(jax.eval_shape(lambda: row_keys(jax.random.key(0), batch)))
    state = rep_tree(jax.eval_shape(
        lambda: init_state(config, sampler, jnp.zeros((batch, sampler.canvas_length), jnp.int32))))
    tokens = jax.ShapeDtypeStruct((batch, prompt), jnp.int32, sharding=rep)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    canvas = jax.ShapeDtypeStruct((batch, sampler.canvas_length), jnp.int32, sharding=rep)
    active = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=rep)
    # the server's slot programs (sampling/slots.py): per-row canvas numbers and sampler knobs, one prompt
    vec = lambda dtype, *shape: jax.ShapeDtypeStruct((batch,) + shape, dtype, sharding=rep)  # noqa: E731
    knobs = rep_tree(RowKnobs.shapes(batch, sampler.max_denoising_steps))
    slots_state = rep_tree(jax.eval_shape(lambda: idle_slots(config, sampler, batch)))
    slot = dict(canvas_index=vec(jnp.int32), last=active, knobs=knobs, state=slots_state,
                slot=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                tokens=jax.ShapeDtypeStruct((1, prompt), jnp.int32, sharding=rep),
                length=jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep),
                start=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                max_ticks=jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
                seed=canvas, pinned=jax.ShapeDtypeStruct(canvas.shape, jnp.bool_, sharding=rep), hold=active)
    pictures = None
    if images:
        v, per = config.vision, ImageSettings().max_patches
        pictures = (jax.ShapeDtypeStruct((images, per, v.patch_dim), jnp.float32, sharding=rep),
                    jax.ShapeDtypeStruct((images, per, 2), jnp.int32, sharding=rep))
    next_canvas = rep_tree(jax.eval_shape(lambda: canvas_start(config, sampler, row_keys(jax.random.key(0), batch), 0)))
    return dict(params=params, cache=cache, keys=keys, state=state, tokens=tokens, lengths=lengths, images=pictures,
                canvas=canvas, active=active, slot=slot, next_canvas=next_canvas)


class KernelFlops:
    """A runtime observer (`Runtime.observer`) adding up the FLOPs of the fused kernel calls traced
    with it: compilers' cost analyses see a Pallas kernel as an opaque call and count none of its work."""

    def __init__(self):
        self.flops = 0.0

    def kernel_call(self, name: str, flops: float) -> None:
        del name
        self.flops += flops


def engine_programs(engine: Engine, max_new_tokens: int) -> dict:
    """The engine's own jitted programs by report name, each with a function mapping
    `program_inputs` to its (positional, keyword) arguments."""
    programs = engine.programs
    prefill_slot, slot_tick = programs.prefill_slot, programs.slot_tick
    return {
        "slot_tick": (slot_tick,
                      lambda a: ((a["params"],), dict(cache=a["cache"], state=a["slot"]["state"], keys=a["keys"],
                                                      canvas_index=a["slot"]["canvas_index"], begin=a["active"],
                                                      active=a["active"], last=a["slot"]["last"],
                                                      keep=a["slot"]["last"], knobs=a["slot"]["knobs"],
                                                      max_ticks=a["slot"]["max_ticks"], seed=a["slot"]["seed"],
                                                      pinned=a["slot"]["pinned"], hold=a["slot"]["hold"],
                                                      end=a["slot"]["hold"], commit=a["active"],
                                                      commit_tokens=a["canvas"]))),
        "prefill_slot": (prefill_slot,
                         lambda a: ((a["params"],), dict(cache=a["cache"], slot=a["slot"]["slot"],
                                                         tokens=a["slot"]["tokens"], length=a["slot"]["length"],
                                                         start=a["slot"]["start"]))),
        "prefill_slot_images": (prefill_slot,
                                lambda a: ((a["params"],), dict(cache=a["cache"], slot=a["slot"]["slot"],
                                                                tokens=a["slot"]["tokens"],
                                                                length=a["slot"]["length"],
                                                                start=a["slot"]["start"], images=a["images"]))),
        "prefill": (programs.prefill,
                    lambda a: ((a["params"],), dict(tokens=a["tokens"], lengths=a["lengths"], cache=a["cache"]))),
        "prefill_images": (programs.prefill,
                           lambda a: ((a["params"],), dict(tokens=a["tokens"], lengths=a["lengths"], cache=a["cache"],
                                                           images=a["images"]))),
        "denoise_step": (programs.denoise_step,
                         lambda a: ((a["params"],), dict(cache=a["cache"], context_end=a["cache"].lengths,
                                                         keys=a["keys"], state=a["state"]))),
        "commit": (programs.commit,
                   lambda a: ((a["params"],), dict(cache=a["cache"], tokens=a["canvas"], active=a["active"]))),
        "commit_step": (programs.commit_step,
                        lambda a: ((a["params"],), dict(cache=a["cache"], tokens=a["canvas"], active=a["active"],
                                                        canvas=a["next_canvas"]))),
        "generate": (engine.fused_program(max_new_tokens),
                     lambda a: ((a["params"],), dict(prompt_tokens=a["tokens"], prompt_lengths=a["lengths"],
                                                     cache=a["cache"], keys=a["keys"]))),
    }


def _lora_training_inputs(config: ModelConfig, shardings, batch: int, prompt: int, num_canvases: int, rank: int,
                          groups):
    """(optimizer, schedule, abstract train state of rank-`rank` adapters, abstract frozen base, abstract
    batch of SFT's layout) for a LoRA step on `shardings`: the base FSDP/tensor/expert-sharded, adapters
    and optimizer state replicated (they are small), the batch split over data/fsdp."""
    rep = shardings.replicated
    frozen = _abstract(param_shapes(config), shardings.params)
    adapters = jax.eval_shape(lambda p: lora_lib.init_lora(config, p, jax.random.key(0), rank, groups),
                              param_shapes(config))
    optimizer, schedule = make_optimizer()
    state = jax.eval_shape(lambda a: init_train_state(a, optimizer, 0), adapters)
    state = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), state)
    t = prompt + num_canvases * config.canvas_length
    data = {"tokens": (batch, t), "lengths": (batch,), "prompt_lengths": (batch,), "num_canvases": (batch,)}
    data = {k: jax.ShapeDtypeStruct(v, jnp.int32, sharding=shardings.named(v, ("batch",) + (None,) * (len(v) - 1)))
            for k, v in data.items()}
    return optimizer, schedule, state, frozen, data


def lora_step_program(config: ModelConfig, shardings, batch: int, prompt: int, num_canvases: int, rank: int = 16,
                      groups=("attention", "mlp"), runtime: Runtime | None = None):
    """(jitted LoRA train step, abstract args) for `config` on `shardings` (the "training" rules).

    The base weights are frozen and FSDP/tensor/expert-sharded; adapters and optimizer state are
    replicated (they are small); the batch is split over data/fsdp. runtime: default, the shardings'
    mesh compiled for TPU; remat is always on (one layer's activations kept, not all 30).
    """
    runtime = (runtime or shardings.runtime(platform="tpu")).replace(remat=True)
    optimizer, schedule, state, frozen, data = _lora_training_inputs(config, shardings, batch, prompt, num_canvases,
                                                                     rank, groups)
    obj = ObjectiveConfig(canvas_length=config.canvas_length)
    step = make_train_step(config, obj, optimizer, schedule=schedule, lora=LoraSpec(rank, 2.0 * rank, tuple(groups)),
                           runtime=runtime)
    return step, (state, frozen, data)


# GRPO's update as `dgemma compile --programs rl_step` compiles it: the RL recipe's defaults
# (recipe.RLSection) except num_samples, 1 so the likelihood's scan over (sample, canvas) draws runs
# once per canvas and cost_analysis (which counts a loop body once) counts the whole update
RL_STEP_DEFAULTS = dict(num_samples=1, updates=1, clip_eps=0.2, kl_beta=0.04, t_eps=1e-3)


def rl_step_program(config: ModelConfig, shardings, batch: int, prompt: int, num_canvases: int, rank: int = 16,
                    groups=("attention", "mlp"), runtime: Runtime | None = None, **rl):
    """(jitted GRPO LoRA update `step.make_rl_update`, abstract args) on a rollout batch of `batch` rows
    (prompts x group size) laid out as SFT's plus "advantages" [batch]; rl: `RL_STEP_DEFAULTS`'s keys.

    The reference is the frozen base (LoRA: adapters off), so the update scores the rows three times
    (policy, rollout policy, reference: one shared rng) and differentiates the policy's. Shardings and
    remat as `lora_step_program`'s."""
    unknown = set(rl) - set(RL_STEP_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown RL step option(s) {sorted(unknown)}; known: {', '.join(RL_STEP_DEFAULTS)}")
    opts = {**RL_STEP_DEFAULTS, **rl}
    runtime = (runtime or shardings.runtime(platform="tpu")).replace(remat=True)
    optimizer, schedule, state, frozen, data = _lora_training_inputs(config, shardings, batch, prompt, num_canvases,
                                                                     rank, groups)
    data["advantages"] = jax.ShapeDtypeStruct((batch,), jnp.float32, sharding=shardings.named((batch,), ("batch",)))
    step = make_rl_update(config, optimizer, num_canvases=num_canvases, lora=LoraSpec(rank, 2.0 * rank, tuple(groups)),
                          num_samples=int(opts["num_samples"]), t_eps=float(opts["t_eps"]),
                          clip_eps=float(opts["clip_eps"]), kl_beta=float(opts["kl_beta"]),
                          updates=int(opts["updates"]), schedule=schedule, runtime=runtime)
    return step, (state, frozen, None, data)


def _cost(compiled) -> dict:
    return {k: v for k, v in cost(compiled).items() if k in ("flops", "bytes_accessed")}


def compile_report(preset: str | ModelConfig, topology_name: str, mesh: str | None = None, rules: str = "latency",
                   batch: int = 1, context: int = 32768, prompt: int = 2048, steps_per_canvas: int = 16,
                   programs=("prefill", "denoise_step", "commit_step", "generate"), dtype: str | None = None,
                   moe_dispatch: str = "auto", attn_kernel: str = "auto", sampler=None, devices=None,
                   max_new_tokens: int | None = None, progress=None, quantize: str | None = None,
                   hop_latency_s: float = coll.DEFAULT_HOP_LATENCY_S, images: int = 0,
                   layers: str = "auto", compiler_options: dict[str, str] | None = None,
                   explain_memory: int = 0, rl: dict | None = None,
                   param_formats: str = "default") -> dict[str, Any]:
    """Lower and compile the engine's programs for a TPU topology; per-chip memory, cost, projections.

    context: KV cache capacity (prompt + committed canvases). prompt: tokens in one prefill call.
    moe_dispatch, attn_kernel, layers: the `Runtime` choices the programs are compiled with (for TPU;
    layers "scan": the repeated layer group compiled once and scanned, `model.layout`).
    quantize: "int8" compiles the programs for weight-only int8 parameters (`model.quant`).
    images: compile with the released vision tower (`with_released_vision`) in the parameters, and
    "prefill_images" (a program in `programs`) with that many images of 280 soft tokens in the prompt.
    Every program's collectives are listed and priced on the slice's ICI (`perf.collectives`, with
    `hop_latency_s` per ring step); projections are given without them, with them run after the
    HBM-bound work (`..._with_ici`), and with them hidden under it (`..._ici_overlapped`).
    compiler_options: XLA options for the TPU compile ({"xla_tpu_...": "true"}), passed to
    `.compile(compiler_options=...)` and recorded in the report; an option XLA does not know is a
    ValueError naming it.
    explain_memory: N > 0 adds each program's memory peak as XLA's buffer assignment gives it
    (`perf.memory_peak.read_peak`: bytes by parameters / temporaries / outputs and the N largest
    buffers live at the peak with the op that made each) as the entry's "memory_peak".
    rl: options of the "rl_step" program (GRPO's LoRA update on `batch` rollout rows, `rl_step_program`;
    `RL_STEP_DEFAULTS` for the rest). With "rl_step" and the rollout's programs (prefill, denoise_step,
    commit) the report's "rl" block projects one RL step: the rollout (prefill + canvases x (steps x
    denoise_step + commit)) plus the update.
    param_formats: "default" (the parameters in the default layouts, as `Engine` places them) or
    "compiler", as `dgemma serve` runs on a TPU (`serving.runner.SlotRunner`): "slot_tick" if asked for,
    else the first program, compiled with its parameters (its first argument) in the layouts the TPU
    compiler prefers (`Engine.with_param_formats`, `Layout.AUTO`; the other inputs and the donation as
    the engine's), and the other programs for those layouts (the engine's own programs, given
    parameters in them), so that it makes no relayout copy of a weight at its start (a temporary, and
    HBM traffic at every call).
    progress: optional callable(name, index, count, seconds, entry) called before each program
    (seconds and entry None) and after it (its compile seconds and report entry).
    Returns a JSON-able dict; `fits` is False when any program exceeds the chip's HBM.
    """
    cfg = preset if isinstance(preset, ModelConfig) else ModelConfig.preset(preset)
    if dtype:
        cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    if images:
        cfg = with_released_vision(cfg)
        if prompt < images * (ImageSettings().max_soft_tokens + 2):
            raise ValueError(f"a prompt of {prompt} tokens cannot hold {images} image(s) of "
                             f"{ImageSettings().max_soft_tokens} soft tokens and their markers: raise prompt")
    elif "prefill_images" in programs or "prefill_slot_images" in programs:
        raise ValueError("the prefill_images and prefill_slot_images programs need images >= 1")
    topo = topology(topology_name)
    devs = devices if devices is not None else tpu_devices(topology_name)
    sampler = sampler or SamplerConfig.for_model(cfg, max_denoising_steps=48)
    if context < prompt + sampler.canvas_length:
        raise ValueError(f"context {context} must hold the prompt ({prompt}) plus a canvas ({sampler.canvas_length})")
    max_new_tokens = max_new_tokens or max(sampler.canvas_length, context - prompt)
    if mesh is None:  # every chip on the model: whole experts, heads, vocab all split len(devs) ways
        mesh = f"expert={len(devs)}"
    sh = Shardings(cfg, make_mesh(mesh, devices=devs), rules)
    runtime = sh.runtime(platform="tpu", moe_dispatch=moe_dispatch, attn_kernel=attn_kernel, layers=layers)
    args = program_inputs(cfg, sampler, sh, batch, context, prompt, quantize, images, runtime.layers)
    if param_formats not in ("default", "compiler"):
        raise ValueError(f"param_formats={param_formats!r} is invalid: 'default' or 'compiler'")
    report: dict[str, Any] = {
        "param_formats": param_formats,
        "preset": cfg.name, "topology": topology_name, "chips": len(devs), "mesh": dict(sh.mesh.shape),
        "rules": rules, "batch": batch, "context": context, "prompt": prompt, "dtype": cfg.param_dtype,
        "moe_dispatch": runtime.dispatch(int4=quantize == "int4"), "attn_kernel": attn_kernel, "layers": runtime.layers,
        "hbm_limit_bytes": topo.hbm_bytes, "programs": {}, "fits": True,
        "quantize": quantize, "images": images, "compiler_options": dict(compiler_options or {}),
        "vision_param_bytes": roofline.tree_bytes({k: v for k, v in args["params"].items()
                                                   if k in ("vision_tower", "embed_vision")}),
        "param_bytes_total": roofline.tree_bytes(args["params"]),
        "ici": {"bidirectional_bytes_per_s_per_chip": topo.ici_bytes_per_s, "ports": topo.ici_ports,
                "ring_bytes_per_s": topo.ring_bytes_per_s or None, "hop_latency_s": hop_latency_s,
                "model": "ring algorithms over one port's bandwidth; see dgemma_jax/perf/collectives.py"},
    }
    chosen = None   # param_formats="compiler": the parameters' formats the first program chose
    if param_formats == "compiler":   # the server's tick chooses (serving.runner), when it is compiled
        programs = tuple(sorted(programs, key=lambda n: n != "slot_tick"))
    for index, name in enumerate(programs):
        lower = None   # param_formats="compiler": the first program's lowering with Layout.AUTO parameters
        if progress is not None:
            progress(name, index, len(programs), None, None)
        kernels = KernelFlops()  # a fresh observer: a fresh trace of this program
        observed = runtime.replace(observer=kernels)
        if name in ("lora_step", "rl_step") and quantize is not None:
            raise ValueError(f"{name} compiles the float training step; drop quantize for it")
        if name in ("lora_step", "rl_step") and param_formats != "default":
            raise ValueError(f"{name} is not an engine program: param_formats='compiler' applies to those only")
        if name == "lora_step":
            fn, pos = lora_step_program(cfg, sh, batch, prompt, max(1, (context - prompt) // cfg.canvas_length),
                                        runtime=observed)
            kw = {}
        elif name == "rl_step":
            fn, pos = rl_step_program(cfg, sh, batch, prompt, max(1, (context - prompt) // cfg.canvas_length),
                                      runtime=observed, **(rl or {}))
            kw = {}
        else:
            engine = Engine(cfg, args["params"], sampler, shardings=sh, runtime=observed,
                            compilation_cache=False)   # the caller decides (dgemma compile: off, or --save DIR)
            fn, make_args = engine_programs(engine, max_new_tokens)[name]
            pos, kw = make_args(args)
            if param_formats == "compiler" and chosen is None:
                # the first program picks the layouts (Layout.AUTO), as the server's tick does
                lower = functools.partial(engine.lower_in_compiler_layouts, fn, kw)
            elif param_formats == "compiler":   # the others compile for its layouts (the parameters' own)
                pos = (jax.tree.map(lambda s, f: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=f), pos[0], chosen),
                       *pos[1:])
        entry: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            lowered = lower()[0] if lower is not None else fn.lower(*pos, **kw)
            if explain_memory > 0:
                compiled, entry["memory_peak"] = compile_with_peak(lowered, compiler_options, explain_memory)
            else:
                compiled = lowered.compile(compiler_options=dict(compiler_options or {}) or None)
            if lower is not None:
                chosen = compiled.input_formats[0][0]   # the other programs compile for these
                report["param_formats_from"] = name
        except Exception as e:  # the TPU compiler reports a program that does not fit
            msg = str(e)
            if "No such compile option" in msg:
                raise ValueError(f"{msg.strip().splitlines()[-1]}: XLA does not know it; check the name of the "
                                 "compiler option (e.g. xla_tpu_...)") from None
            if "RESOURCE_EXHAUSTED" not in msg and "exceeds available HBM" not in msg:
                raise
            entry.update(fits=False, error=msg.strip().splitlines()[-1][:400])
            if getattr(e, "memory_peak", None) is not None:  # --explain-memory: what the refused program held
                entry["memory_peak"] = e.memory_peak
            report["fits"] = False
            report["programs"][name] = entry
            if progress is not None:
                progress(name, index, len(programs), time.perf_counter() - t0, entry)
            continue
        entry["compile_seconds"] = round(time.perf_counter() - t0, 2)
        mem = compiled_memory(compiled)
        total = mem.pop("total_bytes")
        entry.update(memory=mem, total_bytes=total, fits=total <= topo.hbm_bytes, **_cost(compiled))
        # FLOPs: the compiled HLO's matrix products with every loop counted per trip (`hlo_flops.dot_flops`;
        # cost_analysis counts a loop body once), plus the Pallas kernels' (the cache-attention kernel,
        # model/flash.py; the grouped matmul, model/gmm.py), which no compiler count sees: counted from the
        # shapes they were traced with
        hlo_text = compiled.as_text()
        dots = dot_flops(hlo_text)
        entry["kernel_flops"] = kernels.flops
        entry["compiler_flops"] = entry["flops"]
        entry["hlo_dot_flops"] = dots["flops"]
        entry["hlo_dot_flops_upper_bound"] = dots["flops_upper_bound"]
        entry["hlo_dot_flops_by_scope"] = {k: v for k, v in dots["by_scope"].items() if v >= 0.01 * dots["flops"]}
        entry["uncounted_loops"] = dots["uncounted_loops"]
        entry["skipped_block_loops"] = len(dots["skipped_block_loops"])
        entry["flops"] = dots["flops"] + kernels.flops
        traffic = hbm_traffic(hlo_text)
        entry["hbm_bytes"] = traffic["total"]
        entry["hbm_bytes_by_op"] = {k: v for k, v in traffic["by_op"].items() if v >= 1e6}
        entry["hbm_bytes_by_scope"] = {k: v for k, v in traffic["by_scope"].items() if v >= 1e6}
        # bandwidth is spent on HBM traffic; cost_analysis also counts on-chip (VMEM) reads
        entry["projected_seconds"] = max(entry["flops"] / topo.bf16_flops, entry["hbm_bytes"] / topo.hbm_bw)
        entry["projected_seconds_cost_analysis_bytes"] = max(entry["flops"] / topo.bf16_flops,
                                                             entry["bytes_accessed"] / topo.hbm_bw)
        _add_collectives(entry, hlo_text, len(devs), topo, hop_latency_s)
        report["fits"] &= entry["fits"]
        report["programs"][name] = entry
        if progress is not None:
            progress(name, index, len(programs), time.perf_counter() - t0, entry)
    for name in ("denoise_step", "slot_tick"):   # one denoising step over `batch` rows each (a tick: per loop trip)
        if "flops" in report["programs"].get(name, {}):
            _add_efficiency(report["programs"][name], cfg, sh, topo, batch, context, args["params"])
    report["steps_per_canvas"], report["canvas_length"] = steps_per_canvas, sampler.canvas_length
    report["rl_options"] = {**RL_STEP_DEFAULTS, **(rl or {})} if "rl_step" in programs else None
    _add_projections(report)
    return report


def combine_reports(reports: list[dict]) -> dict:
    """One report from `compile_report`s of the same model, topology, mesh and shapes that compiled
    different programs (e.g. one process per program, each saved as it finishes): their programs
    together, the projections recomputed over them."""
    if not reports:
        raise ValueError("no reports to combine")
    same = ("preset", "topology", "mesh", "rules", "batch", "context", "prompt", "dtype", "moe_dispatch", "layers",
            "quantize", "steps_per_canvas", "canvas_length")
    first = reports[0]
    for r in reports[1:]:
        differ = [k for k in same if r.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"reports differ in {', '.join(differ)}: they compiled different things")
    out = {k: v for k, v in first.items() if k not in ("projection", "rl")}
    out["programs"] = {}
    for r in reports:
        out["programs"].update(r["programs"])
        out["rl_options"] = out.get("rl_options") or r.get("rl_options")
    out["fits"] = all(e.get("fits", False) for e in out["programs"].values())
    _add_projections(out)
    return out


def _add_projections(report: dict) -> None:
    """The report's "projection" (per canvas: steps_per_canvas denoise steps and a commit, from the
    compiled denoise_step and commit; where "commit_step" was compiled, the commit in one pass with a
    step as `generate_fused` runs it on an accelerator: steps_per_canvas - 1 steps and that pass) and
    "rl" (`_rl_projection`), from its programs' entries."""
    step = report["programs"].get("denoise_step", {})
    steps_per_canvas, canvas_length, batch = report["steps_per_canvas"], report["canvas_length"], report["batch"]
    commit = report["programs"].get("commit", {})
    fused = "projected_seconds" in report["programs"].get("commit_step", {})
    steps = steps_per_canvas
    if fused:   # the commit pass and one step are the one commit_step pass
        commit, steps = report["programs"]["commit_step"], steps_per_canvas - 1
    if "projected_seconds" in step:
        per_canvas = steps * step["projected_seconds"] + commit.get("projected_seconds", 0.0)
        per_canvas_ici = (steps * step.get("projected_seconds_with_ici", step["projected_seconds"])
                          + commit.get("projected_seconds_with_ici", commit.get("projected_seconds", 0.0)))
        report["projection"] = {
            "label": PROJECTION_LABEL,
            "steps_per_canvas": steps_per_canvas,
            "commit": "with a step, one pass (commit_step)" if fused else "its own pass (commit)",
            "denoise_step_ms": 1e3 * step["projected_seconds"],
            "denoise_step_ici_ms": 1e3 * step.get("ici_seconds", 0.0),
            "denoise_step_ms_with_ici": 1e3 * step.get("projected_seconds_with_ici", step["projected_seconds"]),
            "denoise_step_ms_ici_overlapped": 1e3 * step.get("projected_seconds_ici_overlapped",
                                                              step["projected_seconds"]),
            "roofline_step_ms": 1e3 * step.get("roofline_floor_seconds", float("nan")),
            "per_canvas_ms": 1e3 * per_canvas,
            "per_canvas_ms_with_ici": 1e3 * per_canvas_ici,
            "tokens_per_second": canvas_length / per_canvas if per_canvas else None,
            "tokens_per_second_with_ici": canvas_length / per_canvas_ici if per_canvas_ici else None,
            # every row (a server's slot) refines its own canvas in the same step
            "rows": batch,
            "tokens_per_second_all_rows": batch * canvas_length / per_canvas if per_canvas else None,
        }
    if "projected_seconds" in report["programs"].get("rl_step", {}):
        report["rl"] = _rl_projection(report)
        report["fits"] &= report["rl"]["fits"]


def _rl_projection(report: dict) -> dict:
    """One GRPO step's projected time: the rollout of `batch` rows (one prefill of the prompt, then per
    canvas steps_per_canvas denoise steps and a commit) and the update (`rl_step`); with the
    collectives run after the HBM-bound work too (`..._with_ici`). The rollout's part is None when its
    programs were not compiled. With generate compiled, whether it fits beside the training state
    (the update's arguments: the frozen base, adapters, moments), which the trainer keeps meanwhile."""
    progs, proj = report["programs"], report.get("projection")
    prompt = report["prompt"]
    canvases = max(1, (report["context"] - prompt) // report["canvas_length"])
    update = progs["rl_step"]
    out: dict[str, Any] = {
        "label": PROJECTION_LABEL, "options": report["rl_options"], "rows": report["batch"],
        "prompt_tokens": prompt, "canvases": canvases, "canvas_length": report["canvas_length"],
        "update_seconds": update["projected_seconds"],
        "update_seconds_with_ici": update.get("projected_seconds_with_ici", update["projected_seconds"]),
        "rollout_seconds": None, "step_seconds": None,
    }
    prefill = progs.get("prefill", {})
    if proj is not None and "projected_seconds" in prefill:
        out["steps_per_canvas"] = proj["steps_per_canvas"]
        out["rollout_seconds"] = prefill["projected_seconds"] + canvases * proj["per_canvas_ms"] / 1e3
        out["rollout_seconds_with_ici"] = (prefill.get("projected_seconds_with_ici", prefill["projected_seconds"])
                                           + canvases * proj["per_canvas_ms_with_ici"] / 1e3)
        out["step_seconds"] = out["rollout_seconds"] + out["update_seconds"]
        out["step_seconds_with_ici"] = out["rollout_seconds_with_ici"] + out["update_seconds_with_ici"]
    gen = progs.get("generate", {})
    if "total_bytes" in gen:
        # the rollout runs while the training state lives on: the frozen base, the adapters and their
        # moments (the update's arguments) beside generate's own (its merged parameters and cache)
        held = update["memory"]["argument_size_in_bytes"] + gen["total_bytes"]
        out["rollout_with_training_state_bytes"] = held
        out["rollout_with_training_state_fits"] = held <= report["hbm_limit_bytes"]
    out["fits"] = (all(progs[n].get("fits", False) for n in progs)
                   and out.get("rollout_with_training_state_fits", True))
    return out


def _add_collectives(entry: dict, hlo_text: str, chips: int, topo: Topology, hop_latency_s: float):
    """The program's collectives (`perf.collectives`) and, where the topology's ICI is known, their time."""
    items = coll.collectives(hlo_text, chips)
    entry["collectives"] = items
    entry["collectives_by_kind"] = coll.summary(items)
    if not topo.ring_bytes_per_s:
        return
    ici = coll.ici_seconds(items, topo.ring_bytes_per_s, hop_latency_s)
    entry["ici"] = ici
    entry["ici_seconds"] = ici["seconds"]
    entry["projected_seconds_with_ici"] = entry["projected_seconds"] + ici["seconds"]
    entry["projected_seconds_ici_overlapped"] = max(entry["projected_seconds"], ici["seconds"])


def _add_efficiency(entry: dict, cfg: ModelConfig, sh, topo: Topology, batch: int, context: int, params=None):
    """The step's counted FLOPs and bytes against what it must do (perf/roofline.py); params: the
    (abstract) parameters compiled, whose bytes the step must read (int8 kernels: one byte a weight)."""
    chips = sh.mesh.devices.size
    useful = roofline.denoise_step_flops(cfg, batch, context) / chips
    if params is not None:  # the requirement is read per layer: stacked (a scanned program's) parameters unstacked
        params = unstack_layers(params, cfg)
    need = roofline.denoise_step_bytes_per_chip(cfg, sh, batch, context, params)
    floor = max(useful / topo.bf16_flops, need["total"] / topo.hbm_bw)
    entry.update(useful_flops=useful, required_bytes=need["total"], required_param_bytes=need["params"],
                 required_cache_bytes=need["cache"], flops_ratio=entry["flops"] / useful,
                 bytes_ratio=entry["bytes_accessed"] / need["total"], hbm_bytes_ratio=entry["hbm_bytes"] / need["total"],
                 roofline_floor_seconds=floor)


def fix_hint(report: dict) -> str:
    return (f"{report['preset']} does not fit on {report['topology']} with mesh {report['mesh']} at context "
            f"{report['context']}: use more chips (a larger slice), a mesh that splits more of the model "
            "(every chip on the model axes, e.g. expert=8 rather than data=2,expert=4), a shorter --context, "
            "or a smaller --batch")
