"""A training recipe as one typed value: `TrainConfig.from_recipe(config)`.

A recipe is an ml_collections `get_config()` (configs/*.py) with the sections model, init, data,
objective, optimizer, lora, train, eval and (RL / preference recipes) rl. Each section becomes a
frozen dataclass here, built once, with its defaults in one place; a key no section has is a
ValueError naming the nearest valid key, so a typo never becomes a silently ignored setting. The
trainer reads the typed value only.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Mapping

from dgemma_jax.training.objective import ObjectiveConfig
from dgemma_jax.training.optim import make_optimizer

REQUIRED = dataclasses.MISSING


def plain(section) -> dict:
    """A ConfigDict / mapping / None as a plain dict (lists and nested sections as they are)."""
    if section is None:
        return {}
    return section.to_dict() if hasattr(section, "to_dict") else dict(section)


def _tuple(x):
    return tuple(x) if isinstance(x, (list, tuple)) else x


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """model: `preset` (a ModelConfig preset; "" or None: from init / overrides), `param_dtype` (the
    loaded weights' dtype), `overrides` (ModelConfig fields and Runtime choices)."""

    preset: str | None = None
    param_dtype: str | None = None
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class InitSection:
    """init: where the weights come from. kind "random" (seed, embedding_std, vision_from_scratch),
    "hf" (path, revision), "orbax" (path: our save_params), "bundled" (name or path, revision)."""

    kind: str = "random"
    path: str | None = None
    revision: str | None = None
    name: str | None = None
    seed: int = 0
    embedding_std: float | None = None
    vision_from_scratch: bool = False


@dataclasses.dataclass(frozen=True)
class DataSection:
    """data: the examples and their layout. kind "tasks" (tasks), "image_tasks" (image_tasks,
    max_soft_tokens), "jsonl" (path, prompt_key, response_key, bos_id), "chat" (path, overflow,
    ar_loss), "raw_text" (path, separator, min_prompt, bos_id); tokenizer "tasks", "image_tasks",
    "char" (chars, markers), "char_file" / "hf" (tokenizer_path)."""

    prompt_length: int = REQUIRED
    num_canvases: int = REQUIRED
    batch_size: int = REQUIRED
    kind: str = "tasks"
    seed: int = 0
    tokenizer: str = "tasks"
    chars: str | None = None
    markers: tuple = ()
    tokenizer_path: str | None = None
    tasks: Any = None
    image_tasks: Any = None
    max_soft_tokens: int | None = None
    path: str | None = None
    prompt_key: str = "prompt"
    response_key: str = "response"
    bos_id: int | None = None
    overflow: str = "truncate"
    separator: str = "\n\n"
    min_prompt: int = 1
    ar_loss: str | None = None


@dataclasses.dataclass(frozen=True)
class LoraSection:
    """lora: low-rank adapters on the named groups ("attention", "mlp", "experts") instead of full
    fine-tuning; alpha defaults to the rank."""

    enabled: bool = False
    rank: int = 16
    alpha: float | None = None
    groups: tuple = ("attention", "mlp")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """train: the loop. checkpoint_every 0: only the final checkpoint; time_limit_s 0: none;
    throttle_s: a sleep per step (tests stop runs midway); mesh / rules: a sharded run."""

    workdir: str = REQUIRED
    num_steps: int = REQUIRED
    seed: int = 0
    log_every: int = 10
    checkpoint_every: Any = 500
    eval_every: int = 0
    max_to_keep: int | None = 3
    time_limit_s: float = 0.0
    throttle_s: float = 0.0
    export: bool = False
    progress: bool = True
    final_eval: bool = True
    compilation_cache_dir: str | None = None
    mesh: str | None = None
    rules: str = "training"


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """eval: held-out exact match. path (JSON lines; keys as data's unless given) or, for task data,
    num_examples problems drawn with `seed` (which must differ from data.seed); sampler: SamplerConfig
    fields (the model's canvas length, EOS and pad ids unless given)."""

    num_examples: int | None = None
    batch_size: int = 100
    seed: int = 12345
    sampler: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    path: str | None = None
    prompt_key: str | None = None
    response_key: str | None = None


@dataclasses.dataclass(frozen=True)
class RLSection:
    """rl: reinforcement or preference fine-tuning instead of SFT (`training.rl`, `training.dpo`).
    algorithm "grpo": data gives the prompts (task problems, or JSON lines with prompt_key and an
    optional response_key as the reference), each rolled out group_size times with `sampler`
    (SamplerConfig fields; the model's canvas length, EOS and pad ids unless given), scored by `reward`
    ("module:function"), updated updates_per_rollout times on the clipped surrogate (clip_eps) with a
    k3 KL of weight kl_beta against the initial weights. algorithm "dpo": data.path holds JSON lines of
    {prompt, chosen, rejected} (keys data.prompt_key, chosen_key, rejected_key), loss DPO's with
    dpo_beta (plus nll_weight times the chosen answers' per-token NLL when > 0, RPO's regulariser).
    Both score sequences with `likelihood.token_logprobs`: num_samples stratified noise
    draws per canvas, t in [t_eps, 1), shared between the policy and the reference.
    skip_equal_groups (grpo): dynamic sampling, `rl.GRPOStep`: the update takes only groups whose rewards
    differ, rolling out up to max_rounds batches of data.batch_size prompts per step to find them."""

    algorithm: str = "grpo"
    group_size: int = 4
    reward: str | None = None
    num_samples: int = 2
    updates_per_rollout: int = 1
    clip_eps: float = 0.2
    kl_beta: float = 0.04
    dpo_beta: float = 0.1
    nll_weight: float = 0.0
    t_eps: float = 1e-3
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    sampler: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    skip_equal_groups: bool = False
    max_rounds: int = 4

    def __post_init__(self):
        if self.algorithm not in ("grpo", "dpo"):
            raise ValueError(f"rl.algorithm must be 'grpo' or 'dpo', got {self.algorithm!r}")
        if self.algorithm == "grpo" and int(self.group_size) < 2:
            raise ValueError(f"rl.group_size must be >= 2 (advantages are relative to the group), got {self.group_size}")
        if self.algorithm == "grpo" and not self.reward:
            raise ValueError("rl.algorithm 'grpo' needs rl.reward: a function 'module:function' "
                             "(e.g. 'dgemma_jax.training.rewards:exact_match')")
        for name in ("num_samples", "updates_per_rollout", "max_rounds"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"rl.{name} must be >= 1, got {getattr(self, name)}")


def optimizer_keys() -> tuple[str, ...]:
    """The optimizer section's keys: `make_optimizer`'s arguments (its step count is train.num_steps)
    and `freeze_router`."""
    return tuple(k for k in inspect.signature(make_optimizer).parameters if k != "total_steps") + ("freeze_router",)


def objective_keys() -> tuple[str, ...]:
    """The objective section's keys: `ObjectiveConfig`'s fields (its canvas length is the model's)."""
    return tuple(f.name for f in dataclasses.fields(ObjectiveConfig) if f.name != "canvas_length")


SECTIONS = {"model": ModelSection, "init": InitSection, "data": DataSection, "lora": LoraSection,
            "train": TrainSection, "eval": EvalSection, "rl": RLSection}


def section_keys() -> dict[str, tuple[str, ...]]:
    """Every section's keys, as the typed config reads them."""
    keys = {name: tuple(f.name for f in dataclasses.fields(cls)) for name, cls in SECTIONS.items()}
    keys["optimizer"], keys["objective"] = optimizer_keys(), objective_keys()
    return keys


def _unknown(section: str, key: str, allowed) -> ValueError:
    near = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    hint = f"; did you mean {section}.{near[0]!r}?" if near else f"; {section} takes {', '.join(sorted(allowed))}"
    return ValueError(f"unknown recipe key {section}.{key}{hint}")


def _build(cls, section: str, raw: Mapping[str, Any]):
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise _unknown(section, key, names)
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is REQUIRED and f.default_factory is REQUIRED and raw.get(f.name) is None]
    if missing:
        raise ValueError(f"the recipe's {section} section needs {', '.join(f'{section}.{m}' for m in missing)}")
    return cls(**raw)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A recipe, typed: one frozen section each; `eval` None when the recipe asks for no evaluation
    (no section, or an empty one); `rl` None for SFT. optimizer / objective: `make_optimizer`'s and `ObjectiveConfig`'s
    keyword arguments, checked against them."""

    model: ModelSection
    init: InitSection
    data: DataSection
    lora: LoraSection
    train: TrainSection
    eval: EvalSection | None
    rl: RLSection | None
    optimizer: Mapping[str, Any]
    objective: Mapping[str, Any]

    @classmethod
    def from_recipe(cls, config) -> "TrainConfig":
        """The typed config of a recipe (a `get_config()` ConfigDict or a dict of sections)."""
        raw = plain(config)
        known = set(SECTIONS) | {"optimizer", "objective"}
        for name in raw:
            if name not in known:
                raise _unknown("recipe", name, known)
        for name in ("model", "data", "train", "optimizer"):
            if name not in raw:
                raise ValueError(f"the recipe has no {name} section")
        sections = {name: _build(kind, name, plain(raw.get(name))) for name, kind in SECTIONS.items()
                    if name not in ("eval", "rl")}
        ev = plain(raw.get("eval"))
        for name, allowed in (("optimizer", optimizer_keys()), ("objective", objective_keys())):
            for key in plain(raw.get(name)):
                if key not in allowed:
                    raise _unknown(name, key, allowed)
        rl = plain(raw.get("rl"))
        return cls(eval=_build(EvalSection, "eval", ev) if ev else None,
                   rl=_build(RLSection, "rl", rl) if rl else None,
                   optimizer={k: _tuple(v) for k, v in plain(raw.get("optimizer")).items()},
                   objective=dict(plain(raw.get("objective"))), **sections)
