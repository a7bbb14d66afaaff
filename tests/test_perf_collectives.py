"""Collectives read from programs the TPU compiler built (perf/collectives.py), their ICI price, and the
layer-scan loop counted once per group in both the collective and the HBM-traffic readers."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dgemma_jax.perf import collectives as coll
from dgemma_jax.perf.hbm_traffic import LAYER_LOOP_SCOPE, hbm_traffic

pytest.importorskip("libtpu")


@pytest.fixture(scope="module")
def mesh():
    from dgemma_jax.perf.aot import tpu_devices

    return Mesh(np.array(tpu_devices("v5e-8")).reshape(2, 4), ("a", "b"))


def _compiled_text(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _sds(shape, mesh, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def test_a_row_parallel_matmul_all_reduces_its_output_over_the_split_axis(mesh):
    # x [16, 1024] @ w [1024, 512] with the contracted axis split 4 ways: each chip holds a partial sum
    x = _sds((16, 1024), mesh, P(None, "b"))
    w = _sds((1024, 512), mesh, P("b", None))
    found = coll.collectives(_compiled_text(lambda x, w: x @ w, x, w), 8)
    reduces = [c for c in found if c["kind"] == "all-reduce"]
    assert reduces, found
    assert sum(c["bytes"] * c["count"] for c in reduces) == 16 * 512 * 2  # bf16 output, once
    assert {c["group"] for c in reduces} == {4}  # over "b" only, not all 8 chips


def test_an_all_gather_counts_its_output_and_its_group(mesh):
    x = _sds((64, 256), mesh, P(("a", "b"), None), jnp.float32)
    out = NamedSharding(mesh, P())
    text = jax.jit(lambda x: x * 2, out_shardings=out).lower(x).compile().as_text()
    found = coll.summary(coll.collectives(text, 8))
    assert found["all-gather"]["bytes"] == 64 * 256 * 4 and found["all-gather"]["count"] == 1


def test_the_layer_scan_counts_once_per_group_and_other_loops_once(mesh):
    w = _sds((5, 1024, 1024), mesh, P(None, ("a", "b"), None))
    x = _sds((16, 1024), mesh, P())

    def body(h, wi):
        return jnp.tanh(h @ wi), None

    def scanned(w, x):
        with jax.named_scope(LAYER_LOOP_SCOPE):
            return jax.lax.scan(body, x, w)[0]

    def other_loop(w, x):
        return jax.lax.scan(body, x, w)[0]

    per_layer = 1024 * 1024 * 2 / 8  # one layer's weight shard per chip
    for fn, runs in ((scanned, 5), (other_loop, 1)):
        text = _compiled_text(fn, w, x)
        reduces = [c for c in coll.collectives(text, 8) if c["kind"] == "all-reduce"]
        assert sum(c["count"] for c in reduces) == runs
        traffic = hbm_traffic(text)["total"]
        assert runs * per_layer <= traffic < runs * per_layer * 1.2, (fn.__name__, traffic)


def test_replica_group_spellings():
    assert coll.group_size("replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add", 8) == 4
    assert coll.group_size("replica_groups=[2,4]<=[8], to_apply=%add", 8) == 4
    assert coll.group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, x", 8) == 4
    assert coll.group_size("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, x", 8) == 8
    assert coll.group_size("replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) "
                           "{'axis_1'}, use_global_device_ids=true", 8) == 4
    assert coll.group_size("to_apply=%add", 8) == 8


def test_ring_prices():
    mb = 1e6
    # all-reduce: 2 (n-1)/n of the bytes over the ring, 2 (n-1) steps
    t = coll.ici_seconds([{"kind": "all-reduce", "bytes": mb, "group": 8, "count": 30}], 100e9, 1e-6)
    assert t["bandwidth_seconds"] == pytest.approx(30 * 2 * 7 / 8 * mb / 100e9)
    assert t["latency_seconds"] == pytest.approx(30 * 14 * 1e-6)
    assert t["seconds"] == pytest.approx(t["bandwidth_seconds"] + t["latency_seconds"])
    # one chip: nothing moves
    assert coll.ici_seconds([{"kind": "all-reduce", "bytes": mb, "group": 1, "count": 3}], 100e9)["seconds"] == 0
    with pytest.raises(ValueError, match="unknown collective kind"):
        coll.wire_bytes_and_steps("broadcast", 1.0, 4)


def test_the_aot_table_renders_each_report_with_its_collective_time():
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import aot_table
    finally:
        sys.path.pop(0)
    paths = [os.path.join(root, "benchmarks", "results", f"aot_26b_{w}_v6e-8{s}.json")
             for w, s in (("bf16", "_ici"), ("int8", ""))]
    reports = [json.load(open(p)) for p in paths]
    lines = aot_table.table(reports).splitlines()
    assert len(lines) == 2 + len(reports)
    for line, rep in zip(lines[2:], reports):
        cells = [c.strip() for c in line.strip("|").split("|")]
        step = rep["programs"]["denoise_step"]
        assert cells[0] == "v6e-8" and cells[1] == ("int8" if rep["quantize"] else "bfloat16")
        assert cells[6].startswith(f"{1e3 * step['ici']['seconds']:.2f}")
        assert float(cells[7]) == pytest.approx(1e3 * (step["projected_seconds"] + step["ici_seconds"]), abs=0.01)


def test_async_collectives_nested_in_custom_call_fusions_and_async_wrappers_count_once():
    """The forms the 26B step's HLO has: an all-reduce-start/-done pair inside a custom-call fusion's
    computation, a reduce-scatter in an async-start wrapper, an all-gather pair inside a fusion, a
    collective-permute pair at the top. Each counts once (the old reader found 2 of these 4)."""
    import os

    path = os.path.join(os.path.dirname(__file__), "data", "hlo_async_collectives.txt")
    found = coll.collectives(open(path).read(), 8)
    assert sorted((c["kind"], c["bytes"], c["group"], c["count"]) for c in found) == [
        ("all-gather", 8 * 512 * 2, 4, 1), ("all-reduce", 8 * 512 * 2, 4, 1),
        ("collective-permute", 8 * 512 * 2, 2, 1), ("reduce-scatter", 8 * 512 * 2, 4, 1)]
    assert coll.summary(found)["all-reduce"]["count"] == 1


def test_an_op_the_compiler_inserted_takes_the_scope_of_the_loop_that_holds_it():
    """A copy without source metadata (the compiler's own) counts under the scope of the while loop
    whose body holds it, so a projection that splits a program by scope (the serving tick's commit
    loop) charges it to that loop; at the top level it keeps its op kind."""
    text = "\n".join([
        "%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {",
        "  %p = (s32[], f32[1024]) parameter(0)",
        "  %i = s32[] get-tuple-element(%p), index=0",
        "  %x = f32[1024] get-tuple-element(%p), index=1",
        "  %c = f32[1024] copy(%x)",
        "  ROOT %t = (s32[], f32[1024]) tuple(%i, %c)",
        "}",
        "%cond (q: (s32[], f32[1024])) -> pred[] {",
        "  %q = (s32[], f32[1024]) parameter(0)",
        "  ROOT %r = pred[] constant(true)",
        "}",
        "ENTRY %main (a: f32[1024]) -> (s32[], f32[1024]) {",
        "  %a = f32[1024] parameter(0)",
        "  %top = f32[1024] copy(%a)",
        "  %z = s32[] constant(0)",
        "  %init = (s32[], f32[1024]) tuple(%z, %top)",
        '  ROOT %w = (s32[], f32[1024]) while(%init), condition=%cond, body=%body, '
        'metadata={op_name="jit(tick)/slot_commit/while"}',
        "}",
    ])
    scopes = hbm_traffic(text)["by_scope"]
    assert scopes == {"slot_commit/while/copy": 8192.0, "copy": 8192.0}
