"""The model's one facade: parameters and cache in, results and new cache out.

Two levels, and the only code that calls `Transformer.apply`:
* traceable passes for the drivers (sampling, the engine, training) to use inside their own jits:
  `encode_pass`, `denoise_logits`, `denoise_features`, `soft_embed_pass`, `image_features_pass` (the vision
  tower of a config with `vision`); `adapters` adds the
  unmerged LoRA collection; `runtime` (a `dgemma_jax.runtime.Runtime`, default: this process's
  backend on one device) is how the pass runs: mesh, platform, MoE dispatch, attention kernel;
* checked, jitted entry points for users: `prefill`, `denoise`, `soft_embed`. They check their
  inputs when they are concrete (outside `jax.jit`) and raise a `ValueError` that names the
  problem; inside a trace they only check shapes and dtypes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import linen as nn

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.cache import SLOT_AXIS, KVCache, check_replicas, init_cache, layer_shape, layer_slots, sliding_slots
from dgemma_jax.model.layers import LORA_COLLECTION
from dgemma_jax.model.layout import cache_layer_shapes, layer_plan
from dgemma_jax.model.transformer import Transformer
from dgemma_jax.runtime import Runtime

Params = Any


def _model(config: ModelConfig, runtime: Runtime | None = None) -> Transformer:
    return Transformer(config, runtime if runtime is not None else Runtime())


def _apply(config: ModelConfig, runtime: Runtime | None, variables_: dict, *args, method: str):
    """`Transformer.apply`, with Flax's errors for params that do not fit the config (another
    config's params) turned into one ValueError that names the parameter and the fix."""
    try:
        return _model(config, runtime).apply(variables_, *args, method=method)
    except (flax_errors.ScopeParamShapeError, flax_errors.ScopeParamNotFoundError) as e:
        what = str(e).split(" (https://", 1)[0]
        raise ValueError(f"the params do not fit this ModelConfig ({config.name}): {what} Pass the params made "
                         "for this config, or the config they were made with (e.g. the checkpoint's "
                         "ModelConfig.from_hf / load_hf)") from None


# a params tree may carry LoRA adapters for generation under this key (`with_adapters`), so that every
# driver (fused, streaming, the server's slots) runs them without an argument of its own
ADAPTERS_KEY = "lora_adapters"


def with_adapters(params, adapters, rows=None) -> dict:
    """`params` carrying LoRA adapters that every pass adds unmerged (float32 (x A) B beside the
    base kernels): `adapters` is the "lora" collection (`training.lora.forward_adapters`; scale
    folded into B). rows: None (one adapter for every row), or int [B], each batch row's adapter
    in `adapters` stacked [N, ...] (`training.lora.stack_adapters`; index 0 the zero adapter, the
    base model). Without adapters the parameters (and every program) are unchanged."""
    return {**params, ADAPTERS_KEY: adapters if rows is None else {"pairs": adapters, "rows": rows}}


def with_rows(params, rows) -> dict:
    """`params` made by `with_adapters(params, stacked)` with each row's adapter index rows [B]."""
    entry = params[ADAPTERS_KEY]
    return {**params, ADAPTERS_KEY: {"pairs": entry.get("pairs", entry), "rows": rows}}


def take_rows(params, index) -> dict:
    """`params` for a batch made of rows `index` [K] of the batch they were given for: per-row adapter
    indices (`with_adapters(..., rows)`) follow the rows; anything else is returned as it is."""
    if not has_row_adapters(params):
        return params
    entry = params[ADAPTERS_KEY]
    return {**params, ADAPTERS_KEY: {"pairs": entry["pairs"], "rows": entry["rows"][index]}}


def _attach_rows(tree, rows):
    if isinstance(tree, dict) and "a" in tree and "b" in tree and not isinstance(tree["a"], dict):
        return {"a": tree["a"], "b": tree["b"], "rows": rows}
    return {k: _attach_rows(v, rows) for k, v in tree.items()}


