"""DINGO's dynamic program (engine/dingo.py) against a brute-force oracle over every string of a tiny
vocabulary, the regex DFA's lift to tokens, and the grammar's fixed text pinned before a step
(engine/structured.py's forced tokens)."""

import itertools
import json
import math

import numpy as np
import pytest

from dgemma_jax.engine.dingo import END, TokenDFA, viterbi
from dgemma_jax.engine.grammar import DFA_REGEX_LIMIT, compile_grammar, schema_regex
from dgemma_jax.engine.structured import Walker
from dgemma_jax.io.tokenizer import load_tokenizer
from tests.helpers.subword_tokenizer import subword_tokenizer_json

PIECES = ["a", "b", "ab", "ba", "c", "bb", ""]   # id 6: an empty piece (never moves the automaton)
EOS = 7                                          # a special token: never text


def _dfa(regex):
    return TokenDFA(regex, lambda t: PIECES[t].encode() if t < len(PIECES) else None)


def brute_force(dfa, start, lp, eos_lp, final):
    """The most probable valid run by enumerating every string over the whole vocabulary plus EOS."""
    n, v = lp.shape
    best, best_s = None, -math.inf
    for seq in itertools.product(range(v + 1), repeat=n):
        q, s = start, 0.0
        for i, t in enumerate(seq):
            if t == v:   # EOS: the answer ends (accepting state) or the tail goes on
                if q != END and not dfa.accepting(q):
                    break
                q, s = END, s + eos_lp[i]
            elif q == END or (q := dfa.step(q, t)) is None:
                break
            else:
                s += lp[i, t]
        else:
            if (q == END or not final) and s > best_s:
                best, best_s = [EOS if t == v else t for t in seq], s
    return best, best_s


@pytest.mark.parametrize("regex", ["(ab|b)*a?c", "a(b|c)*a", "(a|bb)c?b", "b*"])
@pytest.mark.parametrize("final", [True, False])
def test_viterbi_finds_the_brute_force_argmax(regex, final):
    dfa = _dfa(regex)
    rng = np.random.default_rng(0)
    found = 0
    for trial in range(25):
        n = int(rng.integers(1, 5))
        lp = np.log(rng.dirichlet(np.ones(len(PIECES) + 1), size=n))     # the last column is EOS
        lp, eos_lp = lp[:, :-1], lp[:, -1]
        ids = np.tile(np.arange(len(PIECES)), (n, 1))                      # every token a candidate: exact
        toks, covered, score, complete = viterbi(dfa, dfa.initial, ids, lp, eos_lp, EOS, final)
        want, want_s = brute_force(dfa, dfa.initial, lp, eos_lp, final)
        if want is None:
            assert not complete, (regex, n, toks)
            continue
        found += 1
        assert complete and covered == n and len(toks) == n
        assert score == pytest.approx(want_s, abs=1e-9), (regex, toks, want)
        # the DP's own run scores what it says, and is valid
        q, s = dfa.initial, 0.0
        for i, t in enumerate(toks):
            if t == EOS:
                assert q == END or dfa.accepting(q)
                q, s = END, s + eos_lp[i]
            else:
                q = dfa.step(q, t)
                assert q is not None and q != END
                s += lp[i, t]
        assert s == pytest.approx(score, abs=1e-9) and (q == END or not final)
    assert found >= 10


def test_viterbi_stops_where_no_candidate_can_go_on():
    """Top-k candidates with no valid token at position 2: the best run over the two positions that
    can be reached (the caller repairs the third from the grammar's mask)."""
    dfa = _dfa("a(b|c)*a")
    ids = np.array([[0, 1], [1, 4], [1, 1]])            # position 2 offers "b" only: after "ab" not ...
    lp = np.log(np.array([[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]]))
    dfa2 = _dfa("a(b|c)a")                              # ... in a(b|c)a, where only "a" may follow
    toks, covered, _, complete = viterbi(dfa2, dfa2.initial, ids, lp, np.full(3, -9.0), EOS, final=True)
    assert covered == 2 and toks == [0, 4] and not complete
    toks, covered, _, complete = viterbi(dfa, dfa.initial, ids, lp, np.full(3, -9.0), EOS, final=False)
    assert covered == 3 and complete and toks == [0, 4, 1]


def test_the_eos_tail_and_the_last_canvas():
    """On the answer's last canvas a run must end (EOS, then EOS to the end); on an earlier one it may
    stop in any live state."""
    dfa = _dfa("ab*")
    ids = np.array([[0], [1], [1]])
    lp = np.log(np.array([[0.9], [0.9], [0.9]]))
    eos_lp = np.log(np.array([0.01, 0.05, 0.05]))
    toks, _, _, complete = viterbi(dfa, dfa.initial, ids, lp, eos_lp, EOS, final=False)
    assert toks == [0, 1, 1] and complete
    toks, _, score, complete = viterbi(dfa, dfa.initial, ids, lp, eos_lp, EOS, final=True)
    assert toks == [0, 1, EOS] and complete and score == pytest.approx(np.log(0.9 * 0.9 * 0.05))
    # "abc" is never complete in one position
    toks, covered, _, complete = viterbi(_dfa("abc"), _dfa("abc").initial, ids[:1], lp[:1], eos_lp[:1], EOS, True)
    assert toks == [0] and covered == 1 and not complete


