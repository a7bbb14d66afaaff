"""A chat request as the model's prompt: token ids and images, built one way for every front end.

`DiffusionGemma.chat`, the multi-turn `ChatSession` and the server's chat route all call
`chat_prompt`; what differs between them (the server's checks of a request, a session's images kept
from turn to turn) stays with them.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from dgemma_jax.io.chat import chat_images, history_without_thinking, render_chat
from dgemma_jax.io.images import ImageBatch, preprocess_images, prompt_with_images, settings_for


def common_prefix(a, b) -> int:
    """The length of the longest common beginning of two token sequences (lists or 1-d arrays)."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text: its string content, or its text parts joined (image parts left out)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(p if isinstance(p, str) else p.get("text") or "" for p in content or ()
                   if isinstance(p, str) or (isinstance(p, Mapping) and p.get("type") == "text"))


def chat_prompt(config, tokenizer, messages: Sequence[Mapping[str, Any]], *, thinking: bool = False,
                max_soft_tokens: int | None = None, preprocessed: list | None = None) -> tuple[list[int], Any]:
    """The prompt of a chat history, ready to generate the next assistant turn.

    Args:
      config: the `ModelConfig` (its vision tower lays out the images).
      tokenizer: a `Tokenizer`. With a chat template (Gemma 4's) the whole history is rendered with the
        generation prompt, earlier answers without their thinking. Without one (the bundled
        character-level models) the prompt is the last message alone: its text parts joined, its
        images placed as `prompt_with_images` places them.
      messages: `{"role", "content"}` dicts; content a string or parts (`{"type": "text", "text"}`,
        `{"type": "image", "image" | "path": ...}`).
      thinking: render the generation prompt with thinking on.
      max_soft_tokens: the per-image budget (default: the checkpoint's).
      preprocessed: a list a caller keeps over one conversation's turns: the history's images,
        preprocessed, in order. Only images past its length are preprocessed (and appended to it).
    Returns:
      (token ids of the prompt, its images as an `ImageBatch` or None).
    Raises:
      ValueError: no messages, a malformed message, an image that cannot be laid out or read.
    """
    if not messages:
        raise ValueError("no messages: pass a list of {'role': ..., 'content': ...} dicts")
    if not tokenizer.has_chat_template:
        last = messages[-1]
        text, images = message_text(last), chat_images([last])
        if not images:
            return list(tokenizer.encode(text, add_bos=True)), None
        tokens, _, batch = prompt_with_images(config, tokenizer, text, images, max_soft_tokens)
        return tokens[0].tolist(), batch
    history = history_without_thinking(messages)
    text = render_chat(history, add_generation_prompt=True, enable_thinking=thinking)
    images = chat_images(history)
    if not images:
        return list(tokenizer.encode(text)), None  # the rendered text starts with <bos>
    if preprocessed is not None:
        settings = settings_for(config, max_soft_tokens)
        preprocessed += [preprocess_images(im, settings) for im in images[len(preprocessed):]]
        images = ImageBatch.concat(preprocessed)
    tokens, _, batch = prompt_with_images(config, tokenizer, text, images, max_soft_tokens, add_bos=False)
    return tokens[0].tolist(), batch