def variables(params, adapters=None) -> dict:
    """The model's variables: the parameters, plus the unmerged LoRA collection when given (or
    carried by `params`, `with_adapters`)."""
    if isinstance(params, dict) and ADAPTERS_KEY in params:
        params = dict(params)
        carried = params.pop(ADAPTERS_KEY)
        if adapters is not None:
            raise ValueError("adapters given twice: the params carry adapters (with_adapters) and adapters= is set")
        adapters = (_attach_rows(carried["pairs"], carried["rows"]) if set(carried) == {"pairs", "rows"}
                    else carried)
    return {"params": params} if adapters is None else {"params": params, LORA_COLLECTION: adapters}


# ------------------------------------------------------------------ traceable passes (drivers)
def encode_pass(params, config: ModelConfig, tokens, starts, num_new, cache: KVCache, logits_mode: str = "none",
                adapters=None, runtime: Runtime | None = None, image_features=None, image_tokens=None):
    """Causal pass over tokens [B, T] written at cache slots starts[b] + t for t < num_new[b].

    image_features [N, D] and image_tokens [B, T] bool (both or neither): the images of this pass
    (see `Transformer.encode`; each image lies wholly in this pass). Returns (logits per
    `logits_mode` -- "all" [B, T, V], "last" [B, V], "none" None -- , new cache)."""
    if (image_features is None) != (image_tokens is None):
        raise ValueError("image_features and image_tokens go together: pass both or neither")
    if image_features is None:  # the text-only call, unchanged
        return _apply(config, runtime, variables(params, adapters), tokens, starts, num_new, cache, logits_mode,
                      method="encode")
    return _apply(config, runtime, variables(params, adapters), tokens, starts, num_new, cache, logits_mode,
                  image_features, image_tokens, method="encode")


def denoise_logits(params, config: ModelConfig, canvas, context_end, cache: KVCache, soft=None, adapters=None,
                   runtime: Runtime | None = None):
    """Bidirectional pass over canvas [B, L] after context_end[b] committed tokens: float32 [B, L, V]."""
    return _apply(config, runtime, variables(params, adapters), canvas, context_end, cache, soft, method="denoise")


def denoise_features(params, config: ModelConfig, canvas, context_end, cache: KVCache, soft=None,
                     runtime: Runtime | None = None):
    """The denoiser up to the final norm, [B, L, D] (the fused sampler applies the head itself)."""
    return _apply(config, runtime, variables(params), canvas, context_end, cache, soft, method="denoise_features")


def commit_denoise_features(params, config: ModelConfig, tokens, num_new, canvas, cache: KVCache, soft=None,
                            runtime: Runtime | None = None):
    """The causal pass writing tokens [B, T] (row b's first num_new[b]) and the denoiser's pass over
    the next canvas [B, L] after them, in one pass over the layers (`Transformer.commit_denoise_features`):
    (the canvas's [B, L, D] up to the final norm, the cache with the tokens written)."""
    return _apply(config, runtime, variables(params), tokens, num_new, canvas, cache, soft,
                  method="commit_denoise_features")


def commit_rows_denoise_features(params, config: ModelConfig, tokens, rows, num_new, canvas, cache: KVCache, soft=None,
                                 runtime: Runtime | None = None):
    """The causal pass writing tokens [G K, T] into rows `rows` [G, K] of the cache (its N rows in G
    groups; row g's k-th writes its first num_new[g K + k]) and the denoiser's pass over every row's
    canvas [N, L] after its committed tokens, in one pass over the layers
    (`Transformer.commit_rows_denoise_features`): (the canvases' [N, L, D] up to the final norm, the
    new cache)."""
    return _apply(config, runtime, variables(params), tokens, rows, num_new, canvas, cache, soft,
                  method="commit_rows_denoise_features")


