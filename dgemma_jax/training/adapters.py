"""LoRA adapters as `dgemma train` saves them, loaded for generation and serving (unmerged).

A LoRA run's work directory is the adapter: its `config.json` (the resolved recipe: `lora.rank`,
`lora.alpha`, `lora.groups`) and its `checkpoints/<step>/state` (orbax; with `lora.enabled` the
checkpoint's "params" are the adapters {..path..: {"a": A, "b": B}}, float32). `load_adapter` takes
the work directory (its latest checkpoint) or one `checkpoints/<step>` directory and reads only the
adapters (not the optimizer state), checked against the base model they will run on.

Generation runs an adapter as training does, unmerged: `Engine(config, params, adapters=single(config,
adapter))`. Serving runs several at once: `stack(config, adapters)`
stacks them [N + 1, ...] behind a zero adapter (index 0: the base model), ranks padded with zeros
to the largest (exact: the padded columns of A meet zero rows of B), and every batch row picks its
own (`model.api.with_rows`).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dgemma_jax.config import ModelConfig
from dgemma_jax.model.api import param_shapes
from dgemma_jax.training import lora as lora_lib


@dataclasses.dataclass(frozen=True)
class Adapter:
    """A loaded LoRA adapter: where from, its rank, alpha and groups, and the {path: {"a", "b"}} tree."""

    path: str
    rank: int
    alpha: float
    groups: tuple[str, ...]
    tree: dict = dataclasses.field(repr=False)


def locate(path: str) -> tuple[str, str]:
    """(the run's config.json, the checkpoint's state item) of a work directory or a checkpoints/<step>;
    ValueError naming the problem when `path` holds no adapter checkpoint (checked before any model loads)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path}: no such directory; give a LoRA run's train.workdir (its latest "
                         "checkpoint) or one of its checkpoints/<step> directories")
    if os.path.isdir(os.path.join(path, "state")):    # checkpoints/<step>
        return os.path.join(path, "..", "..", "config.json"), os.path.join(path, "state")
    ckpts = os.path.join(path, "checkpoints")
    steps = sorted((int(d) for d in (os.listdir(ckpts) if os.path.isdir(ckpts) else ()) if d.isdigit()
                    and os.path.isdir(os.path.join(ckpts, d, "state"))), reverse=True)
    if not steps:
        raise ValueError(f"LoRA adapter {path}: no checkpoint in it (checkpoints/<step>/state); give a LoRA run's "
                         "train.workdir or one of its checkpoints/<step> directories")
    return os.path.join(path, "config.json"), os.path.join(ckpts, str(steps[0]), "state")


def load_adapter(path: str, config: ModelConfig) -> Adapter:
    """The adapter a LoRA run saved at `path` (its work directory: the latest checkpoint; or a
    checkpoints/<step>), checked to fit `config`'s kernels. ValueError naming the problem otherwise."""
    recipe_path, state = locate(path)
    try:
        with open(recipe_path) as f:
            recipe = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {path}: cannot read the run's recipe {os.path.normpath(recipe_path)} "
                         f"({e})") from None
    lc = recipe.get("lora") or {}
    if not lc.get("enabled"):
        raise ValueError(f"LoRA adapter {path}: the run was not a LoRA run (its recipe has lora.enabled false): its "
                         "checkpoints hold full weights; load them as a checkpoint (export/) instead")
    rank = int(lc.get("rank", 16))
    alpha = float(rank if lc.get("alpha") is None else lc["alpha"])
    groups = tuple(lc.get("groups", ("attention", "mlp")))
    try:
        target = jax.eval_shape(lambda p: lora_lib.init_lora(config, p, jax.random.key(0), rank, groups),
                                param_shapes(config))
    except ValueError as e:
        raise ValueError(f"LoRA adapter {path} does not fit {config.name}: {e}") from None
    abstract = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), target)}
    try:
        meta = ocp.PyTreeCheckpointer().metadata(state)
        saved = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta.tree
        saved_shapes = {lora_lib.path_str(p): tuple(m.shape) for p, m in
                        jax.tree_util.tree_flatten_with_path(saved.get("params", {}))[0]}
    except Exception as e:  # noqa: BLE001 - orbax's own errors: the directory is not a checkpoint it can read
        raise ValueError(f"LoRA adapter {path}: {state} is not a readable orbax checkpoint ({type(e).__name__}: {e})") \
            from None
    want = {lora_lib.path_str(p): tuple(s.shape) for p, s in jax.tree_util.tree_flatten_with_path(abstract["params"])[0]}
    if saved_shapes != want:
        diff = sorted(set(saved_shapes.items()) ^ set(want.items()))[:3]
        raise ValueError(f"LoRA adapter {path} does not fit {config.name} (rank {rank}, groups {list(groups)}): "
                         f"its arrays differ from this model's, e.g. {diff}; serve it with the base model it was "
                         "trained on")
    restored = ocp.PyTreeCheckpointer().restore(state, args=ocp.args.PyTreeRestore(
        item=abstract, restore_args=jax.tree.map(lambda s: ocp.RestoreArgs(restore_type=np.ndarray, dtype=s.dtype),
                                                 abstract), partial_restore=True))
    tree = jax.tree.map(jnp.asarray, restored["params"])
    return Adapter(os.fspath(path), rank, alpha, groups, tree)


def single(config: ModelConfig, adapter: Adapter) -> dict:
    """One adapter laid out for the model's "lora" collection (every row runs it)."""
    return lora_lib.forward_adapters(config, param_shapes(config), adapter.tree, adapter.alpha, adapter.rank)


def stack(config: ModelConfig, adapters: list[Adapter]) -> dict:
    """Adapters 1..N stacked behind a zero adapter 0 (the base model), per kernel A [N + 1, *in, r]
    and B [N + 1, r, *out] (r: the largest rank; a kernel an adapter does not adapt gets zeros
    there). The expert kernels' adapters cannot be picked per row (the MoE dispatch mixes the rows'
    tokens): ValueError for an adapter on the "experts" group."""
    for ad in adapters:
        if "experts" in ad.groups:
            raise ValueError(f"LoRA adapter {ad.path} adapts the experts group, which serving cannot pick per "
                             "request (the MoE dispatch mixes the rows' tokens); merge it into the base instead")
    laid = [single(config, ad) for ad in adapters]
    r = max(ad.rank for ad in adapters)
    paths = sorted({p for tree in laid for p in lora_lib._lora_leaves(tree)})
    out: dict = {}
    for p in paths:
        ref = next(lora_lib._lora_leaves(t)[p] for t in laid if p in lora_lib._lora_leaves(t))
        a_shape, b_shape = ref["a"].shape[:-1], ref["b"].shape[1:]
        a_all = [np.zeros((*a_shape, r), np.float32)]
        b_all = [np.zeros((r, *b_shape), np.float32)]
        for tree in laid:
            ab = lora_lib._lora_leaves(tree).get(p)
            a = np.zeros((*a_shape, r), np.float32)
            b = np.zeros((r, *b_shape), np.float32)
            if ab is not None:
                k = ab["a"].shape[-1]
                a[..., :k] = np.asarray(ab["a"], np.float32)
                b[:k] = np.asarray(ab["b"], np.float32)
            a_all.append(a)
            b_all.append(b)
        lora_lib._set(out, p, {"a": jnp.asarray(np.stack(a_all)), "b": jnp.asarray(np.stack(b_all))})
    return out
