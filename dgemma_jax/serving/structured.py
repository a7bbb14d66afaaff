"""`response_format` on the server: answers valid under a JSON schema, any JSON object, or nothing more
than text.

A structured request runs in the scheduler's slots beside the others (`Request.grammar`): after
every denoising step of its canvas the scheduler walks the step's argmax from the held valid prefix
and repairs the first rejected position on the host (`engine/structured.py`'s walker, as
`Engine.generate_structured` runs it), pins what it holds for the next step, and commits the walked
canvas itself; while one is busy every call of the tick program is one tick. Its row decides as it
would alone (its own key `choice_keys(s, n)[i]`, its own sampler settings, its own pins; rows without
pins step exactly as without them), so the same seed gives the same answer whatever else shares the
batch (tests/test_structured_serving.py). What it does not take is refused with a 400 naming the
field: a schema that is not a JSON object or that llguidance cannot compile, `stream`, thinking,
images.
"""

from __future__ import annotations


from dgemma_jax.engine.grammar import Grammar, compile_grammar, schema_of_response_format
from dgemma_jax.serving.handler import APIError, RequestHandler


class StructuredRunner:
    """Structured requests for one app: `grammar(body)` (None for no constraint), then the handler's
    `run(..., grammar=)` puts its sequences into the slots."""

    def __init__(self, handler: RequestHandler):
        self.handler, self.scheduler = handler, handler.scheduler

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
        for field, given in (("stream", body.stream), ("enable_thinking", getattr(body, "thinking", False))):
            if given:
                raise APIError(400, f"response_format cannot be combined with {field} on this server (structured "
                                    "answers are written whole, without thinking)", param="response_format")
        self.handler.sampler_for(body)   # canvas_length's check
        engine = self.scheduler.engine
        try:
            return compile_grammar(self.handler.tok, engine.config.vocab_size, engine.sampler.eos_ids,
                                   json_schema=schema, json_object=json_object)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", code="invalid_response_format",
                           param="response_format") from None