def has_row_adapters(params) -> bool:
    """Whether `params` carry per-row LoRA adapter indices (`with_adapters(..., rows)`: a server's slots)."""
    entry = params.get(ADAPTERS_KEY) if isinstance(params, dict) else None
    return isinstance(entry, dict) and set(entry) == {"pairs", "rows"}


def soft_embed_pass(params, config: ModelConfig, logits, adapters=None, runtime: Runtime | None = None):
    """Self-conditioning soft embedding of logits [B, L, V]: [B, L, D]."""
    return _apply(config, runtime, variables(params, adapters), logits, method="soft_embed")


def image_features_pass(params, config: ModelConfig, pixel_values, position_ids, runtime: Runtime | None = None):
    """Images through the vision tower and `embed_vision`: pixel_values float [N, P, 3 p^2] in [0, 1],
    position_ids int [N, P, 2] (x, y; padding patches (-1, -1)) -> (features [N * S, D] with the valid soft
    tokens of all images first, row-major in image order, activation dtype; n_valid int32 scalar)."""
    return _apply(config, runtime, {"params": _base(params)}, pixel_values, position_ids, method="image_features")


def _base(params):
    """The parameters without the adapters they may carry (the vision tower has none)."""
    if isinstance(params, dict) and ADAPTERS_KEY in params:
        return {k: v for k, v in params.items() if k != ADAPTERS_KEY}
    return params


def _boxed_init(config: ModelConfig, rng):
    tokens = jnp.zeros((1, 2), jnp.int32)
    cache = init_cache(config, 1, 2)
    return _model(config).init(rng, tokens, cache, method="init_all")["params"]


def init_params(config: ModelConfig, rng: jax.Array | int = 0) -> Params:
    """Random parameters.

    Args:
      config: the model. rng: a PRNG key or an int seed.
    Returns:
      a nested dict of arrays in `config.param_dtype`, shaped as `param_shapes(config)`.
    """
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return nn.meta.unbox(jax.jit(_boxed_init, static_argnums=0)(config, rng))


def param_shapes(config: ModelConfig) -> Params:
    """The parameter tree's shapes and dtypes (nothing allocated).

    Args:
      config: the model.
    Returns:
      the parameter tree with a `jax.ShapeDtypeStruct` at every leaf.
    """
    return nn.meta.unbox(jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0)))


def logical_axes(config: ModelConfig) -> Params:
    """The parameter tree's logical axis names (what `axis_rules` maps onto a mesh).

    Args:
      config: the model.
    Returns:
      the parameter tree with a `PartitionSpec` of logical axis names at every leaf.
    """
    boxed = jax.eval_shape(functools.partial(_boxed_init, config), jax.random.key(0))
    return nn.get_partition_spec(boxed)


# ---------------------------------------------------------------------------- validation
def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_tokens(config: ModelConfig, tokens, what: str = "tokens") -> jax.Array:
    """Tokens must be an integer [B, T] array with ids in [0, vocab_size)."""
    if isinstance(tokens, (str, bytes)) or (isinstance(tokens, (list, tuple)) and tokens
                                            and isinstance(tokens[0], (str, bytes))):
        raise ValueError(f"{what} must be token ids (an integer [batch, length] array), not text: tokenize it "
                         "first (tokenizer.encode), or pass text to DiffusionGemma.generate")
    arr = tokens if isinstance(tokens, jax.Array) else np.asarray(tokens)
    if arr.ndim != 2:
        raise ValueError(f"{what} must have shape [batch, length]; got shape {tuple(arr.shape)}. "
                         f"Add a batch axis for a single sequence (e.g. tokens[None]).")
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{what} must be integer token ids; got dtype {arr.dtype}. Tokenize first.")
    if _is_concrete(arr) and arr.size:
        lo, hi = int(np.min(np.asarray(arr))), int(np.max(np.asarray(arr)))
        if lo < 0 or hi >= config.vocab_size:
            bad = hi if hi >= config.vocab_size else lo
            raise ValueError(f"{what} contains id {bad}, outside the vocabulary [0, {config.vocab_size}). "
                             "Check that the tokenizer matches the checkpoint.")
    return jnp.asarray(arr, jnp.int32)


