"""Tokenizers: Gemma's SentencePiece `tokenizer.model` and Hugging Face `tokenizer.json`.

`load_tokenizer(path_or_dir)` accepts a tokenizer file or a checkpoint directory and returns a
`Tokenizer`. Special ids come, in this order of priority, from

1. explicit keyword arguments of `load_tokenizer`,
2. `generation_config.json` (`eos_token_id` there is the full stop list, e.g. [1, 106, 50]),
3. `config.json` (its `text_config` first, then the top level),
4. `tokenizer_config.json` (`bos_token` / `eos_token` / ... as token strings),
5. the tokenizer file itself (SentencePiece's bos/eos/pad/unk ids, or the pieces `<bos>` / `<eos>` /
   `<pad>` / `<unk>` of a `tokenizer.json`).

`Tokenizer` is a small abstract base class; any other tokenizer (e.g. a character tokenizer for a
bundled toy model) can subclass it by implementing `vocab_size`, `encode` and `decode`.
"""

from __future__ import annotations

import abc
import os
import re
from typing import Any, Iterable, Mapping, Sequence

from dgemma_jax.errors import read_json

__all__ = [
    "Tokenizer",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "find_tokenizer_file",
    "read_special_ids",
    "TOKENIZER_FILES",
]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
# what `Tokenizer.decode_generated` writes for an id the tokenizer has no text for
REPLACEMENT = "\ufffd"
_CONFIG_FILES = ("generation_config.json", "config.json", "tokenizer_config.json")
# Gemma 4 marker tokens look like `<|turn>`, `<turn|>`, `<|think|>`, `<|"|>`, `<|image|>`.
_MARKER_RE = re.compile(r"^(<\|[^<>\s]*>|<[^<>\s]*\|>)$")
_UNSET: Any = object()


