"""The training driver: `train(config)` runs a recipe (an ml_collections ConfigDict, see configs/).

    from dgemma_jax.training import train
    from configs import train_bundled
    summary = train(train_bundled.get_config())

Work directory (config.train.workdir)::

    config.json         the resolved recipe
    checkpoints/<step>  orbax: params (or adapters), optimizer state, step, rng, iterator position
    metrics.jsonl       one line per logged step (loss, diffusion_loss, ar_loss, grad_norm, lr, ...)
    eval.jsonl          one line per evaluation (real sampler: exact match, steps, tokens/forward)
    loss_curve.png      losses (and eval accuracy) vs step
    export/             final inference params (LoRA merged) in orbax format, if train.export
    data_stats.json     chat data only: conversations, examples, what was dropped or truncated
    summary.json        final numbers

The work directory is a local path or a gs:// URL (handed to orbax unchanged; the other files go
through etils.epath). Re-running with the same workdir resumes from the latest checkpoint and
continues exactly (the data order depends only on (seed, batch index), the rng is in the checkpoint).
Multi-host (a pod: train.mesh over every process's devices): every process runs this same function
and joins each checkpoint save, restore and the export; process 0 alone writes the other files.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from dgemma_jax import compile_cache
from dgemma_jax.config import RUNTIME_CHOICES, ModelConfig
from dgemma_jax.engine import Engine
from dgemma_jax.io.bundled import load_bundled
from dgemma_jax.io.char_tokenizer import CharTokenizer
from dgemma_jax.io.hf import load_hf
from dgemma_jax.io.locations import orbax_path, resolve
from dgemma_jax.io.model_dir import config_from_dict
from dgemma_jax.io.tokenizer import load_tokenizer
from dgemma_jax.model.api import init_params, param_shapes
from dgemma_jax.parallel import Shardings, make_mesh
from dgemma_jax.parallel.shardings import fetch
from dgemma_jax.parallel.distributed import is_main_process
from dgemma_jax.runtime import Runtime, split_choices
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.training import data as data_lib
from dgemma_jax.training import image_tasks
from dgemma_jax.training import lora as lora_lib
from dgemma_jax.training.dpo import PairSource
from dgemma_jax.training.checkpoint import Checkpointer, load_params, save_params
from dgemma_jax.training.evaluate import evaluate_exact_match
from dgemma_jax.training.objective import ObjectiveConfig
from dgemma_jax.training.optim import make_optimizer
from dgemma_jax.training.recipe import (DataSection, EvalSection, InitSection, ModelSection, RLSection, TrainConfig,
                                        TrainSection, plain, section_keys)
from dgemma_jax.training.rl import GRPOStep, PromptSource, load_reward
from dgemma_jax.training.plots import plot_loss_curve, read_jsonl
from dgemma_jax.training.step import (LoraSpec, inference_params, init_train_state, make_dpo_step, make_rl_update,
                                      make_train_step)
from dgemma_jax.training.tasks import TaskMix, task_tokenizer


def _tuples(d: dict) -> dict:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


# ---------------------------------------------------------------------------- builders
def build_tokenizer(dc: DataSection):
    kind = dc.tokenizer
    if kind == "tasks":
        return task_tokenizer()
    if kind == "char":
        if not dc.chars:
            raise ValueError("data.tokenizer 'char' needs data.chars (the vocabulary's characters)")
        return CharTokenizer(dc.chars, tuple(dc.markers))
    if kind == "image_tasks":  # the characters of the image tasks' instructions and the image markers
        return CharTokenizer(image_tasks.VISION_CHARS, image_tasks.MARKERS)
    if kind in ("char_file", "hf") and not dc.tokenizer_path:
        raise ValueError(f"data.tokenizer {kind!r} needs data.tokenizer_path")
    if kind == "char_file":
        return CharTokenizer.load(dc.tokenizer_path)
    if kind == "hf":
        return load_tokenizer(dc.tokenizer_path)  # a checkpoint directory or its tokenizer.json
    raise ValueError(f"unknown data.tokenizer {kind!r}: use 'tasks', 'image_tasks', 'char', 'char_file' or 'hf'")


def build_model_and_params(mc: ModelSection, ic: InitSection, vocab_size: int | None):
    """(ModelConfig, params) from the recipe's model + init sections."""
    kind = ic.kind
    # execution choices among the overrides (remat, MoE dispatch, ...) go to the trainer's Runtime
    overrides, _ = split_choices(_tuples(dict(mc.overrides)))
    if kind in ("hf", "orbax") and not ic.path:
        raise ValueError(f"init.kind {kind!r} needs init.path")
    if kind == "hf":
        cfg, params = load_hf(ic.path, dtype=mc.param_dtype, revision=ic.revision or None)
        return cfg.replace(**overrides) if overrides else cfg, params
    if kind == "bundled":  # the config comes with the checkpoint; overrides change execution knobs
        path = resolve(ic.path, ic.revision or None) if ic.path else None
        cfg, params, _, _ = load_bundled(ic.name or None, path)
        return cfg.replace(**overrides) if overrides else cfg, params
    if mc.preset:
        cfg = ModelConfig.preset(mc.preset, **overrides)
    elif kind == "orbax" and os.path.exists(os.path.join(ic.path, "..", "model_config.json")):
        with open(os.path.join(ic.path, "..", "model_config.json")) as f:
            cfg = config_from_dict({**json.load(f), **overrides})
    else:
        cfg = ModelConfig(**overrides)
    if vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ValueError(f"model vocab_size={cfg.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if kind == "orbax":  # params saved by save_params (e.g. a run's export/ or an asset's params/)
        return cfg, load_params(resolve(ic.path, check=False), param_shapes(cfg))
    if kind != "random":
        raise ValueError(f"unknown init.kind {kind!r}: use 'random', 'hf', 'orbax' or 'bundled'")
    params = init_params(cfg, int(ic.seed))
    if ic.embedding_std:  # from-scratch: unit-RMS inputs after the sqrt(D) scale, O(1) initial logits
        params = dict(params)
        params["embedding"] = (jax.random.normal(jax.random.key(int(ic.seed) + 1),
                                                 params["embedding"].shape, jnp.float32) * ic.embedding_std
                               ).astype(params["embedding"].dtype)
    if ic.vision_from_scratch and cfg.vision is not None:
        params = _vision_from_scratch(params, int(ic.seed))
    return cfg, params


def _vision_from_scratch(params, seed: int):
    """A tower init that can learn to see: the patch projection at std 1/sqrt(3 p^2) (unit-RMS patch
    features from pixels in [-1, 1]), random position tables (std 0.5) and the projection into the text
    at std 1/sqrt(D_v) (unit-RMS image embeddings, as the text's). The default init (the reference's:
    tables of ones, projections std 0.02) gives every patch the same position and buries the pixels under
    it: the soft tokens of any two pictures then differ by ~4% of their size, at 1/6 of the text's scale."""
    tower = dict(params["vision_tower"])
    k_in, k_pos, k_out = jax.random.split(jax.random.key(seed + 2), 3)
    proj = params["embed_vision"]["projection"]
    embed = dict(params["embed_vision"],
                 projection=(jax.random.normal(k_out, proj.shape, jnp.float32) / np.sqrt(proj.shape[0])
                             ).astype(proj.dtype))
    w, table = tower["input_proj"], tower["position_table"]
    tower["input_proj"] = (jax.random.normal(k_in, w.shape, jnp.float32) / np.sqrt(w.shape[0])).astype(w.dtype)
    tower["position_table"] = (jax.random.normal(k_pos, table.shape, jnp.float32) * 0.5).astype(table.dtype)
    return dict(params, vision_tower=tower, embed_vision=embed)


def build_source(dc: DataSection, tokenizer, layout: data_lib.Layout, batch_size: int, seed: int,
                 config: ModelConfig | None = None):
    kind = dc.kind
    if kind in ("jsonl", "chat", "raw_text") and not dc.path:
        raise ValueError(f"data.kind {kind!r} reads its examples from data.path; set it")
    if kind == "tasks":
        return data_lib.TaskSource(TaskMix.from_config(dc.tasks), tokenizer, layout, batch_size, seed)
    if kind == "image_tasks":
        if config is None or config.vision is None:
            raise ValueError("data.kind 'image_tasks' trains the image path: the model needs a vision tower "
                             "(model.overrides.vision and the image token ids)")
        return image_tasks.ImageTaskSource(image_tasks.tasks_from_config(dc.image_tasks), tokenizer, layout,
                                           batch_size, config, dc.max_soft_tokens, seed)
    if kind == "jsonl":
        return data_lib.JsonlSource(dc.path, tokenizer.encode, layout, batch_size, seed, dc.prompt_key,
                                    dc.response_key, dc.bos_id)
    if kind == "chat":
        return data_lib.ChatSource(dc.path, tokenizer.encode, layout, batch_size, seed, dc.overflow)
    if kind == "raw_text":
        with open(dc.path) as f:
            docs = [tokenizer.encode(d) for d in f.read().split(dc.separator) if d.strip()]
        return data_lib.RawTextSource(docs, layout, batch_size, seed, int(dc.min_prompt), dc.bos_id)
    raise ValueError(f"unknown data.kind {kind!r}: use 'tasks', 'image_tasks', 'jsonl', 'chat' or 'raw_text'")


EXTRA_PROMPT_SEED = 1_000_003   # data.seed + this: dynamic sampling's extra prompt stream


def rl_source(rc: RLSection, dc: DataSection, tokenizer, layout: data_lib.Layout, config: ModelConfig | None = None,
              seed: int | None = None):
    """The data of an rl recipe: preference pairs (dpo) or prompts with their references (grpo); seed:
    data.seed unless given (dynamic sampling's extra prompts are another stream)."""
    bs, seed = int(dc.batch_size), int(dc.seed if seed is None else seed)
    if rc.algorithm == "dpo":
        if dc.kind != "jsonl" or not dc.path:
            raise ValueError("rl.algorithm 'dpo' reads preference pairs from JSON lines: set data.kind='jsonl' and "
                             "data.path (one {prompt, chosen, rejected} per line)")
        return PairSource(dc.path, tokenizer.encode, layout, bs, seed, dc.prompt_key, rc.chosen_key,
                          rc.rejected_key, dc.bos_id)
    if dc.kind == "tasks":
        return PromptSource(bs, seed, task_source=data_lib.TaskSource(TaskMix.from_config(dc.tasks), tokenizer, layout,
                                                                      bs, seed))
    if dc.kind == "image_tasks":
        return PromptSource(bs, seed, image_source=build_source(dc, tokenizer, layout, bs, seed, config))
    if dc.kind == "jsonl" and dc.path:
        return PromptSource.from_jsonl(dc.path, bs, seed, dc.prompt_key, dc.response_key)
    raise ValueError(f"rl.algorithm 'grpo' takes its prompts from data.kind 'tasks', 'image_tasks' or 'jsonl' "
                     f"(with data.path), not {dc.kind!r}")


def _read_pairs(path: str, prompt_key: str, response_key: str, what: str) -> list[tuple[str, str]]:
    pairs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if prompt_key not in row or response_key not in row:
                raise ValueError(f"{what} {path} line {n} lacks {prompt_key!r} or {response_key!r}")
            pairs.append((row[prompt_key], row[response_key]))
    if not pairs:
        raise ValueError(f"{what} {path} holds no examples")
    return pairs


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_eval_source(dc: DataSection, ec: EvalSection | None) -> None:
    """Raise if the eval data overlaps the training data: a task eval drawn with the training seed
    (its problems are training batch 99's), an eval file that is the training file, or an eval file
    sharing examples with it."""
    if ec is None:
        return
    kind = dc.kind
    path = ec.path
    if not path:
        if kind in ("tasks", "image_tasks") and int(ec.seed) == int(dc.seed):
            raise ValueError(f"eval.seed {int(ec.seed)} equals data.seed: the eval problems would "
                             "be drawn exactly as training batch 99 is (the eval set is then a training batch); "
                             "choose a different eval.seed")
        return
    if kind == "tasks":
        return
    if not dc.path:
        return
    if _same_file(path, dc.path):
        raise ValueError(f"eval.path {path} is the training file data.path {dc.path}: evaluate on held-out data")
    if kind == "jsonl":
        pk, rk = dc.prompt_key, dc.response_key
        train_pairs = set(_read_pairs(dc.path, pk, rk, "data.path"))
        evals = _read_pairs(path, ec.prompt_key or pk, ec.response_key or rk, "eval.path")
        shared = sum(p in train_pairs for p in evals)
        if shared:
            raise ValueError(f"{shared} of the {len(evals)} examples in eval.path {path} also appear in the "
                             f"training file {dc.path}: remove them from one of the two")


AR_LOSS = {"all": True, "assistant": False}


def objective_options(dc: DataSection, oc) -> dict:
    """The objective section, with chat data's `data.ar_loss` ("all": the encoder AR loss on every
    token of each example, the spec's default; "assistant": only on the assistant turn's tokens)
    mapped onto `ar_on_prompt` (each chat example's prompt is the context, its response the turn)."""
    oc = dict(oc)
    if dc.ar_loss is None:
        return oc
    if dc.kind != "chat":
        raise ValueError(f"data.ar_loss applies to data.kind='chat' only (got kind {dc.kind!r}); "
                         "use objective.ar_on_prompt")
    if dc.ar_loss not in AR_LOSS:
        raise ValueError(f"data.ar_loss must be one of {tuple(AR_LOSS)}, got {dc.ar_loss!r}")
    on_prompt = AR_LOSS[dc.ar_loss]
    if "ar_on_prompt" in oc and bool(oc["ar_on_prompt"]) != on_prompt:
        raise ValueError(f"data.ar_loss={dc.ar_loss!r} contradicts objective.ar_on_prompt={oc['ar_on_prompt']}: "
                         "set only one of them")
    oc["ar_on_prompt"] = on_prompt
    return oc


def sampler_from(ec: EvalSection | None, cfg: ModelConfig, settings=None) -> SamplerConfig:
    """The eval section's sampler (or `settings`, e.g. rl.sampler) with the model's canvas length, EOS and pad."""
    sc = dict(settings) if settings is not None else dict(ec.sampler) if ec is not None else {}
    sc.setdefault("canvas_length", cfg.canvas_length)
    sc.setdefault("eos_ids", cfg.eos_ids)
    sc.setdefault("pad_id", cfg.pad_id)
    return SamplerConfig(**_tuples(sc))


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.generic, jax.Array)):
        return np.asarray(x).item()
    return x


