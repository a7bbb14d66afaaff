"""The serving projection (benchmarks/serve_projection.py) counts the commit rows the tick really runs, and
docs/serving.md's tables are its committed results."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import serve_projection  # noqa: E402

MESH = {"data": 2, "fsdp": 1, "tensor": 1, "expert": 4}


def test_a_commit_pass_takes_commit_rows_of_every_slot_group():
    # one group (expert-parallel only): commit_rows(N); two data groups: commit_rows(N / 2) of each
    one = {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8}
    assert serve_projection.commit_k({"batch": 8, "mesh": one, "rules": "latency"}) == 1
    assert serve_projection.commit_k({"batch": 32, "mesh": one, "rules": "latency"}) == 4
    assert serve_projection.commit_k({"batch": 8, "mesh": MESH, "rules": "serving"}) == 2
    assert serve_projection.commit_k({"batch": 32, "mesh": MESH, "rules": "serving"}) == 4
    assert serve_projection.commit_k({"batch": 64, "mesh": MESH, "rules": "serving"}) == 8
    # rows over every chip (the throughput rules): eight groups of commit_rows(N / 8)
    assert serve_projection.commit_k({"batch": 32, "mesh": MESH, "rules": "throughput"}) == 8
    assert serve_projection.commit_k({"batch": 128, "mesh": MESH, "rules": "throughput"}) == 16


def test_the_serving_docs_tables_are_the_committed_projections():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "serving.md")) as f:
        doc = f.read()
    for name in ("serve_projection_v6e-8_throughput.json", "serve_projection_v6e-8.json"):
        with open(os.path.join(root, "benchmarks", "results", name)) as f:
            rows = json.load(f)
        table = serve_projection.markdown_rows(rows)
        assert table.count("\n") >= 3 and table in doc, (name, table)


def test_commit_passes_of_canvases_settling_at_independent_times():
    """`commit_passes_per_tick` against a simulation of the committing ticks `slots.slot_tick` runs (ceil of the most
    canvases settled in one group over commit_rows of a group), each slot settling a canvas in a tick with
    probability 1 / S: exact for one slot; for many slots far above the C / S of slots in step (the same
    where a pass commits one row of a single group)."""
    import numpy as np
    from dgemma_jax.sampling.slots import commit_rows

    assert serve_projection.commit_passes_per_tick(1, 1, 16) == 1 / 16
    assert abs(serve_projection.commit_passes_per_tick(2, 1, 2) - 1.0) < 1e-12   # 0 1 2 settled: 1/4 1/2 1/4
    rng = np.random.default_rng(0)
    for slots, groups, steps in ((32, 8, 16), (32, 2, 16), (64, 8, 16), (8, 8, 16), (8, 1, 32)):
        per, k = slots // groups, commit_rows(slots // groups)
        settled = rng.random((200_000, groups, per)) < 1 / steps
        simulated = np.ceil(settled.sum(-1).max(-1) / k).mean()
        got = serve_projection.commit_passes_per_tick(slots, groups, steps)
        assert abs(got - simulated) < 0.01, (slots, groups, steps, got, simulated)
        in_step = -(-slots // (groups * k)) / steps          # C = ceil(N / K) passes per S ticks
        if groups == 1 and k == 1:   # one row a pass, one group: a pass per settled canvas either way
            assert abs(got - in_step) < 1e-12
        else:
            assert got > 2 * in_step
