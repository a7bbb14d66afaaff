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
        n = len(self.pairs)
        out = []
        for j in range(index * self.batch_size, (index + 1) * self.batch_size):
            epoch, k = divmod(j, n)
            perm = np.random.default_rng([self.seed, epoch]).permutation(n)
            out.append(self.pairs[int(perm[k])])
        return out


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
