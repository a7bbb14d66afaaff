"""Training data: the block-diffusion canvas layout, deterministic batch sources, the iterator state.

Layout of one example (canvas length L = 4, prompt of 3, response "abcde", 3 canvas slots)::

    position   0  1  2 | 3  4  5  6 | 7  8  9  10 | 11 12 13 14
    token      p0 p1 p2| a  b  c  d | e  E  E  E  | .  .  .  .       E = eos fill, . = pad
               prompt  | canvas 0   | canvas 1    | canvas 2 (invalid)
    length = 11 (prompt + valid canvases), prompt_length = 3, num_canvases = 2

The prompt is packed directly before the canvases, so canvas c starts at absolute position
prompt_length + c * L, exactly where the sampler puts it at inference. The response always gets at
least one EOS; the last partial canvas is filled with EOS; canvases after it are invalid (padding,
never visible, never scored). A batch is a dict of numpy arrays::

    tokens [B, T] int32, lengths [B], prompt_lengths [B], num_canvases [B]    (T = P + C * L)

Sources are deterministic functions of (seed, batch index), so the iterator position is just the
next index and a resumed run sees exactly the batches the uninterrupted one would have seen.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Callable, Sequence

import numpy as np

from dgemma_jax.io.chat import CHANNEL_END, CHANNEL_START, TURN_END, render_chat, strip_thinking
from dgemma_jax.io.prompts import message_text


@dataclasses.dataclass(frozen=True)
class Layout:
    """Fixed shapes of a batch: prompt slots P, canvas slots C of length L (one compiled shape)."""

    prompt_length: int
    num_canvases: int
    canvas_length: int
    eos_id: int = 1
    pad_id: int = 0

    def __post_init__(self):
        for f in ("prompt_length", "num_canvases", "canvas_length"):
            if getattr(self, f) < 1:
                raise ValueError(f"Layout.{f} must be >= 1, got {getattr(self, f)}")

    @property
    def total_length(self) -> int:
        return self.prompt_length + self.num_canvases * self.canvas_length

    @property
    def response_capacity(self) -> int:
        return self.num_canvases * self.canvas_length


def chunk_example(prompt: Sequence[int], response: Sequence[int], layout: Layout):
    """One (prompt, response) pair -> (tokens [T], length, prompt_length, num_valid_canvases).

    A prompt longer than P keeps its last P tokens (an empty prompt is not allowed: the first
    canvas needs a position >= 1 context). The response plus one EOS is cut into canvases, the last
    filled with EOS; a response longer than C * L is truncated (its last canvas then has no EOS).
    """
    prompt = list(prompt)[-layout.prompt_length:]
    if not prompt:
        raise ValueError("every example needs a non-empty prompt (e.g. a BOS token)")
    resp = list(response)[: layout.response_capacity - 1] + [layout.eos_id]
    if len(response) >= layout.response_capacity:
        resp = list(response)[: layout.response_capacity]
    L = layout.canvas_length
    n = math.ceil(len(resp) / L)
    resp = resp + [layout.eos_id] * (n * L - len(resp))
    tokens = np.full((layout.total_length,), layout.pad_id, np.int32)
    seq = prompt + resp
    tokens[: len(seq)] = seq
    return tokens, len(seq), len(prompt), n


def collate(examples: Sequence[tuple[Sequence[int], Sequence[int]]], layout: Layout) -> dict[str, np.ndarray]:
    rows = [chunk_example(p, r, layout) for p, r in examples]
    return {
        "tokens": np.stack([r[0] for r in rows]).astype(np.int32),
        "lengths": np.asarray([r[1] for r in rows], np.int32),
        "prompt_lengths": np.asarray([r[2] for r in rows], np.int32),
        "num_canvases": np.asarray([r[3] for r in rows], np.int32),
    }


# ---------------------------------------------------------------------------- sources
class Source:
    """A deterministic batch source: `batch(index)` depends only on (seed, index)."""

    layout: Layout
    batch_size: int

    def examples(self, index: int) -> list[tuple[list[int], list[int]]]:
        raise NotImplementedError

    def batch(self, index: int) -> dict[str, np.ndarray]:
        return collate(self.examples(index), self.layout)


class TaskSource(Source):
    """Synthetic (prompt, answer) problems from a `TaskMix`, tokenized with BOS + chars."""

    def __init__(self, mix, tokenizer, layout: Layout, batch_size: int, seed: int = 0):
        self.mix, self.tok, self.layout, self.batch_size, self.seed = mix, tokenizer, layout, batch_size, seed

    def example_strings(self, index: int) -> list[tuple[str, str]]:
        rng = np.random.default_rng([self.seed, index])
        return [self.mix.sample(rng) for _ in range(self.batch_size)]

    def examples(self, index: int):
        return [([self.tok.bos_id] + self.tok.encode(p), self.tok.encode(a)) for p, a in self.example_strings(index)]


def epoch_batch(rows: Sequence, index: int, batch_size: int, seed: int) -> list:
    """Batch `index` of `rows` read in epochs, each a permutation of the rows from (seed, epoch): rows
    index * batch_size ... of that order (SFT's JSON lines, RL's prompts and DPO's pairs)."""
    n = len(rows)
    out = []
    for j in range(index * batch_size, (index + 1) * batch_size):
        epoch, k = divmod(j, n)
        out.append(rows[int(np.random.default_rng([seed, epoch]).permutation(n)[k])])
    return out


class JsonlSource(Source):
    """Supervised pairs from a JSON-lines file ({"prompt": ..., "response": ...} per line), shuffled
    per epoch with `seed`. `tokenize(str) -> list[int]`; BOS is prepended to the prompt when bos_id is
    not None (leave it None if the prompt text already renders the chat template with BOS)."""

    def __init__(self, path: str, tokenize: Callable[[str], list[int]], layout: Layout, batch_size: int,
                 seed: int = 0, prompt_key: str = "prompt", response_key: str = "response",
                 bos_id: int | None = None):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        if not rows:
            raise ValueError(f"{path} holds no examples")
        self.pairs = [(([bos_id] if bos_id is not None else []) + list(tokenize(r[prompt_key])),
                       list(tokenize(r[response_key]))) for r in rows]
        self.layout, self.batch_size, self.seed = layout, batch_size, seed

    def examples(self, index: int):
        return epoch_batch(self.pairs, index, self.batch_size, self.seed)


class RawTextSource(Source):
    """From-scratch pretraining on raw text with the same layout: each example takes a random window
    of a random document and splits it at a random point (prompt = before, response = after)."""

    def __init__(self, documents: Sequence[Sequence[int]], layout: Layout, batch_size: int, seed: int = 0,
                 min_prompt: int = 1, bos_id: int | None = None):
        self.docs = [list(d) for d in documents if len(d) >= min_prompt + 1]
        if not self.docs:
            raise ValueError("RawTextSource needs documents longer than min_prompt")
        self.layout, self.batch_size, self.seed = layout, batch_size, seed
        self.min_prompt, self.bos_id = min_prompt, bos_id

    def examples(self, index: int):
        rng = np.random.default_rng([self.seed, index])
        lay = self.layout
        out = []
        for _ in range(self.batch_size):
            doc = self.docs[int(rng.integers(len(self.docs)))]
            if self.bos_id is not None:
                doc = [self.bos_id] + doc
            start = int(rng.integers(0, max(1, len(doc) - self.min_prompt)))
            window = doc[start:start + lay.prompt_length + lay.response_capacity]
            split = int(rng.integers(self.min_prompt, min(lay.prompt_length, len(window) - 1) + 1))
            out.append((window[:split], window[split:]))
        return out


class DataIterator:
    """The training iterator: yields `source.batch(index)` for index = 0, 1, ...; its whole state
    is {"index": next index} and is saved with every checkpoint."""

    def __init__(self, source: Source, index: int = 0):
        self.source, self.index = source, int(index)

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        b = self.source.batch(self.index)
        self.index += 1
        return b

    def get_state(self) -> dict[str, Any]:
        return {"index": int(self.index)}

    def set_state(self, state: dict[str, Any]) -> None:
        self.index = int(state["index"])


# ---------------------------------------------------------------------------- chat data
_CHAT_ROLES = ("system", "developer", "user", "assistant")
_THINKING_KEYS = ("thinking", "reasoning", "reasoning_content")
OVERFLOW = ("truncate", "drop")


def _assistant_answer(message: dict) -> tuple[str, str]:
    """(thought, answer) of an assistant message: the thought from a thinking/reasoning field or
    from an inline `<|channel>thought\\n...<channel|>` block of the content."""
    thought, answer = strip_thinking(message_text(message))
    for key in _THINKING_KEYS:
        if isinstance(message.get(key), str) and message[key].strip():
            thought = message[key].strip()
    return thought, answer


def chat_turns(messages: Sequence[dict], enable_thinking: bool | None = None) -> list[tuple[str, str]]:
    """One (context, response) text pair per assistant message, laid out as inference sees it.

    context: the Gemma 4 rendering (`io.chat.render_chat`) of the messages before the turn, with the
    generation prompt (earlier turns' thinking removed, as the template does). response: what the
    model then writes: `[<|channel>thought\\n THOUGHT<channel|>]ANSWER<turn|>` (the thought only when
    thinking is on; with it off the generation prompt already ends with the empty thought channel).
    Thinking is on when `enable_thinking` says so, else when any assistant message carries a thought.
    """
    parsed = [(_assistant_answer(m) if m["role"] == "assistant" else None) for m in messages]
    if enable_thinking is None:
        enable_thinking = any(p is not None and p[0] for p in parsed)
    out = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("the conversation starts with an assistant message: it needs a user turn before it")
        if messages[i - 1]["role"] == "assistant":
            raise ValueError(f"messages[{i - 1}] and messages[{i}] are consecutive assistant messages: merge them")
        context = render_chat(messages[:i], add_generation_prompt=True, enable_thinking=enable_thinking)
        thought, answer = parsed[i]
        response = f"{CHANNEL_START}thought\n{thought}{CHANNEL_END}" if (enable_thinking and thought) else ""
        out.append((context, response + answer + TURN_END))
    return out


def _parse_chat_line(line: str, where: str) -> tuple[list[dict], bool | None]:
    try:
        row = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(row, dict) or not isinstance(row.get("messages"), list) or not row["messages"]:
        raise ValueError(f"{where}: expected an object with a non-empty \"messages\" list")
    for j, m in enumerate(row["messages"]):
        if not isinstance(m, dict) or m.get("role") not in _CHAT_ROLES:
            raise ValueError(f"{where}: messages[{j}] needs a \"role\" in {_CHAT_ROLES}, got "
                             f"{m.get('role') if isinstance(m, dict) else m!r}")
        if m["role"] in ("system", "developer") and j > 0:
            raise ValueError(f"{where}: messages[{j}] is a {m['role']} message after the first message")
        if not isinstance(m.get("content"), (str, list)):
            raise ValueError(f"{where}: messages[{j}] needs a string (or list of parts) \"content\"")
    thinking = row.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ValueError(f"{where}: \"enable_thinking\" must be true or false")
    return row["messages"], thinking


class ChatSource(Source):
    """Chat SFT data: a JSON-lines file of {"messages": [...], ["enable_thinking": bool]} (roles
    system/developer first, then user/assistant; assistant messages may carry a "thinking" /
    "reasoning" / "reasoning_content" field or an inline thought channel), rendered with the Gemma 4
    chat template (`chat_turns`).

    One training example per assistant message: prompt = the rendered conversation up to that turn's
    generation prompt, response = the turn's output, cut into the canvases after the prompt exactly
    as the sampler places them. The diffusion loss therefore only ever sees assistant tokens (and the
    EOS fill); with `objective.ar_on_prompt=False` the AR loss too (data.ar_loss="assistant").

    Streaming: the constructor reads the file once, line by line, validating every line (an error
    names the file and line) and keeping only (byte offset, turn) per example plus the token counts;
    batches re-read their lines by offset. Examples that do not fit the layout (context > P tokens,
    response + EOS > C * L) are, with overflow="truncate", cut as `chunk_example` does (the context
    keeps its last P tokens, the response its first C * L) or, with overflow="drop", left out;
    `stats` counts both. Order: a permutation of the examples per epoch from (seed, epoch), so a batch
    depends only on (seed, index) and resume is exact.
    """

    def __init__(self, path: str, tokenize: Callable[[str], list[int]], layout: Layout, batch_size: int,
                 seed: int = 0, overflow: str = "truncate"):
        if overflow not in OVERFLOW:
            raise ValueError(f"data.overflow must be one of {OVERFLOW}, got {overflow!r}")
        self.path, self.tokenize, self.layout, self.batch_size, self.seed = path, tokenize, layout, batch_size, seed
        P, cap = layout.prompt_length, layout.response_capacity
        offsets, turns = [], []
        st = dict(conversations=0, assistant_turns=0, examples=0, conversations_without_assistant=0,
                  examples_dropped=0, contexts_truncated=0, context_tokens_dropped=0,
                  responses_truncated=0, response_tokens_dropped=0)
        with open(path, "rb") as f:
            lineno, offset = 0, 0
            for raw in f:
                lineno += 1
                line_offset, offset = offset, offset + len(raw)
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                messages, thinking = _parse_chat_line(line, f"{path} line {lineno}")
                try:
                    pairs = chat_turns(messages, thinking)
                except (ValueError, TypeError) as e:
                    raise ValueError(f"{path} line {lineno}: {e}") from None
                st["conversations"] += 1
                st["conversations_without_assistant"] += not pairs
                for turn, (context, response) in enumerate(pairs):
                    st["assistant_turns"] += 1
                    c_over = max(0, len(tokenize(context)) - P)
                    r_len = len(tokenize(response))
                    r_cut = r_len + 1 > cap  # no room for the EOS the layout appends
                    if (c_over or r_cut) and overflow == "drop":
                        st["examples_dropped"] += 1
                        continue
                    st["contexts_truncated"] += c_over > 0
                    st["context_tokens_dropped"] += c_over
                    st["responses_truncated"] += r_cut
                    st["response_tokens_dropped"] += max(0, r_len - cap)
                    offsets.append(line_offset)
                    turns.append(turn)
        st["examples"] = len(offsets)
        if not offsets:
            raise ValueError(f"{path} holds no assistant turn that fits the layout ({st})")
        self.offsets, self.turns = np.asarray(offsets, np.int64), np.asarray(turns, np.int32)
        self.stats = st
        self._perm: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self)))
        return self._perm[1]

    def example_texts(self, index: int) -> list[tuple[str, str]]:
        """The (context, response) texts of batch `index`."""
        n = len(self)
        out = []
        with open(self.path, "rb") as f:
            for j in range(index * self.batch_size, (index + 1) * self.batch_size):
                epoch, k = divmod(j, n)
                e = int(self._permutation(epoch)[k])
                f.seek(int(self.offsets[e]))  # a line checked when the source was built
                messages, thinking = _parse_chat_line(f.readline().decode("utf-8"),
                                                      f"{self.path} at byte {int(self.offsets[e])} (changed since?)")
                out.append(chat_turns(messages, thinking)[int(self.turns[e])])
        return out

    def examples(self, index: int):
        return [(self.tokenize(c), self.tokenize(r)) for c, r in self.example_texts(index)]

    def summary(self) -> str:
        s = self.stats
        return (f"chat data {self.path}: {s['conversations']} conversations, {s['assistant_turns']} assistant turns -> "
                f"{s['examples']} examples; dropped {s['examples_dropped']} examples that do not fit; truncated "
                f"{s['contexts_truncated']} contexts ({s['context_tokens_dropped']} tokens) and "
                f"{s['responses_truncated']} responses ({s['response_tokens_dropped']} tokens); "
                f"{s['conversations_without_assistant']} conversations had no assistant turn")
