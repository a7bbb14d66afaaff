"""Grammars for structured output: a JSON schema, a regex or "any JSON object", compiled with llguidance
against a tokenizer's vocabulary (host-side; `engine.structured` walks canvases with the matchers).

Why llguidance (docs/api.md, "Structured output", has the comparison): it ships CPU wheels with no
dependency beyond the Python standard library (xgrammar's wheel requires torch, transformers and
triton; outlines-core compiles a regex into a DFA index over the whole vocabulary up front, seconds to
minutes at 262k tokens for a nested schema), it covers JSON schema (nested objects, arrays, enums,
numbers with bounds, string patterns, required and optional fields), regexes and Lark grammars, and
its matcher has the two calls a diffusion canvas needs: `validate_tokens` (how many tokens of a
proposed run are valid from the current state: one call walks a whole canvas) and the token mask
(`compute_bitmask`) for the position to repair.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import weakref
from typing import Any

import numpy as np

__all__ = ["Grammar", "compile_grammar", "GRAMMAR_LIBRARY"]

GRAMMAR_LIBRARY = "llguidance"
# JSON written compactly: no whitespace between tokens (`whitespace_flexible` off), so a model that
# prefers spaces cannot fill the budget with them
_JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = {"type": "object"}
_tokenizers: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _llg():
    try:
        import llguidance  # deferred: only structured requests need the grammar library
    except ImportError as e:  # pragma: no cover - a dependency of dgemma_jax
        raise ImportError("structured output needs the `llguidance` package (pip install llguidance)") from e
    return llguidance


def _token_bytes(tokenizer, i: int) -> bytes:
    """The bytes of token `i` of a tokenizer without a tokenizer.json (characters, SentencePiece)."""
    piece = tokenizer.id_to_piece(i)
    if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:   # SentencePiece byte fallback
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


class _Wrapped:
    """llguidance's `TokenizerWrapper` input for a project `Tokenizer` without a tokenizer.json."""

    def __init__(self, tokenizer, eos_ids):
        self.eos_token_id = int(eos_ids[0])
        self.bos_token_id = tokenizer.bos_id
        specials = set(tokenizer.special_ids)
        self.special_token_ids = sorted(specials)
        self.tokens = [b"" if i in specials else _token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        for i in specials:   # specials spelled as markers llguidance never matches as text
            self.tokens[i] = f"<[{i}]>".encode()
        self._tok = tokenizer

    def __call__(self, s):
        return self._tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)


def llg_tokenizer(tokenizer, vocab_size: int, eos_ids) -> Any:
    """The llguidance tokenizer of a project `Tokenizer` (cached per tokenizer, vocab size and EOS ids).

    vocab_size: the model's vocabulary (may be larger than the tokenizer's: the extra ids are never
    allowed). eos_ids: the sampler's end-of-sequence ids (what the grammar allows once it accepts)."""
    llg = _llg()
    key = (int(vocab_size), tuple(int(e) for e in eos_ids))
    cache = _tokenizers.setdefault(tokenizer, {})
    if key not in cache:
        path = getattr(tokenizer, "path", None)
        if path is not None and str(path).endswith(".json"):
            with open(path) as f:
                cache[key] = llg.LLTokenizer(f.read(), n_vocab=key[0], eos_token=list(key[1]))
        else:
            cache[key] = llg.LLTokenizer(llg.TokenizerWrapper(_Wrapped(tokenizer, key[1])), n_vocab=key[0],
                                         eos_token=list(key[1]))
    return cache[key]


@dataclasses.dataclass(frozen=True)
class Grammar:
    """A compiled constraint: llguidance's grammar text for one tokenizer. `matcher()` is a fresh
    matcher at the start of the answer; `kind` and `source` say what it was compiled from."""

    tokenizer: Any
    text: str
    kind: str
    source: str

    def matcher(self):
        m = _llg().LLMatcher(self.tokenizer, self.text, log_level=0)
        if m.is_error():  # compile_grammar checked it; a matcher limit can still refuse it
            raise ValueError(f"the {self.kind} cannot be used: {m.get_error()}")
        return m

    @functools.cached_property
    def dfa(self):
        """The constraint's token-level DFA (`engine.dingo.TokenDFA`, built once per grammar) for the DINGO
        decoder, or None (then it keeps the prefix walk): a regex's own, or a JSON schema's through its
        regex (`schema_regex`); None where there is no regex of at most `DFA_REGEX_LIMIT` characters or
        `interegular` cannot parse it."""
        regex = self.source if self.kind == "regex" else schema_regex(self.source)
        if regex is None:
            return None
        from dgemma_jax.engine.dingo import TokenDFA   # deferred: interegular is only for "dingo"
        try:
            return TokenDFA(regex, functools.partial(_llg_token_bytes, self.tokenizer))
        except ValueError:
            return None