def _check_cache(config: ModelConfig, cache: KVCache, batch: int):
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache from init_cache(); got {type(cache).__name__}")
    if not cache.groups and len(cache.keys) != config.num_layers:
        raise ValueError(f"cache has {len(cache.keys)} layers but the model has {config.num_layers}; "
                         "create it with init_cache(config, ...) for this config")
    check_replicas(config, cache.kv_replicas)
    if cache.batch_size != batch:
        raise ValueError(f"cache batch size {cache.batch_size} != input batch size {batch}")
    if cache.groups:
        plan = layer_plan(config)
        if cache.groups != plan.groups or len(cache.keys) != plan.period + len(plan.remainder):
            raise ValueError(f"the stacked cache has {cache.groups} groups and {len(cache.keys)} entries but this model "
                             f"scans {plan.groups} groups of {plan.period} layers (+{len(plan.remainder)}); create it "
                             "with init_cache(config, ..., layers='scan') for this config")
        shapes = cache_layer_shapes(cache, config)
    else:
        shapes = [(tuple(k.shape), tuple(v.shape)) for k, v in zip(cache.keys, cache.values)]
    ring = all(k[SLOT_AXIS] == layer_slots(config, i, cache.max_length) for i, (k, _) in enumerate(shapes))
    for i, (k, v) in enumerate(shapes):
        want = layer_shape(batch, layer_slots(config, i, cache.max_length, ring),
                           config.layer_kv_heads(i) * cache.replicas(i), config.layer_head_dim(i))
        if k != want or v != want:
            raise ValueError(f"cache layer {i} holds keys {k} / values {v} but this model "
                             f"needs {want} [batch, kv_heads (x replicas), slots (max_length, or a sliding layer's "
                             "ring), head_dim]; create the cache with init_cache(config, ...) for this config")


# ---------------------------------------------------------------------------- passes
@functools.partial(jax.jit, static_argnames=("config", "logits_mode", "runtime"))
def _prefill(params, config, tokens, lengths, cache, logits_mode, runtime=None, image_features=None,
             image_tokens=None):
    return encode_pass(params, config, tokens, cache.lengths, lengths, cache, logits_mode, runtime=runtime,
                       image_features=image_features, image_tokens=image_tokens)


@functools.partial(jax.jit, static_argnames=("config", "runtime"))
def _denoise(params, config, canvas, cache, context_end, soft, runtime=None):
    return denoise_logits(params, config, canvas, context_end, cache, soft, runtime=runtime)


@functools.partial(jax.jit, static_argnames=("config", "runtime"))
def _soft_embed(params, config, logits, runtime=None):
    return soft_embed_pass(params, config, logits, runtime=runtime)


