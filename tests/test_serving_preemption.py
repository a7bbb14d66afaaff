"""Scheduling under overload (issue 45): with every slot busy with long requests, a short one takes the
slot of a long one at a canvas boundary (its cache row kept in host memory and restored later), and
the preempted request's tokens equal its tokens alone. Through the official `openai` client against a
real server with the bundled model (2 slots, 4 long requests: 2x slots)."""

import concurrent.futures as cf
import statistics
import time

import httpx
import numpy as np

from tests.helpers.serve import module_server

MODEL = "dgemma-tiny-digits"
# every canvas runs exactly 8 steps (never confident before its budget); the answers take 3 canvases
LONG = dict(max_denoising_steps=8, confidence_threshold=0.0)
SHORT_PROMPT = "s705182936="

server = module_server("--slots", "2", "--max-steps", "64")


def _long_prompts(n):
    rng = np.random.default_rng(7)
    return ["s" + "".join(map(str, rng.integers(0, 10, 40))) + "=" for _ in range(n)]


def _metric(server, name):
    for line in httpx.get(server.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _short(client):
    t0 = time.perf_counter()
    r = client.completions.create(model=MODEL, prompt=SHORT_PROMPT, seed=4, max_tokens=8)
    return time.perf_counter() - t0, r


def _long(client, prompt, seed=10):
    """A long request: one prompt, or a list of them (queued all at once, each with the seed's stream)."""
    return client.completions.create(model=MODEL, prompt=prompt, seed=seed, max_tokens=48, extra_body=LONG)


class _Longs:
    """Long prompts (the first n of one fixed stream) and each one's response alone on one server
    (computed once each)."""

    def __init__(self, server):
        self.client = server.client(timeout=300)
        self._alone = {}

    def prompts(self, n=4):
        return _long_prompts(n)

    def alone(self, n=4):
        for p in self.prompts(n):
            if p not in self._alone:
                self._alone[p] = _long(self.client, p)
        return [self._alone[p] for p in self.prompts(n)]

    def alone_texts(self, n=4):
        return [r.choices[0].text for r in self.alone(n)]


def _behind(server, client, longs: _Longs, tries=3):
    """The long requests at once and, once two of them run and the others wait, the short one: (its
    time, its response, the long ones' texts, how many). The window to catch is the time long
    requests wait: on a loaded machine the client can miss it (the server ran them all before the
    client saw two waiting; each is only 3 canvases), so each round that missed it queues twice as
    many (their texts alone are computed first, on the reference server)."""
    n = 4
    for _ in range(tries):
        longs.alone(n)   # the reference texts first: not inside the window
        with cf.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_long, client, longs.prompts(n))   # one request: its sequences queue at once
            while server.health()["queued"] < 2 and not running.done():
                time.sleep(0.005)
            if not running.done():
                t, short = _short(client)
                texts = [c.text for c in sorted(running.result().choices, key=lambda c: c.index)]
                return t, short, texts, n
            running.result()   # a failed request fails here, not as a missed window
        n *= 2
    raise AssertionError(f"in {tries} rounds (up to {n // 2} long requests) the long requests never held both "
                         "slots with two waiting")


def test_a_short_request_behind_2x_slots_of_long_ones_finishes_within_3x_its_time_alone(server):
    """The short request's time alone and behind four long requests (two running, two queued) are
    measured in the same test on the same server, so the machine's load cancels out; first come,
    first served it waited for two long requests to end first (12-14x in the issue). Each long
    request's tokens equal its tokens alone although it was preempted."""
    client = server.client(timeout=300)
    longs = _Longs(server)
    assert all(r.usage.model_extra["canvases"] == 3 for r in longs.alone())   # 3 canvases of 8 steps; warms every path
    alone = sorted(_short(client)[0] for _ in range(5))
    t_alone = statistics.median(alone)
    preempted_before = _metric(server, "vllm:num_preemptions_total")
    ratios = []
    # a long request is preempted when the short one meets it at the end of its first canvas (with 2
    # canvases left it is not: PREEMPT_FACTOR); in a round where the short one comes later it takes
    # the slot of the first long one to end instead
    # the short one must be waiting when a long one ends its first canvas (a window of 8 ticks): a loaded
    # machine can miss it in a round (seen in a two-worker run: two rounds, no preemption), so up to five
    for _ in range(5):   # the better round counts; the loop ends once both claims hold
        t_behind, short, behind_long, n = _behind(server, client, longs)
        assert short.choices[0].text == "01235678"
        ratios.append(t_behind / t_alone)
        assert behind_long == longs.alone_texts(n)
        if min(ratios) < 3.0 and _metric(server, "vllm:num_preemptions_total") >= preempted_before + 1:
            break   # both claims below already hold: a second round would assert them again
    assert min(ratios) < 3.0, (ratios, t_alone, alone)
    assert _metric(server, "vllm:num_preemptions_total") >= preempted_before + 1


fcfs_server = module_server("--slots", "2", "--max-steps", "64", "--schedule", "fcfs")


def test_first_come_first_served_never_preempts_and_gives_the_same_tokens(server, fcfs_server):
    """`--schedule fcfs`: the short request waits for the long ones (nobody preempted), and every
    request's tokens equal the preemptive server's."""
    longs = _Longs(server)   # the preemptive server's texts alone
    shorts = []
    for srv in (server, fcfs_server):
        _, short, behind_long, n = _behind(srv, srv.client(timeout=300), longs)
        shorts.append(short.choices[0].text)
        assert behind_long == longs.alone_texts(n)
    assert shorts[0] == shorts[1]
    assert _metric(fcfs_server, "vllm:num_preemptions_total") == 0
    assert fcfs_server.health()["policy"] == "fcfs"
