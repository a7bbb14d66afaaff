"""The structured-output driver: answers valid under a grammar (`engine.grammar`), over the engine's programs.

A canvas is written in parallel, so the constraint acts between denoising steps, on the host, with the
pinned positions the step already honours (infilling's mechanism): each row runs alone (its own
batch-1 programs and its own key, so a request gets the same tokens with or without others), and
per canvas:

0. the grammar's fixed text is pinned at once: whenever the held prefix leaves the grammar one way on
   (a JSON schema's braces, keys and quotes, a regex's literal), llguidance's forced tokens
   (`compute_ff_tokens`) are held before the next step, so the model denoises only the free positions;
1. after every `denoise_step` the canvas's valid run from the held prefix is held (pinned in the
   canvas and the argmax for the next steps), chosen by the row's constraint decoder:
   - "prefix" (left to right): the grammar's matcher walks the step's argmax (`validate_tokens`: the
     longest run it accepts); the first position it rejects is repaired with the allowed token (the
     grammar's mask) that the step's self-conditioning embedding scores highest (`soft . E`, the
     model's expected token there, a proxy that needs no [L, V] logits on the host);
   - "dingo" (a grammar with a DFA, `engine.dingo`: a regex, or a JSON schema through its regex): the
     Viterbi pass over the remaining positions x the DFA's states picks the most probable valid canvas from the step's top-k
     log-probabilities (and the EOS tail); the run where it agrees with the argmax is held, plus its
     first disagreeing position (the DP's repair, which accounts for every later position); where no
     top-k run reaches a position, that position is repaired from the mask as in "prefix";
   every run is checked by llguidance's matcher before it is held;
2. when the canvas stops (stable and confident, or its step budget), the decoder runs to the canvas's
   end without further passes ("dingo": the whole DP run at once), so the committed canvas is a valid
   prefix of the answer.

Once the grammar is complete, the first EOS it allows ends the answer (the rest of the canvas is EOS).
Every committed canvas is valid; an answer whose grammar is not complete when the token budget runs out
ends with finish_reason "length" (its text a valid prefix). Cost per step beyond the pass: one argmax
canvas [L] read on the host, the walk, and for the repair one mask and one [V] score row; "dingo" adds
the [L, k] top-k read and the DP (measured in benchmarks/structured_output.py).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine.dingo import DINGO_TOP_K, viterbi
from dgemma_jax.engine.grammar import Grammar, allowed_tokens
from dgemma_jax.engine.outputs import report_nonfinite
from dgemma_jax.model.layers import softcap
from dgemma_jax.sampling.fused import _head_table
from dgemma_jax.sampling.generate import num_canvases
from dgemma_jax.sampling.loop import denoise_step
from dgemma_jax.sampling.ops import sanitize_logits

CONSTRAINT_DECODERS = ("prefix", "dingo")
DEFAULT_DECODER = "prefix"


@dataclasses.dataclass
class StructuredOutput:
    """tokens: each row's answer ids (no EOS / pad); finish_reasons: "stop" (the grammar is complete and
    the answer ended) or "length" (the budget ran out first; the text is a valid prefix); steps: [B, C]
    denoiser passes per canvas; repairs: [B] positions the constraint chose instead of the model's argmax;
    forced: [B] tokens pinned as the grammar's fixed text before the model wrote them; nonfinite: [B] the
    row met non-finite logits; constraint_s: [B] host seconds in the constraint (the matcher's walk,
    forced tokens, masks, repair scores, the DP), step_s: [B] seconds in the denoising steps (dispatch
    to the argmax, and for "dingo" the top-k, on the host); decoders: each row's constraint decoder
    ("dingo" only for a grammar with a DFA, `Grammar.dfa`; one without keeps "prefix")."""

    tokens: list
    finish_reasons: list
    steps: np.ndarray
    repairs: np.ndarray
    forced: np.ndarray
    nonfinite: np.ndarray
    constraint_s: np.ndarray
    step_s: np.ndarray
    decoders: list


def token_scores(table, soft_row):
    """[V] float32: each token's embedding . the position's self-conditioning embedding (the engine jits it)."""
    return jnp.asarray(table, jnp.float32) @ soft_row.astype(jnp.float32)


def topk_logprobs(embedding, h_row, cap, k: int, eos_ids):
    """The step's distribution at temperature 1 for one row, reduced for the host: (ids [L, k] int32,
    log-probabilities [L, k] float32 of the top k non-EOS tokens, [L] the EOS set's log-probability),
    from h_row [L, D] and the tied embedding (one [L, V] float32 tile: a batch-1 row)."""
    table, scale = _head_table(embedding)
    logits = h_row.astype(jnp.float32) @ table.astype(jnp.float32).T
    if scale is not None:
        logits = logits * scale
    if cap:
        logits = softcap(logits, cap)
    lp = jax.nn.log_softmax(sanitize_logits(logits), axis=-1)
    eos = jnp.asarray(eos_ids, jnp.int32)
    eos_lp = jax.nn.logsumexp(lp[:, eos], axis=-1)
    vals, ids = jax.lax.top_k(lp.at[:, eos].set(-jnp.inf), k)
    return ids.astype(jnp.int32), vals, eos_lp


def dingo_step(params, config, sampler, runtime, k, **kw):
    """`denoise_step` for one row plus its top-k log-probabilities (`topk_logprobs`): (state, ids, lp, eos_lp)."""
    state, h = denoise_step(params, config, sampler, runtime=runtime, with_features=True, **kw)
    ids, lp, eos_lp = topk_logprobs(params["embedding"], h[0], config.final_logit_softcap, k, sampler.eos_ids)
    return state, ids, lp, eos_lp


class Walker:
    """One row's matcher, the valid prefix of the canvas in flight (held positions) and, for "dingo",
    the regex DFA's state after it."""

    def __init__(self, grammar: Grammar, vocab_size: int, eos_id: int, scores, dfa=None):
        self.m = grammar.matcher()
        self.v, self.eos, self.scores = vocab_size, eos_id, scores
        self.dfa = dfa
        self.q = dfa.initial if dfa is not None else None
        self.repairs = self.forced = 0
        self.answer: list[int] = []
        self.ended = False      # the answer's EOS was written

    def start(self, length: int, owed: int):
        self.held, self.owed = 0, owed
        self.seed = np.zeros((1, length), np.int32)
        self.pinned = np.zeros((1, length), bool)
        self.force()

    def _hold(self, toks):
        n = len(toks)
        self.seed[0, self.held:self.held + n] = toks
        self.pinned[0, self.held:self.held + n] = True
        self.held += n
        if not self.m.consume_tokens([int(t) for t in toks]):
            raise RuntimeError(f"grammar matcher refused tokens it validated: {self.m.get_error()}")
        for t in toks:
            if int(t) == self.eos:
                self.ended = True
                break
            self.answer.append(int(t))
            if self.q is not None:   # the DFA follows the held text (None: lost, the prefix walk takes over)
                s = self.dfa.text(int(t))
                self.q = None if s is None else self.dfa.walk(self.q, s)
        self.ended = self.ended or self.m.is_stopped()   # complete, nothing can follow: the answer ends here
        if self.ended:  # the rest of the canvas is EOS
            self.seed[0, self.held:] = self.eos
            self.pinned[0, self.held:] = True
            self.held = self.seed.shape[1]

    def force(self) -> None:
        """Hold the tokens the grammar forces next (its fixed text), as far as the canvas owes."""
        while not self.ended and self.held < self.owed:
            ff = list(self.m.compute_ff_tokens())[:self.owed - self.held]
            if not ff:
                return
            self._hold(np.asarray(ff, np.int32))
            self.forced += len(ff)

    def _repair(self, soft) -> None:
        """Hold the allowed token (the grammar's mask) the step's soft embedding scores highest."""
        allowed = allowed_tokens(self.m, self.v)
        if not allowed.any():   # nothing can follow (cannot happen before the answer ended)
            raise RuntimeError(f"the grammar allows no token after {len(self.answer)} tokens: {self.m.get_error()}")
        scores = np.asarray(self.scores(soft[0, self.held]))
        scores = np.where(allowed, scores, -np.inf)
        self._hold(np.asarray([int(np.argmax(scores))], np.int32))
        self.repairs += 1

    def advance(self, argmax: np.ndarray, soft, owed: int) -> None:
        """"prefix": hold the longest valid run of `argmax` from the held prefix, then repair the next position."""
        if self.ended or self.held >= owed:
            return
        run = argmax[self.held:owed]
        k = self.m.validate_tokens([int(t) for t in run])
        if k:
            self._hold(run[:k])
        if not self.ended and self.held < owed:
            self._repair(soft)
        self.force()

    def advance_dingo(self, argmax: np.ndarray, soft, top, owed: int, final: bool, whole: bool) -> None:
        """"dingo": the DP's most probable valid run over the rest of the canvas; hold where it agrees
        with `argmax` plus its first other position (`whole`: all of it), else repair from the mask."""
        if self.ended or self.held >= owed:
            return
        if self.q is None:   # the DFA lost the held text (a dialect difference): the prefix walk
            return self.advance(argmax, soft, owed)
        ids, lp, eos_lp = top
        h = self.held
        path, covered, _, complete = viterbi(self.dfa, self.q, ids[h:owed], lp[h:owed], eos_lp[h:owed], self.eos,
                                             final)
        take = path[:covered] if complete or covered < owed - h else []   # (final, no EOS within top-k: repair)
        if not whole:
            agree = np.asarray(take) == argmax[h:h + len(take)]
            take = take[:int(np.argmin(agree)) + 1] if not agree.all() else take
        if self.eos in take:
            take = take[:take.index(self.eos) + 1]
        k = self.m.validate_tokens([int(t) for t in take]) if take else 0
        run = take[:k]
        body = run[:-1] if run and run[-1] == self.eos else run
        if body:
            self.repairs += int((np.asarray(body) != argmax[h:h + len(body)]).sum())
            self._hold(np.asarray(body, np.int32))
        if len(body) < len(run) and not self.ended:   # the run's EOS (unless the grammar ended it already)
            self.repairs += int(argmax[self.held] != self.eos)
            self._hold(np.asarray([self.eos], np.int32))
        if k == 0 and not self.ended and self.held < owed:
            self._repair(soft)
        self.force()

    def finish(self, argmax: np.ndarray, soft, owed: int, top=None, final: bool = False) -> np.ndarray:
        """Walk and repair to the canvas's end (no more passes); the canvas to commit [1, L]."""
        while not self.ended and self.held < owed:
            if top is None:
                self.advance(argmax, soft, owed)
            else:
                self.advance_dingo(argmax, soft, top, owed, final, whole=True)
        return self.seed


