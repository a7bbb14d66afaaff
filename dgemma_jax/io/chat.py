"""The Gemma 4 chat format, which DiffusionGemma uses (spec §3.7).

    <bos><|turn>system\\n[<|think|>\\n]SYSTEM<turn|>\\n
    <|turn>user\\nUSER<turn|>\\n
    <|turn>model\\nANSWER<turn|>\\n
    <|turn>model\\n[<|channel>thought\\n<channel|>]          <- generation prompt

Source. transformers 5.23 ships no Gemma 4 chat template text (the template lives in the model
repos' `chat_template.jinja`, not in the library; the library only knows the output markers, in
`transformers/cli/serving/utils.py`). `render_chat` re-implements, for text conversations, the logic
of the official Gemma 4 `chat_template.jinja` published with the google/gemma-4-* checkpoints
(revision with the empty thought channel in the generation prompt), as read from a public copy:

- `bos_token` first.
- A system turn is written when thinking is on or the first message is `system`/`developer`;
  `<|think|>\\n` opens it when thinking is on; the first message's content is trimmed.
- `assistant` is renamed `model`; other roles keep their name. Every content is trimmed; a model
  turn first drops every `<|channel>...<channel|>` block (thinking of earlier turns is never fed
  back). An assistant message right after another assistant message continues the same turn
  (no second `<|turn>model\\n` header).
- List contents: `text` parts as above, `image` / `audio` / `video` parts become `<|image|>` /
  `<|audio|>` / `<|video|>`; system list contents are the trimmed texts each followed by a space.
- The generation prompt is `<|turn>model\\n`, followed by the empty thought channel
  `<|channel>thought\\n<channel|>` unless thinking is on.

Google has published several revisions of this template. Differences seen between them, for
text chats: the E2B/E4B ("E-series") templates have no empty thought channel in the generation
prompt (`empty_thought_channel=False` reproduces that); a later revision also drops the `<turn|>\n`
between two consecutive assistant messages (here it is kept, as in the revision followed), and
renders a `reasoning_content` field of assistant messages after the last user message (here such
fields are ignored). DiffusionGemma's own template was not available; it is derived from the
26B-A4B Gemma 4, whose ("mainline") template is the one followed.

Tool declarations, tool calls and tool responses are not handled here; for those, and whenever a
checkpoint ships its own template, pass it (`load_chat_template(checkpoint_dir)`) as
`chat_template=`, which `render_chat` then runs with Jinja2 the way transformers'
`apply_chat_template` does.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Mapping, Sequence

__all__ = [
    "TURN_START", "TURN_END", "THINK", "CHANNEL_START", "CHANNEL_END", "EMPTY_THOUGHT",
    "render_chat", "render_chat_template", "load_chat_template", "strip_thinking",
    "history_without_thinking", "chat_images",
]

BOS = "<bos>"
EOS = "<eos>"
TURN_START = "<|turn>"      # id 105
TURN_END = "<turn|>"        # id 106
THINK = "<|think|>"
CHANNEL_START = "<|channel>"
CHANNEL_END = "<channel|>"
THOUGHT_CHANNEL = "thought"
EMPTY_THOUGHT = f"{CHANNEL_START}{THOUGHT_CHANNEL}\n{CHANNEL_END}"
MEDIA_PLACEHOLDERS = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
_SYSTEM_ROLES = ("system", "developer")
_THINKING_KEYS = ("reasoning", "reasoning_content", "thinking")


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                        f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: a chat needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] = {m!r} is not a dict with a string 'role'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list, tuple)):
            raise TypeError(f"messages[{i}]['content'] must be a str or a list of parts, "
                            f"got {type(content).__name__}")
    return list(messages)


def _drop_channels(text: str) -> str:
    """Remove every `<|channel>...<channel|>` block (an unclosed one to the end) and trim."""
    kept = []
    for part in text.split(CHANNEL_END):
        kept.append(part.split(CHANNEL_START)[0] if CHANNEL_START in part else part)
    return "".join(kept).strip()


def _content_text(content: Any, model: bool) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return _drop_channels(content) if model else content.strip()
    out = []
    for item in content:
        kind = item.get("type") if isinstance(item, Mapping) else None
        if kind == "text":
            text = item.get("text") or ""
            out.append(_drop_channels(text) if model else text.strip())
        elif kind in MEDIA_PLACEHOLDERS:
            out.append(MEDIA_PLACEHOLDERS[kind])
    return "".join(out)


def _system_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    return "".join(((item.get("text") if isinstance(item, Mapping) else None) or "").strip() + " "
                   for item in content)


def render_chat(messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                enable_thinking: bool = False, *, bos_token: str = BOS, empty_thought_channel: bool = True,
                chat_template: str | None = None, **template_kwargs: Any) -> str:
    """The Gemma 4 prompt text of `messages` (`[{"role": "system"|"user"|"assistant", "content": ...}]`).

    The text starts with `bos_token` (`"<bos>"`; pass `""` to leave it out), so encode it with
    `add_bos=False`. With thinking off, the generation prompt ends with the empty thought channel
    `<|channel>thought\n<channel|>` unless `empty_thought_channel=False`. With `chat_template`
    (e.g. from `load_chat_template`), that Jinja template is rendered instead, with
    `template_kwargs` passed through.
    """
    if chat_template is not None:
        return render_chat_template(chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking, bos_token=bos_token, **template_kwargs)
    if template_kwargs:
        raise TypeError(f"unexpected arguments {sorted(template_kwargs)}: extra template variables need "
                        "chat_template=")
    messages = _check_messages(messages)
    for i, m in enumerate(messages):
        if m["role"] == "tool" or m.get("tool_calls") or m.get("tool_responses"):
            raise ValueError(f"messages[{i}] is a tool message/call; the built-in Gemma 4 renderer handles text "
                             "chats only: pass the checkpoint's template, chat_template=load_chat_template(dir)")
    out = [bos_token]
    rest = messages
    if enable_thinking or messages[0]["role"] in _SYSTEM_ROLES:
        out.append(f"{TURN_START}system\n")
        if enable_thinking:
            out.append(f"{THINK}\n")
        if messages[0]["role"] in _SYSTEM_ROLES:
            out.append(_system_text(messages[0].get("content")))
            rest = messages[1:]
        out.append(f"{TURN_END}\n")
    prev_role = None
    for m in rest:
        role = "model" if m["role"] == "assistant" else m["role"]
        if not (role == "model" and prev_role == "assistant"):
            out.append(f"{TURN_START}{role}\n")
        out.append(_content_text(m.get("content"), model=role == "model"))
        out.append(f"{TURN_END}\n")
        prev_role = m["role"]
    if add_generation_prompt:
        out.append(f"{TURN_START}model\n")
        if not enable_thinking and empty_thought_channel:
            out.append(EMPTY_THOUGHT)
    return "".join(out)


def strip_thinking(text: str) -> tuple[str, str]:
    """Split a decoded model output into `(thought, answer)`.

    The output looks like `<|channel>thought\\n...<channel|>answer<turn|>`: the text inside the
    channel (without its `thought` label) is the thought, the rest is the answer. Everything from
    the first `<turn|>` or `<eos>` on is dropped, an unclosed channel runs to the end, and text
    before a `<channel|>` that has no opener (a prompt that already opened the channel) is
    thought. Both parts are trimmed; a missing part is "".
    """
    for stop in (TURN_END, EOS):
        i = text.find(stop)
        if i >= 0:
            text = text[:i]
    thoughts: list[str] = []
    answer: list[str] = []
    first_open, first_close = text.find(CHANNEL_START), text.find(CHANNEL_END)
    pos = 0
    if first_close >= 0 and (first_open < 0 or first_close < first_open):
        thoughts.append(text[:first_close])
        pos = first_close + len(CHANNEL_END)
    while pos < len(text):
        s = text.find(CHANNEL_START, pos)
        if s < 0:
            answer.append(text[pos:])
            break
        answer.append(text[pos:s])
        s += len(CHANNEL_START)
        e = text.find(CHANNEL_END, s)
        thoughts.append(text[s:] if e < 0 else text[s:e])
        pos = len(text) if e < 0 else e + len(CHANNEL_END)
    cleaned = []
    for t in thoughts:
        if t.startswith(THOUGHT_CHANNEL) and (len(t) == len(THOUGHT_CHANNEL) or t[len(THOUGHT_CHANNEL)] == "\n"):
            t = t[len(THOUGHT_CHANNEL):]
        t = t.strip()
        if t:
            cleaned.append(t)
    return "\n".join(cleaned), "".join(answer).replace(CHANNEL_END, "").strip()


IMAGE_SOURCE_KEYS = ("image", "path", "url")


def chat_images(messages: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The images of `messages`, in the order `render_chat` writes their `<|image|>` placeholders.

    An image part is `{"type": "image", "image": <PIL.Image, array or bytes>}` or with a `"path"` (or
    `"url"`, which `dgemma_jax.io.images` refuses: download it first). Parts of a leading system message
    are rendered as text only (no placeholder), so its images are not listed. Pass the result to
    `dgemma_jax.io.images.encode_with_images` with the rendered text.
    """
    messages = _check_messages(messages)
    rest = messages[1:] if messages[0]["role"] in _SYSTEM_ROLES else messages
    offset = len(messages) - len(rest)
    out = []
    for i, m in enumerate(rest, start=offset):
        content = m.get("content")
        if not isinstance(content, (list, tuple)):
            continue
        for j, item in enumerate(content):
            if isinstance(item, Mapping) and item.get("type") == "image":
                source = next((item[k] for k in IMAGE_SOURCE_KEYS if item.get(k) is not None), None)
                if source is None:
                    raise ValueError(f"messages[{i}]['content'][{j}] is an image part without its image: add "
                                     f"one of the keys {list(IMAGE_SOURCE_KEYS)} (a PIL image, array, bytes or path)")
                out.append(source)
    return out