def prefill(params: Params, config: ModelConfig, tokens, lengths=None, cache: KVCache | None = None, *,
            logits: str = "all", runtime: Runtime | None = None, image_features=None, image_tokens=None,
            padding: str = "right"):
    """Causal encoder pass: append tokens [B, T] to the cache at each row's current end.

    Row b's i-th valid token sits at position cache.lengths[b] + i and in that cache slot whichever
    side its padding is on; padding is never written to the cache and never visible. An image must
    lie wholly in one call; the k-th image placeholder (row-major) takes feature row k, and each run
    of placeholders is one image, which attends to itself bidirectionally.

    Args:
      params, config: the model.
      tokens: [B, T] int token ids (each in [0, vocab_size)).
      lengths: [B] valid tokens per row (default T).
      cache: from `init_cache` (default: a new one of exactly T slots).
      logits: "all" -> [B, T, V] float32 (in the layout of `tokens`; at padding they mean nothing),
        "last" -> [B, V] at each row's last valid token, "none" -> None.
      runtime: how it runs (default: this backend, one device).
      image_features: [N, hidden_size] float, the projected soft tokens of this pass's images in
        row-major order (the vision tower's output; unused trailing rows allowed).
      image_tokens: [B, T] bool, True on the image placeholders (mm_token_type_ids == 1), only among
        each row's valid tokens, at most N of them. Give both image arguments or neither.
      padding: "right" (row b's tokens are tokens[b, :lengths[b]]) or "left" (tokens[b, T - lengths[b]:],
        a tokenizer's left-padded batch: the same cache and logits as the right-padded batch).
    Returns:
      (logits, new cache), the cache's lengths advanced by `lengths`.
    Raises:
      ValueError naming the problem: token ids out of range, a cache too short for the pass, lengths
      out of [0, T], image arguments that do not match.
    """
    tokens = check_tokens(config, tokens)
    b, t = tokens.shape
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)
    if not jnp.issubdtype(jnp.asarray(lengths).dtype, jnp.integer):
        raise ValueError(f"lengths must be integers; got dtype {jnp.asarray(lengths).dtype}")
    lengths = jnp.asarray(lengths, jnp.int32)
    if lengths.shape != (b,):
        raise ValueError(f"lengths must have shape [{b}] (one per row); got {tuple(lengths.shape)}")
    if padding not in ("right", "left"):
        raise ValueError(f"padding must be 'right' or 'left' (where each row's padding is); got {padding!r}")
    if padding == "left":  # the same pass over the rows moved to the right-padded layout
        shift = t - lengths
        tokens = _roll_rows(tokens, shift)
        if image_tokens is not None:
            image_tokens = _roll_rows(jnp.asarray(image_tokens), shift)
        out, cache = prefill(params, config, tokens, lengths, cache, logits=logits, runtime=runtime,
                             image_features=image_features, image_tokens=image_tokens)
        return (_roll_rows(out, -shift) if logits == "all" else out), cache
    if cache is None:
        cache = init_cache(config, b, t)
    _check_cache(config, cache, b)
    if logits not in ("all", "last", "none"):
        raise ValueError(f"logits must be 'all', 'last' or 'none'; got {logits!r}")
    if _is_concrete(lengths) and _is_concrete(cache.lengths):
        ln, st = np.asarray(lengths), np.asarray(cache.lengths)
        if (ln < 0).any() or (ln > t).any():
            raise ValueError(f"lengths must be in [0, {t}]; got {ln.tolist()}")
        if (ln + st > cache.max_length).any():
            need = int((ln + st).max())
            raise ValueError(f"the cache holds {cache.max_length} tokens per row but this pass needs {need} "
                             f"(already committed {st.tolist()} + new {ln.tolist()}); create the cache with "
                             f"init_cache(config, batch, max_length>={need}) or shorten the prompt")
    if image_features is None and image_tokens is None:
        return _prefill(params, config, tokens, lengths, cache, logits, runtime)
    image_features, image_tokens = _check_images(config, image_features, image_tokens, lengths, (b, t))
    return _prefill(params, config, tokens, lengths, cache, logits, runtime, image_features, image_tokens)


def _roll_rows(x, shift):
    """x [B, T, ...] with row b moved `shift[b]` places to the left (cyclically): out[b, i] = x[b, i + shift[b]]."""
    t = x.shape[1]
    idx = (jnp.arange(t)[None, :] + shift[:, None]) % t
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


@functools.partial(jax.jit, static_argnames=("config", "runtime"))
def _image_features(params, config, pixel_values, position_ids, runtime=None):
    return image_features_pass(params, config, pixel_values, position_ids, runtime=runtime)


