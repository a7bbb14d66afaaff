"""`response_format` on the server: answers valid under a JSON schema, any JSON object, or nothing more
than text, through `Engine.generate_structured` (engine/structured.py).

A structured request does not go through the slot scheduler: its canvases are walked and repaired on
the host between denoising steps, one row at a time, on one thread of its own (`StructuredRunner`)
that shares the scheduler's engine. Choice i of a request with seed s uses the scheduler's key
`choice_keys(s, n)[i]`. What it does not take is refused with a 400 naming the field: a schema that is
not a JSON object or that llguidance cannot compile, `stream`, the sampler's knobs (the engine's
sampler is used), thinking, images.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import secrets
import time
import uuid

import jax
import numpy as np

from dgemma_jax.engine.grammar import Grammar, compile_grammar, schema_of_response_format
from dgemma_jax.sampling.loop import choice_keys
from dgemma_jax.serving.handler import APIError, RequestHandler


class StructuredRunner:
    """Structured requests for one app: `grammar(body)` (None for no constraint), then `run`."""

    def __init__(self, handler: RequestHandler):
        self.handler, self.scheduler = handler, handler.scheduler
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dgemma-structured")   # the app shuts it

    def grammar(self, body) -> Grammar | None:
        """The request's compiled constraint, None without one ({"type": "text"} or no response_format);
        a 400 naming the problem for a bad or uncompilable schema or a field it cannot go with."""
        rf = getattr(body, "response_format", None)
        if rf is None or (isinstance(rf, dict) and rf.get("type") == "text" and set(rf) == {"type"}):
            return None
        try:
            schema, json_object = schema_of_response_format(rf)
        except ValueError as e:
            raise APIError(400, str(e), param="response_format") from None
        for field, given in (("stream", body.stream), ("enable_thinking", getattr(body, "thinking", False)),
                             (", ".join(body.sampler_changes()), bool(body.sampler_changes()))):
            if given:
                raise APIError(400, f"response_format cannot be combined with {field} on this server (structured "
                                    "answers are written with the server's sampler, whole, without thinking)",
                               param="response_format")
        self.handler.sampler_for(body)   # canvas_length's check
        engine = self.scheduler.engine
        try:
            return compile_grammar(self.handler.tok, engine.config.vocab_size, engine.sampler.eos_ids,
                                   json_schema=schema, json_object=json_object)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", code="invalid_response_format",
                           param="response_format") from None

    async def run(self, body, grammar: Grammar, prompts: list[list[int]], chat: bool, images=None) -> dict:
        """The OpenAI response of a structured request (each prompt's n choices)."""
        if images is not None:
            raise APIError(400, "response_format cannot be combined with images on this server", param="response_format")
        st = self.scheduler.status()
        if st["stopping"]:
            raise APIError(503, "the server is shutting down and takes no new requests", "server_error",
                           "shutting_down")
        if not st["ready"]:
            raise APIError(503, "the server is still compiling its programs; retry shortly", "server_error", "starting",
                           headers={"Retry-After": "5"})
        try:
            budget = body.token_budget()
        except ValueError as e:
            raise APIError(400, str(e), param="max_tokens") from None
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        keys = np.asarray(jax.random.key_data(choice_keys(int(seed), body.n)))
        jobs = []
        for ids in prompts:
            n_tok = budget if budget is not None else self.scheduler.default_max_tokens(
                len(ids), self.handler.default_max_tokens)
            try:
                self.scheduler.check_fits(len(ids), n_tok)
            except ValueError as e:
                raise APIError(400, str(e), param="max_tokens") from None
            jobs.append((ids, n_tok))
        loop = asyncio.get_running_loop()
        outs = [await loop.run_in_executor(self.pool, self._generate, ids, n_tok, grammar, keys)
                for ids, n_tok in jobs]
        choices, completion = [], 0
        for p, out in enumerate(outs):
            for j in range(body.n):
                text = self.handler.tok.decode(out.tokens[j], skip_special=True)
                completion += len(out.tokens[j])
                i, reason = p * body.n + j, out.finish_reasons[j]
                if chat:
                    choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                    "finish_reason": reason, "logprobs": None})
                else:
                    choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": None})
        prompt = sum(len(ids) for ids in prompts)
        steps = sum(int(out.steps.sum()) for out in outs)
        return {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.handler.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                          "denoising_steps": steps, "repairs": sum(int(out.repairs.sum()) for out in outs)}}

    def _generate(self, ids, n_tok, grammar, keys):
        tokens = np.asarray([ids] * len(keys), np.int32)
        return self.scheduler.engine.generate_structured(tokens, None, grammars=grammar, rng=keys,
                                                         max_new_tokens=n_tok)