def _as_id_list(ids: Any) -> list[int]:
    """An int, a sequence of ints or a 0-/1-d numpy/jax array -> list of Python ints."""
    if isinstance(ids, int):
        return [ids]
    if hasattr(ids, "tolist") and hasattr(ids, "ndim"):
        if ids.ndim > 1:
            raise ValueError(f"token ids must be 0- or 1-dimensional, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
        if isinstance(ids, int):
            return [ids]
    return [int(i) for i in ids]


class Tokenizer(abc.ABC):
    """What the rest of dgemma_jax needs from a tokenizer.

    Subclasses implement `vocab_size`, `encode` and `decode` and set the special ids
    (`bos_id`, `eos_ids`, `pad_id`, `unk_id`; None / () when the vocabulary has none).
    `id_to_piece` / `piece_to_id` are optional.
    """

    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None
    unk_id: int | None = None
    # whether prompts are rendered with the Gemma 4 chat template (a Gemma vocabulary spells its markers)
    has_chat_template: bool = True

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""

    @abc.abstractmethod
    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in `text` (e.g. `<|turn>`) become their ids."""

    @abc.abstractmethod
    def decode(self, ids: Any, skip_special: bool = False) -> str:
        """Text of `ids`; with `skip_special` the special tokens are left out."""

    def decode_generated(self, ids: Any, skip_special: bool = False) -> str:
        """Text of ids a model generated. A checkpoint whose vocabulary is larger than this tokenizer's
        (`ModelConfig.vocab_size` > `vocab_size`) can emit ids this tokenizer has no text for: each
        such id is written as U+FFFD (the replacement character), where `decode` would raise."""
        ids = _as_id_list(ids)
        n = self.vocab_size
        if all(0 <= i < n for i in ids):
            return self.decode(ids, skip_special)
        parts, run = [], []
        for i in ids + [-1]:  # a sentinel flushes the last run
            if 0 <= i < n:
                run.append(i)
                continue
            if run:
                parts.append(self.decode(run, skip_special))
                run = []
            parts.append(REPLACEMENT)
        return "".join(parts[:-1])

    def id_to_piece(self, token_id: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} has no piece table")

    def piece_to_id(self, piece: str) -> int | None:
        """The id of `piece`, or None when it is not in the vocabulary."""
        raise NotImplementedError(f"{type(self).__name__} has no piece table")

    @property
    def eos_id(self) -> int | None:
        """The first stop id (the tokenizer's own `<eos>` when nothing else was configured)."""
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids that `decode(..., skip_special=True)` leaves out."""
        return frozenset(i for i in (self.bos_id, self.pad_id, self.unk_id, *self.eos_ids) if i is not None)

    def _set_special_ids(self, bos_id, eos_ids, pad_id, unk_id) -> None:
        n = self.vocab_size
        for name, value in (("bos_id", bos_id), ("pad_id", pad_id), ("unk_id", unk_id)):
            if value is not None and not 0 <= int(value) < n:
                raise ValueError(f"{name}={value} is outside the vocabulary [0, {n}) of {self!r}")
        eos = () if eos_ids is None else (eos_ids,) if isinstance(eos_ids, int) else tuple(eos_ids)
        for e in eos:
            if not 0 <= int(e) < n:
                raise ValueError(f"eos id {e} is outside the vocabulary [0, {n}) of {self!r}")
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_ids = tuple(dict.fromkeys(int(e) for e in eos))
        self.pad_id = None if pad_id is None else int(pad_id)
        self.unk_id = None if unk_id is None else int(unk_id)

    def _check_ids(self, ids: list[int]) -> None:
        n = self.vocab_size
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {n}) of {self!r}")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `tokenizer.model` (Gemma's native tokenizer).

    Differences from plain `sentencepiece`, to agree with Hugging Face's `tokenizer.json`:
    control pieces (`<bos>`, `<eos>`, `<pad>`, ...) and `<unk>` written literally in the text are
    encoded as their ids, and `decode(skip_special=False)` writes them out instead of dropping them.
    `skip_special=True` also drops marker pieces such as `<|turn>` / `<channel|>`.
    """

    def __init__(self, model_path: str | os.PathLike, *, bos_id: int | None = _UNSET,
                 eos_ids: int | Sequence[int] | None = _UNSET, pad_id: int | None = _UNSET,
                 unk_id: int | None = _UNSET, extra_special_ids: Iterable[int] = ()):
        try:
            import sentencepiece as spm  # deferred: ~8 ms to import; only SentencePiece checkpoints need it
        except ImportError as e:  # pragma: no cover - sentencepiece is a dependency
            raise ImportError(f"reading {model_path!s} needs the `sentencepiece` package") from e
        self.path = os.fspath(model_path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no SentencePiece model file at {self.path!r}")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(self.path)
        except Exception as e:  # sentencepiece raises OSError/RuntimeError with a terse message
            raise ValueError(f"{self.path!r} is not a valid SentencePiece model (tokenizer.model): {e}") from e
        self._n = int(self._sp.GetPieceSize())

        def own(i):
            return None if i < 0 else int(i)

        self._set_special_ids(
            own(self._sp.bos_id()) if bos_id is _UNSET else bos_id,
            ([] if self._sp.eos_id() < 0 else [self._sp.eos_id()]) if eos_ids is _UNSET else eos_ids,
            own(self._sp.pad_id()) if pad_id is _UNSET else pad_id,
            own(self._sp.unk_id()) if unk_id is _UNSET else unk_id,
        )
        self._extra_special = frozenset(int(i) for i in extra_special_ids)
        self._check_ids(sorted(self._extra_special))
        self._special_cache: frozenset[int] | None = None
        # Pieces that sentencepiece never parses out of raw text but HF's tokenizer.json does.
        literal = {i for i in range(self._n) if self._sp.IsControl(i)}
        if self.unk_id is not None:
            literal.add(self.unk_id)
        self._literal = {self._sp.IdToPiece(i): i for i in sorted(literal)}
        self._literal = {p: i for p, i in self._literal.items() if p}
        self._literal_re = (re.compile("|".join(re.escape(p) for p in sorted(self._literal, key=len, reverse=True)))
                            if self._literal else None)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self._n})"

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def special_ids(self) -> frozenset[int]:
        if self._special_cache is None:
            ids = set(super().special_ids) | set(self._extra_special)
            for i in range(self._n):
                if self._sp.IsControl(i) or self._sp.IsUnknown(i):
                    ids.add(i)
                elif not self._sp.IsByte(i) and _MARKER_RE.match(self._sp.IdToPiece(i)):
                    ids.add(i)
            self._special_cache = frozenset(ids)
        return self._special_cache

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        out: list[int] = []
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self!r} has no BOS token; call encode(..., add_bos=False)")
            out.append(self.bos_id)
        pos = 0
        if self._literal_re is not None:
            for m in self._literal_re.finditer(text):
                if m.start() > pos:
                    out += self._sp.EncodeAsIds(text[pos:m.start()])
                out.append(self._literal[m.group()])
                pos = m.end()
        if pos < len(text):
            out += self._sp.EncodeAsIds(text[pos:])
        return out

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        ids = _as_id_list(ids)
        self._check_ids(ids)
        special = self.special_ids if skip_special else frozenset()
        parts: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in special:
                continue
            if self._sp.IsControl(i) or self._sp.IsUnknown(i):
                if run:
                    parts.append(self._sp.DecodeIds(run))
                    run = []
                parts.append(self._sp.IdToPiece(i))
            else:
                run.append(i)
        if run:
            parts.append(self._sp.DecodeIds(run))
        return "".join(parts)

    def id_to_piece(self, token_id: int) -> str:
        self._check_ids([int(token_id)])
        return self._sp.IdToPiece(int(token_id))

    def piece_to_id(self, piece: str) -> int | None:
        i = int(self._sp.PieceToId(piece))
        return i if 0 <= i < self._n and self._sp.IdToPiece(i) == piece else None


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json`, read with the `tokenizers` library (no transformers)."""

    def __init__(self, json_path: str | os.PathLike, *, bos_id: int | None = _UNSET,
                 eos_ids: int | Sequence[int] | None = _UNSET, pad_id: int | None = _UNSET,
                 unk_id: int | None = _UNSET, extra_special_ids: Iterable[int] = ()):
        try:
            from tokenizers import Tokenizer as _Tok  # deferred: ~8 ms to import; only tokenizer.json needs it
        except ImportError as e:  # pragma: no cover - tokenizers is a dependency
            raise ImportError(f"reading {json_path!s} needs the `tokenizers` package") from e
        self.path = os.fspath(json_path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"no tokenizer.json file at {self.path!r}")
        try:
            self._tok = _Tok.from_file(self.path)
        except Exception as e:
            raise ValueError(f"{self.path!r} is not a valid Hugging Face tokenizer.json "
                             f"(expected the `tokenizers` serialization format): {e}") from e
        self._n = int(self._tok.get_vocab_size(with_added_tokens=True))

        def find(*pieces):
            for p in pieces:
                i = self._tok.token_to_id(p)
                if i is not None:
                    return int(i)
            return None

        eos = find("<eos>", "</s>", "<|endoftext|>")
        self._set_special_ids(
            find("<bos>", "<s>") if bos_id is _UNSET else bos_id,
            ([] if eos is None else [eos]) if eos_ids is _UNSET else eos_ids,
            find("<pad>") if pad_id is _UNSET else pad_id,
            find("<unk>") if unk_id is _UNSET else unk_id,
        )
        added = self._tok.get_added_tokens_decoder()
        self._added_special = frozenset(int(i) for i, t in added.items() if t.special)
        self._extra_special = frozenset(int(i) for i in extra_special_ids)
        self._check_ids(sorted(self._extra_special))

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self._n})"

    @property
    def vocab_size(self) -> int:
        return self._n

    @property
    def special_ids(self) -> frozenset[int]:
        return super().special_ids | self._added_special | self._extra_special

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"{self!r} has no BOS token; call encode(..., add_bos=False)")
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Any, skip_special: bool = False) -> str:
        ids = _as_id_list(ids)
        self._check_ids(ids)
        extra = (self.special_ids - self._added_special) if skip_special else frozenset()
        if extra:
            ids = [i for i in ids if i not in extra]
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def id_to_piece(self, token_id: int) -> str:
        self._check_ids([int(token_id)])
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} has no piece in {self!r}")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        i = self._tok.token_to_id(piece)
        return None if i is None else int(i)


# --------------------------------------------------------------------------------------------
# Finding files and special ids.


def find_tokenizer_file(path_or_dir: str | os.PathLike, prefer: str | None = None) -> str:
    """The tokenizer file for `path_or_dir`: the path itself when it is a file, else a
    `tokenizer.json` / `tokenizer.model` in the directory, its `tokenizer/` subfolder or its parent.

    `prefer="sentencepiece"` tries `tokenizer.model` first; the default prefers `tokenizer.json`
    (what transformers' fast tokenizer reads, so ids match the HF reference by construction).
    """
    path = os.fspath(path_or_dir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path!r} does not exist; expected a tokenizer.json / tokenizer.model file "
                                "or a checkpoint directory that contains one")
    if os.path.isfile(path):
        return path
    names = _file_order(prefer)
    searched = []
    for d in (path, os.path.join(path, "tokenizer"), os.path.dirname(os.path.abspath(path))):
        for name in names:
            cand = os.path.join(d, name)
            searched.append(cand)
            if os.path.isfile(cand):
                return cand
    raise FileNotFoundError(f"no tokenizer found for {path!r}: expected one of {' or '.join(names)}; looked for "
                            + ", ".join(repr(s) for s in searched))


def _file_order(prefer: str | None) -> tuple[str, ...]:
    if prefer in (None, "tokenizers", "hf", "json"):
        return TOKENIZER_FILES
    if prefer in ("sentencepiece", "spm", "model"):
        return TOKENIZER_FILES[::-1]
    raise ValueError(f"prefer={prefer!r}: expected None, 'tokenizers' or 'sentencepiece'")


def _read_json(path: str) -> dict | None:
    return read_json(path) if os.path.isfile(path) else None


def _token_string(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):  # serialized AddedToken
        return value["content"]
    return None


def read_special_ids(config_dirs: str | os.PathLike | Sequence[str | os.PathLike],
                     piece_to_id=None, known: Mapping[str, Mapping] | None = None) -> dict[str, Any]:
    """Special ids configured in the checkpoint's JSON files, highest priority first.

    Returns a dict with some of `bos_id`, `eos_ids`, `pad_id`, `unk_id` (only the ones found) and
    `extra_special_ids` (ids marked special in tokenizer_config.json's `added_tokens_decoder`).
    `piece_to_id` maps the token strings of tokenizer_config.json to ids; without it they are ignored.
    known: {absolute path: content} of files already read (used instead of reading them again).
    """
    if isinstance(config_dirs, (str, os.PathLike)):
        config_dirs = [config_dirs]
    dirs = list(dict.fromkeys(os.path.abspath(os.fspath(d)) for d in config_dirs))
    found: dict[str, Any] = {}
    known = known or {}

    def read(src):
        return known[src] if src in known else _read_json(src)

    def put(key, value, src):
        if key in found or value is None:
            return
        if key == "eos_ids":
            value = [value] if isinstance(value, int) else value
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
                raise ValueError(f"{src}: eos_token_id={value!r} should be an integer or a list of integers")
            if value:
                found[key] = tuple(value)
            return
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{src}: {key.replace('_id', '_token_id')}={value!r} should be an integer")
        found[key] = value

    for name in ("generation_config.json", "config.json"):
        for d in dirs:
            src = os.path.join(d, name)
            data = read(src)
            if data is None:
                continue
            for scope in ([data.get("text_config")] if isinstance(data.get("text_config"), dict) else []) + [data]:
                for key, hf in (("bos_id", "bos_token_id"), ("eos_ids", "eos_token_id"), ("pad_id", "pad_token_id"),
                                ("unk_id", "unk_token_id")):
                    put(key, scope.get(hf), src)
    extra: list[int] = []
    for d in dirs:
        src = os.path.join(d, "tokenizer_config.json")
        data = read(src)
        if data is None:
            continue
        decoder = data.get("added_tokens_decoder") or {}
        if isinstance(decoder, Mapping):
            for k, v in decoder.items():
                if isinstance(v, Mapping) and v.get("special"):
                    try:
                        extra.append(int(k))
                    except ValueError:
                        raise ValueError(f"{src}: added_tokens_decoder key {k!r} is not an integer id") from None
        if piece_to_id is None:
            continue
        for key, hf in (("bos_id", "bos_token"), ("eos_ids", "eos_token"), ("pad_id", "pad_token"),
                        ("unk_id", "unk_token")):
            piece = _token_string(data.get(hf))
            if piece is None:
                continue
            i = piece_to_id(piece)
            if i is None:
                raise ValueError(f"{src}: {hf}={piece!r} is not a token of the tokenizer")
            put(key, i, src)
    if extra:
        found["extra_special_ids"] = tuple(dict.fromkeys(extra))
    return found


def load_tokenizer(path_or_dir: str | os.PathLike, *, prefer: str | None = None, bos_id: int | None = _UNSET,
                   eos_ids: int | Sequence[int] | None = _UNSET, pad_id: int | None = _UNSET,
                   unk_id: int | None = _UNSET, known: Mapping[str, Mapping] | None = None) -> Tokenizer:
    """Load the tokenizer of a checkpoint directory, or a `tokenizer.json` / `tokenizer.model` file.

    Special ids not given as arguments are read from generation_config.json, config.json and
    tokenizer_config.json (in that priority order), looked up in the given directory and in the
    directory that holds the tokenizer file, then from the tokenizer file itself. known: {absolute
    path: content} of those JSON files already read (`CheckpointSource.known_json`), not read again.
    """
    path = os.fspath(path_or_dir)
    file = find_tokenizer_file(path, prefer)
    dirs = ([path] if os.path.isdir(path) else []) + [os.path.dirname(os.path.abspath(file))]
    cls = HFTokenizer if file.endswith(".json") else SentencePieceTokenizer
    base = cls(file)  # first without config ids: needed to map tokenizer_config.json strings to ids
    cfg = read_special_ids(dirs, base.piece_to_id, known)
    explicit = {"bos_id": bos_id, "eos_ids": eos_ids, "pad_id": pad_id, "unk_id": unk_id}
    kwargs = {k: v for k, v in explicit.items() if v is not _UNSET}
    for k in explicit:
        if k not in kwargs and k in cfg:
            kwargs[k] = cfg[k]
    extra = cfg.get("extra_special_ids", ())
    if not kwargs and not extra:
        return base
    try:
        return cls(file, extra_special_ids=extra, **kwargs)
    except ValueError as e:
        raise ValueError(f"the special ids configured next to {path!r} do not fit the tokenizer {file!r}: {e}") from e
