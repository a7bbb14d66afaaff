"""DINGO-style decoding of a canvas under a regex (or a JSON schema's regex): the most probable canvas a
DFA accepts, by dynamic programming over positions x automaton states (DINGO, 2025: "Constrained
Inference for Diffusion LLMs"), given the denoising step's per-position distributions.

A canvas is written in parallel, so the constraint can choose the whole canvas at once: where the
left-to-right walk (`engine.structured`, "prefix") repairs the first rejected position from the
grammar's mask alone, the Viterbi pass here picks, over the canvas's remaining positions, the valid
token sequence with the highest summed log-probability, so a repair accounts for what the later
positions can still be.

The automaton: the regex's character DFA (`interegular`, the pure-Python regex -> FSM library that
outlines uses) lifted to tokens lazily: a token moves state q to the state its decoded text reaches
(`TokenDFA.step`, cached per (q, token)); a token that leaves the DFA's live states (those from which
a final state is reachable), a special token and one whose bytes are not whole UTF-8 are refused.
llguidance stays the authority: every run the DP picks is checked with the grammar's matcher
(`validate_tokens`) before it is held, so a regex dialect difference between the two libraries can
shorten a run, never admit an invalid one. A JSON schema's automaton comes from its regex
(`grammar.schema_regex`: outlines-core's conversion, compact JSON), since llguidance compiles a schema
to a parser with no automaton states to expose; a schema whose regex is too long keeps the prefix walk.

Tractability: the DP considers each position's top-k tokens (`DINGO_TOP_K`, from the step's true
distribution at temperature 1, computed on the device) plus the EOS set; the paper's DP runs over the
whole vocabulary. A canvas ends in EOS and pad, "the tail": once the answer's EOS is placed the later
positions score their own EOS log-probability. Cost: positions x reachable states x k transitions, each
a dict look-up after its first walk (measured in benchmarks/structured_output.py).
"""

from __future__ import annotations

import math
import numpy as np

__all__ = ["TokenDFA", "viterbi", "DINGO_TOP_K", "END"]

DINGO_TOP_K = 32
END = -1          # the automaton state after the answer's EOS (EOS / pad to the canvas's end)


def _interegular():
    try:
        import interegular  # deferred: only regex requests decoded with DINGO need it
    except ImportError as e:  # pragma: no cover - a dependency of dgemma_jax
        raise ImportError('constraint_decoder="dingo" needs the `interegular` package (pip install interegular)') from e
    return interegular


class TokenDFA:
    """A regex's character DFA lifted to a vocabulary's tokens, transitions computed on demand.

    token_bytes(i) -> bytes or None: token i's bytes (None: a special token, never text).
    Raises ValueError when `interegular` cannot parse the regex (a syntax it does not support)."""

    def __init__(self, regex: str, token_bytes):
        ig = _interegular()
        try:
            fsm = ig.parse_pattern(regex).to_fsm()
        except Exception as e:   # interegular raises its own exception types for unsupported syntax
            raise ValueError(f"regex {regex!r} has no DFA here (interegular: {type(e).__name__}: {e})"[:300]) from None
        self.fsm = fsm
        self.initial = fsm.initial
        self.finals = frozenset(fsm.finals)
        self.live = frozenset(s for s in fsm.states if fsm.islive(s))
        self._bytes = token_bytes
        self._text: dict[int, str | None] = {}
        self._step: dict[tuple, int | None] = {}

    def text(self, t: int) -> str | None:
        """Token t's text, or None (special, or bytes that are not whole UTF-8)."""
        if t not in self._text:
            b = self._bytes(t)
            try:
                self._text[t] = None if b is None else b.decode("utf-8")
            except UnicodeDecodeError:
                self._text[t] = None
        return self._text[t]

    def walk(self, q, s: str):
        """The state after text `s` from q, or None (dead)."""
        fsm = self.fsm
        for ch in s:
            sym = fsm.alphabet[ch]
            q = fsm.map.get(q, {}).get(sym)
            if q is None or q not in self.live:
                return None
        return q

    def step(self, q, t: int):
        """The state after token t from q, or None (refused)."""
        key = (q, t)
        if key not in self._step:
            s = self.text(int(t))
            self._step[key] = None if not s else self.walk(q, s)   # an empty token never moves the canvas on
        return self._step[key]

    def accepting(self, q) -> bool:
        return q in self.finals


def viterbi(dfa: TokenDFA, start, cand_ids: np.ndarray, cand_lp: np.ndarray, eos_lp: np.ndarray, eos_id: int,
            final: bool) -> tuple[list[int], int, float, bool]:
    """The most probable valid run over n positions from DFA state `start`.

    Args:
      cand_ids, cand_lp: [n, k] each position's candidate tokens and their log-probabilities.
      eos_lp: [n] each position's log-probability of the EOS set (the answer ending there, or the tail).
      eos_id: the token written for EOS.
      final: the canvas is the answer's last: a run must end with the answer's EOS (the END state);
        otherwise it may also stop in any live state (the next canvas goes on).
    Returns:
      (tokens, covered, score, complete): `covered` = n when a run of live states spans every position,
      else the most positions any run reaches (its tokens are the best such run; the caller repairs the
      next one); `complete`: the run is valid as a whole (it spans the n positions and, with `final`,
      ends in END); with `final` and no run reaching END, the best live run over n positions.
    """
    n = len(eos_lp)
    layer = {start: 0.0}
    back: list[dict] = []
    for i in range(n):
        nxt: dict = {}
        ptr: dict = {}
        for q, score in layer.items():
            if q == END:
                cands = ((eos_id, END, float(eos_lp[i])),)
            else:
                cands = []
                if dfa.accepting(q):
                    cands.append((eos_id, END, float(eos_lp[i])))
                for t, lp in zip(cand_ids[i], cand_lp[i]):
                    if lp == -math.inf:
                        continue
                    q2 = dfa.step(q, int(t))
                    if q2 is not None:
                        cands.append((int(t), q2, float(lp)))
            for t, q2, lp in cands:
                s = score + lp
                if q2 not in nxt or s > nxt[q2]:
                    nxt[q2] = s
                    ptr[q2] = (q, t)
        if not nxt:
            break
        back.append(ptr)
        layer = nxt
    covered = len(back)
    if covered == n and final and END in layer:
        best = END
    else:
        best = max(layer, key=layer.get) if covered else None
    if best is None:
        return [], 0, 0.0, False
    score, q, toks = layer[best], best, []
    for ptr in reversed(back):
        q, t = ptr[q]
        toks.append(t)
    toks.reverse()
    return toks, covered, score, covered == n and (best == END or not final)

