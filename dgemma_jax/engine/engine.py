"""The engine: a model and a sampler with their compiled programs (`Engine`), and `generate`.

The engine owns every compiled program that runs the model for generation (`jax.jit`, buffer
donation, shardings, AOT compilation); the other jit sites compile no generation program (the
trainer's steps, the checked one-call passes of `model/api.py`, quantizing, allocating, the
load-time finite check: the list `tests/test_layers.py` keeps). Everything it runs is the pure code
of `dgemma_jax.model` and `dgemma_jax.sampling`, given the engine's `Runtime` (mesh and rules,
platform, MoE dispatch, attention kernel) as a static argument: one code path with or without a mesh.

    engine = Engine(config, params, SamplerConfig(...))
    out = engine.generate(prompt_tokens, lengths, rng=0, max_new_tokens=512)
    for event in engine.stream(prompt_tokens, lengths, rng=0, max_new_tokens=512): ...
"""

from __future__ import annotations

import copy
import functools
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax import compile_cache
from dgemma_jax.config import ModelConfig
from dgemma_jax.engine import drivers
from dgemma_jax.engine import infill as infill_driver
from dgemma_jax.engine import rows as rows_lib
from dgemma_jax.engine import structured as structured_driver
from dgemma_jax.engine.inputs import (bucket_length, canvas_length_warning, check_images, check_images_host,
                                      check_sampler, prepare_inputs)
from dgemma_jax.engine.outputs import report_nonfinite, reporting
from dgemma_jax.engine.placement import layers_for, runtime_for
from dgemma_jax.engine.programs import ProgramCache, Programs
from dgemma_jax.errors import DgemmaWarning
from dgemma_jax.model import api
from dgemma_jax.model.cache import KVCache, cache_row, concat_rows, init_cache, ring_limit
from dgemma_jax.model.layers import dtype_of
from dgemma_jax.model.masks import image_runs
from dgemma_jax.model.quant import mode_for, quantization_of, quantize_params
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import generate as gen
from dgemma_jax.sampling import slots as slots_lib
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import Canvas, denoise_step, row_keys


# the keys per attention block of the batch-invariant programs per platform (None: any other;
# `Runtime.attn_fixed_blocks`)
INVARIANT_KEY_BLOCK = {"cpu": 64, None: 512}
# the most rows the default (`batch_invariant=True`) runs in one program where rows share programs: a
# longer call runs in blocks of this many rows and one of the rest, so its memory stays bounded
INVARIANT_MAX_ROWS = 64


def rows_share_programs(config: ModelConfig, runtime: Runtime) -> bool:
    """Whether `batch_invariant=True` runs a call's rows as one program (else each row as its own 1-row
    program). Prefill chunks and fixed key blocks make a row's numbers independent of the other rows'
    prompt widths and cache lengths by construction; independence of the row count is measured, not
    built in: on XLA:CPU with float32 activations (float32, int8 and int4 weights) no row's tokens
    changed with it in any model tried, with bfloat16 activations most did
    (benchmarks/results/batch_invariance_configs.json). So: one device, a CPU, float32 activations."""
    return (runtime.platform == "cpu" and runtime.mesh is None
            and jnp.dtype(dtype_of(config.dtype)) == jnp.dtype(jnp.float32))


def _sharding_of(a) -> jax.sharding.Sharding:
    """Where an engine's array lives: its own sharding (an array's, or an AOT ShapeDtypeStruct's), or the
    default device for a host (numpy) array."""
    return getattr(a, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])