def test_the_token_lift_refuses_specials_dead_ends_and_empty_pieces():
    dfa = _dfa("ab*c")
    q = dfa.step(dfa.initial, 2)       # "ab"
    assert q is not None and not dfa.accepting(q)
    assert dfa.accepting(dfa.step(q, 4))
    assert dfa.step(dfa.initial, 1) is None            # "b" first: dead
    assert dfa.step(dfa.initial, EOS) is None          # a special token is never text
    assert dfa.step(dfa.initial, 6) is None            # an empty piece makes no progress
    with pytest.raises(ValueError, match="no DFA"):
        _dfa("(?<=a)b")


# ------------------------------------------------------------------ the grammar side (real subword BPE)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    subword_tokenizer_json(path)
    return load_tokenizer(str(path))


def test_a_regex_and_a_small_schema_have_a_dfa_and_any_object_none(tokenizer):
    """A regex's DFA is its own; a schema's comes from its compact-JSON regex (outlines-core); "any JSON
    object" has a regex too long for a DFA (DFA_REGEX_LIMIT) and keeps the prefix walk."""
    g = compile_grammar(tokenizer, 400, (1,), regex=r"[0-9]{3}-[a-z]{2,4}")
    dfa = g.dfa
    q = dfa.initial
    for t in tokenizer.encode("123-ab"):
        q = dfa.step(q, t)
    assert dfa.accepting(q)
    schema = {"type": "object", "required": ["ok"], "additionalProperties": False,
              "properties": {"ok": {"type": "boolean"}}}
    dfa = compile_grammar(tokenizer, 400, (1,), json_schema=schema).dfa
    for text, accepted in (('{"ok":true}', True), ('{"ok": true}', False), ('{"ok":1}', False)):
        q = dfa.initial
        for t in tokenizer.encode(text):
            q = None if q is None else dfa.step(q, t)
        assert (q is not None and dfa.accepting(q)) == accepted, text
    assert schema_regex(json.dumps({"type": "object"})) is None and DFA_REGEX_LIMIT < 6428
    assert compile_grammar(tokenizer, 400, (1,), json_object=True).dfa is None


def test_the_schemas_fixed_text_is_pinned_before_any_step(tokenizer):
    """A schema whose answer must start with '{"name":"': its tokens are held and pinned at the canvas's
    start, before the model writes anything, up to the string's quote (the BPE has pieces that join that
    quote to the string's first characters, so llguidance leaves its token open); a literal regex is
    pinned whole, then EOS."""
    schema = {"type": "object", "required": ["name"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 5}}}
    w = Walker(compile_grammar(tokenizer, 400, (1,), json_schema=schema), 400, 1, scores=None)
    w.start(16, 16)
    prefix = tokenizer.decode(w.seed[0, :w.held].tolist())
    assert w.held >= 3 and prefix == '{"name":' and w.forced == w.held
    assert w.pinned[0, :w.held].all() and not w.pinned[0, w.held:].any()
    w = Walker(compile_grammar(tokenizer, 400, (1,), regex="hello world"), 400, 1, scores=None)
    w.start(16, 16)
    assert w.ended and tokenizer.decode(w.answer) == "hello world" and w.pinned.all()
    assert (w.seed[0, len(w.answer):] == 1).all()
    w = Walker(compile_grammar(tokenizer, 400, (1,), regex="hello world"), 400, 1, scores=None)
    w.start(16, 3)                          # only 3 positions owed: the forced text stops there
    assert w.held == 3 and not w.ended


def test_the_dingo_walker_holds_the_agreeing_run_and_its_repair_then_commits_the_dp_run(tokenizer):
    """The step's argmax '12a-bc' breaks [0-9]{3}-[a-z]{2} at 'a'; the DP's run '123-bc' + EOS takes '3'
    (the top-k's valid choice there): the step holds '12' + '3', the grammar then forces '-', and the
    canvas's end commits the rest of the DP run."""
    one = {c: tokenizer.encode(c) for c in "0123456789-abcxy"}
    assert all(len(v) == 1 for v in one.values())
    t = {c: v[0] for c, v in one.items()}
    eos, length = 1, 8
    g = compile_grammar(tokenizer, 400, (eos,), regex=r"[0-9]{3}-[a-z]{2}")
    argmax = np.asarray([t[c] for c in "12a-bc"] + [eos, eos])
    cands = ["1x", "2y", "a3", "-0", "bx", "cy", "ab", "ab"]
    ids = np.asarray([[t[c] for c in pair] for pair in cands])
    lp = np.log(np.tile([0.7, 0.2], (length, 1)))
    eos_lp = np.log(np.asarray([1e-4] * 6 + [0.9, 0.9]))
    w = Walker(g, 400, eos, scores=None, dfa=g.dfa)
    w.start(length, length)
    assert w.held == 0
    w.advance_dingo(argmax, None, (ids, lp, eos_lp), length, final=True, whole=False)
    assert tokenizer.decode(w.answer) == "123-" and w.repairs == 1 and w.forced == 1
    assert w.pinned[0, :4].all() and not w.pinned[0, 4:].any()
    w.finish(argmax, None, length, (ids, lp, eos_lp), final=True)
    assert w.ended and tokenizer.decode(w.answer) == "123-bc" and w.repairs == 1
    assert list(w.seed[0, 6:]) == [eos, eos]
