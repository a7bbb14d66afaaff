"""Continuous batching at step granularity: a queue, N slots and one worker thread.

    scheduler = Scheduler(engine, tokenizer, slots=8, context=4096)
    scheduler.start()                        # the runner compiles the slot programs, reports their memory
    req = scheduler.submit(Request(prompt_ids, n=1, max_tokens=64, sampler=..., seed=0, stop=(), ...))
    ... req.on_event (a callback) receives a `SeqEvent` per committed canvas, per choice's end, and
        with `provisional=True` one per denoising step (the canvas as it stands) ...
    scheduler.stop()                         # drains: every submitted request still finishes

The worker loops over ticks (`sampling.slots.slot_tick`). Each tick advances every busy slot by one
pass of its own: a slot being admitted gets its next prompt chunk (a batch-1 prefill into its cache
row; at most one chunk per slot per tick, so a long prompt never stalls the others), every other busy
slot one denoising step of its own canvas; a canvas that settles is committed by the next call's
first tick (`slots.slot_tick`, on an accelerator in the same pass as that tick's step), where its
slot's next canvas takes its first step. No slot waits for another slot's canvas. While every
slot is busy decoding (nothing can be admitted) one call of the tick program runs up to
`ticks_per_call` ticks and returns when a canvas settles; otherwise a call is one tick. A choice
(one of a request's `n`) ends at EOS, at `max_tokens`, at a stop string, or when its client is gone
(its slot is free after the current call).

Admission and preemption are the planner's (`serving/planner.py`, `policy`): with "fcfs" a free slot
takes the waiting choice with the lowest `Request.priority` (vLLM's field), the earliest among
equals, and a running choice keeps its slot; with "preempt" (default) the queue is ordered by
priority then work left, and a running choice at a canvas boundary gives its slot to a waiting one of
higher priority or much less work, its cache row kept in host memory (`SlotRunner.save_row`) and
restored into a free slot when it is admitted again. Every counter and latency of `GET /metrics` is
kept here (`self.metrics`, `serving/metrics.py`).

Prefix reuse: with `prefix_reuse` (default) a slot keeps what its cache row holds after its request
ends (the prompt, every committed canvas, and the last canvas committed too), and a new prompt goes
into the free slot whose row shares the longest beginning with it (images count by their pixels),
prefilling only the rest; the least recently used slot is overwritten when none shares more than a
short beginning (under `SMALL_PREFILL` tokens and half its row); a row longer than its sliding layers' ring
caches is reused only up to canvas + 1 tokens before its end (`model.cache.rewind_ok`). The reused tokens are
`SeqEvent.cached_tokens` (OpenAI's `usage.prompt_tokens_details.cached_tokens`).

The planner keeps the books (the queue, the slots, what each cache row holds) and decides who goes
where; the scheduler drives it from its worker thread (the lifecycle, the tick arguments, events and
metrics) and carries its decisions out; the device side (the slots' cache and state, the compiled programs,
the calls that run them) is `serving/runner.py`. A prompt's chunks and its identity for prefix
matching are `serving/chunks.py`, what a client sees of a choice's tokens (text, stop strings,
previews) `serving/output.py`.

Structured requests (`Request.grammar`, `response_format`) run in the slots too: after each tick the
host walks a structured slot's argmax from its held valid prefix and repairs the first rejected
position (`_walk`, with `engine/structured.py`'s walker), hands the held positions to the next tick
(`slot_tick`'s seed / pinned; the tick commits no held slot's canvas) and commits the walked canvas
itself (a prefill of the canvas into the slot's row). While one is busy every call is one tick.

Reproducibility: choice i of a request with seed s uses the row key `choice_keys(s, n)[i]` (for n=1
the key `Engine.generate(rng=s)` gives the prompt, `prompt_key(s)`), its own sampler settings (`RowKnobs`), and
programs whose shapes depend only on (slots, context): on XLA:CPU its tokens were the same whatever
else ran and with or without a reused prefix (tests/test_serving_*.py); not verified on TPU or GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from dgemma_jax.engine import Engine
from dgemma_jax.engine.inputs import new_tokens_that_fit
from dgemma_jax.engine.structured import Walker, token_scores
from dgemma_jax.model.cache import rewind_ok
from dgemma_jax.sampling.config import SamplerConfig
from dgemma_jax.sampling.fused import _head_table
from dgemma_jax.sampling.loop import RowKnobs, choice_keys
from dgemma_jax.sampling.settings import batch_wide
from dgemma_jax.serving import chunks as chunks_lib
from dgemma_jax.serving.metrics import Metrics
from dgemma_jax.serving.output import OutputProcessor, SeqEvent
from dgemma_jax.serving.planner import SMALL_PREFILL, Choice, Drop, Planner, Preempt
from dgemma_jax.serving.runner import SlotRunner
from dgemma_jax.training import adapters as adapters_lib

log = logging.getLogger("dgemma_jax.serving")


class _SlotSoft:
    """Slot `s`'s self-conditioning embeddings as the walker indexes a batch-1 row's ([0, position])."""

    def __init__(self, runner: SlotRunner, s: int):
        self.runner, self.s = runner, s

    def __getitem__(self, index):
        _, position = index
        return self.runner.state.state.soft[self.s, position]

__all__ = ["Request", "Scheduler", "QueueFull", "ShuttingDown", "Starting", "SMALL_PREFILL"]


class QueueFull(Exception):
    """The queue holds `max_queue` waiting choices already (HTTP 429)."""


class ShuttingDown(Exception):
    """The scheduler is draining and takes no new requests (HTTP 503)."""


class Starting(Exception):
    """The scheduler is still compiling its programs and takes no requests yet (HTTP 503, Retry-After)."""


@dataclasses.dataclass
class Request:
    """A validated request: prompt ids, n choices, the token budget and its sampler settings.

    on_event(SeqEvent) is called from the worker thread (hand it to your event loop thread-safely).
    provisional: also send a preview event after every denoising step of the choice's canvas."""

    prompt_ids: Sequence[int]
    max_tokens: int
    sampler: SamplerConfig
    seed: int
    on_event: Callable[[SeqEvent], None]
    n: int = 1
    stop: Sequence[str] = ()
    keep_special: bool = False      # decode with special tokens (chat: the thought channel's markers)
    images: Any = None              # the prompt's images (`dgemma_jax.io.images.ImageBatch`), in prompt order
    provisional: bool = False
    priority: int = 0               # lower runs first (vLLM's); equal priorities in arrival order
    adapter: int = 0                # the engine's LoRA adapter it runs (0: the base model; `Engine(adapter_rows=)`)
    grammar: Any = None             # an `engine.grammar.Grammar`: the answer is valid under it (structured output)
    content: Any = dataclasses.field(default=None, init=False, repr=False)  # set by `Scheduler.submit`
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    submitted: float = dataclasses.field(default_factory=time.monotonic)


