"""Model configuration: a frozen, validated dataclass with presets and a Hugging Face reader.

`ModelConfig` describes the DiffusionGemma text backbone (a Gemma 4 MoE transformer used in two
modes, causal "encoder" and bidirectional "denoiser"). It is hashable, so it can be a static
argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

from dgemma_jax.errors import read_json

SLIDING = "sliding"
GLOBAL = "global"

_DTYPES = ("float32", "bfloat16", "float16")
DENOISE_WINDOWS = ("block", "band")
# the per-image soft-token budgets of the Gemma 4 image processor
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)
# how a program runs, not what the checkpoint computes: fields of `dgemma_jax.runtime.Runtime`
# (ModelConfig held them in earlier versions; recipes and stored configs may still name them)
RUNTIME_CHOICES = ("moe_dispatch", "moe_capacity_factor", "moe_shard_rows_factor", "attn_kernel", "attn_key_block",
                   "remat", "layers")


def _no_runtime_choices(changes: Mapping[str, Any]) -> None:
    named = sorted(k for k in changes if k in RUNTIME_CHOICES)
    if named:
        raise ValueError(f"{', '.join(named)} {'is' if len(named) == 1 else 'are'} not part of ModelConfig: how a "
                         f"program runs is a dgemma_jax.Runtime; pass e.g. Engine(..., runtime=Runtime("
                         f"{named[0]}=...))")


def layer_pattern(num_layers: int, period: int = 6) -> tuple[str, ...]:
    """`period - 1` sliding layers then one global layer, repeated; the last layer is global."""
    types = [GLOBAL if (i + 1) % period == 0 else SLIDING for i in range(num_layers)]
    types[-1] = GLOBAL
    return tuple(types)


PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def read_processor_config(path: str | os.PathLike) -> tuple[dict, str] | None:
    """(the image processor's settings, the file) saved with a checkpoint: `processor_config.json` (its
    "image_processor" entry) or `preprocessor_config.json` in the folder `path` (or that file itself);
    None when there is neither."""
    path = os.fspath(path)
    files = [path] if os.path.isfile(path) else [os.path.join(path, n) for n in PROCESSOR_FILES]
    for f in files:
        if os.path.isfile(f):
            data = read_json(f)
            return (data["image_processor"] if isinstance(data.get("image_processor"), dict) else data), f
    return None


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """Shapes and numerics of the Gemma 4 vision tower (`gemma4_vision`) and its projection into the text.

    Patches of `patch_size` x `patch_size` RGB pixels are embedded (a linear map plus learned x and y
    position tables of `position_embedding_size` entries), run through `num_layers` bidirectional
    encoder layers (axial 2D RoPE with theta `rope_theta`, q/k norms, no 1/sqrt(d) scaling, a gelu-tanh
    gated MLP of width `intermediate_size`), averaged over `pooling_kernel_size` x `pooling_kernel_size`
    blocks into soft tokens, scaled by sqrt(hidden_size) and, when `standardize`, shifted and scaled by
    the learned `std_bias` / `std_scale`. `use_clipped_linears`: every encoder linear clamps its input and
    output to learned bounds (transformers' `Gemma4ClippableLinear`). `default_soft_tokens`: the image
    processor's per-image budget this tower was released or trained with (the default of every image
    prompt; a processor setting, not a shape: the tower takes any budget).
    """

    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_layers: int = 27
    num_heads: int = 16
    num_kv_heads: int = 16
    head_dim: int = 72
    patch_size: int = 16
    pooling_kernel_size: int = 3
    position_embedding_size: int = 10_240
    rope_theta: float = 100.0
    rms_norm_eps: float = 1e-6
    standardize: bool = False
    use_clipped_linears: bool = False
    default_soft_tokens: int = 280

    def __post_init__(self):
        def bad(field, value, why):
            raise ValueError(f"VisionConfig.{field}={value!r} is invalid: {why}")

        if self.default_soft_tokens not in SOFT_TOKEN_BUDGETS:
            bad("default_soft_tokens", self.default_soft_tokens, f"must be a Gemma 4 soft-token budget, one of "
                f"{SOFT_TOKEN_BUDGETS}")

        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "patch_size", "pooling_kernel_size", "position_embedding_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, v, "must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            bad("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.head_dim % 4:
            bad("head_dim", self.head_dim, "must be a multiple of 4 (axial RoPE rotates each half of a head "
                "with one of the two patch coordinates)")
        for f in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, f) > 0:
                bad(f, getattr(self, f), "must be > 0")

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: 3 * patch_size^2."""
        return 3 * self.patch_size * self.patch_size

    def param_count(self, text_hidden: int) -> int:
        """Parameters of the tower plus the projection into a text model of width `text_hidden`."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * hd * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * hd
        layer = attn + 3 * d * f + 4 * d + (4 * 7 if self.use_clipped_linears else 0)  # 7 linears x 4 bounds
        tower = self.patch_dim * d + 2 * self.position_embedding_size * d + self.num_layers * layer
        return tower + (2 * d if self.standardize else 0) + d * text_hidden

    @staticmethod
    def from_hf(vc: Mapping[str, Any]) -> "VisionConfig":
        """From the `vision_config` of a Hugging Face config.json (a `gemma4_vision` config)."""
        mt = vc.get("model_type", "gemma4_vision")
        if mt not in ("gemma4_vision", None):
            raise ValueError(f"vision_config has model_type={mt!r}; expected 'gemma4_vision'")
        rope = vc.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") != "axial":
            raise ValueError(f"vision_config rope_type {rope.get('rope_type')!r} is unsupported: the Gemma 4 "
                             "vision tower uses 'axial'")
        act = vc.get("hidden_activation", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"vision_config hidden_activation {act!r} is unsupported (expected gelu_pytorch_tanh)")
        if vc.get("attention_bias"):
            raise ValueError("vision_config attention_bias=true is unsupported (Gemma 4 has no biases)")
        d = VisionConfig()
        heads = int(vc.get("num_attention_heads", 12))
        hidden = int(vc.get("hidden_size", 768))
        try:
            return VisionConfig(
                hidden_size=hidden,
                intermediate_size=int(vc.get("intermediate_size", 3072)),
                num_layers=int(vc.get("num_hidden_layers", 16)),
                num_heads=heads,
                num_kv_heads=int(vc.get("num_key_value_heads", heads)),
                head_dim=int(vc.get("head_dim") or hidden // heads),
                patch_size=int(vc.get("patch_size", 16)),
                pooling_kernel_size=int(vc.get("pooling_kernel_size") or 3),
                position_embedding_size=int(vc.get("position_embedding_size", d.position_embedding_size)),
                rope_theta=float(rope.get("rope_theta", 100.0)),
                rms_norm_eps=float(vc.get("rms_norm_eps", 1e-6)),
                standardize=bool(vc.get("standardize", False)),
                use_clipped_linears=bool(vc.get("use_clipped_linears", False)),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"config.json vision_config is invalid: {e}") from None

    def with_processor(self, directory: str | os.PathLike) -> "VisionConfig":
        """This tower with the image budget (`default_soft_tokens`) of the image processor saved in a
        checkpoint directory (`processor_config.json` / `preprocessor_config.json`, read by
        `read_processor_config`, as `io.images.ImageSettings.from_dir` reads it; `max_soft_tokens`, 280
        when the file leaves it out; the budget's value is checked where images are made). Without
        such a file: unchanged. A processor whose patch or pooling size differs from the tower's is a
        ValueError (its patches would not fit the tower)."""
        found = read_processor_config(directory)
        if found is None:
            return self
        proc, _ = found
        patch, pooling = proc.get("patch_size", 16), proc.get("pooling_kernel_size", 3)
        if (patch, pooling) != (self.patch_size, self.pooling_kernel_size):
            raise ValueError(f"the image processor in {os.fspath(directory)!r} uses patch {patch}, pooling "
                             f"{pooling} but config.json's vision tower patch {self.patch_size}, pooling "
                             f"{self.pooling_kernel_size}: the files belong to different models; restore the "
                             "checkpoint's own processor file")
        return dataclasses.replace(self, default_soft_tokens=proc.get("max_soft_tokens", 280))

    def to_hf(self) -> dict[str, Any]:
        """The `Gemma4VisionConfig` kwargs describing this tower."""
        return dict(
            model_type="gemma4_vision", hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers, num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, patch_size=self.patch_size,
            pooling_kernel_size=self.pooling_kernel_size, position_embedding_size=self.position_embedding_size,
            rope_parameters={"rope_type": "axial", "rope_theta": self.rope_theta}, rms_norm_eps=self.rms_norm_eps,
            standardize=self.standardize, use_clipped_linears=self.use_clipped_linears,
            hidden_activation="gelu_pytorch_tanh",
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes, numerics and special ids of a DiffusionGemma text model.

    Sliding ("local") layers use `head_dim` / `num_kv_heads` and a causal window of
    `sliding_window` keys (itself + window-1 previous tokens). Global layers use
    `global_head_dim` / `num_global_kv_heads`, have no V projection (V = v_norm(k_proj(x)))
    and proportional partial RoPE.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    num_kv_heads: int
    global_head_dim: int
    num_global_kv_heads: int
    intermediate_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    sliding_window: int
    layer_types: tuple[str, ...] = ()
    rope_theta_local: float = 10_000.0
    rope_theta_global: float = 1_000_000.0
    global_rope_proportion: float = 0.25
    rms_norm_eps: float = 1e-6
    final_logit_softcap: float = 30.0
    max_position_embeddings: int = 262_144
    canvas_length: int = 256
    pad_id: int = 0
    bos_id: int = 2
    eos_ids: tuple[int, ...] = (1, 106, 50)
    # Numerics (not stored in the checkpoint's config; how a program runs is a `dgemma_jax.Runtime`).
    dtype: str = "float32"
    param_dtype: str = "float32"
    # which committed slots a sliding layer's canvas sees in the denoiser (model/masks.py): "block" =
    # the same last window-1 committed tokens for every canvas position; "band" = position q sees (q - window, E)
    denoise_window: str = "block"
    name: str = "custom"
    # The image path (None: a text-only model): the vision tower and the special ids of an image in the prompt
    # (boi + image_token x n + eoi).
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    def __post_init__(self):
        if not self.layer_types:
            object.__setattr__(self, "layer_types", layer_pattern(self.num_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        eos = (self.eos_ids,) if isinstance(self.eos_ids, int) else self.eos_ids
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in eos))
        if isinstance(self.vision, Mapping):  # a stored config (dataclasses.asdict) names the tower as a dict
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self):
        def bad(field, value, why):
            raise ValueError(f"ModelConfig.{field}={value!r} is invalid: {why}")

        for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "num_kv_heads",
                  "global_head_dim", "num_global_kv_heads", "intermediate_size", "num_experts",
                  "top_k", "moe_intermediate_size", "sliding_window", "canvas_length",
                  "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                bad(f, v, "must be a positive integer")
        if len(self.layer_types) != self.num_layers:
            bad("layer_types", self.layer_types,
                f"needs one entry per layer ({self.num_layers}), got {len(self.layer_types)}")
        for t in self.layer_types:
            if t not in (SLIDING, GLOBAL):
                bad("layer_types", t, f"each entry must be {SLIDING!r} or {GLOBAL!r}")
        if self.num_heads % self.num_kv_heads:
            bad("num_kv_heads", self.num_kv_heads, f"must divide num_heads={self.num_heads}")
        if self.num_heads % self.num_global_kv_heads:
            bad("num_global_kv_heads", self.num_global_kv_heads,
                f"must divide num_heads={self.num_heads}")
        for f in ("head_dim", "global_head_dim"):
            if getattr(self, f) % 2:
                bad(f, getattr(self, f), "must be even (rotary pairs dims i and i + head_dim/2)")
        if self.top_k > self.num_experts:
            bad("top_k", self.top_k, f"cannot exceed num_experts={self.num_experts}")
        if not 0.0 <= self.global_rope_proportion <= 1.0:
            bad("global_rope_proportion", self.global_rope_proportion, "must be in [0, 1]")
        for f in ("rope_theta_local", "rope_theta_global", "rms_norm_eps", "final_logit_softcap"):
            if not getattr(self, f) > 0:
                bad(f, getattr(self, f), "must be > 0")
        for f in ("dtype", "param_dtype"):
            if getattr(self, f) not in _DTYPES:
                bad(f, getattr(self, f), f"must be one of {_DTYPES}")
        if self.denoise_window not in DENOISE_WINDOWS:
            bad("denoise_window", self.denoise_window, f"must be one of {DENOISE_WINDOWS}")
        for f in ("pad_id", "bos_id"):
            v = getattr(self, f)
            if not 0 <= v < self.vocab_size:
                bad(f, v, f"must be a token id in [0, {self.vocab_size})")
        for e in self.eos_ids:
            if not 0 <= e < self.vocab_size:
                bad("eos_ids", self.eos_ids, f"id {e} is outside [0, {self.vocab_size})")
        if self.vision is not None and not isinstance(self.vision, VisionConfig):
            bad("vision", self.vision, "must be a VisionConfig or None")
        for f in ("image_token_id", "boi_token_id", "eoi_token_id"):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                bad(f, v, "must be a non-negative token id or None")

    # ------------------------------------------------------------------ derived
    def replace(self, **changes) -> "ModelConfig":
        _no_runtime_choices(changes)
        return dataclasses.replace(self, **changes)

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == GLOBAL

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_global_kv_heads if self.is_global(layer) else self.num_kv_heads

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)

    def param_count(self) -> dict[str, int]:
        """Total and per-token active parameter counts (text model); "vision": the vision tower and its projection
        into the text, when the model has one."""
        d = self.hidden_size
        emb = self.vocab_size * d
        attn = 0
        for i in range(self.num_layers):
            hd, kv = self.layer_head_dim(i), self.layer_kv_heads(i)
            n_kv_proj = 1 if self.is_global(i) else 2
            attn += d * self.num_heads * hd * 2 + d * kv * hd * n_kv_proj + 2 * hd
        dense = self.num_layers * 3 * d * self.intermediate_size
        experts = self.num_layers * self.num_experts * 3 * d * self.moe_intermediate_size
        router = self.num_layers * (d * self.num_experts + d + self.num_experts)
        norms = self.num_layers * (7 * d + 2) + d
        sc = 3 * d * self.intermediate_size + d
        total = emb + attn + dense + experts + router + norms + sc
        active = total - experts + experts * self.top_k // self.num_experts
        out = {"total": total, "active": active, "experts": experts, "embedding": emb}
        if self.vision is not None:  # the tower + its projection, not part of "total" (the text model)
            out["vision"] = self.vision.param_count(d)
        return out

    # ------------------------------------------------------------------ presets
    @staticmethod
    def preset(name: str, **overrides) -> "ModelConfig":
        """A named configuration. `ModelConfig.preset_names()` lists them."""
        if name not in _PRESETS:
            raise ValueError(f"unknown preset {name!r}; available presets: {', '.join(sorted(_PRESETS))}")
        _no_runtime_choices(overrides)
        kw = dict(_PRESETS[name])
        kw.update(overrides)
        kw.setdefault("name", name)
        return ModelConfig(**kw)

    @staticmethod
    def preset_names() -> list[str]:
        return sorted(_PRESETS)

    # ------------------------------------------------------------------ Hugging Face
    @staticmethod
    def from_hf(source: str | os.PathLike | Mapping[str, Any], **overrides) -> "ModelConfig":
        """Build from a Hugging Face DiffusionGemma `config.json` (path, directory or dict).

        Accepts both the released flat keys (`global_head_dim`, `num_global_key_value_heads`) and the
        `per_layer_config` form that transformers >= 5.23 writes on save. From a directory (or its
        config.json), a vision tower's image budget is the directory's image processor's
        (`VisionConfig.with_processor`), as transformers' processor would make it.
        """
        directory = None
        if isinstance(source, Mapping):
            cfg = dict(source)
        else:
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"no config.json at {path!r}: pass a Hugging Face model directory")
            cfg = read_json(path)
            directory = os.path.dirname(path)
        text = cfg.get("text_config", cfg)
        model_type = cfg.get("model_type", text.get("model_type"))
        if model_type not in (None, "diffusion_gemma", "diffusion_gemma_text", "gemma4", "gemma4_text"):
            raise ValueError(f"config.json has model_type={model_type!r}; expected a DiffusionGemma config")
        def req(key):  # a required integer field of the text config
            if text.get(key) is None:
                raise KeyError(key)
            try:
                return int(text[key])
            except (TypeError, ValueError):
                raise ValueError(f"config.json field {key!r}={text[key]!r} is not an integer") from None

        try:
            n_layers = req("num_hidden_layers")
            hf_types = text.get("layer_types")
            types = tuple(GLOBAL if t == "full_attention" else SLIDING for t in hf_types) if hf_types \
                else layer_pattern(n_layers)
            head_dim = req("head_dim")
            kv = req("num_key_value_heads")
            g_head_dim = text.get("global_head_dim")
            g_kv = text.get("num_global_key_value_heads")
            plc = text.get("per_layer_config") or {}
            for idx, lc in plc.items():
                if types[int(idx)] == GLOBAL:
                    g_head_dim = lc.get("head_dim", g_head_dim)
                    g_kv = lc.get("num_key_value_heads", g_kv)
            rope = text.get("rope_parameters") or {}
            rl = rope.get("sliding_attention", {}) or {}
            rg = rope.get("full_attention", {}) or {}
            eos = text.get("eos_token_id", cfg.get("eos_token_id", 1))
            eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
            kw = dict(
                vocab_size=req("vocab_size"),
                hidden_size=req("hidden_size"),
                num_layers=n_layers,
                num_heads=req("num_attention_heads"),
                head_dim=head_dim,
                num_kv_heads=kv,
                global_head_dim=int(g_head_dim if g_head_dim is not None else 512),
                num_global_kv_heads=int(g_kv if g_kv is not None else kv),
                intermediate_size=req("intermediate_size"),
                num_experts=req("num_experts"),
                top_k=req("top_k_experts"),
                moe_intermediate_size=req("moe_intermediate_size"),
                sliding_window=req("sliding_window"),
                layer_types=types,
                rope_theta_local=float(rl.get("rope_theta", 10_000.0)),
                rope_theta_global=float(rg.get("rope_theta", 1_000_000.0)),
                global_rope_proportion=float(rg.get("partial_rotary_factor", 0.25)),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                final_logit_softcap=float(text.get("final_logit_softcapping") or 30.0),
                max_position_embeddings=int(text.get("max_position_embeddings", 262_144)),
                canvas_length=int(cfg.get("canvas_length", 256)),
                pad_id=int(text.get("pad_token_id", 0) or 0),
                bos_id=int(text.get("bos_token_id", 2) if text.get("bos_token_id") is not None else 2),
                eos_ids=tuple(int(e) for e in eos if e is not None),
                name=str(cfg.get("_name_or_path") or "hf"),
            )
            if cfg is not text and cfg.get("vision_config") is not None:
                kw["vision"] = VisionConfig.from_hf(cfg["vision_config"])
                if directory is not None:
                    kw["vision"] = kw["vision"].with_processor(directory)
                for f in ("image_token_id", "boi_token_id", "eoi_token_id"):
                    if cfg.get(f) is not None:
                        kw[f] = int(cfg[f])
        except KeyError as e:
            raise ValueError(f"config.json is missing the field {e.args[0]!r} (or it is null) of a DiffusionGemma "
                             "text config") from None
        if rl.get("rope_type", "default") != "default" or rg.get("rope_type", "proportional") != "proportional":
            raise ValueError(f"unsupported rope types {rl.get('rope_type')!r}/{rg.get('rope_type')!r}: "
                             "DiffusionGemma uses 'default' on sliding and 'proportional' on full layers")
        _no_runtime_choices(overrides)
        kw.update(overrides)
        return ModelConfig(**kw)

    def to_hf_text_config(self) -> dict[str, Any]:
        """The `DiffusionGemmaTextConfig` kwargs describing this model (used by tests and converters)."""
        return dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            global_head_dim=self.global_head_dim,
            num_global_key_value_heads=self.num_global_kv_heads,
            sliding_window=self.sliding_window,
            layer_types=["full_attention" if t == GLOBAL else "sliding_attention" for t in self.layer_types],
            num_experts=self.num_experts,
            top_k_experts=self.top_k,
            moe_intermediate_size=self.moe_intermediate_size,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": self.rope_theta_local},
                "full_attention": {"rope_type": "proportional", "rope_theta": self.rope_theta_global,
                                   "partial_rotary_factor": self.global_rope_proportion},
            },
            rms_norm_eps=self.rms_norm_eps,
            final_logit_softcapping=self.final_logit_softcap,
            max_position_embeddings=self.max_position_embeddings,
            pad_token_id=self.pad_id,
            bos_token_id=self.bos_id,
            eos_token_id=list(self.eos_ids),
            hidden_activation="gelu_pytorch_tanh",
        )


_PRESETS: dict[str, dict[str, Any]] = {
    # The released google/diffusiongemma-26B-A4B-it text model.
    "diffusiongemma-26b-a4b": dict(
        vocab_size=262_144, hidden_size=2816, num_layers=30, num_heads=16,
        head_dim=256, num_kv_heads=8, global_head_dim=512, num_global_kv_heads=2,
        intermediate_size=2112, num_experts=128, top_k=8, moe_intermediate_size=704,
        sliding_window=1024, canvas_length=256, eos_ids=(1, 106, 50),
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # The shared benchmark configuration (benchmarks/, performance issue).
    "bench": dict(
        vocab_size=32_768, hidden_size=512, num_layers=6, num_heads=8,
        head_dim=64, num_kv_heads=4, global_head_dim=128, num_global_kv_heads=1,
        intermediate_size=1024, num_experts=16, top_k=4, moe_intermediate_size=256,
        sliding_window=256, canvas_length=256, eos_ids=(1,),
    ),
    # Small test models.
    "tiny-2layer": dict(
        vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
        head_dim=16, num_kv_heads=2, global_head_dim=32, num_global_kv_heads=1,
        intermediate_size=96, num_experts=4, top_k=2, moe_intermediate_size=32,
        sliding_window=8, canvas_length=16, eos_ids=(1,),
        layer_types=(SLIDING, GLOBAL),
    ),
    "tiny-6layer": dict(
        vocab_size=256, hidden_size=64, num_layers=6, num_heads=4,
        head_dim=16, num_kv_heads=2, global_head_dim=32, num_global_kv_heads=1,
        intermediate_size=96, num_experts=8, top_k=2, moe_intermediate_size=32,
        sliding_window=16, canvas_length=16, eos_ids=(1,),
    ),
}


def preset_name_of(config: ModelConfig) -> ModelConfig:
    """`config` named after the preset it equals in everything but its name, else as it is. A checkpoint
    that `save_hf` wrote from a preset loads back under that name (the name is part of the programs'
    cache key); nothing is added to its config.json, which stays what transformers reads."""
    if config.name != "hf":  # named by its config.json's _name_or_path or by the caller
        return config
    for name in _PRESETS:
        try:
            preset = ModelConfig.preset(name)
        except (TypeError, ValueError):
            continue
        if dataclasses.replace(config, name=name) == preset:
            return preset
    return config
