"""A character-level tokenizer for the small from-scratch models (the bundled one and tests).

Ids 0/1/2 are pad/eos/bos, as in Gemma (so `ModelConfig(pad_id=0, bos_id=2, eos_ids=(1,))` holds);
every other id is one character, except the optional `markers`: multi-character pieces that are one
token each (the image models' `<|image>`, `<|image|>`, `<image|>`), numbered after the characters. The
vocab is a JSON file::

    {"type": "char", "specials": ["<pad>", "<eos>", "<bos>"], "chars": "0123456789=+...", "markers": [...]}
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

    decode stops at the first EOS and leaves out pad/bos and ids outside the vocabulary (those special
    tokens have no spelling here); `skip_special` also leaves out the markers. The vocabulary cannot spell the
    Gemma 4 chat template's turn markers (`has_chat_template` is False).
    """

    has_chat_template = False

    def __init__(self, chars: str | Sequence[str], markers: Sequence[str] = ()):
        chars = "".join(chars)
        if len(set(chars)) != len(chars):
            raise ValueError(f"CharTokenizer chars must be distinct; got {chars!r}")
        markers = tuple(markers)
        for m in markers:
            if not isinstance(m, str) or len(m) < 2 or m in SPECIALS or markers.count(m) > 1:
                raise ValueError(f"CharTokenizer markers must be distinct strings of 2+ characters other than "
                                 f"{SPECIALS}; got {markers!r}")
        self.chars, self.markers = chars, markers
        self._to_id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}
        self._marker_id = {m: i + len(SPECIALS) + len(chars) for i, m in enumerate(markers)}
        # the longest marker first, so one that begins another never cuts it
        self._by_length = sorted(markers, key=len, reverse=True)
        self._set_special_ids(BOS_ID, (EOS_ID,), PAD_ID, None)

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars) + len(self.markers)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            m = next((m for m in self._by_length if text.startswith(m, i)), None)
            if m is not None:
                ids.append(self._marker_id[m])
                i += len(m)
                continue
            if text[i] not in self._to_id:
                raise ValueError(f"character {text[i]!r} is not in the vocabulary {self.chars!r}")
            ids.append(self._to_id[text[i]])
            i += 1
        return [BOS_ID] + ids if add_bos else ids

    def id_to_piece(self, token_id: int) -> str:
        token_id = int(token_id)
        if 0 <= token_id < len(SPECIALS):
            return SPECIALS[token_id]
        if token_id < len(SPECIALS) + len(self.chars):
            return self.chars[token_id - len(SPECIALS)]
        if token_id < self.vocab_size:
            return self.markers[token_id - len(SPECIALS) - len(self.chars)]
        raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self.vocab_size}) of {self!r}")

    def piece_to_id(self, piece: str) -> int | None:
        if piece in SPECIALS:
            return SPECIALS.index(piece)
        return self._marker_id.get(piece, self._to_id.get(piece))

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        """The characters of `ids` up to the first EOS (markers spelled out unless skip_special)."""
        out = []
        for i in ids:
            i = int(i)
            if i == EOS_ID:
                break
            j = i - len(SPECIALS)
            if 0 <= j < len(self.chars):
                out.append(self.chars[j])
            elif not skip_special and 0 <= j - len(self.chars) < len(self.markers):
                out.append(self.markers[j - len(self.chars)])
        return "".join(out)

    # ------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        d = {"type": "char", "specials": list(SPECIALS), "chars": self.chars}
        if self.markers:
            d["markers"] = list(self.markers)
        return d

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CharTokenizer":
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read(), path)

    @classmethod
    def from_json(cls, text: str, path: str | os.PathLike = "<text>") -> "CharTokenizer":
        """From the content of a vocab file (`save`); path names it in the error."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path} is not a CharTokenizer vocab file ({e})") from None
        if not isinstance(d, dict) or d.get("type") != "char" or tuple(d.get("specials", ())) != SPECIALS:
            raise ValueError(f"{path} is not a CharTokenizer vocab file")
        return cls(d["chars"], d.get("markers", ()))

    def __repr__(self) -> str:
        extra = f", markers={list(self.markers)!r}" if self.markers else ""
        return f"CharTokenizer(vocab_size={self.vocab_size}, chars={self.chars!r}{extra})"
