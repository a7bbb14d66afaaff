"""The structured-output driver: answers valid under a grammar (`engine.grammar`), over the engine's programs.

A canvas is written in parallel, so the constraint acts between denoising steps, on the host, with the
pinned positions the step already honours (infilling's mechanism): each row runs alone (its own
batch-1 programs and its own key, so a request gets the same tokens with or without others), and
per canvas:

1. after every `denoise_step`, the grammar's matcher walks the step's argmax from the canvas's valid
   prefix (`validate_tokens`: the longest run it accepts) and those tokens are consumed and pinned
   (held in the canvas and the argmax by the next steps);
2. the first position the grammar rejects is repaired: it takes the allowed token (the grammar's
   mask) that the step's self-conditioning embedding at that position scores highest (`soft . E`,
   the model's expected token at that position, a proxy for the masked distribution that needs no
   [L, V] logits on the host), and is pinned too; the rest of the canvas is denoised again around
   the pins at the next step;
3. when the canvas stops (stable and confident, or its step budget), the same walk-and-repair runs to
   the canvas's end without further passes, so the committed canvas is a valid prefix of the answer.

Once the grammar is complete, the first EOS it allows ends the answer (the rest of the canvas is EOS).
Every committed canvas is valid; an answer whose grammar is not complete when the token budget runs out
ends with finish_reason "length" (its text a valid prefix). Cost per step beyond the pass: one argmax
canvas [L] read on the host, the walk, and for the repair one mask and one [V] score row (measured in
benchmarks/structured_output.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from dgemma_jax.engine.grammar import Grammar, allowed_tokens
from dgemma_jax.engine.outputs import report_nonfinite
from dgemma_jax.sampling.fused import _head_table
from dgemma_jax.sampling.generate import num_canvases


@dataclasses.dataclass
class StructuredOutput:
    """tokens: each row's answer ids (no EOS / pad); finish_reasons: "stop" (the grammar is complete and
    the answer ended) or "length" (the budget ran out first; the text is a valid prefix); steps: [B, C]
    denoiser passes per canvas; repairs: [B] positions the constraint chose instead of the model's argmax;
    nonfinite: [B] the row met non-finite logits; constraint_s: [B] host seconds in the constraint (the
    matcher's walk, masks and repair scores), step_s: [B] seconds in the denoising steps (dispatch to
    the argmax on the host)."""

    tokens: list
    finish_reasons: list
    steps: np.ndarray
    repairs: np.ndarray
    nonfinite: np.ndarray
    constraint_s: np.ndarray
    step_s: np.ndarray


def token_scores(table, soft_row):
    """[V] float32: each token's embedding . the position's self-conditioning embedding (the engine jits it)."""
    return jnp.asarray(table, jnp.float32) @ soft_row.astype(jnp.float32)


class _Walker:
    """One row's matcher and the valid prefix of the canvas in flight (held positions)."""

    def __init__(self, grammar: Grammar, vocab_size: int, eos_id: int, scores):
        self.m = grammar.matcher()
        self.v, self.eos, self.scores = vocab_size, eos_id, scores
        self.repairs = 0
        self.answer: list[int] = []
        self.ended = False      # the answer's EOS was written

    def start(self, length: int):
        self.held = 0
        self.seed = np.zeros((1, length), np.int32)
        self.pinned = np.zeros((1, length), bool)

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
        self.ended = self.ended or self.m.is_stopped()   # complete, nothing can follow: the answer ends here
        if self.ended:  # the rest of the canvas is EOS
            self.seed[0, self.held:] = self.eos
            self.pinned[0, self.held:] = True
            self.held = self.seed.shape[1]

    def advance(self, argmax: np.ndarray, soft, owed: int) -> None:
        """Hold the longest valid run of `argmax` from the held prefix, then repair the next position."""
        if self.ended or self.held >= owed:
            return
        run = argmax[self.held:owed]
        k = self.m.validate_tokens([int(t) for t in run])
        if k:
            self._hold(run[:k])
        if self.ended or self.held >= owed:
            return
        allowed = allowed_tokens(self.m, self.v)
        if not allowed.any():   # nothing can follow (cannot happen before the answer ended)
            raise RuntimeError(f"the grammar allows no token after {len(self.answer)} tokens: {self.m.get_error()}")
        scores = np.asarray(self.scores(soft[0, self.held]))
        scores = np.where(allowed, scores, -np.inf)
        self._hold(np.asarray([int(np.argmax(scores))], np.int32))
        self.repairs += 1

    def finish(self, argmax: np.ndarray, soft, owed: int) -> np.ndarray:
        """Walk and repair to the canvas's end (no more passes); the canvas to commit [1, L]."""
        while not self.ended and self.held < owed:
            self.advance(argmax, soft, owed)
        return self.seed


