"""The scheduler's books and decisions: which waiting sequence goes into which slot, and when a running
one is preempted. No thread, no device, no clock: `Scheduler` (serving/scheduler.py) drives it from
its worker and carries out its decisions on the slots (`serving/runner.py`).

    planner = Planner(slots=4, context=4096, canvas_length=256, prefix_reuse=True, policy="preempt")
    planner.add(choices)                     # a request's sequences join the queue
    for d in planner.plan(tick):             # between two calls of the tick program
        ...                                  # Drop (cancelled while waiting), Preempt (save the slot's
                                             # row), Admit (prefill its prompt, or restore its saved row)

Policies (`--schedule`):
- "fcfs": a free slot takes the waiting sequence with the lowest `priority`, the earliest among
  equals; a running sequence keeps its slot until it ends.
- "preempt" (default): the queue is ordered by (priority, work left, arrival), where a sequence's work
  left is the canvases its `max_tokens` still allows (shortest first). When no slot is
  free, a running sequence at a canvas boundary (its last canvas committed, the next not begun) gives
  its slot to the first waiting one when it has a higher priority value, or the same and more than
  `PREEMPT_FACTOR` times its work left (the factor keeps two long sequences from trading a slot back
  and forth). The preempted sequence's cache row (prompt and committed canvases) is copied to host
  memory and goes back into a free slot (any one) when the sequence is admitted again; its next
  canvas then starts from the same key as it would have (`fold_in(row key, canvas)`), so its tokens
  are those of the same request never preempted. A stream of shorter requests can hold a long one
  back indefinitely (no ageing): `--schedule fcfs` where that matters more than short latencies.

Prefix reuse: with `prefix_reuse`, a new prompt goes into the free slot whose row (`rows`: the content
keys of what each cache row holds) shares the longest beginning with it, prefilling only the rest; the
least recently used slot is overwritten when none shares more than a short beginning.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple, Sequence

import numpy as np

from dgemma_jax.io.prompts import common_prefix

SMALL_PREFILL = 32    # the prefill width of short prompts and of a long prompt's last few tokens
POLICIES = ("preempt", "fcfs")
PREEMPT_FACTOR = 2    # a waiting sequence preempts one with more than this many times its work left


@dataclasses.dataclass
class Choice:
    """One sequence (choice `index` of a request) and where it stands."""

    request: Any                    # the scheduler's `Request`
    index: int
    key: np.ndarray                 # uint32 key data of its row key
    n_canvases: int
    tokens: list = dataclasses.field(default_factory=list)
    steps: int = 0                  # denoiser passes of its finished canvases
    canvas: int = 0                 # canvases finished
    slot: int = -1
    admitted_tick: int = -1
    chunks: list = dataclasses.field(default_factory=list)   # prompt chunks still to prefill
    begin: bool = False             # its slot starts canvas `canvas` on the next tick
    cached: int = 0                 # prompt tokens reused from the slot's row
    seq: int = 0                    # arrival order (set by `Planner.add`)
    saved: Any = None               # after a preemption: its cache row on the host, until restored
    saved_row: Any = None           # and the content keys of that row
    preemptions: int = 0
    walker: Any = None              # a structured request's: its grammar's walk over the canvas (engine/structured.py)
    complete: bool = False          # its canvas is wholly held (the walker's): it settles on the next tick, no step

    def work_left(self) -> int:
        """Canvases it may still run (`max_tokens` in canvases, less those done). Not its step budget:
        a canvas that settles early (most do) would make that a poor guess."""
        return self.n_canvases - self.canvas

    def at_boundary(self) -> bool:
        """Its prompt is in, its last canvas committed and the next one not begun."""
        return self.slot >= 0 and self.begin and not self.chunks and self.saved is None


class Drop(NamedTuple):
    """A waiting sequence whose client is gone: it ends ("cancelled") without a slot."""
    choice: Choice


class Preempt(NamedTuple):
    """Copy slot `slot`'s row to the host and put its sequence back in the queue."""
    slot: int
    choice: Choice


class Admit(NamedTuple):
    """Put `choice` into slot `slot`: restore its saved row (`restore`), or prefill its prompt from
    position `reuse` on (the row's first `reuse` tokens are its prompt's already)."""
    choice: Choice
    slot: int
    reuse: int
    restore: bool