def history_without_thinking(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A copy of `messages` whose assistant turns keep only their answers.

    Thinking blocks (`<|channel>...<channel|>`, see `strip_thinking`) are removed from assistant
    contents, text after `<turn|>`/`<eos>` is cut, and `reasoning` / `reasoning_content` /
    `thinking` fields are dropped. Other messages are copied unchanged.
    """
    out = []
    for m in _check_messages(messages):
        m = dict(m)
        if m["role"] in ("assistant", "model"):
            for key in _THINKING_KEYS:
                m.pop(key, None)
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = strip_thinking(content)[1]
            elif isinstance(content, (list, tuple)):
                parts = []
                for item in content:
                    if isinstance(item, Mapping) and item.get("type") == "text" and isinstance(item.get("text"), str):
                        item = {**item, "text": strip_thinking(item["text"])[1]}
                    parts.append(item)
                m["content"] = parts
        out.append(m)
    return out


# --------------------------------------------------------------------------------------------
# Checkpoint templates (run with Jinja2 like transformers' apply_chat_template).


def load_chat_template(path_or_dir: str | os.PathLike) -> str | None:
    """The chat template shipped with a checkpoint, or None when it has none.

    Looks for `chat_template.jinja`, then `chat_template.json`, then the `chat_template` field of
    `tokenizer_config.json` (a string, or a list of named templates: the one named "default").
    `path_or_dir` may also be one of those files.
    """
    path = os.fspath(path_or_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist; expected a checkpoint directory or a chat template file")
    if os.path.isfile(path):
        files = [path]
    else:
        files = [os.path.join(path, n) for n in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")]
    for f in files:
        if not os.path.isfile(f):
            continue
        if not f.endswith(".json"):
            with open(f, encoding="utf-8") as fh:
                return fh.read()
        try:
            with open(f, encoding="utf-8") as fh:
                data = json.load(fh)
        except ValueError as e:
            raise ValueError(f"could not read {f!r} as JSON: {e}") from e
        template = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
    return None


def render_chat_template(chat_template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, enable_thinking: bool = False,
                         bos_token: str = BOS, eos_token: str = EOS, **kwargs: Any) -> str:
    """Render a Hugging Face Jinja chat template the way transformers does (sandboxed Jinja2 with
    `trim_blocks`, `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now` and a
    non-escaping `tojson`)."""
    template = _compile(chat_template)
    return template.render(messages=[dict(m) for m in _check_messages(messages)],
                           add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                           bos_token=bos_token, eos_token=eos_token, **kwargs)


_COMPILED: dict[str, Any] = {}


def _compile(source: str):
    if source in _COMPILED:
        return _COMPILED[source]
    # deferred: jinja2 takes ~80 ms to import and only rendering a chat template needs it
    import jinja2
    from jinja2.ext import loopcontrols  # deferred with jinja2 (above)
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # deferred with jinja2 (above)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    _COMPILED[source] = env.from_string(source)
    return _COMPILED[source]