class JsonLines:
    """A JSON-lines log of the run (metrics.jsonl, eval.jsonl) on process 0: its rows in memory, the
    file a local path or a gs:// URL. A local file grows a line at a time (readable while the run goes
    on); an object store cannot append, so there `flush()` rewrites the whole file (the trainer flushes
    before every checkpoint and at the end: a checkpoint never exists without the rows up to it)."""

    def __init__(self, path: epath.Path, enabled: bool = True):
        self.path, self.enabled = path, enabled
        self.local = not _is_url(path)
        self.rows = read_jsonl(path) if enabled else []
        self._dirty = False

    def truncate(self, max_step: int) -> None:
        """Drop the rows after `max_step` (those of a run that went past its last checkpoint)."""
        if not self.enabled:
            return
        self.rows = [r for r in self.rows if r.get("step", 0) <= max_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))

    def append(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        if self.local:
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        else:
            self._dirty = True

    def flush(self) -> None:
        if self._dirty:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            self._dirty = False


def _is_url(path) -> bool:
    return "://" in os.fspath(path)


def _write_json(path: epath.Path, obj) -> None:
    path.write_text(json.dumps(_jsonable(obj), indent=1))


# ---------------------------------------------------------------------------- run
class Run:
    """Everything a recipe builds (model, data, optimizer, state, step function); `train` drives it."""

    def __init__(self, config):
        """config: a recipe (`get_config()`, overrides applied) or its typed `TrainConfig`."""
        self.config = config
        recipe = config if isinstance(config, TrainConfig) else TrainConfig.from_recipe(config)
        self.recipe = recipe
        dc, tc, ec, lc = recipe.data, recipe.train, recipe.eval, recipe.lora
        self.tc, self.ec, self.dc = tc, ec, dc
        check_eval_source(dc, ec)
        self.tokenizer = build_tokenizer(dc)
        self.model_config, base = build_model_and_params(recipe.model, recipe.init,
                                                         getattr(self.tokenizer, "vocab_size", None))
        cfg = self.model_config
        _, choices = split_choices(_tuples(dict(recipe.model.overrides)))
        # train.mesh (e.g. "fsdp=8" or "expert=4"): parameters placed in their shards, the batch split
        # over data/fsdp, the step traced under the rule set's logical constraints (train.rules)
        self.shardings = None
        if tc.mesh:
            self.shardings = Shardings(cfg, make_mesh(tc.mesh), tc.rules)
            base = self.shardings.place_params(base)
        # how the step runs: the mesh and rules (when sharded) and the recipe's execution choices
        self.runtime = self.shardings.runtime(**choices) if self.shardings is not None else Runtime(**choices)
        L = cfg.canvas_length
        self.layout = data_lib.Layout(int(dc.prompt_length), int(dc.num_canvases), L,
                                      eos_id=cfg.eos_ids[0], pad_id=cfg.pad_id)
        self.seed = int(tc.seed)
        self.rl = recipe.rl
        if self.rl is None:
            self.source = build_source(dc, self.tokenizer, self.layout, int(dc.batch_size), int(dc.seed), cfg)
        else:
            self.source = rl_source(self.rl, dc, self.tokenizer, self.layout, cfg)
        self.obj = ObjectiveConfig(canvas_length=L, **objective_options(dc, recipe.objective))
        self.num_steps = int(tc.num_steps)
        oc = dict(recipe.optimizer)
        freeze = list(oc.pop("freeze", ()) or ())
        if oc.pop("freeze_router", False):
            freeze.append(lora_lib.ROUTER_PATTERN)
        if cfg.vision is not None and dc.kind != "image_tasks":
            # text-only training: no gradient reaches the tower, and no weight decay either
            freeze.append(lora_lib.VISION_PATTERN)
        self.lora = None
        if lc.enabled:
            self.lora = LoraSpec(int(lc.rank), float(lc.rank if lc.alpha is None else lc.alpha), tuple(lc.groups))
            self.frozen = base
            trainable = lora_lib.init_lora(cfg, base, jax.random.key(self.seed + 7), self.lora.rank,
                                           self.lora.groups)
            freeze = []  # adapters only; the base (router included) never changes
        else:
            self.frozen = None
            trainable = base
        # an RL step makes rl.updates_per_rollout optimizer updates
        updates = int(self.rl.updates_per_rollout) if self.rl is not None and self.rl.algorithm == "grpo" else 1
        self.optimizer, self.schedule = make_optimizer(total_steps=self.num_steps * updates, freeze=tuple(freeze), **oc)
        self.state = init_train_state(trainable, self.optimizer, self.seed)
        if self.shardings is not None:  # counters, keys, adapters and their moments: replicated
            n = self.shardings.mesh.devices.size
            self.state = jax.tree.map(lambda x: x if len(x.sharding.device_set) == n
                                      else jax.device_put(x, self.shardings.replicated), self.state)
        if self.rl is None:
            step_fn = make_train_step(cfg, self.obj, self.optimizer, schedule=self.schedule, lora=self.lora,
                                      runtime=self.runtime)
            self.step_fn = lambda state, frozen, batch: step_fn(state, frozen, self.place(batch))
        else:
            self.step_fn = self._rl_step(base)
        self.sampler = sampler_from(ec, cfg)

    def place(self, batch: dict) -> dict:
        """A host batch as the step's input: split over the mesh's batch axes when sharded."""
        sh = self.shardings
        if sh is None:
            return batch
        return {k: sh.global_array(v, ("batch",) + (None,) * (np.ndim(v) - 1)) for k, v in batch.items()}

    def _rl_step(self, base):
        """The step of an rl recipe: a jitted DPO update, or GRPO's rollout + reward + jitted update."""
        rc, cfg = self.rl, self.model_config
        # the frozen reference: the base under LoRA (adapters off), else a copy of the initial weights (the
        # state's own buffers are donated to each update)
        reference = None if self.lora is not None else jax.tree.map(jnp.copy, base)
        common = dict(num_canvases=self.layout.num_canvases, lora=self.lora, num_samples=int(rc.num_samples),
                      t_eps=float(rc.t_eps), schedule=self.schedule, runtime=self.runtime)
        if rc.algorithm == "dpo":
            fn = make_dpo_step(cfg, self.optimizer, beta=float(rc.dpo_beta), nll_weight=float(rc.nll_weight), **common)
            return lambda state, frozen, batch: fn(state, frozen, reference, self.place(batch))
        update = make_rl_update(cfg, self.optimizer, clip_eps=float(rc.clip_eps), kl_beta=float(rc.kl_beta),
                                updates=int(rc.updates_per_rollout), **common)
        sampler = sampler_from(None, cfg, rc.sampler)

        def rollout_params(state):  # the policy on this process (a pod: gathered from every host's shards)
            params = self.inference_params(state)
            return jax.tree.map(fetch, params) if jax.process_count() > 1 else params

        # the rollouts run the recipe's execution choices (model.overrides: layer layout, MoE dispatch,
        # attention kernel, ...) as the update does; the engine follows the parameters' placement
        rollout_runtime = self.runtime.local()
        extra_prompts, rounds = None, int(rc.max_rounds) if rc.skip_equal_groups else 1
        if rounds > 1:   # dynamic sampling's extra prompts: their own stream, batch (step, round) of it
            extra = rl_source(rc, self.dc, self.tokenizer, self.layout, cfg, seed=int(self.dc.seed) + EXTRA_PROMPT_SEED)

            def extra_prompts(step, rnd):
                return extra.batch(step * (rounds - 1) + rnd - 1)

        return GRPOStep(skip_equal_groups=bool(rc.skip_equal_groups), max_rounds=rounds, extra_prompts=extra_prompts,
                        tokenizer=self.tokenizer, layout=self.layout, group_size=int(rc.group_size),
                        reward=load_reward(rc.reward), seed=self.seed, rollout_params=rollout_params,
                        engine=lambda p: Engine(cfg, p, sampler, batch_invariant=False, compilation_cache=False,
                                                runtime=rollout_runtime),
                        update=update, reference=reference, place=self.place, eos_ids=cfg.eos_ids,
                        pad_id=cfg.pad_id, step_of=lambda state: int(fetch(state.step)), config=cfg)

    def inference_params(self, state=None):
        state = state or self.state
        return inference_params(self.model_config, state.params, self.frozen, self.lora)

    def eval_pairs(self) -> list[tuple[str, str]]:
        """Held-out (prompt, answer) strings: the first eval.num_examples of eval.path (JSON lines of
        {"prompt", "response"}, keys as data's or eval.prompt_key / eval.response_key) if set, else
        the task source with the eval seed (tasks data; none otherwise)."""
        ec, dc = self.ec, self.dc
        if ec is None:
            return []
        if ec.path:
            pairs = _read_pairs(ec.path, ec.prompt_key or dc.prompt_key, ec.response_key or dc.response_key,
                                "eval.path")
            return pairs[: int(ec.num_examples)] if ec.num_examples else pairs
        if dc.kind != "tasks":
            return []
        mix = TaskMix.from_config(dc.tasks)
        rng = np.random.default_rng([int(ec.seed), 99])
        return [mix.sample(rng) for _ in range(int(ec.num_examples or 100))]

    def eval_image_problems(self) -> list[tuple[Any, str, str]]:
        """Held-out (picture, instruction, answer) problems of an image-task recipe (the eval seed)."""
        return image_tasks.heldout_examples(image_tasks.tasks_from_config(self.dc.image_tasks),
                                            int(self.ec.num_examples or 100), int(self.ec.seed))

    def evaluate(self, state=None) -> dict[str, Any]:
        if self.ec is None:
            return {}
        pictures = None
        if self.dc.kind == "image_tasks" and not self.ec.path:
            problems = self.eval_image_problems()
            pairs, pictures = [(p, a) for _, p, a in problems], [im for im, _, _ in problems]
        else:
            pairs = self.eval_pairs()
        if not pairs:
            return {}
        return evaluate_exact_match(
            self.model_config, self.inference_params(state), self.sampler, self.tokenizer, pairs,
            prompt_width=self.layout.prompt_length, max_new_tokens=self.layout.response_capacity,
            batch_size=int(self.ec.batch_size), seed=int(self.ec.seed), images=pictures,
            image_settings=getattr(self.source, "settings", None))


def train(config) -> dict[str, Any]:
    """Run (or resume) a recipe to config.train.num_steps; returns the summary dict."""
    recipe = TrainConfig.from_recipe(config)
    tc = recipe.train
    # a local directory (made absolute) or a gs:// URL, handed to orbax as it is; the run's other
    # files go through etils.epath (orbax's own path layer) beside the checkpoints
    workdir = epath.Path(orbax_path(tc.workdir, "train.workdir"))
    ckpt_every = checkpoint_interval(tc)
    if jax.process_count() > 1 and not tc.mesh:
        raise ValueError(f"this run has {jax.process_count()} processes but no train.mesh: each would train alone "
                         f"on its own devices; set train.mesh over all {jax.device_count()} devices "
                         f"(e.g. train.mesh=data={jax.device_count()})")
    if tc.compilation_cache_dir:  # the run's own persistent cache (the process's jax setting, as `dgemma` sets it)
        compile_cache.enable(tc.compilation_cache_dir)
    run = Run(recipe)
    # multi-host: every process trains (and evaluates) in lockstep and joins every checkpoint save and
    # restore (orbax's multi-host protocol); process 0 alone writes the run's other files and prints
    lead = is_main_process()
    if lead:
        workdir.mkdir(parents=True, exist_ok=True)
        _write_json(workdir / "config.json", plain(config))
    data_stats = getattr(run.source, "stats", None)
    if data_stats is not None and lead:  # what chat data dropped or truncated, logged and recorded
        _write_json(workdir / "data_stats.json", data_stats)
        print(run.source.summary(), flush=True)
    metrics = JsonLines(workdir / "metrics.jsonl", lead)
    evals = JsonLines(workdir / "eval.jsonl", lead)
    ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=tc.max_to_keep)
    it = data_lib.DataIterator(run.source)
    state = run.state
    start = 0
    if ckpt.latest_step() is not None:
        state, dstate = ckpt.restore(jax.tree.map(  # restored straight into the state's shardings
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), state))
        it.set_state(dstate)
        start = int(state.step)
        if lead:  # stderr, beside the progress bar: stdout is the summary
            print(f"resuming from the step-{start} checkpoint in {workdir / 'checkpoints'}", file=sys.stderr, flush=True)
        metrics.truncate(start)
        evals.truncate(start)
    log_every = int(tc.log_every)
    eval_every = int(tc.eval_every)
    time_limit = float(tc.time_limit_s or 0)
    throttle = float(tc.throttle_s or 0)  # sleep per step: lets tests kill a run mid-way
    # the bar starts after the first step, so that its rate and ETA leave the step's compile out
    bar = None
    if lead and tc.progress and start < run.num_steps:
        print("train: compiling the train step (the progress bar starts after it) ...", file=sys.stderr, flush=True)
    t0 = time.time()
    train_time = float(metrics.rows[-1].get("time_s", 0.0)) if metrics.rows else 0.0
    step = start
    stopped_early = False
    while step < run.num_steps:
        batch = next(it)
        state, m = run.step_fn(state, run.frozen, batch)
        step += 1
        if throttle:
            jax.block_until_ready(m)
            time.sleep(throttle)
        if step % log_every == 0 or step == run.num_steps:
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            elapsed = train_time + time.time() - t0
            metrics.append({"step": step, "time_s": round(elapsed, 3), **m})
            if bar is not None:
                bar.set_postfix(loss=f"{m['loss']:.4f}", **({"acc": f"{m['canvas_token_acc']:.3f}"}
                                                           if "canvas_token_acc" in m else {}))
        if bar is not None:
            bar.update(1)
        elif lead and tc.progress:  # the first step ran: its compile is done
            jax.block_until_ready(m)
            bar = _progress(tc, step, run.num_steps)
        if ckpt_every and step % ckpt_every == 0 and step < run.num_steps:
            metrics.flush()
            evals.flush()
            ckpt.save(step, state, it.get_state())
        if eval_every and step % eval_every == 0 and step < run.num_steps:
            _log_eval(run, state, step, evals, bar, lead)
        if time_limit and _all_agree(train_time + time.time() - t0 > time_limit):
            stopped_early = True
            break
    if bar is not None:
        bar.close()
    train_seconds = train_time + time.time() - t0
    metrics.flush()
    evals.flush()
    if step not in ckpt.all_steps():
        ckpt.save(step, state, it.get_state(), force=True)
    ckpt.close()
    summary: dict[str, Any] = {"steps": step, "train_seconds": round(train_seconds, 1),
                               "stopped_by_time_limit": stopped_early}
    if metrics.rows:
        summary["final_metrics"] = metrics.rows[-1]
    if data_stats is not None:
        summary["data_stats"] = data_stats
    if run.ec is not None and tc.final_eval:
        summary["eval"] = _log_eval(run, state, step, evals, None, lead)
        evals.flush()
    if tc.export:  # every process saves the shards it holds (orbax, as the checkpoints)
        save_params(workdir / "export", run.inference_params(state))
    if lead:
        summary["loss_curve"] = plot_loss_curve(workdir / "metrics.jsonl", workdir / "loss_curve.png",
                                                eval_path=workdir / "eval.jsonl")
        _write_json(workdir / "summary.json", summary)
    run.state = state
    summary["run"] = run
    return summary


