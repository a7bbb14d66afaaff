"""The OpenAI request bodies the server accepts (pydantic), and what they mean for DiffusionGemma.

Fields follow OpenAI's `/v1/chat/completions` and `/v1/completions`. The diffusion sampler's own
knobs are extra fields, one per setting declared with `http` in `sampling/settings.py` (today
`max_denoising_steps`, `t_max`, `t_min`, `entropy_bound`, `confidence_threshold`, `canvas_length`);
thinking is `chat_template_kwargs.enable_thinking` (the
convention of OpenAI-compatible servers). Unknown fields are refused with their name rather than
ignored (in a message too), and so is an autoregressive `temperature`/`top_p` other than 1: the
diffusion sampler has no such knob (its temperature is the linear schedule t_max -> t_min). Types are
strict: `max_tokens: "8"` or `true`, `seed: "7"`, `stream: "yes"` are refused, not converted.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from dgemma_jax.sampling import settings as settings_lib
from dgemma_jax.sampling.loop import SEED_RANGE
from dgemma_jax.sampling.settings import SETTINGS

MAX_N = 64
MAX_STOPS = 16          # stop strings a request may send (each is searched for in every event's text)
MAX_STOP_CHARS = 256    # characters of each stop string


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False
    # an extension: after every denoising step, the current canvas's text as it stands in
    # `delta.provisional` (chat) or `provisional` (completions); `content` / `text` stay committed only
    include_provisional: bool = False


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    enable_thinking: bool = False


def sampler_fields_model(settings=SETTINGS) -> type[BaseModel]:
    """The DiffusionGemma sampler's request fields, one per `Setting` with `http` (sampling/settings.py)."""
    return create_model("SamplerFields", __config__=ConfigDict(extra="forbid", strict=True),
                        **settings_lib.http_fields(settings))


class _Common(sampler_fields_model()):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    n: int = Field(1, ge=1, le=MAX_N)
    user: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's: a lower value is admitted to a free slot first (equal values in arrival order)
    priority: int = Field(0, ge=-2 ** 31, lt=2 ** 31)
    # OpenAI's structured output: {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    # (serving/structured.py checks it)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _no_autoregressive_sampling(self):
        for name in ("temperature", "top_p"):
            v = getattr(self, name)
            if v is not None and v != 1.0:
                raise ValueError(f"{name}={v} has no meaning for the diffusion sampler; set t_max / t_min (its "
                                 "linear temperature schedule) or entropy_bound instead")
        if isinstance(self.stop, list) and any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if self.stop == "":
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return self

    @model_validator(mode="after")
    def _bounded_stops_and_streaming(self):
        stops = self.stops
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop has {len(stops)} strings; this server takes at most {MAX_STOPS}")
        longest = max((len(s) for s in stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has {longest} characters; this server takes at most {MAX_STOP_CHARS} "
                             "per stop string")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs \"stream\": true (it only shapes a streamed response)")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampler_changes(self) -> dict[str, Any]:
        """The per-row sampler settings this request sets (`SamplerConfig.replace` takes them)."""
        return settings_lib.request_changes(self)

    def token_budget(self) -> int | None:
        return self.max_tokens


PART_TYPES = ("text", "image_url")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    # an assistant turn's thinking, as clients send it back: dropped before rendering
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _parts(self):
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            kind = part.get("type")
            if kind is None:
                raise ValueError(f"content[{j}] has no \"type\": a content part is {{\"type\": \"text\", \"text\": "
                                 "...} or {\"type\": \"image_url\", \"image_url\": {\"url\": ...}}")
            if kind == "image":  # the library's form, which may name any file: images/resolve_image_parts says why not
                continue
            if kind not in PART_TYPES:
                raise ValueError(f"content[{j}].type {kind!r} is not a content part this server takes; send "
                                 f"{' or '.join(map(repr, PART_TYPES))}")
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content[{j}]: a text part needs a string \"text\"")
                if set(part) - {"type", "text"}:
                    raise ValueError(f"content[{j}]: unknown field(s) {sorted(set(part) - {'type', 'text'})} in a "
                                     "text part: this server does not support them")
        return self


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: ChatTemplateKwargs | None = None

    def token_budget(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens={self.max_completion_tokens} "
                             "disagree; send one of them")
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def thinking(self) -> bool:
        return bool(self.chat_template_kwargs and self.chat_template_kwargs.enable_thinking)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int]]
    # OpenAI's: the text after the completion (infill: the answer is the middle, `Engine.infill`)
    suffix: str | None = None

    @model_validator(mode="after")
    def _non_empty(self):
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt is an empty list: send a string, a list of strings or a list of token ids")
        return self

    def prompts(self) -> list:
        """Each prompt as a str or a list of token ids."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)
