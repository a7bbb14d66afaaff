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

Images (a checkpoint with a vision tower): `send(text, images=[...])` puts them before the text in
the user's turn, preprocessed once. Each turn lays out every image of the conversation
(`io.images.prompt_with_images`), and only those after the reused prefix are run through the vision
tower again: earlier images stay in the cache, as any earlier token does.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine.drivers import CanvasEvent, collect
from dgemma_jax.engine.inputs import default_new_tokens
from dgemma_jax.engine.outputs import warn_if_cut_short
from dgemma_jax.io.chat import strip_thinking
from dgemma_jax.io.images import image_runs
from dgemma_jax.io.prompts import chat_prompt, common_prefix
from dgemma_jax.model.cache import KVCache, rewind_ok


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
    return strip_thinking(tokenizer.decode_generated(ids, skip_special=False))


class ChatSession:
    """A conversation with one model whose KV cache carries over from turn to turn.

    tokenizer: one that can encode the chat template's markers (a Gemma tokenizer); a character
    tokenizer (the bundled digits model) cannot, and then every turn is the user's line alone.
    context: KV cache tokens (capped at the model's positions). max_new_tokens: per turn (default:
    `engine.inputs.DEFAULT_NEW_TOKENS`, capped to what fits). seed: turn t uses seed + t (mod 2**64).
    max_soft_tokens: the per-image token budget (default: the checkpoint's, 280 for the released model).
    A turn reuses the cache's common prefix with its prompt while the sliding layers' ring caches still hold
    the window before that prefix's end (`model.cache.rewind_ok`: within canvas_length + 1 tokens of the
    cached row's end, or a row no longer than the ring); otherwise it prefills the whole conversation.
    """

    def __init__(self, engine, tokenizer, *, system: str = "", thinking: bool = False, context: int = 4096,
                 max_new_tokens: int | None = None, seed: int = 0, max_soft_tokens: int | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_soft_tokens = max_soft_tokens
        self._preprocessed = []  # the conversation's images, preprocessed (ImageBatch of one each), in order
        self.thinking, self.max_new_tokens, self.seed = thinking, max_new_tokens, int(seed)
        self.cache_length = min(int(context), engine.config.max_position_embeddings)
        self.messages = [{"role": "system", "content": system}] if system else []
        self.templated = tokenizer.has_chat_template
        self.cache, self.cached_ids = None, []
        self.turns = 0

    def prompt_ids(self) -> list[int]:
        """The tokens of the conversation so far plus the generation prompt."""
        return self._prompt()[0]

    def _prompt(self):
        """(the conversation's tokens + the generation prompt, its images as an ImageBatch or None); each
        image is preprocessed once, on its turn (the history only grows at its end)."""
        return chat_prompt(self.engine.config, self.tokenizer, self.messages, thinking=self.thinking,
                           max_soft_tokens=self.max_soft_tokens, preprocessed=self._preprocessed)

    def _new_images(self, ids: list[int], keep: int, batch):
        """(keep, the images whose tokens start at or after `keep`): an image that the reused prefix
        would cut is prefilled again whole (keep moves back to its start)."""
        if batch is None:
            return keep, None
        runs = image_runs(ids, self.engine.config.image_token_id)
        for a, b in runs:
            if a < keep < b:
                keep = a - 1  # back to the image's begin marker
        return keep, batch.select([i for i, (a, _) in enumerate(runs) if a >= keep])

    def send(self, text: str, images=(), on_step=None) -> ChatTurn:
        """One user turn (`images`: paths, bytes, PIL images or arrays shown before the text).

        on_step: called with each denoising step's `StepEvent` and each finished canvas's
        `CanvasEvent` as they come; the turn then runs on the step-by-step driver (`Engine.steps`,
        the same tokens and cache as the fused program)."""
        engine, sampler = self.engine, self.engine.sampler
        images = list(images) if isinstance(images, (list, tuple)) else [images]
        content = text if not images else [{"type": "image", "image": im} for im in images] + [
            {"type": "text", "text": text}]
        self.messages.append({"role": "user", "content": content})
        seen = len(self._preprocessed)
        try:
            ids, batch = self._prompt()
        except ValueError:
            self.messages.pop()  # nothing of a refused turn stays in the history
            del self._preprocessed[seen:]
            raise
        keep = 0
        if self.cache is not None:
            keep = min(common_prefix(self.cached_ids, ids), len(ids) - 1)  # at least one token to prefill
        kept, picked = self._new_images(ids, keep, batch)
        if kept > 0 and not rewind_ok(engine.config, self.cache.max_length, int(np.asarray(self.cache.lengths)[0]), kept):
            kept, picked = self._new_images(ids, 0, batch)   # the rings no longer hold the window before it
        keep, batch = kept, picked
        if keep > 0:
            cache = self.cache.replace(lengths=jnp.full_like(self.cache.lengths, keep))
        else:
            cache = None
        new = ids[keep:]
        max_new = (default_new_tokens(engine.config, sampler, len(ids), self.cache_length)
                   if self.max_new_tokens is None else self.max_new_tokens)
        rng = (self.seed + self.turns) % 2 ** 64
        kw = dict(rng=rng, max_new_tokens=max_new, cache=cache,
                  cache_length=None if cache is not None else self.cache_length, images=batch)
        try:
            if on_step is None:
                out = engine.generate(np.array([new], np.int32), None, donate_cache=True, **kw)
                tokens, steps, finished = np.asarray(out.tokens)[0], np.asarray(out.steps)[0], np.asarray(out.finished)
                out_cache = out.cache
            else:
                tokens, steps, finished, out_cache = self._steps(new, on_step, kw)
        except ValueError:
            self.messages.pop()
            del self._preprocessed[seen:]
            raise
        gen = [int(t) for t in tokens if int(t) != sampler.pad_id]
        if self.templated:
            thought, answer = split_reply(self.tokenizer, gen)
        else:
            thought, answer = "", self.tokenizer.decode_generated(gen, skip_special=True)
        if self.max_new_tokens is None:
            warn_if_cut_short(engine.config, max_new, finished, len(ids), self.cache_length)
        self.messages.append({"role": "assistant", "content": answer})
        self.cache = out_cache
        committed = int(np.asarray(self.cache.lengths)[0])
        self.cached_ids = (ids + [int(t) for t in tokens])[:committed]  # the prompt, then the committed canvases
        self.turns += 1
        return ChatTurn(answer=answer, thought=thought, reused=keep, prefilled=len(new),
                        steps=steps[steps > 0].tolist(), prompt_ids=ids, tokens=tokens, max_new_tokens=max_new,
                        rng=rng, cache_length=self.cache_length if cache is None else cache.max_length)

    def _steps(self, new: list[int], on_step, kw):
        """`send`'s generation on the step-by-step driver, each event passed to `on_step`: (tokens,
        steps per canvas, finished, the cache after it), as from the fused program's output."""
        sampler, events, cache = self.engine.sampler, [], None
        for ev in self.engine.steps(np.array([new], np.int32), None, final_cache=True, **kw):
            if isinstance(ev, KVCache):
                cache = ev
                continue
            on_step(ev)
            if isinstance(ev, CanvasEvent):
                events.append(ev)
        tokens, steps, finished = collect(events, 1, kw["max_new_tokens"], sampler.canvas_length, sampler.pad_id)
        return tokens[0], steps[0], finished, cache