class Planner:
    """The queue, which sequence holds which slot, and what each slot's cache row holds."""

    def __init__(self, slots: int, context: int, canvas_length: int, *, prefix_reuse: bool = True,
                 policy: str = "preempt", image_blocks=None, can_rewind=None):
        """image_blocks(ids) -> [(begin, end)]: a prompt's image spans (a prefix match never ends
        inside one); None when the model takes no images. can_rewind(row_length, keep) -> bool:
        whether a row can be cut back to its first `keep` tokens (`model.cache.rewind_ok`: a sliding
        layer's ring cache forgets what lies a window before its end); None: always."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.slots, self.context, self.canvas_length = int(slots), int(context), int(canvas_length)
        self.prefix_reuse, self.policy = bool(prefix_reuse), policy
        self.image_blocks, self.can_rewind = image_blocks, can_rewind
        self.queue: list[Choice] = []
        self.busy: list[Choice | None] = [None] * self.slots
        self.rows: list[np.ndarray] = [np.zeros((0,), np.int64) for _ in range(self.slots)]
        self.row_used = [0] * self.slots
        self.row_adapter = [0] * self.slots   # the LoRA adapter whose keys and values each row holds (0: the base)
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------ books
    def add(self, choices: Sequence[Choice]) -> None:
        for c in choices:
            c.seq = next(self._arrivals)
        self.queue.extend(choices)

    def running(self) -> int:
        return sum(c is not None for c in self.busy)

    def idle(self) -> bool:
        return not self.queue and not any(self.busy)

    def free(self, slot: int, tick: int) -> Choice | None:
        """Slot `slot`'s sequence ended: the slot is free (its row stays, for prefix reuse)."""
        c, self.busy[slot] = self.busy[slot], None
        self.row_used[slot] = tick + 1
        return c

    def keeps(self, slot: int) -> bool:
        """Slot `slot`'s last canvas goes into its row too (prefix reuse keeps the answer), when it fits."""
        return self.prefix_reuse and len(self.rows[slot]) + self.canvas_length <= self.context

    def _rank(self, c: Choice):
        if self.policy == "fcfs":
            return (c.request.priority, c.seq)
        return (c.request.priority, c.work_left(), c.seq)

    def _victim(self, waiting: Choice) -> int | None:
        """The slot to preempt for `waiting` (policy "preempt"): among the sequences at a canvas
        boundary that rank below it by priority, or by more than `PREEMPT_FACTOR` times its work
        left, the one with the highest priority value, then the most work left, then the latest."""
        if self.policy != "preempt":
            return None
        p, w = waiting.request.priority, waiting.work_left()
        cands = [s for s, c in enumerate(self.busy) if c is not None and c.at_boundary()
                 and (c.request.priority > p or (c.request.priority == p and c.work_left() > PREEMPT_FACTOR * w))]
        if not cands:
            return None
        return max(cands, key=lambda s: (self.busy[s].request.priority, self.busy[s].work_left(), self.busy[s].seq))

    # ------------------------------------------------------------------ decisions
    def plan(self, tick: int) -> list:
        """What to do before the next tick, in order: `Drop`s, `Preempt`s and `Admit`s; the books
        already say it is done (the slots' new holders, the queue without them, the preempted ones
        queued again). The caller carries each out in order and sets `Choice.saved` of each
        preempted sequence before the slot is written again."""
        out = []
        while self.queue:
            free = [s for s in range(self.slots) if self.busy[s] is None]
            i = min(range(len(self.queue)), key=lambda k: self._rank(self.queue[k]))
            first = self.queue[i]
            if first.request.cancelled.is_set():
                del self.queue[i]
                out.append(Drop(first))
                continue
            if not free:
                victim = self._victim(first)
                if victim is None:
                    break
                c = self.busy[victim]
                self.busy[victim] = None
                c.slot, c.preemptions = -1, c.preemptions + 1
                c.saved_row = self.rows[victim]
                self.queue.append(c)
                out.append(Preempt(victim, c))
                continue
            del self.queue[i]
            out.append(self._place(first, free, tick))
        return out

    def _place(self, choice: Choice, free: list[int], tick: int) -> Admit:
        req = choice.request
        if choice.saved_row is not None:   # a preempted sequence: its whole row comes back, anywhere
            slot = min(free, key=lambda s: self.row_used[s])
            self.rows[slot] = choice.saved_row
            choice.saved_row = None
            self._take(choice, slot, tick)
            return Admit(choice, slot, len(self.rows[slot]), True)
        ids = np.asarray(req.prompt_ids)
        slot, reuse = free[0], 0
        if self.prefix_reuse:
            blocks = self.image_blocks(ids) if (req.images is not None and self.image_blocks) else []
            adapter = getattr(req, "adapter", 0)
            shared = {s: self._reusable(s, req.content, len(ids), blocks) if self.row_adapter[s] == adapter else 0
                      for s in free}   # a row computed under another adapter holds other keys and values
            slot = max(free, key=lambda s: (shared[s], -self.row_used[s]))
            # a short shared beginning (a BOS, a chat header) of a long row is not worth that row:
            # the least recently used slot is overwritten instead
            if shared[slot] < SMALL_PREFILL and 2 * shared[slot] < len(self.rows[slot]):
                slot = min(free, key=lambda s: self.row_used[s])
            reuse = shared[slot]
        self.rows[slot] = self.rows[slot][:reuse]
        choice.cached, choice.admitted_tick = reuse, tick
        self._take(choice, slot, tick)
        return Admit(choice, slot, reuse, False)

    def _take(self, choice: Choice, slot: int, tick: int) -> None:
        choice.slot = slot
        self.row_adapter[slot] = getattr(choice.request, "adapter", 0)
        self.busy[slot] = choice
        self.row_used[slot] = tick + 1

    def _reusable(self, slot: int, content: np.ndarray, length: int, blocks) -> int:
        """How many of a prompt's first tokens slot `slot`'s row holds already: the common beginning of
        the row and the prompt's `content_keys`, at least one of its `length` tokens left to prefill,
        never ending inside one of its image `blocks`; 0 when the row cannot be cut back that far
        (`can_rewind`)."""
        m = min(common_prefix(self.rows[slot], content), length - 1)
        for b, e in blocks:
            if b < m < e:
                m = b
        if m > 0 and self.can_rewind is not None and not self.can_rewind(len(self.rows[slot]), m):
            return 0   # the row's sliding-layer rings no longer hold the window before that prefix's end
        return max(m, 0)
