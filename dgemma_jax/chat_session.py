"""Multi-turn chat over one engine, reusing the KV cache from turn to turn.

    session = ChatSession(engine, tokenizer, thinking=False, context=4096)
    turn = session.send("Hello!")        # turn.answer, turn.thought, turn.reused, turn.prefilled

Every turn renders the whole conversation with the Gemma 4 chat template (`io.chat.render_chat`;
the thinking of earlier turns is never fed back) and encodes it. The cache of the previous turn
holds that turn's prompt and its committed canvases; the longest prefix it shares with the new
tokens is kept and only the rest is prefilled. The cache is rolled back to that prefix: slots at or
past a row's length are never read, and the encoder is causal, so the K/V of position s depend only
on tokens 0..s and the kept prefix is what a fresh prefill of it would hold.

What the prefix covers: the generation prompt without thinking ends in the empty thought channel
(`<|channel>thought\\n<channel|>`) and the template drops channels from earlier model turns, so on
the next turn the history diverges right after the previous `<|turn>model\\n`; everything before it
(system, earlier turns, the last user message) is reused, and the previous answer is prefilled
again at its template position. With thinking on, the thought is dropped the same way.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine import default_new_tokens, warn_if_cut_short
from dgemma_jax.io.chat import history_without_thinking, render_chat, strip_thinking


@dataclasses.dataclass
class ChatTurn:
    answer: str           # the reply without its thinking, trimmed
    thought: str          # the thinking text ("" when there was none)
    reused: int           # prompt tokens taken from the cache
    prefilled: int        # prompt tokens prefilled this turn
    steps: list           # denoiser passes per canvas run
    prompt_ids: list      # the whole turn's prompt (conversation so far + generation prompt)
    tokens: np.ndarray    # the generated tokens [max_new_tokens] (pad after the end)
    max_new_tokens: int
    rng: int
    cache_length: int


def split_reply(tokenizer, ids) -> tuple[str, str]:
    """(thought, answer) of a chat reply's token ids. Decoded with its special tokens, since a
    Gemma tokenizer's `skip_special` also drops the `<|channel>` / `<channel|>` markers that
    `strip_thinking` splits the thought off at (the thought would then stay in the answer)."""
    return strip_thinking(tokenizer.decode(ids, skip_special=False))


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class ChatSession:
    """A conversation with one model whose KV cache carries over from turn to turn.

    tokenizer: one that can encode the chat template's markers (a Gemma tokenizer); a character
    tokenizer (the bundled digits model) cannot, and then every turn is the user's line alone.
    context: KV cache tokens (capped at the model's positions). max_new_tokens: per turn (default:
    `pipeline.DEFAULT_NEW_TOKENS`, capped to what fits). seed: turn t uses seed + t (mod 2**64).
    """

    def __init__(self, engine, tokenizer, *, system: str = "", thinking: bool = False, context: int = 4096,
                 max_new_tokens: int | None = None, seed: int = 0):
        self.engine, self.tokenizer = engine, tokenizer
        self.thinking, self.max_new_tokens, self.seed = thinking, max_new_tokens, int(seed)
        self.cache_length = min(int(context), engine.config.max_position_embeddings)
        self.messages = [{"role": "system", "content": system}] if system else []
        self.templated = tokenizer.has_chat_template
        self.cache, self.cached_ids = None, []
        self.turns = 0

    def prompt_ids(self) -> list[int]:
        """The tokens of the conversation so far plus the generation prompt."""
        if not self.templated:
            return self.tokenizer.encode(self.messages[-1]["content"], add_bos=True)
        text = render_chat(history_without_thinking(self.messages), add_generation_prompt=True,
                           enable_thinking=self.thinking)
        return list(self.tokenizer.encode(text))  # the text starts with <bos>

    def send(self, text: str) -> ChatTurn:
        engine, sampler = self.engine, self.engine.sampler
        self.messages.append({"role": "user", "content": text})
        ids = self.prompt_ids()
        keep = 0
        if self.cache is not None:
            keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)  # at least one token to prefill
        if keep > 0:
            cache = self.cache.replace(lengths=jnp.full_like(self.cache.lengths, keep))
        else:
            cache = None
        new = ids[keep:]
        max_new = (default_new_tokens(engine.config, sampler, len(ids), self.cache_length)
                   if self.max_new_tokens is None else self.max_new_tokens)
        rng = (self.seed + self.turns) % 2 ** 64
        out = engine.generate(np.array([new], np.int32), None, rng=rng, max_new_tokens=max_new, cache=cache,
                              cache_length=None if cache is not None else self.cache_length)
        tokens = np.asarray(out.tokens)[0]
        gen = [int(t) for t in tokens if int(t) != sampler.pad_id]
        thought, answer = split_reply(self.tokenizer, gen) if self.templated else ("", self.tokenizer.decode(gen, skip_special=True))
        if self.max_new_tokens is None:
            warn_if_cut_short(engine.config, max_new, np.asarray(out.finished), len(ids), self.cache_length)
        self.messages.append({"role": "assistant", "content": answer})
        self.cache = out.cache
        committed = int(np.asarray(self.cache.lengths)[0])
        self.cached_ids = (ids + [int(t) for t in tokens])[:committed]  # the prompt, then the committed canvases
        self.turns += 1
        steps = np.asarray(out.steps)[0]
        return ChatTurn(answer=answer, thought=thought, reused=keep, prefilled=len(new),
                        steps=steps[steps > 0].tolist(), prompt_ids=ids, tokens=tokens, max_new_tokens=max_new,
                        rng=rng, cache_length=self.cache_length if cache is None else cache.max_length)