def image_features(params: Params, config: ModelConfig, pixel_values, position_ids, *,
                   runtime: Runtime | None = None) -> jax.Array:
    """The vision tower's output: the soft tokens that replace a prompt's image placeholders.

    Checked and jitted; the number of rows is read on the host, so inside your own `jax.jit` use
    `dgemma_jax.model.api.image_features_pass` (static shapes: all N * P / k^2 rows, the valid ones
    first, and their count).

    Args:
      pixel_values: float [N, P, 3 p^2] in [0, 1], as `dgemma_jax.io.images.preprocess_images` makes
        them (`.pixel_values`).
      position_ids: int [N, P, 2] patch positions (x, y; padding patches (-1, -1)) (`.position_ids`).
      runtime: how it runs (default: this backend, one device).
    Returns:
      [sum of the images' soft tokens, hidden_size] in the activation dtype: image 0's soft tokens,
      then image 1's, ...; row k is what the k-th image placeholder of the prompt (row-major) gets in
      `prefill(..., image_features=, image_tokens=)` and in the engine's prompt pass.
    """
    v = config.vision
    if v is None:
        raise ValueError(f"{config.name} has no vision tower (ModelConfig.vision is None): load a checkpoint with "
                         "vision weights to compute image features")
    px, pos = jnp.asarray(pixel_values), jnp.asarray(position_ids)
    if px.ndim != 3 or px.shape[-1] != v.patch_dim or tuple(pos.shape) != tuple(px.shape[:2]) + (2,):
        raise ValueError(f"pixel_values must be [N, patches, {v.patch_dim}] and position_ids [N, patches, 2]; got "
                         f"{tuple(px.shape)} and {tuple(pos.shape)}: preprocess the images with this config's patch "
                         f"size ({v.patch_size}, dgemma_jax.io.images.preprocess_images)")
    features, n_valid = _image_features(params, config, px.astype(jnp.float32), pos.astype(jnp.int32), runtime)
    if not _is_concrete(n_valid):
        raise ValueError("image_features reads its row count on the host and cannot be traced: inside jax.jit use "
                         "dgemma_jax.model.api.image_features_pass (all rows, the valid ones first, and their count)")
    return features[: int(n_valid)]


def _check_images(config: ModelConfig, image_features, image_tokens, lengths, shape) -> tuple[jax.Array, jax.Array]:
    """`prefill`'s image inputs, checked: shapes and dtypes always, counts when concrete."""
    if image_features is None or image_tokens is None:
        missing = "image_features" if image_features is None else "image_tokens"
        raise ValueError(f"image_features and image_tokens go together; {missing} is missing")
    feats = image_features if isinstance(image_features, jax.Array) else np.asarray(image_features)
    if feats.ndim != 2 or feats.shape[1] != config.hidden_size:
        raise ValueError(f"image_features must be [num_soft_tokens, hidden_size={config.hidden_size}] (the projected "
                         f"vision features of every image, row-major); got shape {tuple(feats.shape)}")
    if feats.shape[0] == 0:
        raise ValueError("image_features has no rows; for a text-only pass leave image_features and image_tokens None")
    if not jnp.issubdtype(feats.dtype, jnp.floating):
        raise ValueError(f"image_features must be floating point; got dtype {feats.dtype}")
    marks = image_tokens if isinstance(image_tokens, jax.Array) else np.asarray(image_tokens)
    if tuple(marks.shape) != tuple(shape):
        raise ValueError(f"image_tokens must have the shape of tokens {tuple(shape)} (True on image placeholders); "
                         f"got {tuple(marks.shape)}")
    if marks.dtype != bool:
        raise ValueError(f"image_tokens must be a bool mask (e.g. mm_token_type_ids == 1); got dtype {marks.dtype}")
    if _is_concrete(marks) and _is_concrete(lengths):
        m, ln = np.asarray(marks), np.asarray(lengths)
        beyond = m & (np.arange(shape[1])[None, :] >= ln[:, None])
        if beyond.any():
            rows = sorted(set(np.nonzero(beyond)[0].tolist()))
            raise ValueError(f"image_tokens marks padding (positions at or beyond lengths) in rows {rows}; "
                             "images must lie among each row's valid tokens")
        if int(m.sum()) > feats.shape[0]:
            raise ValueError(f"image_tokens marks {int(m.sum())} image placeholders but image_features has only "
                             f"{feats.shape[0]} rows; every placeholder needs its feature row")
    return jnp.asarray(feats), jnp.asarray(marks)