class Engine:
    """A model + sampler with compiled programs (built lazily, cached per input shape).

    shardings: optional `dgemma_jax.parallel.Shardings` placing params, cache and activations on a
    mesh; without it everything runs on the default device.
    runtime: how the programs run (`dgemma_jax.Runtime`: platform, MoE dispatch, attention kernel,
    ...); default `Runtime()`. The shardings' mesh and rules are filled in when it has no mesh.
    donate: give the caches the engine makes to its programs, in place (False: never donate). A
    cache you pass to `generate` is donated only with `generate(..., donate_cache=True)`.
    bucket: pad prompt widths and derived cache lengths up to `bucket_length` (default), so that
    prompts of different lengths reuse a few compiled programs instead of compiling one per length;
    the outputs agree up to the order of floating-point sums. False compiles for the exact shapes given.
    quantize: "int8" or "int4" quantizes float `params` on construction (`model.quant.quantize_params`:
    weight-only expert, attention and MLP kernels, placed like the float ones when `shardings` are
    given); "auto" picks the first of none / int8 / int4 whose weights fit the devices' memory
    (`model.quant.resolve_quantize`; nothing on the CPU); params already quantized are passed as they
    are, without it (or with "auto"). None or "none" (default): run `params` as given.
    batch_invariant (also `DiffusionGemma(batch_invariant=)`): a prompt with its seed (its key from the
    seed alone, `row_keys`) gets the same tokens from `generate`, `stream` and `steps` whatever else is
    in the call (its size, order, the prompt's position, the other prompts' lengths;
    tests/test_batch_invariance.py and tests/test_batch_blocks.py on XLA:CPU, float32 and int8), and
    the same tokens under every batched setting (True where it batches, any N > 1). Where rows share
    a program, no shape a row's numbers depend on comes from the other rows: the prompt
    prefilled in canvas-length chunks (`prefill_chunk`), attention over fixed key blocks
    (`gen_runtime`, `Runtime.attn_fixed_blocks`) in a cache of whole key blocks
    (`invariant_cache_length`), so that a row's numbers do not depend on the block's widest prompt
    or longest cache (`_blocks`). True (default): on one CPU device with float32 activations the
    rows of a call that start new caches run as one block of exactly their number (one program
    call, up to `INVARIANT_MAX_ROWS` rows a block; a prompt alone a 1-row program; a batch of 8
    costs at most about 1.1x the non-invariant batched program, docs/api.md), where a row's
    independence of the row count was measured (`rows_share_programs`); elsewhere (bfloat16, an
    accelerator, a mesh) row by row: each prompt its own program shaped by itself (invariant by
    construction; a batch costs about the sum of its rows). An int N > 1: blocks of exactly N rows
    (a short block filled with copies of its first row; any dtype and device): one compiled program
    for any batch size up to N, a prompt alone paying N rows; N = 1: row by row. A row with images
    runs alone, shaped by itself; rows continuing a caller's cache go together by its length.
    False: one program for the whole batch (rows padded to the longest prompt, one softmax over the
    keys, no prefill chunks): the fastest batches, and a row's tokens can change with the rest of
    the batch (float rounding, then the sampler).
    compilation_cache: True (default) turns jax's persistent compilation cache on
    (`dgemma_jax.compile_cache.enable`: JAX_COMPILATION_CACHE_DIR, else a directory already set in
    jax.config, else ~/.cache/dgemma_jax/xla), a string names the directory, False leaves jax's
    setting alone.
    programs: the `ProgramCache` holding this engine's jitted programs; default `ProgramCache.shared`,
    so that engines with equal configs, samplers and runtimes reuse each other's compiled programs.
    adapters: LoRA adapters run unmerged beside the base (float32 (x A) B), as the model's "lora"
    collection: one adapter every row runs (`training.adapters.single`), or with
    `adapter_rows=True` adapters stacked behind the zero adapter (`training.adapters.stack`), which
    the server's rows pick one each (`params_for`). None (default): the programs are the base's.
    """

    def __init__(self, config: ModelConfig, params: Any, sampler: SamplerConfig | None = None, *,
                 shardings: Any | None = None, runtime: Runtime | None = None, donate: bool = True,
                 bucket: bool = True, quantize: str | None = None,
                 compilation_cache: bool | str = True, batch_invariant: bool | int = True,
                 programs: "ProgramCache | None" = None, adapters: Any | None = None,
                 adapter_rows: bool = False):
        if compilation_cache:
            compile_cache.enable(None if compilation_cache is True else compilation_cache)
        self.config = config
        devices = shardings.mesh.devices.flat if shardings is not None else None
        quantize = mode_for(config, quantize, quantization_of(params), devices)
        if quantize is not None:
            params = quantize_params(config, params, quantize)
            if shardings is not None:
                params = shardings.place_params(params)
        self.runtime = runtime_for(runtime, shardings)
        self.params = layers_for(config, params, self.runtime.layers, shardings)
        self.adapter_rows = bool(adapter_rows and adapters is not None)
        if adapters is not None:  # replicated: the adapters are small
            if shardings is not None:
                adapters = jax.device_put(adapters, shardings.replicated)
            rows = jnp.zeros((1,), jnp.int32) if self.adapter_rows else None
            self.params = api.with_adapters(self.params, adapters, rows)
        self.sampler = sampler or SamplerConfig.for_model(config)
        check_sampler(config, self.sampler)
        mismatch = canvas_length_warning(config, self.sampler)
        if mismatch:
            warnings.warn(mismatch, DgemmaWarning, stacklevel=2)
        self.shardings = shardings
        self.donate = donate
        self.bucket = bool(bucket)
        if not isinstance(batch_invariant, (bool, int)) or batch_invariant < 0:
            raise ValueError(f"batch_invariant must be True, False or a block size >= 1; got {batch_invariant!r}")
        self.batch_invariant = bool(batch_invariant)
        # rows per invariant program call: None, a call's rows together; N, blocks of exactly N
        if batch_invariant is True:
            self.invariant_block = None if rows_share_programs(config, self.runtime) else 1
        else:
            self.invariant_block = int(batch_invariant) if batch_invariant else None
        # rows share invariant programs (a call's, or blocks of N): those attend in fixed key blocks
        # and prefill in chunks; a row alone in its program (row by row) runs it shaped by itself
        self.shared_rows = self.batch_invariant and self.invariant_block != 1
        self.gen_runtime = self.runtime
        if self.shared_rows:
            kb = INVARIANT_KEY_BLOCK.get(self.runtime.platform, INVARIANT_KEY_BLOCK[None])
            self.gen_runtime = self.runtime.replace(attn_fixed_blocks=True,
                                                    attn_key_block=min(kb, self.runtime.attn_key_block))
        self._program_cache = ProgramCache.shared if programs is None else programs
        self._programs = {}
        self._donated: dict = {}  # per program key: the argument names it donates
        self._bound = None

    def with_sampler(self, sampler: SamplerConfig) -> "Engine":
        """The same model with another sampler.

        Args:
          sampler: the sampler settings (checked against the config as the constructor does).
        Returns:
          an `Engine` sharing this one's weights, runtime and mesh (not copied); its programs are those
          of any engine with that sampler (the `ProgramCache`).
        """
        check_sampler(self.config, sampler)
        other = copy.copy(self)
        other.sampler, other._programs, other._bound = sampler, {}, None
        return other

    def params_for(self, rows) -> Any:
        """The parameters a program call takes for a batch whose rows run these LoRA adapters.

        Args:
          rows: each batch row's adapter index [B] (0: the base model; 1, 2, ...: the stacked adapters).
        Returns:
          the parameters with the row indices attached (`model.api.with_rows`, a copy of `rows`) when the
          engine holds stacked adapters (`adapter_rows`); else the parameters as they are.
        """
        # a copy: the caller's array (the server's slot table) changes while the program may still read it
        return api.with_rows(self.params, np.array(rows, np.int32)) if self.adapter_rows else self.params

    # ------------------------------------------------------------------ programs
    def fused_program(self, max_new_tokens: int, donate_cache: bool = True):
        """The jitted fused generate (`generate_fused`) for `max_new_tokens`.

        Args:
          max_new_tokens: the token budget the program is built for (its canvas count).
          donate_cache: give the cache argument's buffers to the program (unless the engine's `donate=False`).
        Returns:
          the jitted function, called as `generate_fused` is, with config, sampler and runtime bound.
        """
        chunk = self.prefill_chunk
        fn = functools.partial(gen.generate_fused, config=self.config, sampler=self.sampler,
                               max_new_tokens=int(max_new_tokens), runtime=self.gen_runtime, prefill_chunk=chunk)
        if not donate_cache:
            return self._program(("fused", int(max_new_tokens), chunk, "cache kept"), fn, donate=(),
                                 runtime=self.gen_runtime)
        return self._program(("fused", int(max_new_tokens), chunk), fn, runtime=self.gen_runtime)

    @property
    def prefill_chunk(self) -> int | None:
        """The tokens per prefill pass of the generation programs: with rows sharing batch-invariant
        programs a canvas's length (a row's passes then have the same shapes whatever the other rows'
        prompt lengths), else None (one pass over the padded prompts; row by row, the row's own)."""
        return self.sampler.canvas_length if self.shared_rows else None

    def _program(self, key, fn, donate=("cache",), runtime: Runtime | None = None):
        """`fn` (its static arguments, the runtime among them, bound) jitted, donating `donate` unless
        `donate=False`. Engines with equal configs, runtimes and donation share one jit (and so its
        compiled programs) per `key`, through their `ProgramCache`."""
        if key not in self._programs:
            dn = tuple(donate) if self.donate else ()
            rt = self.runtime if runtime is None else runtime
            self._programs[key] = self._program_cache.get((key, self.config, self.sampler, rt, dn),
                                                          lambda: jax.jit(fn, donate_argnames=dn))
            self._donated[key] = dn
        return self._programs[key]

    def with_param_formats(self, program, formats, kwargs: dict):
        """One of this engine's programs jitted again with its parameters in given formats (layouts).

        Args:
          program: one of this engine's jitted programs (`programs`, `fused_program`).
          formats: a `jax.experimental.layout.Format` per parameter leaf (`Layout.AUTO`: left to the compiler).
          kwargs: the program's keyword arguments (arrays or ShapeDtypeStructs keep their shardings; host
            arrays are placed as jit places them).
        Returns:
          (f, (donated, other)): f(params, donated, other) jitted, donating what `program` donated, and
          `kwargs` split into those two dicts.
        """
        key = next((k for k, fn in self._programs.items() if fn is program), None)
        if key is None:
            raise ValueError("not a program of this engine")
        raw, donated = program.__wrapped__, self._donated[key]
        give = {k: v for k, v in kwargs.items() if k in donated}
        keep = {k: v for k, v in kwargs.items() if k not in donated}
        shardings = lambda tree: jax.tree.map(lambda s: getattr(s, "sharding", None), tree)  # noqa: E731

        def run(params, give, keep):
            return raw(params, **give, **keep)

        # named as the program (its compiled name and persistent-cache key: jit_slot_tick-...)
        run.__name__ = run.__qualname__ = getattr(raw, "__name__", None) or getattr(raw, "func").__name__
        fn = jax.jit(run, in_shardings=(formats, shardings(give), shardings(keep)), donate_argnums=(1,))
        return fn, (give, keep)

    def lower_in_compiler_layouts(self, program, kwargs: dict):
        """Lower one of this engine's programs with its parameters' layouts left to the compiler
        (`Layout.AUTO`): on a TPU the weights' tiled layouts differ between programs, and a program given
        them in other layouts re-lays them out (reads and writes them) at every call.

        Args:
          program: one of this engine's jitted programs.
          kwargs: its keyword arguments (their shardings are kept, their layouts the default).
        Returns:
          (lowered, (donated, other)): the lowered f(params, donated, other) of `with_param_formats`
          and `kwargs` split as it takes them.
        """
        from jax.experimental.layout import Format, Layout  # deferred: placement only

        auto = jax.tree.map(lambda a: Format(Layout.AUTO, _sharding_of(a)), self.params)
        fn, split = self.with_param_formats(program, auto, kwargs)
        spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_sharding_of(a)), self.params)
        return fn.lower(spec, *split), split

    def compile_in_compiler_layouts(self, program, kwargs: dict):
        """Compile one of this engine's programs with its parameters in the layouts the compiler prefers
        for it (`lower_in_compiler_layouts`).

        Args:
          program: one of this engine's jitted programs.
          kwargs: its keyword arguments.
        Returns:
          (formats, compiled, call): the parameters' formats the compiler chose (a pytree of
          `jax.experimental.layout.Format`, for `place_params`), the compiled program, and
          call(params, **kwargs) running it as `program` is called (params in `formats`).
        """
        lowered, (give, keep) = self.lower_in_compiler_layouts(program, kwargs)
        compiled = lowered.compile()

        def call(params, **kw):
            return compiled(params, {k: v for k, v in kw.items() if k in give}, {k: v for k, v in kw.items() if k in keep})

        return compiled.input_formats[0][0], compiled, call

    def place_params(self, formats) -> None:
        """Lay this engine's parameters out in other memory layouts, leaf by leaf: each old array is
        freed once nothing else holds it (a caller keeping the parameters it gave the engine keeps both
        copies). Every program compiles for the layouts its arguments come in, so the engine's programs
        then take the new layouts.

        Args:
          formats: a `jax.experimental.layout.Format` per parameter leaf (e.g. from
            `compile_in_compiler_layouts`); a leaf already in its format is kept as it is.
        Returns:
          None: `params` is replaced in place.
        """
        leaves, tree = jax.tree.flatten(self.params)
        wanted = tree.flatten_up_to(formats)
        self.params = None
        for i, fmt in enumerate(wanted):
            leaf, leaves[i] = leaves[i], None
            leaves[i] = leaf if getattr(leaf, "format", None) == fmt else jax.device_put(leaf, fmt)
            del leaf
        self.params = tree.unflatten(leaves)

    def new_slots(self, slots: int) -> Canvas:
        """Idle server slots: the first state the `slot_tick` program takes.

        Args:
          slots: N, the number of slots.
        Returns:
          a `Canvas` of N idle rows (each leaf its own buffer, so the tick can take it donated; on the
          engine's mesh each slot's rows split like the cache's batch, the keys replicated).
        """
        state = slots_lib.idle_slots(self.config, self.sampler, slots)
        keys = jax.random.wrap_key_data(self.place(np.array(jax.random.key_data(state.keys)))[0])
        if self.shardings is None:
            return state.replace(state=jax.tree.map(np.array, state.state), keys=keys)
        # each slot's state with its cache row (split like the batch), as `slot_tick` returns it
        rows = jax.tree.map(lambda x: self.shardings.global_array(np.array(x), ("batch",) + (None,) * (x.ndim - 1)),
                            state.state)
        return state.replace(state=rows, keys=keys)

    @property
    def programs(self) -> "Programs":
        """The engine's jitted programs (`Programs`): one per pure function of `dgemma_jax.sampling`,
        config, sampler and runtime bound; the fused generate is `fused_program`."""
        if self._bound is None:
            cfg, rt, smp, grt = self.config, self.runtime, self.sampler, self.gen_runtime
            model = dict(config=cfg, runtime=rt)
            full = dict(model, sampler=smp)
            # the generation drivers' programs (`iter_steps`, `iter_canvases`) run the generation runtime
            gmodel = dict(config=cfg, runtime=grt)
            gfull = dict(gmodel, sampler=smp)
            program = self._program
            gen_program = functools.partial(self._program, runtime=grt)
            self._bound = Programs(
                sampler=smp,
                prefill=gen_program(("prefill", self.prefill_chunk),
                                    functools.partial(gen.prefill, chunk=self.prefill_chunk, **gmodel)),
                commit=gen_program(("commit",), functools.partial(gen.commit, **gmodel)),
                canvas_start=program(("canvas_start",), functools.partial(gen.canvas_start, config=cfg, sampler=smp),
                                     donate=()),
                denoise_step=gen_program(("denoise_step",), functools.partial(denoise_step, **gfull), donate=()),
                canvas_end=gen_program(("canvas_end",), functools.partial(gen.canvas_end, **gfull)),
                canvas_step=gen_program(("canvas_step",), functools.partial(gen.canvas_step, **gfull)),
                commit_step=gen_program(("commit_step",), functools.partial(gen.commit_and_first_step, **gfull)),
                prefill_slot=program(("prefill_slot",), functools.partial(slots_lib.prefill_slot, **model)),
                slot_tick=program(("slot_tick",), functools.partial(slots_lib.slot_tick, **full),
                                  donate=("cache", "state")),
                read_row=program(("read_row",), slots_lib.read_row, donate=()),
                write_row=program(("write_row",), slots_lib.write_row),
            )
        return self._bound

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache in the layout of the engine's programs (`Runtime.layers`), placed on its mesh.

        Args:
          batch: B rows. length: S token slots per row (prompt plus committed canvases).
        Returns:
          a `KVCache` with every row's length 0.
        """
        layers = self.runtime.layers
        if self.shardings is not None:
            return self.shardings.init_cache(batch, length, layers)
        return init_cache(self.config, batch, length, dtype_of(self.config.dtype), layers=layers)

    def place(self, *arrays):
        """Host inputs as global arrays on the engine's mesh (replicated).

        Args:
          *arrays: numpy arrays, identical on every process (or already global arrays).
        Returns:
          a tuple of global arrays (None stays None), or the inputs unchanged without shardings.
        """
        if self.shardings is None:
            return arrays
        return tuple(None if a is None else self.shardings.global_array(a) for a in arrays)

    # ------------------------------------------------------------------ running
    def generate(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
                 seed_canvas=None, pinned=None, cache_length: int | None = None,
                 cache: KVCache | None = None, images=None, donate_cache: bool = False,
                 nonfinite: str = "warn") -> gen.GenerateOutput:
        """Generate with the fused program (prefill, then every canvas in one compiled loop).

        With `batch_invariant` (the default) the rows run in fixed-size blocks whose shapes do not
        change a row's numbers, so its tokens do not depend on the rest of the batch (the class
        docstring says how and what is tested).

        Args:
          prompt_tokens: [B, P] int token ids, right-padded.
          lengths: [B] valid prompt tokens per row (default P).
          rng: an int seed (every row uses that seed's stream), a list of B int seeds (one per prompt),
            one key (every row uses its stream) or [B] keys (`row_keys`: a row's key never depends on its
            index).
          max_new_tokens: the token budget (default: one canvas, L), run as ceil(max_new_tokens / L) canvases.
          seed_canvas, pinned: [B, n * L] the first n canvases' starts and the positions held at them
            (infilling; `infill` writes a middle before a suffix with them).
          cache_length: the cache's slots per row (default: prompt plus budget).
          cache: continue an earlier cache (multi-turn chat: the prompt is then only the new tokens;
            `out.cache` of a previous call holds everything committed so far, earlier images included; rows
            run alone get caches of their own lengths, merged padded to the longest). It stays usable
            unless `donate_cache=True`, which gives its buffers to the program (your handle is deleted).
          images: the prompt's images (`dgemma_jax.io.images.preprocess_images`), one run of
            `config.image_token_id` tokens per image in the prompts, in row-major order.
          nonfinite: what a row that met NaN/Inf logits gives: "warn" (a DgemmaWarning), "raise"
            (`errors.NonFiniteLogits`) or "ignore" (no host sync; the flags stay in `out.nonfinite`).
        Returns:
          a `GenerateOutput`: tokens [B, max_new_tokens] (EOS-truncated, pad after), steps [B, C] per
          canvas, finished [B], num_canvases, the final cache, nonfinite [B].
        Raises:
          ValueError naming the bad input (token ids out of range, lengths, shapes, a cache too short).
        """
        max_new_tokens = self.sampler.canvas_length if max_new_tokens is None else max_new_tokens
        cache_given = cache
        if self.batch_invariant:
            rows = self._prepare_rows(prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                                      cache, images)
            # a row of a caller's batch>1 cache is a copy: donating it costs the caller nothing
            fn = self.fused_program(max_new_tokens, donate_cache=cache_given is None or donate_cache or len(rows) > 1)
            where, outs = [0] * len(rows), []   # where: each row's place among the blocks' rows
            for idx, (t, n, k, c, sc, pin, im) in self._blocks(rows):
                for r, i in enumerate(idx):
                    where[i] = sum(o.tokens.shape[0] for o in outs) + r
                outs.append(fn(self.params, prompt_tokens=t, prompt_lengths=n, cache=c, keys=k, seed_canvas=sc,
                               pinned=pin, images=im))
            out = rows_lib.merge_outputs(outs)
            if where != list(range(out.tokens.shape[0])):   # blocks filled up or out of the call's order
                out = rows_lib.take_rows(out, where)
            report_nonfinite(out.nonfinite, nonfinite)
            return out
        tokens, lengths, keys, cache, seed_canvas, pinned, images = self._prepare(
            prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, cache, images)
        fn = self.fused_program(max_new_tokens, donate_cache=cache_given is None or donate_cache)
        out = fn(self.params, prompt_tokens=tokens, prompt_lengths=lengths, cache=cache, keys=keys,
                 seed_canvas=seed_canvas, pinned=pinned, images=images)
        report_nonfinite(out.nonfinite, nonfinite)
        return out

    def infill(self, prompt_tokens, lengths=None, *, suffixes, rng: Any = 0, max_new_tokens: int | None = None,
               **kw):
        """The middle between each prompt (the prefix) and its suffix: the suffix pinned on the canvas
        after the middle, several middle lengths tried, the most likely kept (`engine.infill.infill`).

        Args:
          prompt_tokens: [B, P] right-padded prompts; lengths: [B] (default P).
          suffixes: B lists of suffix token ids (no BOS, at least one token each).
          rng: as `generate`. max_new_tokens: the middle's most tokens (default one canvas).
          **kw: `max_candidates` (most middle lengths tried, default 32), `middle_lengths` (the lengths
            to try instead), `nonfinite` (as `generate`).
        Returns:
          an `InfillOutput` (middles without the suffix, chosen lengths, every candidate's score).
        """
        return infill_driver.infill(self, prompt_tokens, lengths, suffixes, rng=rng, max_new_tokens=max_new_tokens, **kw)

    def generate_structured(self, prompt_tokens, lengths=None, *, grammars, rng: Any = 0,
                            max_new_tokens: int | None = None, nonfinite: str = "warn", **decoder):
        """Answers valid under a grammar (`engine.structured`: between denoising steps the grammar's fixed
        text and the canvas's valid run are pinned, the run chosen left to right from the argmax or, with
        `constraint_decoder="dingo"`, by the DP over positions x the DFA states of the regex or schema).

        Args:
          prompt_tokens: [B, P] right-padded prompts; lengths: [B] (default P).
          grammars: one `engine.grammar.Grammar` (`compile_grammar`) for every row, or one per row.
          rng, max_new_tokens, nonfinite: as `generate` (each row runs alone, with its own seed's key).
          **decoder: `constraint_decoder` ("prefix" or "dingo") and `top_k` (`structured.generate_structured`).
        Returns:
          a `StructuredOutput` (answer ids, finish reasons "stop" / "length", steps, repairs, forced tokens).
        """
        return structured_driver.generate_structured(self, prompt_tokens, lengths, grammars, rng=rng,
                                                     max_new_tokens=max_new_tokens, nonfinite=nonfinite, **decoder)

    def _prepare(self, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, cache=None,
                 images=None):
        """Validate on the host, make per-row keys and the cache, place inputs on the mesh."""
        committed = None if cache is None else np.asarray(cache.lengths)
        if cache is not None:
            cache_length = cache.max_length
        tokens, lengths, s, seed_canvas, pinned = prepare_inputs(
            self.config, self.sampler, prompt_tokens, lengths, max_new_tokens, cache_length, seed_canvas, pinned,
            committed, bucket=self.bucket)
        images = check_images(self.config, tokens, lengths, images)
        keys = row_keys(rng, tokens.shape[0])
        if cache is None:
            cache = self.new_cache(tokens.shape[0], s)
        elif cache.batch_size != tokens.shape[0]:
            raise ValueError(f"cache batch {cache.batch_size} != prompt batch {tokens.shape[0]}")
        tokens, lengths, keys, seed_canvas, pinned = self.place(tokens, lengths, keys, seed_canvas, pinned)
        if images is not None:
            images = self.place(*images)
        return tokens, lengths, keys, cache, seed_canvas, pinned, images

    def _prepare_rows(self, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                      cache=None, images=None):
        """`_prepare` for each row alone (`batch_invariant`): a list of per-row host inputs (tokens [1, W],
        lengths [1], its key as (keys, index), the length S of a new cache or its row of the caller's
        cache, seed_canvas, pinned, images), W the bucket of its own prompt length, S its own derived
        cache length in whole key blocks (`invariant_cache_length`; or the `cache_length` the caller
        gave for all rows), images the row's own
        (placed; such a row runs alone, `_blocks`). `_block` makes a program's inputs of them."""
        committed = None if cache is None else np.asarray(cache.lengths)
        if cache is not None:
            cache_length = cache.max_length
        # the whole batch checked first, so errors speak of the call's shapes
        tokens, lengths, _, seed_canvas, pinned = prepare_inputs(
            self.config, self.sampler, prompt_tokens, lengths, max_new_tokens, cache_length, seed_canvas, pinned,
            committed, bucket=False)
        b = tokens.shape[0]
        checked = check_images_host(self.config, tokens, lengths, images)
        keys = row_keys(rng, b)
        if cache is not None and cache.batch_size != b:
            raise ValueError(f"cache batch {cache.batch_size} != prompt batch {b}")
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        ends = lengths + (0 if committed is None else committed)
        n_canvas = gen.num_canvases(int(max_new_tokens), self.sampler.canvas_length)
        later = (n_canvas - 1) * self.sampler.canvas_length
        top = self.config.max_position_embeddings
        first_image = 0
        rows = []
        for i in range(b):
            # each row's shapes as `prepare_inputs` gives the row alone (the batch is checked above)
            n = int(lengths[i])
            width = max(n, min(bucket_length(n), top)) if self.bucket else n
            t = np.full((1, width), self.config.pad_id, np.int32)
            t[0, :n] = tokens[i, :n]
            ln = lengths[i:i + 1].astype(np.int32)
            s = cache_length
            if self.invariant_block == 1:   # row by row: the row's own shapes, as `prepare_inputs` sizes them
                pick = (lambda x: None if x is None else x[i:i + 1])  # noqa: E731
                t, ln, s, _, _ = prepare_inputs(self.config, self.sampler, tokens[i:i + 1, :n], lengths[i:i + 1],
                                                max_new_tokens, cache_length, pick(seed_canvas), pick(pinned),
                                                pick(committed), bucket=self.bucket)
            elif s is None:   # derived: in whole key blocks, at least a ring (a given length is every row's)
                need = int(ends[i]) + later
                s = self.invariant_cache_length(
                    max(need, min(bucket_length(int(ends[i])) + later, top)) if self.bucket else need)
            sc = None if seed_canvas is None else seed_canvas[i:i + 1]
            pin = None if pinned is None else pinned[i:i + 1]
            pictures = None
            if checked is not None:
                count = len(image_runs(tokens[i, :n], self.config.image_token_id))
                if count:
                    pictures = self.place(*(jnp.asarray(x[first_image:first_image + count], dtype)
                                             for x, dtype in zip(checked, (jnp.float32, jnp.int32))))
                first_image += count
            rows.append((t, ln, (keys, i), int(s) if cache is None else cache if b == 1 else cache_row(cache, i),
                         sc, pin, pictures))
        return rows

    def _blocks(self, rows):
        """The rows of `_prepare_rows` as the engine runs them: the rows that start new caches and
        have the same seed-canvas shape go together whatever their prompt lengths (the shapes of
        their program do not matter to a row's bits: prefill in chunks, attention in fixed key
        blocks); rows continuing a caller's cache go together by its length; a row with images runs
        alone, shaped by itself. A group runs as one block of its rows (`invariant_block` None; at most
        `INVARIANT_MAX_ROWS` a block, the last block the rest) or in blocks of exactly
        `invariant_block` rows (a short block filled with copies of its first row). Yields (row
        indices, the program's inputs)."""
        groups: dict = {}
        for i, (t, ln, k, c, sc, pin, im) in enumerate(rows):
            shape = ("new" if isinstance(c, int) else c.max_length, None if sc is None else sc.shape,
                     None if pin is None else pin.shape)
            groups.setdefault(("alone", i) if im is not None else shape, []).append(i)
        for idx in groups.values():
            step = 1 if rows[idx[0]][6] is not None else self.invariant_block or INVARIANT_MAX_ROWS
            for start in range(0, len(idx), step):
                part = idx[start:start + step]
                # blocks of exactly `invariant_block` rows; a call's rows (None) as many as they are
                yield part, self._block([rows[i] for i in part], step if self.invariant_block else len(part))

    def _block(self, part, size: int = 1):
        """The placed inputs of one program call for the rows `part` (of `_prepare_rows`), filled to
        `size` rows with copies of the first: (tokens [size, W], lengths, keys, cache, seed_canvas,
        pinned, images). W is the widest row's prompt, a new cache's length the longest row's
        (`_prepare_rows` gives derived lengths in whole key blocks and at least a sliding layer's
        ring, `invariant_cache_length`; a length the caller gave is every row's), so that each row's
        blocks and rings are those it gets alone."""
        fill = list(part) + [part[0]] * (size - len(part))

        def cat(xs):
            if xs[0] is None:
                return None
            return np.concatenate(xs) if all(isinstance(x, np.ndarray) for x in xs) else jnp.concatenate(xs)

        width = max(r[0].shape[1] for r in fill)
        tokens = np.concatenate([np.pad(np.asarray(r[0]), ((0, 0), (0, width - r[0].shape[1])),
                                        constant_values=self.config.pad_id) for r in fill])
        keys = fill[0][2][0][np.array([r[2][1] for r in fill])]
        first = fill[0][3]
        if isinstance(first, int):
            cache = self.new_cache(size, max(r[3] for r in fill))
        else:
            cache = first if len(fill) == 1 else concat_rows([r[3] for r in fill])
        t, ln, k, sc, pin = self.place(tokens, cat([r[1] for r in fill]), keys, cat([r[4] for r in fill]),
                                       cat([r[5] for r in fill]))
        return t, ln, k, cache, sc, pin, fill[0][6]

    def invariant_cache_length(self, need: int) -> int:
        """The cache length a batch-invariant program gets for a row that needs `need` slots.

        Args:
          need: the slots the row's prompt and committed canvases take (bucketed).
        Returns:
          `need` in whole key blocks of the invariant runtime (`Runtime.attn_fixed_blocks`), at least a
          sliding layer's whole ring (so every row's ring has one size), within the model's positions.
        """
        kb = self.gen_runtime.attn_key_block
        need = max(int(need), ring_limit(self.config))
        return min(-(-need // kb) * kb, self.config.max_position_embeddings)

    def _iter(self, which, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, images,
              cache=None, final_cache=False):
        max_new_tokens = self.sampler.canvas_length if max_new_tokens is None else max_new_tokens
        if self.batch_invariant:
            rows = self._prepare_rows(prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                                      cache, images)
            per_row = [None] * len(rows)
            for idx, (t, n, k, c, sc, pin, im) in self._blocks(rows):
                events = which(self.programs, self.params, t, n, c, k, max_new_tokens, sc, pin, im)
                for i, view in zip(idx, [events] if t.shape[0] == 1 else rows_lib.split_rows(events, t.shape[0])):
                    per_row[i] = view
            return reporting(rows_lib.merge_row_events(per_row, max_new_tokens, self.sampler.canvas_length,
                                                       self.sampler.pad_id, final_cache), "warn")
        tokens, lengths, keys, cache, seed_canvas, pinned, images = self._prepare(
            prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, cache, images)
        return reporting(which(self.programs, self.params, tokens, lengths, cache, keys, max_new_tokens, seed_canvas,
                                pinned, images), "warn")

    def stream(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
               seed_canvas=None, pinned=None, cache_length: int | None = None,
               images=None) -> Iterator[drivers.CanvasEvent]:
        """Per-canvas driver: each finished canvas as it is committed (the same tokens as `generate`).

        Args:
          as `generate` (prompt_tokens [B, P], lengths [B], rng, max_new_tokens, seed_canvas, pinned,
          cache_length, images).
        Returns:
          an iterator of `CanvasEvent`s (index, tokens [B, L], steps [B], finished [B]).
        """
        return self._iter(drivers.iter_canvases, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned,
                          cache_length, images)

    def steps(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
              seed_canvas=None, pinned=None, cache_length: int | None = None, images=None,
              cache: KVCache | None = None, final_cache: bool = False):
        """Per-step driver: every denoising step's state and every finished canvas (same tokens as `generate`).

        With `batch_invariant` each block of rows runs its own step programs, in lockstep
        (`rows.merge_row_events`: a row already done shows its last state, a finished row pad).

        Args:
          as `generate` (prompt_tokens [B, P], lengths [B], rng, max_new_tokens, seed_canvas, pinned,
            cache_length, images), and:
          cache: continue an earlier cache, as `generate`'s (given to the programs, as with
            `generate(..., donate_cache=True)`, unless the engine's `donate=False`).
          final_cache: end with the `KVCache` holding everything committed (`generate`'s `out.cache`;
            multi-turn chat carries it on).
        Returns:
          an iterator of a `StepEvent` per step (canvas_index, step, argmax [B, L], the next input
          canvas [B, L], done [B]) and a `CanvasEvent` per canvas, then the final cache when `final_cache`.
        """
        return self._iter(functools.partial(drivers.iter_steps, final_cache=final_cache), prompt_tokens, lengths, rng,
                          max_new_tokens, seed_canvas, pinned, cache_length, images, cache, final_cache)


def generate(params, config: ModelConfig, prompt_tokens, lengths=None, sampler_config: SamplerConfig | None = None,
             rng: Any = 0, *, max_new_tokens: int | None = None, seed_canvas=None, pinned=None,
             cache_length: int | None = None, runtime: Runtime | None = None) -> gen.GenerateOutput:
    """Prefill and multi-canvas denoising in one compiled program, without building an `Engine` first.

    It checks its inputs on the host, so it cannot run inside `jax.jit`: there, call the traceable
    `generate_fused` (docs/api.md, "Your own loop").

    Args:
      params, config: the model. sampler_config: the sampler (default `SamplerConfig.for_model(config)`).
      prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length: as `Engine.generate`.
      runtime: how it runs (default: this backend, one device).
    Returns:
      a `GenerateOutput`, as `Engine.generate`.
    """
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, prompt_tokens, lengths, rng))):
        raise ValueError("dgemma_jax.generate checks its inputs on the host and cannot be traced: inside jax.jit "
                         "call dgemma_jax.generate_fused (traceable; keys from dgemma_jax.row_keys)")
    return Engine(config, params, sampler_config, runtime=runtime).generate(
        prompt_tokens, lengths, rng=rng, max_new_tokens=max_new_tokens, seed_canvas=seed_canvas, pinned=pinned,
        cache_length=cache_length)