def generate_structured(engine, prompt_tokens, lengths, grammars: Grammar | Sequence[Grammar], *, rng: Any = 0,
                        max_new_tokens: int | None = None, nonfinite: str = "warn",
                        constraint_decoder: str = DEFAULT_DECODER, top_k: int = DINGO_TOP_K) -> StructuredOutput:
    """Answers valid under a grammar (`Engine.generate_structured`).

    Args:
      prompt_tokens: [B, P] right-padded prompts; lengths: [B] (default P).
      grammars: one `Grammar` (`engine.grammar.compile_grammar`) for every row, or one per row.
      rng: as `Engine.generate` (a row's key comes from its own seed).
      max_new_tokens: the token budget (default one canvas).
      nonfinite: as `Engine.generate`.
      constraint_decoder: "prefix" (left to right: walk the argmax, repair the first rejected position
        from the mask) or "dingo" (the DP over positions x the DFA's states of a regex, or of a JSON
        schema's regex; a grammar without a DFA, `Grammar.dfa` None, keeps "prefix"). top_k: the
        candidates per position "dingo" weighs.
    Returns:
      a `StructuredOutput`.
    """
    if constraint_decoder not in CONSTRAINT_DECODERS:
        raise ValueError(f"constraint_decoder must be one of {CONSTRAINT_DECODERS}; got {constraint_decoder!r}")
    tokens = np.asarray(prompt_tokens)
    b = tokens.shape[0] if tokens.ndim == 2 else 0
    grammars = [grammars] * b if isinstance(grammars, Grammar) else list(grammars)
    if len(grammars) != b:
        raise ValueError(f"give one grammar or one per prompt: {len(grammars)} grammars for {b} prompts")
    sampler, p, params = engine.sampler, engine.programs, engine.params
    budget = sampler.canvas_length if max_new_tokens is None else max_new_tokens
    if not sampler.eos_ids:
        raise ValueError("structured output needs an EOS id in the sampler (the answer ends with it)")
    rows = engine._prepare_rows(tokens, lengths, rng, budget, None, None, None)
    l, n_canvas = sampler.canvas_length, num_canvases(budget, sampler.canvas_length)
    table = _head_table(params["embedding"])[0]
    score_program = engine._program(("token_scores",), token_scores, donate=())
    k = int(min(top_k, engine.config.vocab_size - len(sampler.eos_ids)))
    dingo_program = None

    def scores(soft_row):
        return score_program(table, soft_row)
    out = StructuredOutput([], [], np.zeros((b, n_canvas), np.int32), np.zeros((b,), np.int32),
                           np.zeros((b,), np.int32), np.zeros((b,), bool), np.zeros((b,)), np.zeros((b,)), [])
    for i, row in enumerate(rows):
        t, n, key, cache, _, _, _ = engine._block([row])
        dfa = grammars[i].dfa if constraint_decoder == "dingo" else None
        if dfa is not None and dingo_program is None:
            dingo_program = engine._program(
                ("dingo_step", k), functools.partial(dingo_step, config=engine.config, sampler=sampler,
                                                     runtime=engine.gen_runtime, k=k), donate=())
        out.decoders.append("dingo" if dfa is not None else "prefix")
        walker = Walker(grammars[i], engine.config.vocab_size, int(sampler.eos_ids[0]), scores, dfa)
        cache = p.prefill(params, tokens=t, lengths=n, cache=cache, images=None)
        finished = jnp.zeros((1,), bool)
        for c in range(n_canvas):
            owed = min(l, budget - c * l)
            final = c + 1 >= n_canvas
            canvas = p.canvas_start(keys=key, index=jnp.int32(c), finished=finished)
            t1 = time.perf_counter()
            walker.start(l, owed)
            out.constraint_s[i] += time.perf_counter() - t1
            state, top = canvas.state, None
            while not (walker.ended or walker.held >= owed):   # (forced text may fill the canvas: no pass)
                t0 = time.perf_counter()
                seed, pinned = engine.place(walker.seed, walker.pinned)
                kw = dict(cache=cache, context_end=cache.lengths, keys=canvas.keys, state=state, seed=seed,
                          pinned=pinned)
                if dfa is not None:
                    state, *top = dingo_program(params, **kw)
                    top = tuple(np.asarray(x) for x in top)
                else:
                    state = p.denoise_step(params, **kw)
                argmax = np.asarray(state.argmax)[0]
                t1 = time.perf_counter()
                if dfa is not None:
                    walker.advance_dingo(argmax, state.soft, top, owed, final, whole=False)
                else:
                    walker.advance(argmax, state.soft, owed)
                out.step_s[i] += t1 - t0
                out.constraint_s[i] += time.perf_counter() - t1
                if int(state.step) >= sampler.max_denoising_steps or bool(np.asarray(state.done)[0]):
                    break
            t1 = time.perf_counter()
            final_canvas = walker.finish(np.asarray(state.argmax)[0], state.soft, owed, top, final)
            out.constraint_s[i] += time.perf_counter() - t1
            out.steps[i, c] = int(np.asarray(state.steps)[0])
            out.nonfinite[i] |= bool(np.asarray(state.nonfinite)[0])
            if walker.ended or final:   # (the last canvas, or one that ended the answer, is not committed)
                break
            (final_dev,) = engine.place(final_canvas)
            _, finished, cache = p.canvas_end(params, cache=cache, argmax=final_dev, finished=finished,
                                              last=jnp.bool_(False))
        out.tokens.append(walker.answer)
        out.finish_reasons.append("stop" if walker.ended else "length")
        out.repairs[i] = walker.repairs
        out.forced[i] = walker.forced
    report_nonfinite(out.nonfinite, nonfinite)
    return out
