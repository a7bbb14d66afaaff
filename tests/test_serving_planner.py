"""The scheduler's planner (serving/planner.py) on its own: no device, no thread, no clock. Which
waiting sequence takes which slot, and when a running one is preempted, under each policy."""

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from dgemma_jax.serving.planner import PREEMPT_FACTOR, Admit, Choice, Drop, Planner, Preempt


def _choice(n_canvases, priority=0, prompt=(2, 5, 6, 7)):
    ids = np.asarray(prompt, np.int64)
    req = SimpleNamespace(priority=priority, cancelled=threading.Event(), prompt_ids=ids, images=None, content=ids)
    return Choice(req, 0, np.zeros(2, np.uint32), n_canvases)


def _running(planner, *choices, canvas=0):
    """Admit `choices` into the planner's slots, prompts in, each at a canvas boundary after `canvas` canvases."""
    planner.add(choices)
    for d in planner.plan(0):
        assert isinstance(d, Admit) and not d.restore
        d.choice.canvas, d.choice.begin = canvas, True
        planner.rows[d.slot] = np.asarray(d.choice.request.content)


def test_a_short_request_preempts_a_long_one_at_a_canvas_boundary_and_its_row_comes_back():
    p = Planner(2, 64, 8)
    a, b = _choice(6), _choice(5)
    _running(p, a, b)
    short, slot = _choice(1), a.slot
    p.add([short])
    d = p.plan(1)
    # the victim: the most work left (a); the short one takes its slot; a waits with its row's keys
    assert [type(x) for x in d] == [Preempt, Admit]
    assert d[0].slot == slot and d[0].choice is a and d[1].choice is short and d[1].slot == slot
    assert not d[1].restore
    assert a.slot == -1 and a.preemptions == 1 and p.queue == [a]
    assert list(a.saved_row) == [2, 5, 6, 7]
    short.begin = True
    assert p.plan(2) == []                       # a never preempts a one-canvas request back
    p.free(slot, 3)
    (d,) = p.plan(4)
    assert (d.choice, d.slot, d.reuse, d.restore) == (a, slot, 4, True)
    assert a.saved_row is None and p.busy[slot] is a and b.slot == 1 - slot


def test_a_long_request_mid_canvas_or_with_little_work_left_keeps_its_slot():
    p = Planner(1, 64, 8)
    long = _choice(3)
    _running(p, long)
    long.begin = False                          # mid-canvas: never preempted there
    p.add([_choice(1)])
    assert p.plan(1) == []
    long.begin, long.canvas = True, 3 - PREEMPT_FACTOR   # at a boundary, but only PREEMPT_FACTOR x the work left
    assert p.plan(2) == []
    long.canvas = 3 - PREEMPT_FACTOR - 1
    assert [type(x) for x in p.plan(3)] == [Preempt, Admit]


def test_priority_preempts_whatever_the_work_and_a_lower_priority_never_does():
    p = Planner(1, 64, 8)
    low = _choice(1, priority=5)
    _running(p, low)
    p.add([_choice(9, priority=5), _choice(9, priority=7)])
    assert p.plan(1) == []                       # more work or a higher value: no preemption
    urgent = _choice(9, priority=-1)
    p.add([urgent])
    d = p.plan(2)
    assert d[0].choice is low and d[1].choice is urgent
    # the freed slot then goes by priority first: the preempted one (5) before the one of 7
    urgent.begin = True
    p.free(0, 3)
    assert p.plan(4)[0].choice is low


def test_first_come_first_served_never_preempts_and_admits_by_priority_then_arrival():
    p = Planner(1, 64, 8, policy="fcfs")
    long = _choice(9)
    _running(p, long)
    waiting = [_choice(1, priority=1), _choice(1, priority=-3), _choice(9, priority=0), _choice(1, priority=0)]
    p.add(waiting)
    assert p.plan(1) == []
    order = []
    for t in range(4):
        p.free(0, t)
        (d,) = p.plan(t)
        order.append(waiting.index(d.choice))
    assert order == [1, 2, 3, 0]


def test_a_cancelled_waiting_sequence_is_dropped_and_a_bad_policy_is_refused():
    p = Planner(1, 64, 8)
    _running(p, _choice(3))
    gone = _choice(1)
    gone.request.cancelled.set()
    p.add([gone])
    (d,) = p.plan(1)
    assert isinstance(d, Drop) and d.choice is gone and p.queue == []
    with pytest.raises(ValueError, match="policy must be one of preempt, fcfs; got 'lifo'"):
        Planner(1, 64, 8, policy="lifo")


@pytest.mark.parametrize("rewindable", [True, False])
def test_a_prefix_is_reused_only_where_the_row_can_be_cut_back_to_it(rewindable):
    """Prefix reuse asks `can_rewind(row_length, keep)` (the ring cache's `rewind_ok`): a row whose
    sliding-layer rings no longer hold the window before the shared prefix is prefilled again."""
    asked = []

    def can_rewind(row, keep):
        asked.append((row, keep))
        return rewindable

    p = Planner(1, 64, 8, can_rewind=can_rewind)
    first = _choice(1, prompt=(2, 5, 6, 7, 8, 9))
    _running(p, first)
    p.free(first.slot, 1)
    p.add([_choice(1, prompt=(2, 5, 6, 7, 3))])
    (d,) = p.plan(2)
    assert asked == [(6, 4)]
    assert d.reuse == (4 if rewindable else 0) and not d.restore


def test_a_prefix_is_reused_only_from_a_row_computed_under_the_same_adapter():
    """A slot's row holds keys and values of the LoRA adapter that computed it: a request under another
    adapter (or the base) shares none of it, however equal the tokens."""
    p = Planner(1, 64, 8)
    first = _choice(1, prompt=(2, 5, 6, 7, 8, 9))
    first.request.adapter = 2
    _running(p, first)
    assert p.row_adapter == [2]
    p.free(first.slot, 1)
    for adapter, reuse in ((0, 0), (2, 4)):
        nxt = _choice(1, prompt=(2, 5, 6, 7, 3))
        nxt.request.adapter = adapter
        p.add([nxt])
        (d,) = p.plan(2)
        assert d.reuse == reuse and p.row_adapter == [adapter]
        p.rows[d.slot] = np.asarray((2, 5, 6, 7, 8, 9))
        p.row_adapter[d.slot] = 2
        p.free(d.slot, 3)
