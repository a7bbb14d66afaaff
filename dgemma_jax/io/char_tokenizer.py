"""A character-level tokenizer for the small from-scratch models (the bundled one and tests).

Ids 0/1/2 are pad/eos/bos, as in Gemma (so `ModelConfig(pad_id=0, bos_id=2, eos_ids=(1,))` holds);
every other id is one character. The vocab is a JSON file::

    {"type": "char", "specials": ["<pad>", "<eos>", "<bos>"], "chars": "0123456789=+..."}
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from dgemma_jax.io.tokenizer import Tokenizer

SPECIALS = ("<pad>", "<eos>", "<bos>")
PAD_ID, EOS_ID, BOS_ID = 0, 1, 2


class CharTokenizer(Tokenizer):
    """The `Tokenizer` of a character vocabulary: encode(text, add_bos) -> ids, decode(ids) -> text.

    decode stops at the first EOS and leaves out pad/bos and ids outside the vocabulary: the special
    tokens have no spelling here, so `skip_special` changes nothing. The vocabulary cannot spell the
    Gemma 4 chat template's turn markers (`has_chat_template` is False).
    """

    has_chat_template = False

    def __init__(self, chars: str | Sequence[str]):
        chars = "".join(chars)
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer chars must be distinct; got {chars!r}")
        self.chars = chars
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self._set_special_ids(BOS_ID, (EOS_ID,), PAD_ID, None)

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary {self.chars!r}") from None
        return [BOS_ID] + ids if add_bos else ids

    def id_to_piece(self, token_id: int) -> str:
        token_id = int(token_id)
        if 0 <= token_id < len(SPECIALS):
            return SPECIALS[token_id]
        if token_id < self.vocab_size:
            return self.chars[token_id - len(SPECIALS)]
        raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size}) of {self!r}")

    def piece_to_id(self, piece: str) -> int | None:
        return SPECIALS.index(piece) if piece in SPECIALS else self._to_id.get(piece)

    def decode(self, ids: Any, skip_special: bool = False) -> str:
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