def generate_structured(engine, prompt_tokens, lengths, grammars: Grammar | Sequence[Grammar], *, rng: Any = 0,
                        max_new_tokens: int | None = None, nonfinite: str = "warn") -> StructuredOutput:
    """Answers valid under a grammar (`Engine.generate_structured`).

    Args:
      prompt_tokens: [B, P] right-padded prompts; lengths: [B] (default P).
      grammars: one `Grammar` (`engine.grammar.compile_grammar`) for every row, or one per row.
      rng: as `Engine.generate` (a row's key comes from its own seed).
      max_new_tokens: the token budget (default one canvas).
      nonfinite: as `Engine.generate`.
    Returns:
      a `StructuredOutput`.
    """
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

    def scores(soft_row):
        return score_program(table, soft_row)
    out = StructuredOutput([], [], np.zeros((b, n_canvas), np.int32), np.zeros((b,), np.int32), np.zeros((b,), bool),
                           np.zeros((b,)), np.zeros((b,)))
    for i, row in enumerate(rows):
        t, n, key, cache, _, _, _ = engine._block([row])
        walker = _Walker(grammars[i], engine.config.vocab_size, int(sampler.eos_ids[0]), scores)
        cache = p.prefill(params, tokens=t, lengths=n, cache=cache, images=None)
        finished = jnp.zeros((1,), bool)
        for c in range(n_canvas):
            owed = min(l, budget - c * l)
            canvas = p.canvas_start(keys=key, index=jnp.int32(c), finished=finished)
            walker.start(l)
            state = canvas.state
            while True:
                t0 = time.perf_counter()
                seed, pinned = engine.place(walker.seed, walker.pinned)
                state = p.denoise_step(params, cache=cache, context_end=cache.lengths, keys=canvas.keys, state=state,
                                       seed=seed, pinned=pinned)
                argmax = np.asarray(state.argmax)[0]
                t1 = time.perf_counter()
                walker.advance(argmax, state.soft, owed)
                out.step_s[i] += t1 - t0
                out.constraint_s[i] += time.perf_counter() - t1
                if (int(state.step) >= sampler.max_denoising_steps or bool(np.asarray(state.done)[0])
                        or walker.ended or walker.held >= owed):
                    break
            t1 = time.perf_counter()
            final = walker.finish(np.asarray(state.argmax)[0], state.soft, owed)
            out.constraint_s[i] += time.perf_counter() - t1
            out.steps[i, c] = int(np.asarray(state.steps)[0])
            out.nonfinite[i] |= bool(np.asarray(state.nonfinite)[0])
            last = walker.ended or c + 1 >= n_canvas
            if not last:   # commit the valid canvas (the last one, or one that ended the answer, is not needed)
                (final_dev,) = engine.place(final)
                _, finished, cache = p.canvas_end(params, cache=cache, argmax=final_dev, finished=finished,
                                                  last=jnp.bool_(False))
            else:
                break
        out.tokens.append(walker.answer)
        out.finish_reasons.append("stop" if walker.ended else "length")
        out.repairs[i] = walker.repairs
    report_nonfinite(out.nonfinite, nonfinite)
    return out