class Scheduler:
    """N slots of one engine's model, fed from a bounded queue by a worker thread."""

    def __init__(self, engine: Engine, tokenizer: Any, *, slots: int = 8, context: int | None = None,
                 max_queue: int = 256, default_sampler: SamplerConfig | None = None, prefill_chunk: int = 512,
                 prefix_reuse: bool = True, ticks_per_call: int = 16, policy: str = "preempt",
                 adapter_names: Sequence[str] = (), param_layouts: str = "auto"):
        """engine: its sampler gives the canvas length, EOS ids and stability threshold of every
        request, and its `max_denoising_steps` the most steps a request may ask for.
        default_sampler: a request's settings when it names none (default: the engine's).
        prefill_chunk: prompts go into their slot in chunks of this many tokens (a short prompt or
        tail in one of `SMALL_PREFILL` tokens): two prefill programs serve every prompt length, both
        compiled at startup, so no request ever waits for a compile that would stall every slot.
        prefix_reuse: a prompt that begins with what a free slot's cache row holds prefills only the
        rest (module docstring).
        ticks_per_call: the most ticks one call of the tick program runs while every slot is busy
        decoding (it returns when a canvas settles; otherwise a call runs one tick, so a new request
        is admitted at the next tick). A cancelled request leaves at the end of the call.
        policy: "preempt" or "fcfs" (`serving/planner.py`).
        adapter_names: the names of the engine's stacked LoRA adapters 1, 2, ... (`Request.adapter`).
        param_layouts: "auto", "default" or "compiler": the parameters' layouts (`SlotRunner`)."""
        cfg, smp = engine.config, engine.sampler
        self.default_sampler = default_sampler or smp
        shared = batch_wide() + ("accept", "stop")   # the tick's own: settings a request cannot set
        if any(getattr(self.default_sampler, f) != getattr(smp, f) for f in shared):
            raise ValueError(f"default_sampler must share the engine sampler's {', '.join(shared)}")
        if self.default_sampler.max_denoising_steps > smp.max_denoising_steps:
            raise ValueError("default_sampler asks for more steps than the engine's budget")
        if slots < 1:
            raise ValueError(f"slots must be >= 1; got {slots}")
        self.engine, self.tokenizer = engine, tokenizer
        self.adapter_names = tuple(adapter_names)
        self.outputs = OutputProcessor(tokenizer, smp.pad_id, smp.eos_ids)
        self.slots = int(slots)
        self.context = int(min(context or cfg.max_position_embeddings, cfg.max_position_embeddings))
        if self.context < smp.canvas_length + 1:
            raise ValueError(f"context {self.context} cannot hold a prompt and a canvas of {smp.canvas_length}")
        self.max_queue = int(max_queue)
        big = min(int(prefill_chunk), self.context)
        self.prefill_widths = (min(SMALL_PREFILL, big), big)   # (short prompts and tails, whole chunks)
        self.prefix_reuse = bool(prefix_reuse)
        # the device side: the slots' cache and state, the compiled tick and prefills
        self.runner = SlotRunner(engine, self.slots, self.context, self.prefill_widths, param_layouts)
        self.ticks_per_call = int(ticks_per_call)
        # the books: the queue, the slots' sequences, what each cache row holds (guarded by _cond)
        self.plan = Planner(self.slots, self.context, smp.canvas_length, prefix_reuse=self.prefix_reuse,
                            policy=policy, image_blocks=lambda ids: chunks_lib.image_blocks(cfg, ids),
                            can_rewind=lambda row, keep: rewind_ok(cfg, self.context, row, keep))
        self._knobs = None
        self._scores = None   # the structured walker's token scores (`_token_scores`), made on first use
        self._owed_from = [0] * self.slots   # where the canvas each row is owed (`SlotRunner.owed`) begins
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.stats = collections.Counter()
        self.metrics = Metrics(self.status)   # its Prometheus metrics (`GET /metrics`), its own registry
        self.error: BaseException | None = None
        self.ready = threading.Event()   # every program compiled and the worker running
        self._started_at: float | None = None

    @classmethod
    def for_model(cls, config, params, tokenizer, sampler: SamplerConfig, *, max_steps: int | None = None,
                  shardings=None, runtime=None, adapters=None, **kwargs) -> "Scheduler":
        """A scheduler over a new `Engine`; requests may ask for up to `max_steps` denoising steps
        (default: the sampler's own budget). runtime: how its programs run (`dgemma_jax.Runtime`).
        adapters: {name: `training.adapters.Adapter`}, LoRA adapters a request picks by index
        (`Request.adapter`: 1, 2, ... in this order; 0 the base), mixed in one batch."""
        budget = max(int(max_steps or 0), sampler.max_denoising_steps)
        stacked = adapters_lib.stack(config, list(adapters.values())) if adapters else None
        engine = Engine(config, params, sampler.replace(max_denoising_steps=budget), shardings=shardings,
                        runtime=runtime, adapters=stacked, adapter_rows=True)
        return cls(engine, tokenizer, default_sampler=sampler, adapter_names=tuple(adapters or ()), **kwargs)

    # ------------------------------------------------------------------ limits
    @property
    def canvas_length(self) -> int:
        return self.engine.sampler.canvas_length

    def check_fits(self, prompt_len: int, max_tokens: int) -> None:
        """ValueError (HTTP 400) naming the numbers when a request cannot fit a slot."""
        cfg, l = self.engine.config, self.canvas_length
        n_canvas = -(-max_tokens // l)
        if prompt_len + l > self.context:
            raise ValueError(f"the prompt is {prompt_len} tokens; with one canvas of {l} it exceeds this server's "
                             f"context of {self.context} tokens per request: shorten the prompt")
        if prompt_len + (n_canvas - 1) * l > self.context or prompt_len + n_canvas * l > cfg.max_position_embeddings:
            most = new_tokens_that_fit(cfg, self.engine.sampler, prompt_len, max_tokens, self.context)
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens={max_tokens} ({n_canvas} canvases of {l}) "
                             f"do not fit this server's context of {self.context} tokens per request; "
                             f"ask for at most {most} tokens or shorten the prompt")

    def plan_chunks(self, prompt_ids: Sequence[int], images=None, start: int = 0) -> list[tuple[int, int, int, Any]]:
        """The prompt's prefill chunks from position `start` on at this server's widths
        (`chunks.plan_chunks`)."""
        return chunks_lib.plan_chunks(self.engine.config, prompt_ids, self.prefill_widths, images, start)

    def default_max_tokens(self, prompt_len: int, limit: int) -> int:
        """The most tokens (<= limit, whole canvases) that fit after a prompt of `prompt_len`."""
        return new_tokens_that_fit(self.engine.config, self.engine.sampler, prompt_len, limit, self.context)

    # ------------------------------------------------------------------ lifecycle
    def start(self, wait: bool = True) -> None:
        """Start the runner (`SlotRunner.start`: the slots' cache, the compiled tick and prefill widths),
        then the worker. wait=False returns at once and does all that in a thread: until `ready` is
        set, `status()` reports each program's progress and `submit` raises `Starting`; a failed
        compile sets `error`."""
        self._started_at = time.perf_counter()
        if wait:
            self._start_up()
            if self.error is not None:
                raise self.error
            return
        threading.Thread(target=self._start_up, name="dgemma-startup", daemon=True).start()

    def _start_up(self) -> None:
        try:
            self.runner.start(self._tick_args())
        except BaseException as e:  # noqa: BLE001 - reported through status(), /health and start(wait=True)
            self.error = e
            return
        self.stats["startup_compile_ms"] = int(1e3 * (time.perf_counter() - self._started_at))
        self._thread = threading.Thread(target=self._run, name="dgemma-scheduler", daemon=True)
        self._thread.start()
        self.ready.set()

    def close(self) -> None:
        """Stop taking requests (`submit` raises ShuttingDown); the submitted ones go on."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def pending(self) -> int:
        """Sequences queued or in a slot."""
        with self._cond:
            return len(self.plan.queue) + self.plan.running()

    def stop(self, timeout: float | None = None) -> None:
        """Stop taking requests, finish every submitted one, then end the worker."""
        self.close()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: Request) -> Request:
        """Queue a request's choices (QueueFull / ShuttingDown when it cannot be taken)."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[Request]) -> list[Request]:
        """Queue the choices of several requests (one HTTP request's prompts) all at once or none:
        ValueError when one cannot fit a slot, QueueFull when they do not all fit the queue now,
        ShuttingDown / Starting when nothing is taken."""
        choices = []
        for request in requests:
            if request.n < 1:
                raise ValueError(f"n must be >= 1; got {request.n}")
            self.check_fits(len(request.prompt_ids), request.max_tokens)
            self.plan_chunks(request.prompt_ids, request.images)   # its checks (the plan depends on the slot)
            request.content = chunks_lib.content_keys(np.asarray(request.prompt_ids), self.engine.config.image_token_id,
                                           request.images)
            keys = np.asarray(jax.random.key_data(choice_keys(int(request.seed), request.n)))
            n_canvas = -(-request.max_tokens // self.canvas_length)
            choices += [Choice(request, i, keys[i], n_canvas) for i in range(request.n)]
        if self._started_at is not None and not self.ready.is_set():  # compiling (before start: queued)
            if self.error is not None:
                raise ShuttingDown(f"the server failed to start ({self.error}); restart it")
            raise Starting(f"the server is still compiling its programs ({self.runner.progress()}); retry shortly")
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down and takes no new requests")
            if self.error is not None:
                raise ShuttingDown(f"the server's worker failed ({self.error}); restart it")
            if len(self.plan.queue) + len(choices) > self.max_queue:
                raise QueueFull(f"the queue holds {len(self.plan.queue)} waiting sequences (limit {self.max_queue}) and "
                                f"this request adds {len(choices)}; retry later")
            self.plan.add(choices)
            self.stats["requests"] += len(requests)
            self._cond.notify_all()
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in requests))
        return list(requests)

    def status(self) -> dict:
        with self._cond:
            busy = self.plan.running()
            since = self._started_at
            return {"slots": self.slots, "busy_slots": busy, "queued": len(self.plan.queue), "context": self.context,
                    "policy": self.plan.policy,
                    "canvas_length": self.canvas_length, "stopping": self._stopping, "ready": self.ready.is_set(),
                    "worker_alive": bool(self._thread and self._thread.is_alive()),
                    "memory": self.runner.memory,
                    "programs": {k: dict(v) for k, v in self.runner.programs.items()},
                    "seconds_since_start": round(time.perf_counter() - since, 1) if since is not None else None,
                    "stats": dict(self.stats)}

    # ------------------------------------------------------------------ programs
    def _tick_args(self, busy=None, begin=None, active=None, max_ticks: int = 1):
        n = self.slots
        busy = busy if busy is not None else [None] * n
        samplers = tuple(c.request.sampler if c else self.default_sampler for c in busy)
        if self._knobs is None or self._knobs[0] != samplers:   # rebuilt (and sent) only when the slots change
            self._knobs = (samplers, RowKnobs.from_samplers(samplers, self.engine.sampler.max_denoising_steps))
        keys = np.zeros((n, 2), np.uint32)
        canvas_index, last, keep = np.zeros(n, np.int32), np.zeros(n, bool), np.zeros(n, bool)
        for s, c in enumerate(busy):
            if c is not None:
                keys[s], canvas_index[s] = c.key, c.canvas
                last[s] = c.canvas + 1 >= c.n_canvases
                keep[s] = self.plan.keeps(s)
        # structured slots: the valid prefix each holds, and whether its canvas is complete (`_walk`)
        l = self.canvas_length
        seed, pinned = np.zeros((n, l), np.int32), np.zeros((n, l), bool)
        hold, end = np.zeros(n, bool), np.zeros(n, bool)
        for s, c in enumerate(busy):
            if c is not None and c.request.grammar is not None and c.walker is not None:
                hold[s], end[s] = True, c.complete
                seed[s], pinned[s] = c.walker.seed[0], c.walker.pinned[0]
        return dict(keys=jax.random.wrap_key_data(keys),
                    canvas_index=canvas_index, begin=np.zeros(n, bool) if begin is None else begin,
                    active=np.zeros(n, bool) if active is None else active, last=last, keep=keep,
                    knobs=self._knobs[1], max_ticks=np.int32(max_ticks), seed=seed, pinned=pinned, hold=hold, end=end)

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    while self.plan.idle() and not self._stopping:
                        self._cond.wait()
                    if self._stopping and self.plan.idle():
                        return
                self._admit()
                if any(self.plan.busy):
                    self._tick()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting client, then re-raised
            log.exception("the scheduler's worker failed")
            self.error = e
            self._fail_all(e)
            raise

    def _admit(self) -> None:
        """Carry out the planner's decisions (`Planner.plan`): cancelled waiting choices end, preempted
        ones have their slot's row copied to the host, admitted ones get their saved row back or their
        prompt chunks queued (one per tick)."""
        with self._cond:
            decisions = self.plan.plan(self.stats["ticks"])
        for d in decisions:
            if isinstance(d, Drop):
                self._emit(d.choice, "cancelled")
                self.stats["finished_cancelled"] += 1
                self._finished(d.choice, "cancelled")
            elif isinstance(d, Preempt):
                t0 = time.perf_counter()
                d.choice.saved = self.runner.save_row(d.slot)
                self.stats["preempt_save_ms"] += round(1e3 * (time.perf_counter() - t0), 3)
                self.stats["preemptions"] += 1
                self.metrics.preemptions.inc()
            elif d.restore:
                self.runner.slot_adapter[d.slot] = d.choice.request.adapter
                t0 = time.perf_counter()
                self.runner.restore_row(d.slot, d.choice.saved)
                if d.choice.saved.owed is not None:   # the row it holds ends with the canvas it is owed
                    self._owed_from[d.slot] = len(self.plan.rows[d.slot]) - self.canvas_length
                d.choice.saved = None
                self.stats["preempt_restore_ms"] += round(1e3 * (time.perf_counter() - t0), 3)
                self.stats["restores"] += 1
            else:
                c, req = d.choice, d.choice.request
                if self.runner.owes(d.slot) and d.reuse <= self._owed_from[d.slot]:
                    self.runner.forget_owed(d.slot)   # the prompt keeps none of the canvas the row is owed
                self.runner.slot_adapter[d.slot] = req.adapter
                c.chunks = self.plan_chunks(np.asarray(req.prompt_ids, np.int32), req.images, start=d.reuse)
                self.stats["prefix_tokens_reused"] += d.reuse
                self.metrics.prefix_queries.inc(len(req.prompt_ids))
                self.metrics.prefix_hits.inc(d.reuse)
                self.metrics.queue_time.observe(time.monotonic() - req.submitted)
                self.stats["prefills"] += 1

    def _prefill_chunk(self, c: Choice) -> None:
        """One of the choice's prompt chunks into its slot's row."""
        start, end, width, imgs = c.chunks.pop(0)
        ids = np.asarray(c.request.prompt_ids, np.int32)
        n = end - start
        tokens = np.full((1, width), self.engine.config.pad_id, np.int32)
        tokens[0, :n] = ids[start:end]
        before = self.runner.image_compiles
        self.runner.prefill(c.slot, tokens, n, start, imgs)
        self.stats["image_prefill_compiles"] += self.runner.image_compiles - before
        self.plan.rows[c.slot] = np.concatenate([self.plan.rows[c.slot][:start], c.request.content[start:end]])
        self.stats["prefill_chunks"] += 1
        if not c.chunks:
            c.begin = True

    def _tick(self) -> None:
        """Cancelled choices leave; admitted ones get a prompt chunk; then the tick program runs every
        other busy slot one denoising step a tick until a canvas settles (one tick a call unless every
        slot is busy decoding and nobody asked for previews) and commits the settled canvases that
        go into the cache."""
        for s, c in enumerate(self.plan.busy):
            if c is not None and c.request.cancelled.is_set():
                self._emit(c, "cancelled")
                self._free(s, "cancelled")
        prefilled = False
        for c in self.plan.busy:
            # a row still owed its last holder's canvas (kept for prefix reuse) takes no prompt before
            # the tick below writes that canvas
            if c is not None and c.chunks and not self.runner.owes(c.slot):
                self._prefill_chunk(c)
                prefilled = True
        busy = list(self.plan.busy)
        active = np.array([c is not None and not c.chunks for c in busy], bool)
        if not active.any() and not self.runner.owed.any():
            self.stats["ticks"] += 1
            return
        previews = any(c is not None and c.request.provisional for c in busy)
        structured = [bool(active[s] and c.request.grammar is not None) for s, c in enumerate(busy)]
        # several ticks a call only while every slot is busy decoding: then nothing can be admitted
        # before a canvas settles, and the call returns when one does; a structured slot's walk needs
        # every step's argmax on the host
        one = prefilled or previews or any(structured) or not active.all()
        begin = np.array([bool(c is not None and c.begin) for c in busy], bool)
        for s, c in enumerate(busy):
            if structured[s] and c.begin:   # a new canvas: nothing held yet
                if c.walker is None:
                    c.walker = Walker(c.request.grammar, self.engine.config.vocab_size,
                                       int(self.engine.sampler.eos_ids[0]), self._token_scores())
                owed = min(self.canvas_length, c.request.max_tokens - c.canvas * self.canvas_length)
                c.walker.start(self.canvas_length, owed)   # holds the grammar's forced text at once
                c.complete = c.walker.ended or c.walker.held >= owed
        args = self._tick_args(busy, begin, active, 1 if one else self.ticks_per_call)
        ticks, settled, tokens, eos, steps, nonfinite, argmax, owed = self.runner.tick(args, previews or any(structured))
        self.stats["slot_steps"] += int(active.sum()) * ticks
        self.stats["tick_calls"] += 1
        self.stats["ticks"] += ticks - 1     # the last tick is counted below, after its events
        for s, c in enumerate(busy):
            if not active[s]:
                continue
            if c.begin and owed[s] and not settled[s]:   # its row's commit waits for the next call: so does its canvas
                continue
            c.begin = False
            if previews and c.request.provisional:   # every step's preview, the settling one too
                self._emit(c, None, preview=argmax[s], preview_steps=int(steps[s]))
            if structured[s]:
                self._walk(s, c, argmax[s], bool(settled[s]), int(steps[s]), bool(nonfinite[s]),
                           bool(args["last"][s]), bool(args["keep"][s]))
            elif settled[s]:
                self._settle(s, c, tokens[s], int(steps[s]), bool(eos[s]), bool(nonfinite[s]),
                             bool(args["last"][s]), bool(args["keep"][s]))
        self.stats["ticks"] += 1

    def _token_scores(self):
        """soft [D] -> [V] scores of every token at a position (the structured walker's repair)."""
        if self._scores is None:
            table = _head_table(self.engine.params["embedding"])[0]
            program = self.engine._program(("token_scores",), token_scores, donate=())
            self._scores = lambda soft_row: program(table, soft_row)
        return self._scores

    def _walk(self, s: int, c: Choice, argmax: np.ndarray, settled: bool, steps: int, nonfinite: bool,
              last: bool, keep: bool) -> None:
        """A structured slot after a tick (`engine/structured.py`'s walk, row by row as
        `Engine.generate_structured` runs it): the step's argmax extends the held valid prefix and its
        first rejected position is repaired; once the canvas settles (or is wholly held, the tick
        after) the walk runs to its end and the host commits that canvas (the tick commits none of a
        held slot's), which joins the answer."""
        w, l = c.walker, self.canvas_length
        owed = min(l, c.request.max_tokens - c.canvas * l)
        soft = _SlotSoft(self.runner, s)
        if not settled:
            w.advance(argmax, soft, owed)
            c.complete = w.ended or w.held >= owed
            return
        final = w.finish(argmax, soft, owed)[0].astype(np.int32)
        tokens = final.copy()
        eos_ids = list(self.engine.sampler.eos_ids)
        at = np.flatnonzero(np.isin(tokens, eos_ids))
        if at.size:   # EOS truncation, as `finish_canvas`
            tokens[at[0] + 1:] = self.engine.sampler.pad_id
        eos = bool(at.size) or w.ended   # the grammar is complete: the answer ends here
        if (not eos and not last) or keep:   # the host commits it (a causal pass over the canvas, the slot's row)
            start = len(self.plan.rows[s])
            width = min(w for w in self.runner.prefill_widths if w >= l) if max(self.runner.prefill_widths) >= l \
                else None
            if width is None:
                raise RuntimeError(f"no prefill width of this server holds a canvas of {l} tokens")
            chunk = np.full((1, width), self.engine.config.pad_id, np.int32)
            chunk[0, :l] = tokens
            self.runner.prefill(s, chunk, l, start)
        self._settle(s, c, tokens, steps, eos, nonfinite, last, keep)

    def _settle(self, s: int, c: Choice, tokens: np.ndarray, steps: int, eos: bool, nonfinite: bool,
                last: bool, keep: bool) -> None:
        """A slot's canvas ended this tick: its tokens join the answer; the request goes on (its next
        canvas starts on the next tick) or ends."""
        l = self.canvas_length
        if nonfinite:
            self.stats["nonfinite_canvases"] += 1
            log.warning("slot %d met non-finite logits: the model's weights or activations hold NaN/Inf, so this "
                        "answer is not the model's (check the checkpoint)", s)
        if (not eos and not last) or keep:   # what the next slot_tick call commits into the row
            self._owed_from[s] = len(self.plan.rows[s])
            self.plan.rows[s] = np.concatenate([self.plan.rows[s], tokens.astype(np.int64)])
            self.stats["commits"] += 1
        owed = c.request.max_tokens - c.canvas * l
        c.tokens.extend(int(t) for t in tokens[:owed])
        self.metrics.generation_tokens.inc(int(np.count_nonzero(tokens[:owed] != self.engine.sampler.pad_id)))
        self.metrics.steps.inc(steps)
        self.metrics.canvases.inc()
        if c.canvas == 0:
            self.metrics.ttft.observe(time.monotonic() - c.request.submitted)
        c.steps += steps
        c.canvas += 1
        self.stats["slot_canvases"] += 1
        reason = "stop" if eos else ("length" if c.canvas >= c.n_canvases else None)
        if reason is None and c.request.cancelled.is_set():
            reason = "cancelled"
        reason = self._emit(c, reason)
        if reason is None:
            c.begin = True
        else:
            self._free(s, reason)

    def _free(self, s: int, reason: str) -> None:
        with self._cond:
            c = self.plan.free(s, self.stats["ticks"])
            self.stats["finished_" + reason] += 1
        self._finished(c, reason)

    def _finished(self, c: Choice, reason: str) -> None:
        self.metrics.finished(reason)
        self.metrics.e2e.observe(time.monotonic() - c.request.submitted)

    def _emit(self, c: Choice, reason: str | None, preview=None, preview_steps: int = 0) -> str | None:
        """Send the choice's event (`output.OutputProcessor`) to its listener; returns its finish reason."""
        ev = self.outputs.event(c, reason, self.stats["ticks"], preview, preview_steps)
        try:
            c.request.on_event(ev)
        except Exception:  # noqa: BLE001 - a broken listener must not stop the other slots
            log.exception("a request's event listener failed; cancelling it")
            c.request.cancelled.set()
        return ev.finish_reason

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = [c for c in self.plan.busy if c is not None] + list(self.plan.queue)
            self.plan.queue.clear()
            self.plan.busy = [None] * self.slots
        for c in pending:
            self.metrics.finished("error")
            try:
                c.request.on_event(SeqEvent(c.index, "", 0, c.steps, c.canvas, "error"))
            except Exception:  # noqa: BLE001
                pass