# a schema's regex longer than this gets no DFA (interegular's construction grows fast with it: the
# 6,428-character regex of "any JSON object" took 13 s for 1,414 states; the test schemas' 107-184
# characters take 0.1-0.2 s for 50-113 states)
DFA_REGEX_LIMIT = 2000


def schema_regex(schema_json: str) -> str | None:
    """A regex of the compact JSON texts a schema allows (outlines-core's `build_regex_from_schema`, no
    whitespace, as llguidance writes JSON here), or None: outlines-core missing, the schema outside what
    it converts, or the regex over `DFA_REGEX_LIMIT` characters. The regex may be looser than the schema
    (it does not bound numbers): llguidance checks every run the DP picks, so it only guides."""
    try:
        from outlines_core.json_schema import build_regex_from_schema  # deferred: only for "dingo"
    except ImportError:
        return None
    try:
        regex = build_regex_from_schema(schema_json, whitespace_pattern="")
    except Exception:   # a schema feature outlines-core does not convert: no DFA, the prefix walk
        return None
    return regex if len(regex) <= DFA_REGEX_LIMIT else None


def compile_grammar(tokenizer, vocab_size: int, eos_ids, *, json_schema: Any = None, regex: str | None = None,
                    json_object: bool = False) -> Grammar:
    """Compile exactly one of `json_schema` (a dict or its JSON text), `regex` or `json_object=True`
    (any JSON object) for `tokenizer`.

    Raises:
      ValueError naming the problem: none or several given, a schema that is not JSON or not a valid
      schema, a schema feature the library does not support, a bad regex, no EOS id.
    """
    given = [x for x in (json_schema is not None, regex is not None, bool(json_object)) if x]
    if len(given) != 1:
        raise ValueError("give exactly one of json_schema, regex or json_object=True")
    if not eos_ids:
        raise ValueError("structured output needs an EOS id in the sampler (the answer ends with it)")
    llg = _llg()
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise ValueError(f"regex must be a non-empty string; got {regex!r}"[:200])
        kind, source, text = "regex", regex, llg.LLMatcher.grammar_from_regex(regex)
    else:
        schema = _ANY_OBJECT if json_object else json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema must be a JSON object; got {type(schema).__name__}")
        kind, source = "JSON schema", json.dumps(schema)
        try:
            text = llg.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"the JSON schema cannot be compiled: {_regex_error(str(e))}") from None
    error = llg.LLMatcher.validate_grammar(text, llg_tokenizer(tokenizer, vocab_size, eos_ids))
    if error:
        raise ValueError(f"the {kind} cannot be compiled by {GRAMMAR_LIBRARY}: {_regex_error(error)}"[:600])
    return Grammar(llg_tokenizer(tokenizer, vocab_size, eos_ids), text, kind, source)


def _llg_token_bytes(tokenizer, t: int) -> bytes | None:
    """Token t's bytes in an llguidance tokenizer, or None for a special token or an id past its vocabulary."""
    if t >= tokenizer.vocab_size or tokenizer.is_special_token(t):
        return None
    return tokenizer.decode_bytes([t])


def _regex_error(message: str) -> str:
    """llguidance's error on one line; a regex parse error (the regex, a caret line, "error: ...") as
    "regex '...': what is wrong"."""
    parse = re.search(r"regex parse error:\s*\n\s*(.*)\n(?:.*\n)*?error: (.+)", message)
    if parse:
        return f"regex {parse.group(1).strip()!r}: {parse.group(2).strip()}"
    return _one_line(message)


def _one_line(message: str) -> str:
    """llguidance's multi-line error (a caret under the regex) on one line."""
    return " ".join(message.split())


def allowed_tokens(matcher, vocab_size: int) -> np.ndarray:
    """[V] bool: the tokens the matcher allows next (its bitmask unpacked)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    return bits[:vocab_size].astype(bool)


def schema_of_response_format(response_format: Any):
    """(json_schema or None, json_object) of an OpenAI `response_format`: {"type": "json_object"} (any
    JSON object) or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}.
    {"type": "text"} is not a constraint and is refused here (the caller skips it).

    Raises:
      ValueError naming the field that is wrong."""
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise ValueError('response_format must be an object with a "type": "json_object" or "json_schema"')
    kind = response_format["type"]
    if kind == "json_object":
        return None, True
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError('response_format {"type": "json_schema"} needs "json_schema": {"name": ..., '
                             '"schema": {...}} with the schema as a JSON object')
        return spec["schema"], False
    raise ValueError(f'response_format.type must be "json_object" or "json_schema"; got {kind!r}'[:200])
