"""Compiled entry points: prefill, denoise step, denoise canvas and the fused generate.

The engine is the one place that knows about `jax.jit`, buffer donation, shardings and AOT
compilation. Everything it runs is the pure code of `dgemma_jax.model` and `dgemma_jax.sampling`,
given the engine's `Runtime` (mesh and rules, platform, MoE dispatch, attention kernel) as a static
argument: one code path with or without a mesh.

    engine = Engine(config, params, SamplerConfig(...))
    out = engine.generate(prompt_tokens, lengths, rng=0, max_new_tokens=512)
    for event in engine.stream(prompt_tokens, lengths, rng=0, max_new_tokens=512): ...
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax import compile_cache
from dgemma_jax.config import ModelConfig
from dgemma_jax.errors import DgemmaWarning, NonFiniteLogits
from dgemma_jax.model.api import check_tokens, encode_pass
from dgemma_jax.model.cache import KVCache, cache_row, init_cache
from dgemma_jax.model.layers import dtype_of
from dgemma_jax.model.layout import check_scannable, is_stacked, stack_layers, unstack_layers
from dgemma_jax.model.masks import image_runs
from dgemma_jax.model.quant import mode_for, quantization_of, quantize_params
from dgemma_jax.runtime import Runtime
from dgemma_jax.sampling import generate as gen
from dgemma_jax.sampling import slots as slots_lib
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.loop import denoise_canvas, denoise_step, row_keys


def _check_sampler(config: ModelConfig, sampler: SamplerConfig):
    if not isinstance(sampler, SamplerConfig):
        raise ValueError(f"sampler must be a SamplerConfig; got {type(sampler).__name__}")
    bad = [e for e in sampler.eos_ids if e >= config.vocab_size]
    if bad:
        raise ValueError(f"SamplerConfig.eos_ids {bad} are outside the vocabulary [0, {config.vocab_size}); "
                         "set eos_ids to the model's end-of-sequence ids")
    if sampler.pad_id >= config.vocab_size:
        raise ValueError(f"SamplerConfig.pad_id={sampler.pad_id} is outside the vocabulary [0, {config.vocab_size})")


def canvas_length_warning(config: ModelConfig, sampler: SamplerConfig) -> str | None:
    """A warning when the sampler's canvas length is not the one the model was trained with (its
    config's canvas_length): the denoiser has only seen canvases of that length, and on the bundled
    model other lengths give wrong answers."""
    if sampler.canvas_length == config.canvas_length:
        return None
    return (f"canvas length {sampler.canvas_length} is not the {config.canvas_length} this model was trained with "
            f"(its config's canvas_length); answers may be wrong: use a canvas length of {config.canvas_length}")


def bucket_length(n: int, minimum: int = 16) -> int:
    """The smallest length >= n of the form 2**k or 3 * 2**(k-1) (16, 24, 32, 48, 64, 96, ...).

    Programs are compiled per shape, so the engine pads prompt widths and derived cache lengths up to
    these buckets: prompts of many lengths share a handful of programs, and at most a third of a
    bucket (under half of the length it pads) is padding."""
    n = max(int(n), int(minimum))
    pow2 = 1 << (n - 1).bit_length()
    return 3 * pow2 // 4 if 3 * pow2 // 4 >= n else pow2


def prepare_inputs(config: ModelConfig, sampler: SamplerConfig, prompt_tokens, lengths, max_new_tokens: int,
                   cache_length: int | None = None, seed_canvas=None, pinned=None, committed=None,
                   bucket: bool = False):
    """Validate generate() inputs on the host (before anything is compiled) and size the cache.

    committed: [B] tokens already in a cache being continued (multi-turn), else 0.
    bucket: right-pad the prompt width with pad ids to `bucket_length`, and size a derived cache for
    the bucketed context (capped at the model's positions), so that all prompts of one bucket share
    one program. The padding is masked and never written to the cache; it changes only the order of
    floating-point sums (bench config: first-pass logits within 2.2e-3 of the exact shapes' at a scale
    of 30, benchmarks/prompt_buckets.py).
    Returns (tokens [B, P] int32, lengths [B] int32, cache_length, seed_canvas, pinned).
    """
    _check_sampler(config, sampler)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((prompt_tokens, lengths))):
        raise ValueError("generate checks its inputs on the host and cannot be traced: inside jax.jit call "
                         "dgemma_jax.generate_fused (traceable; keys from dgemma_jax.row_keys)")
    tokens = check_tokens(config, prompt_tokens, "prompt_tokens")
    b, p = tokens.shape
    if b == 0 or p == 0:
        raise ValueError(f"prompt_tokens has shape {(b, p)}: generate needs at least one prompt of at least one token")
    if lengths is None:
        lengths = np.full((b,), p, np.int32)
    lengths = np.asarray(lengths)
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"lengths must be an integer array of shape [{b}]; got {lengths.dtype} {lengths.shape}")
    if (lengths < 1).any() or (lengths > p).any():
        raise ValueError(f"each prompt length must be in [1, {p}] (the padded prompt width); got {lengths.tolist()}")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer; got {max_new_tokens!r}")
    n_canvas = gen.num_canvases(int(max_new_tokens), sampler.canvas_length)
    ends = lengths + (0 if committed is None else np.asarray(committed))
    need = int(ends.max()) + (n_canvas - 1) * sampler.canvas_length
    last_pos = int(ends.max()) + n_canvas * sampler.canvas_length
    if last_pos > config.max_position_embeddings:
        raise ValueError(f"context ({int(ends.max())} tokens) + {n_canvas} canvas(es) of {sampler.canvas_length} "
                         f"reach position {last_pos}, beyond the model's max_position_embeddings="
                         f"{config.max_position_embeddings}; shorten the prompt or lower max_new_tokens")
    if cache_length is None:
        # bucketed: sized from the bucketed context, so one program serves a whole prompt bucket
        padded = bucket_length(int(ends.max())) + (n_canvas - 1) * sampler.canvas_length
        cache_length = max(need, min(padded, config.max_position_embeddings)) if bucket else need
    elif need > cache_length:
        raise ValueError(f"the KV cache holds {cache_length} tokens per row but the context ({int(ends.max())}) "
                         f"plus {n_canvas - 1} committed canvas(es) of {sampler.canvas_length} need {need}; "
                         f"raise cache_length to >= {need}, shorten the prompt or lower max_new_tokens "
                         f"(= {max_new_tokens})")
    if seed_canvas is not None:
        seed_canvas = check_tokens(config, seed_canvas, "seed_canvas")
        if seed_canvas.shape != (b, sampler.canvas_length):
            raise ValueError(f"seed_canvas must have shape [{b}, {sampler.canvas_length}]; got {seed_canvas.shape}")
    if pinned is not None:
        if seed_canvas is None:
            raise ValueError("pinned positions need a seed_canvas holding their tokens")
        pinned = jnp.asarray(pinned)
        if pinned.shape != seed_canvas.shape or pinned.dtype != jnp.bool_:
            raise ValueError(f"pinned must be a bool array of shape {tuple(seed_canvas.shape)}; "
                             f"got {pinned.dtype} {tuple(pinned.shape)}")
    width = max(p, min(bucket_length(p), config.max_position_embeddings)) if bucket else p
    if width > p:
        tokens = jnp.pad(tokens, ((0, 0), (0, width - p)), constant_values=config.pad_id)
    return tokens, jnp.asarray(lengths, jnp.int32), int(cache_length), seed_canvas, pinned


def check_images(config: ModelConfig, tokens, lengths, images):
    """The prompt's images checked against the prompt on the host: None, or (pixel_values,
    position_ids) arrays for the programs (`check_images_host`, then on the device)."""
    checked = check_images_host(config, tokens, lengths, images)
    if checked is None:
        return None
    return (jnp.asarray(checked[0], jnp.float32), jnp.asarray(checked[1], jnp.int32))


def check_images_host(config: ModelConfig, tokens, lengths, images):
    """`check_images` without the device transfer: None, or numpy (pixel_values, position_ids).

    images: an object with `pixel_values` [N, P, 3 p^2], `position_ids` [N, P, 2] and `soft_tokens`
    [N] (`dgemma_jax.io.images.preprocess_images`). The prompts must hold exactly sum(soft_tokens) image
    tokens in runs, one run of soft_tokens[i] tokens per image, in row-major order."""
    if images is None:
        tok = np.asarray(tokens)
        if config.image_token_id is not None and (tok == config.image_token_id).any():
            raise ValueError("the prompt holds image tokens but no images were given: pass images=... (the "
                             "preprocessed images whose placeholders these are) or remove the image tokens")
        return None
    if config.vision is None:
        raise ValueError(f"{config.name} is a text-only checkpoint (no vision tower): it cannot take images. "
                         "Load a checkpoint with vision weights (vision_config in its config.json) or drop the images")
    try:
        pixels, positions = np.asarray(images.pixel_values), np.asarray(images.position_ids)
        soft = [int(n) for n in np.asarray(images.soft_tokens).reshape(-1)]
    except AttributeError:
        raise ValueError("images must be preprocessed images (dgemma_jax.io.images.preprocess_images(...)): an "
                         f"object with pixel_values, position_ids and soft_tokens; got {type(images).__name__}") from None
    v = config.vision
    want = v.patch_dim
    if pixels.ndim != 3 or pixels.shape[-1] != want or positions.shape != pixels.shape[:2] + (2,):
        raise ValueError(f"images.pixel_values must be [N, patches, {want}] and position_ids [N, patches, 2]; got "
                         f"{pixels.shape} and {positions.shape}: preprocess them with this checkpoint's patch size "
                         f"({v.patch_size})")
    if len(soft) != pixels.shape[0]:
        raise ValueError(f"images.soft_tokens lists {len(soft)} images but pixel_values holds {pixels.shape[0]}")
    tok, n = np.asarray(tokens), np.asarray(lengths)
    runs = [b - a for row, length in zip(tok, n) for a, b in image_runs(row[:length], config.image_token_id)]
    if runs != soft:
        raise ValueError(f"the prompts hold {len(runs)} run(s) of image tokens of lengths {runs}, but the "
                         f"{len(soft)} image(s) give {soft} soft tokens: expand each image's placeholder with its "
                         "own soft-token count (dgemma_jax.io.images) and pass the images in prompt order")
    return (pixels, positions)


MEMORY_FIELDS = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
                 "generated_code_size_in_bytes")


def compiled_memory(compiled) -> dict[str, int]:
    """What a compiled program needs on its device (XLA's memory analysis), with `total_bytes`:
    arguments + outputs - the outputs aliased to (donated) arguments + temporaries + code. Empty where
    the backend has no analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return {}
    mem = {f: int(getattr(m, f, 0)) for f in MEMORY_FIELDS}
    mem["total_bytes"] = (mem["argument_size_in_bytes"] + mem["output_size_in_bytes"] - mem["alias_size_in_bytes"]
                          + mem["temp_size_in_bytes"] + mem["generated_code_size_in_bytes"])
    return mem


def new_tokens_that_fit(config: ModelConfig, sampler: SamplerConfig, context: int, limit: int,
                        cache_length: int | None = None) -> int:
    """The most new tokens (at most `limit`) whose canvases fit after `context` tokens: within the
    model's positions and, when given, a cache of `cache_length` (which holds all but the last
    canvas). Never less than one canvas; a context that leaves no room is `prepare_inputs`' error."""
    step = sampler.canvas_length
    canvases = (config.max_position_embeddings - context) // step
    if cache_length is not None:
        canvases = min(canvases, (cache_length - context) // step + 1)
    return max(1, min(int(limit), canvases * step))


# new tokens when not given, by the library and the command line alike: as many whole canvases of
# this many tokens as fit the model's positions (and a chat's cache) after the prompt
DEFAULT_NEW_TOKENS = 256


def default_new_tokens(config, sampler, context: int, cache_length: int | None = None) -> int:
    """The new-token budget when none is given: DEFAULT_NEW_TOKENS, capped to whole canvases that fit."""
    return new_tokens_that_fit(config, sampler, context, DEFAULT_NEW_TOKENS, cache_length)


def warn_if_cut_short(config, max_new: int, finished, context: int, cache_length: int | None = None) -> None:
    """Warn (DgemmaWarning) when the default budget was capped by the room left after the prompt and
    a row used all of it without an end of sequence: its text is cut short, not finished."""
    if max_new >= DEFAULT_NEW_TOKENS or bool(np.all(np.asarray(finished))):
        return
    room = f"the model's {config.max_position_embeddings} positions"
    if cache_length is not None and cache_length < config.max_position_embeddings:
        room = f"the {cache_length}-token context"
    warnings.warn(f"the output was cut short at {max_new} new tokens (of {DEFAULT_NEW_TOKENS} by default) without "
                  f"an end of sequence: a {context}-token prompt leaves no room for more in {room}; "
                  "shorten the prompt", DgemmaWarning, stacklevel=3)


NONFINITE_CHOICES = ("warn", "raise", "ignore")


def report_nonfinite(flags, action: str = "warn") -> None:
    """Act on a result's per-row `nonfinite` flags ([B] bool; see `sampling.loop.nonfinite_rows`):
    "warn" (a DgemmaWarning), "raise" (`NonFiniteLogits`) or "ignore"; nothing when no row met one."""
    if action not in NONFINITE_CHOICES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_CHOICES}; got {action!r}")
    if action == "ignore" or isinstance(flags, jax.core.Tracer):  # traced: the flags are the caller's to read
        return
    rows = np.flatnonzero(np.asarray(flags))
    if len(rows) == 0:
        return
    msg = (f"the model produced NaN/Inf logits for row(s) {rows.tolist()[:8]}: its weights or activations are not "
           "finite, so the tokens are not its answer; check the checkpoint (loading names a non-finite tensor) and "
           "the dtype (float16/bfloat16 overflow)")
    if action == "raise":
        raise NonFiniteLogits(msg)
    warnings.warn(msg, DgemmaWarning, stacklevel=3)


def _reporting(events, action: str):
    """The streaming drivers' events, each `CanvasEvent`'s nonfinite flags reported as they come."""
    for ev in events:
        if isinstance(ev, gen.CanvasEvent) and ev.nonfinite is not None:
            report_nonfinite(ev.nonfinite, action)
        yield ev


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
    batch_invariant: True (default): `generate`, `stream` and `steps` run each prompt of a batch as its
    own batch-1 program, whose shapes (prompt width, cache length) come from that prompt alone, with
    the key of its own seed (`row_keys`): a prompt with its seed gets the same tokens whatever else is
    in the call (its size, order, the prompt's position; tests/test_batch_invariance.py on XLA:CPU,
    float32 and int8). The rows run one after another, so a batch costs about the sum of its rows
    (docs/api.md has the measured cost). False: one program for the whole batch (rows padded to the
    longest prompt, one MoE dispatch for all tokens): faster for big batches on accelerators, but a
    row's tokens can change with the rest of the batch (float rounding, then the sampler).
    compilation_cache: True (default) turns jax's persistent compilation cache on
    (`dgemma_jax.compile_cache.enable`: JAX_COMPILATION_CACHE_DIR, else a directory already set in
    jax.config, else ~/.cache/dgemma_jax/xla), a string names the directory, False leaves jax's
    setting alone.
    programs: the `ProgramCache` holding this engine's jitted programs; default `ProgramCache.shared`,
    so that engines with equal configs, samplers and runtimes reuse each other's compiled programs.
    """

    def __init__(self, config: ModelConfig, params: Any, sampler: SamplerConfig | None = None, *,
                 shardings: Any | None = None, runtime: Runtime | None = None, donate: bool = True,
                 bucket: bool = True, quantize: str | None = None,
                 compilation_cache: bool | str = True, batch_invariant: bool = True,
                 programs: "ProgramCache | None" = None):
        if compilation_cache:
            compile_cache.enable(None if compilation_cache is True else compilation_cache)
        self.config = config
        devices = shardings.mesh.devices.flat if shardings is not None else None
        quantize = mode_for(config, quantize, quantization_of(params), devices)
        if quantize is not None:
            params = quantize_params(config, params, quantize)
            if shardings is not None:
                params = shardings.place_params(params)
        self.runtime = _runtime_for(runtime, shardings)
        self.params = layers_for(config, params, self.runtime.layer_layout, shardings)
        self.sampler = sampler or SamplerConfig.for_model(config)
        _check_sampler(config, self.sampler)
        mismatch = canvas_length_warning(config, self.sampler)
        if mismatch:
            warnings.warn(mismatch, DgemmaWarning, stacklevel=2)
        self.shardings = shardings
        self.donate = donate
        self.bucket = bool(bucket)
        self.batch_invariant = bool(batch_invariant)
        self._program_cache = ProgramCache.shared if programs is None else programs
        self._programs = {}
        self._streaming = None

    # ------------------------------------------------------------------ programs
    def fused_program(self, max_new_tokens: int, donate_cache: bool = True):
        """The jitted fused generate for `max_new_tokens` (cache donated unless `donate=False` or
        `donate_cache=False`)."""
        fn = functools.partial(gen.generate_fused, config=self.config, sampler=self.sampler,
                               max_new_tokens=int(max_new_tokens), runtime=self.runtime)
        if not donate_cache:
            return self._program(("fused", int(max_new_tokens), "cache kept"), fn, donate=())
        return self._program(("fused", int(max_new_tokens)), fn)

    def _program(self, key, fn, donate=("cache",)):
        """`fn` (its static arguments, the runtime among them, bound) jitted, donating `donate` unless
        `donate=False`. Engines with equal configs, runtimes and donation share one jit (and so its
        compiled programs) per `key`, through their `ProgramCache`."""
        if key not in self._programs:
            dn = tuple(donate) if self.donate else ()
            self._programs[key] = self._program_cache.get((key, self.config, self.sampler, self.runtime, dn),
                                                          lambda: jax.jit(fn, donate_argnames=dn))
        return self._programs[key]

    def step_program(self):
        """One denoise step (`sampling.loop.denoise_step` over the cache's committed context), jitted:
        step(params, cache, keys, state) -> new state."""
        return self._program(("denoise_step",), functools.partial(_denoise_step, config=self.config,
                                                                  sampler=self.sampler, runtime=self.runtime),
                             donate=())

    def commit_program(self):
        """The causal commit of a canvas, cache donated: commit(params, cache=, tokens=, active=) -> cache."""
        return self._program(("commit",), functools.partial(gen.commit, config=self.config, runtime=self.runtime))

    def slot_programs(self):
        """(prefill_slot, slot_tick) jitted for this engine: the continuous-batching programs of
        `dgemma_jax.sampling.slots` (the server's), cache and slot state donated unless `donate=False`.

        prefill_slot(params, cache=, slot=, tokens= [1, W], length= [1], start=, images=None) -> cache (one
        prompt chunk at position `start`; images: (pixel_values, position_ids) of the images wholly inside it)
        slot_tick(params, cache=, state=, keys=, canvas_index=, begin=, active=, last=, keep=, knobs=,
        max_ticks=) -> TickOutput (keywords; `new_slots` gives the first state)
        """
        rt, cfg = self.runtime, self.config
        pre = self._program(("prefill_slot",), functools.partial(slots_lib.prefill_slot, config=cfg, runtime=rt))
        tick = self._program(("slot_tick",), functools.partial(slots_lib.slot_tick, config=cfg,
                                                              sampler=self.sampler, runtime=rt),
                             donate=("cache", "state"))
        return pre, tick

    def new_slots(self, slots: int) -> "slots_lib.SlotState":
        """`slots` idle slots: the first state `slot_tick` takes (host arrays, each its own buffer, so
        the tick can take them donated; replicated on the engine's mesh)."""
        state = slots_lib.idle_slots(self.config, self.sampler, slots)
        loop = jax.tree.map(lambda x: self._place(np.array(x))[0], state.loop)
        keys = jax.random.wrap_key_data(self._place(np.array(jax.random.key_data(state.keys)))[0])
        return slots_lib.SlotState(loop, keys)

    @property
    def programs(self) -> "StreamPrograms":
        """The streaming drivers' programs, jitted here: prefill_prompt, canvas_step (the same canvas
        step as the fused program's loop body), and start_state / step_state / canvas_end for the
        step-by-step driver."""
        if self._streaming is None:
            bound = dict(config=self.config, sampler=self.sampler, runtime=self.runtime)
            self._streaming = StreamPrograms(
                sampler=self.sampler,
                prefill_prompt=self._program(("prefill_prompt",), functools.partial(
                    gen.prefill_prompt, config=self.config, runtime=self.runtime)),
                canvas_step=self._program(("canvas_step",), functools.partial(_canvas_step, **bound)),
                start_state=self._program(("start_state",), functools.partial(_start_state, **bound), donate=()),
                step_state=self._program(("step_state",), functools.partial(_step_state, **bound), donate=()),
                canvas_end=self._program(("canvas_end",), functools.partial(_canvas_end, **bound)),
            )
        return self._streaming

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty cache in the layout of the engine's programs (`Runtime.layers`)."""
        layers = self.runtime.layer_layout
        if self.shardings is not None:
            return self.shardings.init_cache(batch, length, layers)
        return init_cache(self.config, batch, length, dtype_of(self.config.dtype), layers=layers)

    def _place(self, *arrays):
        """Inputs as global (replicated) arrays on the mesh; unchanged without shardings."""
        if self.shardings is None:
            return arrays
        return tuple(None if a is None else self.shardings.global_array(a) for a in arrays)

    # ------------------------------------------------------------------ running
    def generate(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
                 seed_canvas=None, pinned=None, cache_length: int | None = None,
                 cache: KVCache | None = None, images=None, donate_cache: bool = False,
                 nonfinite: str = "warn") -> gen.GenerateOutput:
        """Generate with the fused program: prompt_tokens [B, P] (right-padded), lengths [B].

        rng: an int seed (every row uses that seed's stream), a list of B int seeds (one per prompt),
        one key (every row uses its stream) or [B] keys (`row_keys`: a row's key never depends on
        its index). With `batch_invariant` (default) each row then runs as its own program, so its
        tokens do not depend on the rest of the batch (the class docstring says what is tested).
        cache: continue an earlier cache (multi-turn chat: the prompt is then only the new tokens;
        `out.cache` of a previous call holds everything committed so far, i.e. all but the last
        canvas, earlier images included; rows run alone get caches of their own lengths, merged
        padded to the longest). With `batch_invariant` all rows of a cache passed in keep its
        length. The cache you
        pass stays usable unless `donate_cache=True`, which gives its buffers to the program (no
        copy of the cache; your handle is then deleted). images: the
        prompt's images (`dgemma_jax.io.images.preprocess_images`: pixel values, positions, soft-token
        counts), one run of `config.image_token_id` tokens per image in the prompts, in row-major
        order (`check_images`). nonfinite: what a row that met NaN/Inf logits (`out.nonfinite`) gives:
        "warn" (a DgemmaWarning; default), "raise" (`errors.NonFiniteLogits`) or "ignore" (no
        host sync: the flags stay in the result for the caller). Returns `GenerateOutput`.
        """
        max_new_tokens = self.sampler.canvas_length if max_new_tokens is None else max_new_tokens
        cache_given = cache
        if self.batch_invariant:
            rows = self._prepare_rows(prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                                      cache, images)
            # a row of a caller's batch>1 cache is a copy: donating it costs the caller nothing
            fn = self.fused_program(max_new_tokens, donate_cache=cache_given is None or donate_cache or len(rows) > 1)
            out = gen.merge_outputs(
                fn(self.params, prompt_tokens=t, prompt_lengths=n, cache=c, keys=k, seed_canvas=sc, pinned=pin,
                   images=im) for t, n, k, c, sc, pin, im in rows)
            report_nonfinite(out.nonfinite, nonfinite)
            return out
        tokens, lengths, keys, cache, seed_canvas, pinned, images = self._prepare(
            prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, cache, images)
        fn = self.fused_program(max_new_tokens, donate_cache=cache_given is None or donate_cache)
        out = fn(self.params, prompt_tokens=tokens, prompt_lengths=lengths, cache=cache, keys=keys,
                 seed_canvas=seed_canvas, pinned=pinned, images=images)
        report_nonfinite(out.nonfinite, nonfinite)
        return out

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
        tokens, lengths, keys, seed_canvas, pinned = self._place(tokens, lengths, keys, seed_canvas, pinned)
        if images is not None:
            images = self._place(*images)
        return tokens, lengths, keys, cache, seed_canvas, pinned, images

    def _prepare_rows(self, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                      cache=None, images=None):
        """`_prepare` for each row alone (`batch_invariant`): a list of per-row inputs (tokens [1, W],
        lengths [1], keys [1], cache [1, S], seed_canvas, pinned, images) whose shapes come from the
        row alone: W the bucket of its own prompt length, S its own derived cache length (or the
        `cache_length` / cache the caller gave for all rows), images the row's own."""
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
        first_image = 0
        rows = []
        for i in range(b):
            n = int(lengths[i])
            pick = (lambda x: None if x is None else x[i:i + 1])  # noqa: E731
            t, ln, s, sc, pin = prepare_inputs(self.config, self.sampler, tokens[i:i + 1, :n], lengths[i:i + 1],
                                               max_new_tokens, cache_length, pick(seed_canvas), pick(pinned),
                                               pick(committed), bucket=self.bucket)
            pictures = None
            if checked is not None:
                count = len(image_runs(tokens[i, :n], self.config.image_token_id))
                if count:
                    pictures = self._place(*(jnp.asarray(x[first_image:first_image + count], dtype)
                                             for x, dtype in zip(checked, (jnp.float32, jnp.int32))))
                first_image += count
            row_cache = self.new_cache(1, s) if cache is None else cache if b == 1 else cache_row(cache, i)
            t, ln, k, sc, pin = self._place(t, ln, keys[i:i + 1], sc, pin)
            rows.append((t, ln, k, row_cache, sc, pin, pictures))
        return rows

    def _iter(self, which, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, images,
              cache=None, final_cache=False):
        max_new_tokens = self.sampler.canvas_length if max_new_tokens is None else max_new_tokens
        if self.batch_invariant:
            rows = self._prepare_rows(prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length,
                                      cache, images)
            return _reporting(gen.merge_row_events(
                (which(self.programs, self.params, t, n, c, k, max_new_tokens, sc, pin, im)
                 for t, n, k, c, sc, pin, im in rows), max_new_tokens, self.sampler.canvas_length, self.sampler.pad_id,
                final_cache), "warn")
        tokens, lengths, keys, cache, seed_canvas, pinned, images = self._prepare(
            prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned, cache_length, cache, images)
        return _reporting(which(self.programs, self.params, tokens, lengths, cache, keys, max_new_tokens, seed_canvas,
                                pinned, images), "warn")

    def stream(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
               seed_canvas=None, pinned=None, cache_length: int | None = None,
               images=None) -> Iterator[gen.CanvasEvent]:
        """Per-canvas driver: yields each finished canvas (same tokens as `generate`)."""
        return self._iter(gen.iter_canvases, prompt_tokens, lengths, rng, max_new_tokens, seed_canvas, pinned,
                          cache_length, images)

    def steps(self, prompt_tokens, lengths=None, *, rng: Any = 0, max_new_tokens: int | None = None,
              seed_canvas=None, pinned=None, cache_length: int | None = None, images=None,
              cache: KVCache | None = None, final_cache: bool = False):
        """Per-step driver: yields a `StepEvent` per denoising step and a `CanvasEvent` per canvas (same
        tokens as `generate`). With `batch_invariant` each row runs its own step programs, in lockstep
        (`gen.merge_row_events`: a row already done shows its last state, a finished row pad).
        cache: continue an earlier cache, as `generate`'s (given to the programs, as with
        `generate(..., donate_cache=True)`, unless the engine's `donate=False`). final_cache: the last
        item yielded is then the `KVCache` holding everything committed (`generate`'s `out.cache`;
        multi-turn chat carries it on)."""
        return self._iter(functools.partial(gen.iter_steps, final_cache=final_cache), prompt_tokens, lengths, rng,
                          max_new_tokens, seed_canvas, pinned, cache_length, images, cache, final_cache)


class ProgramCache:
    """Jitted programs by key (program, config, sampler, runtime, donated arguments), shared by the
    engines that use this cache; past `size` entries the least recently used is dropped, and with it
    its compiled executables and the mesh its runtime holds (an engine keeps the programs it has
    already taken). `ProgramCache.shared` is the engines' default."""

    shared: "ProgramCache"

    def __init__(self, size: int = 64):
        if size < 1:
            raise ValueError(f"a ProgramCache holds at least one program; got size={size}")
        self.size = size
        self._jits: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, make):
        """The program under `key`, made by `make()` when absent."""
        if key in self._jits:
            self._jits.move_to_end(key)
            return self._jits[key]
        fn = self._jits[key] = make()
        while len(self._jits) > self.size:
            self._jits.popitem(last=False)
        return fn

    def __len__(self) -> int:
        return len(self._jits)


ProgramCache.shared = ProgramCache()


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


def _runtime_for(runtime: Runtime | None, shardings) -> Runtime:
    """The engine's runtime: the one given (default `Runtime()`), on the shardings' mesh and rules."""
    runtime = runtime if runtime is not None else Runtime()
    if not isinstance(runtime, Runtime):
        raise ValueError(f"runtime must be a dgemma_jax.Runtime; got {type(runtime).__name__}")
    if shardings is None:
        return runtime
    if runtime.mesh is None:
        return runtime.replace(mesh=shardings.mesh, rules=shardings.rules)
    if runtime.mesh != shardings.mesh or runtime.rules != tuple(shardings.rules):
        raise ValueError("the runtime's mesh and rules differ from the shardings': build it with "
                         "shardings.runtime(...) or leave its mesh unset")
    return runtime


@dataclasses.dataclass(frozen=True)
class StreamPrograms:
    """The jitted programs the streaming drivers (`gen.iter_canvases`, `gen.iter_steps`) call."""

    sampler: SamplerConfig
    prefill_prompt: Any
    canvas_step: Any
    start_state: Any
    step_state: Any
    canvas_end: Any


# the programs' call signatures (config, sampler and runtime bound as static keywords)
def _canvas_step(params, cache, keys, index, last, finished, seed_canvas, pinned, *, config, sampler, runtime):
    return gen.canvas_step(params, config, sampler, cache, keys, index, last, finished, seed_canvas, pinned,
                           runtime)


def _start_state(keys, index, finished, seed_canvas, pinned, *, config, sampler, runtime):
    del runtime  # no model pass: the canvas start is sampler arithmetic
    return gen.start_state(config, sampler, keys, index, finished, seed_canvas, pinned)


def _step_state(params, cache, canvas_keys, state, seed, pinned, *, config, sampler, runtime):
    return gen.step_state(params, config, sampler, cache, canvas_keys, state, seed, pinned, runtime)


def _canvas_end(params, cache, argmax, finished, last, *, config, sampler, runtime):
    return gen.canvas_end(params, config, sampler, cache, argmax, finished, last, runtime)


def _denoise_step(params, cache, keys, state, *, config, sampler, runtime):
    return denoise_step(params, config, sampler, cache, cache.lengths, keys, state, runtime=runtime)


# ---------------------------------------------------------------------- functional API
def generate(params, config: ModelConfig, prompt_tokens, lengths=None, sampler_config: SamplerConfig | None = None,
             rng: Any = 0, *, max_new_tokens: int | None = None, seed_canvas=None, pinned=None,
             cache_length: int | None = None, runtime: Runtime | None = None) -> gen.GenerateOutput:
    """Prefill + multi-canvas denoising, one compiled program. See `Engine.generate`.

    It checks its inputs on the host, so it cannot run inside `jax.jit`: there, call the traceable
    `generate_fused` (docs/api.md, "Your own loop")."""
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((params, prompt_tokens, lengths, rng))):
        raise ValueError("dgemma_jax.generate checks its inputs on the host and cannot be traced: inside jax.jit "
                         "call dgemma_jax.generate_fused (traceable; keys from dgemma_jax.row_keys)")
    return Engine(config, params, sampler_config, runtime=runtime).generate(
        prompt_tokens, lengths, rng=rng, max_new_tokens=max_new_tokens, seed_canvas=seed_canvas, pinned=pinned,
        cache_length=cache_length)


@functools.partial(jax.jit, static_argnames=("config", "sampler", "runtime"))
def jit_denoise_step(params, config, sampler, cache, keys, state, seed=None, pinned=None, runtime=None):
    """The separately jitted denoise step (one bidirectional pass + sampler update)."""
    return denoise_step(params, config, sampler, cache, cache.lengths, keys, state, seed=seed, pinned=pinned,
                        runtime=runtime)


@functools.partial(jax.jit, static_argnames=("config", "sampler", "runtime"))
def jit_denoise_canvas(params, config, sampler, cache, keys, canvas=None, pinned=None, done=None, runtime=None):
    """One canvas denoised to completion in one `lax.while_loop`."""
    return denoise_canvas(params, config, sampler, cache, keys, canvas=canvas, pinned=pinned, done=done,
                          runtime=runtime)


@functools.partial(jax.jit, static_argnames=("config", "logits_mode", "runtime"), donate_argnames=("cache",))
def jit_prefill(params, config, tokens, lengths, cache, logits_mode="none", runtime=None):
    """The separately jitted prefill/commit pass, cache donated."""
    return encode_pass(params, config, tokens, cache.lengths, lengths, cache, logits_mode, runtime=runtime)
