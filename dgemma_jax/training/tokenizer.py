"""A character-level tokenizer for the small from-scratch models (the bundled one and tests).

Ids 0/1/2 are pad/eos/bos, as in Gemma (so `ModelConfig(pad_id=0, bos_id=2, eos_ids=(1,))` holds);
every other id is one character. The vocab is a JSON file::

    {"type": "char", "specials": ["<pad>", "<eos>", "<bos>"], "chars": "0123456789=+..."}
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

SPECIALS = ("<pad>", "<eos>", "<bos>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2


class CharTokenizer:
    """encode(str) -> list[int] (no BOS/EOS added), decode(list[int]) -> str (stops at the first EOS,
    skips pad/bos and ids outside the vocabulary)."""

    def __init__(self, chars: str | Sequence[str]):
        chars = "".join(chars)
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer chars must be distinct; got {chars!r}")
        self.chars = chars
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

    pad_id, eos_id, bos_id = PAD_ID, EOS_ID, BOS_ID

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from None

    def decode(self, ids: Iterable[int]) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            j = i - len(SPECIALS)
            if 0 <= j < len(self.chars):
                out.append(self.chars[j])
        return "".join(out)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        return {"type": "char", "specials": list(SPECIALS), "chars": self.chars}

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        with open(path) as f:
            d = json.load(f)
        if d.get("type") != "char" or tuple(d.get("specials", ())) != SPECIALS:
            raise ValueError(f"{path} is not a CharTokenizer vocab file")
        return cls(d["chars"])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={self.chars!r})"