def checkpoint_interval(tc: TrainSection) -> int:
    """train.checkpoint_every: a checkpoint every N steps; 0: only the final one (at num_steps or when
    train.time_limit_s stops the run)."""
    every = tc.checkpoint_every
    try:
        n = int(every)
        whole = not isinstance(every, bool) and n == float(every) and n >= 0
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise ValueError(f"train.checkpoint_every must be a whole number of steps >= 0 (0: only the final "
                         f"checkpoint), got {every!r}")
    return n


def _all_agree(flag: bool) -> bool:
    """Process 0's decision, on every process (a run's processes must stop at the same step)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def _log_eval(run: Run, state, step: int, evals: JsonLines, bar, lead: bool = True) -> dict[str, Any]:
    r = run.evaluate(state)
    if not r or not lead:
        return r
    evals.append({"step": step, **{k: v for k, v in r.items() if k != "samples"}})
    msg = (f"eval step {step}: exact match {r['accuracy']:.3f} on {r['n']}, steps/canvas "
           f"{r['mean_steps_per_canvas']:.2f}, tokens/forward {r['tokens_per_forward']:.2f}")
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)
    return r


def _progress(tc: TrainSection, start: int, total: int):
    if not tc.progress:
        return None
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True, mininterval=2.0)


def recipe_keys(cfg) -> set[str]:
    """Every dotted key an override may set: the recipe's own, every typed section's
    (`recipe.section_keys`), ModelConfig fields and Runtime choices under model.overrides and
    SamplerConfig fields under eval.sampler."""
    keys = set()

    def walk(node, prefix):
        for k, v in node.items():
            keys.add(prefix + k)
            if isinstance(v, dict) or hasattr(v, "to_dict"):
                walk(v, prefix + k + ".")

    walk(cfg, "")
    for section, names in section_keys().items():
        keys.add(section)
        keys.update(f"{section}.{k}" for k in names)
    keys.update(f"model.overrides.{f.name}" for f in dataclasses.fields(ModelConfig))
    keys.update(f"model.overrides.{k}" for k in RUNTIME_CHOICES)  # the trainer's Runtime takes these
    keys.update(f"eval.sampler.{f.name}" for f in dataclasses.fields(SamplerConfig))
    return keys


def _check_recipe(path: str) -> None:
    """Refuse, without running it, a --config that is not a recipe: not a .py file, not Python, or no
    top-level `def get_config` (setup.py, a JSON file, a data file)."""

    fix = "give a recipe: a .py file defining get_config() (see configs/)"
    if not path.endswith(".py"):
        raise ValueError(f"--config {path!r} is not a Python recipe (.py); {fix}")
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, UnicodeDecodeError) as e:
        raise ValueError(f"--config {path!r} is not valid Python ({e}); {fix}") from None
    if not any(isinstance(node, ast.FunctionDef) and node.name == "get_config" for node in tree.body):
        raise ValueError(f"--config {path!r} defines no get_config(), so it is not a recipe (not run); {fix}")


def load_config(path: str, overrides: dict[str, Any] | None = None):
    """`get_config()` of a recipe file (e.g. configs/train_bundled.py), with dotted-key overrides
    such as {"train.num_steps": 10}. A key that is neither in the recipe nor read by the trainer is a
    ValueError naming the nearest valid key. A recipe is Python and is run; a file that is not Python or
    defines no top-level `get_config` is refused before anything in it runs."""
    _check_recipe(path)
    spec = importlib.util.spec_from_file_location(f"_recipe_{abs(hash(path))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    valid = recipe_keys(cfg) if overrides else set()
    for key, value in (overrides or {}).items():
        if key not in valid:
            near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]!r}?" if near else f"; the sections are {', '.join(sorted(cfg.keys()))}"
            raise ValueError(f"unknown config key {key!r}: neither recipe {os.path.basename(path)} nor the trainer "
                             f"has it{hint}")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            if p not in node or node[p] is None:
                node[p] = ml_collections.ConfigDict()
            node = node[p]
        node[leaf] = value
    return cfg


def main(config) -> dict[str, Any]:
    """CLI entry: train, print the summary (without the Run object), return it."""
    summary = train(config)
    if not is_main_process():  # multi-host: one summary, from process 0
        return summary
    printable = {k: v for k, v in summary.items() if k != "run"}
    if "eval" in printable:
        printable["eval"] = {k: v for k, v in printable["eval"].items() if k not in ("samples", "failures")}
    print(json.dumps(_jsonable(printable), indent=1))
    return summary
