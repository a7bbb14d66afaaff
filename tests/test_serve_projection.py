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