def soft_embed(params: Params, config: ModelConfig, sc_logits, *, runtime: Runtime | None = None) -> jax.Array:
    """The self-conditioning soft embedding softmax_fp32(logits) @ E * sqrt(D).

    Args:
      sc_logits: [B, L, V] the previous step's tempered logits.
    Returns:
      [B, L, D] the next step's self-conditioning input.
    """
    return _soft_embed(params, config, sc_logits, runtime)


def denoise(params: Params, config: ModelConfig, canvas, cache: KVCache, self_conditioning=None, *,
            context_end=None, runtime: Runtime | None = None) -> jax.Array:
    """One bidirectional denoiser pass over a canvas; reads the cache, never writes it.

    Args:
      canvas: [B, L] int token ids.
      cache: the `KVCache` [B, S] holding the committed context.
      self_conditioning: None (first step, exactly zero), the previous step's tempered logits
        [B, L, V], or the soft embeddings they give [B, L, D].
      context_end: [B] committed tokens visible to the canvas (default: cache.lengths); the
        canvas sits at positions context_end[b] + j.
      runtime: how it runs (default: this backend, one device).
    Returns:
      float32 logits [B, L, V].
    """
    canvas = check_tokens(config, canvas, "canvas")
    b, l = canvas.shape
    if l == 0:
        raise ValueError("canvas must hold at least one token; got shape (batch, 0)")
    _check_cache(config, cache, b)
    if context_end is not None and not jnp.issubdtype(jnp.asarray(context_end).dtype, jnp.integer):
        raise ValueError(f"context_end must be integers; got dtype {jnp.asarray(context_end).dtype}")
    ctx = cache.lengths if context_end is None else jnp.asarray(context_end, jnp.int32)
    if ctx.shape != (b,):
        raise ValueError(f"context_end must have shape [{b}] (one per row); got {tuple(ctx.shape)}")
    if _is_concrete(ctx) and _is_concrete(cache.lengths):
        c, n = np.asarray(ctx), np.asarray(cache.lengths)
        if (c < 0).any() or (c > n).any():
            raise ValueError(f"context_end must be in [0, cache.lengths] per row (only committed tokens can "
                             f"be visible); got {c.tolist()} with cache.lengths {n.tolist()}")
        ring = sliding_slots(cache)
        back = ring - config.sliding_window + 1
        if ((n > ring) & (c < n - back)).any():
            raise ValueError(f"context_end {c.tolist()} lies more than {back} tokens before "
                             f"cache.lengths {n.tolist()}: the sliding layers' ring caches ({ring} slots) no longer "
                             "hold the window before it; denoise at cache.lengths, or prefill the context again")
    soft = None
    if self_conditioning is not None:
        sc = jnp.asarray(self_conditioning)
        if sc.ndim != 3 or sc.shape[:2] != (b, l):
            raise ValueError(f"self_conditioning must be [batch={b}, canvas={l}, V or D]; got {tuple(sc.shape)}")
        if sc.shape[-1] == config.vocab_size and sc.shape[-1] != config.hidden_size:
            soft = soft_embed(params, config, sc, runtime=runtime)
        elif sc.shape[-1] == config.hidden_size and sc.shape[-1] != config.vocab_size:
            soft = sc
        else:
            raise ValueError(f"self_conditioning last axis {sc.shape[-1]} is neither vocab_size "
                             f"{config.vocab_size} (logits) nor hidden_size {config.hidden_size} (soft embeddings)"
                             + (" (they are equal: pass soft_embed(...) output explicitly)"
                                if config.vocab_size == config.hidden_size else ""))
    return _denoise(params, config, canvas, cache, ctx, soft, runtime)
