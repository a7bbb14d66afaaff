"""Sharding rules are checked when they are built and used, rules come from files and ml_collections
entries as well as by name, and meshes follow the topology (hybrid ICI x DCN across slices)."""

import ast
import dataclasses
import json
import os

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from dgemma_jax import ModelConfig, Runtime
from dgemma_jax.config import VisionConfig
from dgemma_jax.model import layout
from dgemma_jax.model.api import logical_axes
from dgemma_jax.parallel import Shardings, make_mesh
from dgemma_jax.parallel.mesh import device_array, mesh_sizes, parse_mesh
from dgemma_jax.axis_rules import (ACTIVATION_AXES, CACHE_AXES, LOGICAL_AXES, MESH_AXES, RULE_SETS, check_rules,
                                       rules_for)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = ModelConfig.preset("tiny-6layer", num_heads=8, num_kv_heads=4, num_global_kv_heads=2)
needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


# ------------------------------------------------------------------ the logical names are the model's
def _names_in_calls(path: str) -> set[str]:
    """String constants in the logical-axis tuples the code passes to constrain / spec_for / named."""
    tree = ast.parse(open(path).read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if fn in ("constrain", "_constrain", "spec_for", "named"):
                for arg in node.args:
                    if isinstance(arg, ast.Tuple):
                        out |= {e.value for e in arg.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return out


def model_logical_names() -> set[str]:
    """Every logical axis name the code uses: the parameters' (a MoE model with a vision tower), the
    stacked layers', the cache's, the activations' and those written into placement calls."""
    vision = VisionConfig(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                          head_dim=8, standardize=True)
    cfg = CFG.replace(vision=vision, image_token_id=5, boi_token_id=6, eoi_token_id=7)
    names = {n for spec in jax.tree.leaves(logical_axes(cfg), is_leaf=lambda x: isinstance(x, P)) for n in spec}
    names |= {layout.LAYER_AXIS, *CACHE_AXES, *ACTIVATION_AXES}
    for sub in ("model", "sampling", "parallel", "engine", "serving", "training", "perf"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, "dgemma_jax", sub)):
            names |= set().union(*(_names_in_calls(os.path.join(dirpath, f)) for f in files if f.endswith(".py")))
    names |= _names_in_calls(os.path.join(ROOT, "dgemma_jax", "runtime.py"))
    return names - {None}


def test_the_known_logical_axes_are_exactly_the_models():
    assert set(LOGICAL_AXES) == model_logical_names()
    for name, rules in RULE_SETS.items():  # the built-in sets name only known axes and mesh axes
        assert check_rules(rules) == rules, name


# ------------------------------------------------------------------ typos are errors naming them
@needs_8
def test_a_typo_in_a_rule_or_a_mesh_axis_is_an_error_naming_it():
    mesh = make_mesh("tensor=8")
    good = dict(rules_for("latency"))
    # before: the typo'd rule was ignored and the query heads silently replicated
    with pytest.raises(ValueError, match=r"unknown logical axis 'heds' \(did you mean 'heads'\?\); the logical axes "
                                         r"are batch, seq, embed"):
        Shardings(CFG, mesh, {**{k: v for k, v in good.items() if k != "heads"}, "heds": ("tensor", "expert")})
    with pytest.raises(ValueError, match=r"rule for 'heads' names unknown mesh axis 'tensr' \(did you mean 'tensor'\?\)"
                                         r"; the mesh axes are data, fsdp, tensor, expert"):
        Shardings(CFG, mesh, {**good, "heads": ["tensr", "expert"]})
    with pytest.raises(ValueError, match=r"Runtime.rules: the rule for 'batch' names unknown mesh axis 'dat'"):
        Runtime(mesh=mesh, rules=[("batch", "dat")])
    with pytest.raises(ValueError, match=r"Runtime.rules: unknown logical axis 'batchh'"):
        Runtime(rules={"batchh": "data"})
    with pytest.raises(ValueError, match=r"logical axis 'batch' has two rules"):
        check_rules([("batch", "data"), ("batch", "fsdp")])
    with pytest.raises(ValueError, match=r"'layers' is always replicated"):
        check_rules({"layers": "data"})
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tensr' \(did you mean 'tensor'\?\)"):
        make_mesh("tensr=8")
    with pytest.raises(ValueError, match=r"unknown mesh axis 'dcn_dta' \(did you mean 'dcn_data'\?\)"):
        make_mesh("tensor=8,dcn_dta=1")
    with pytest.raises(ValueError, match=r"unknown sharding rule set 'latncy' \(did you mean 'latency'\?\)"):
        rules_for("latncy")
    # a mesh of other axis names: its own axes are valid in rules, others are not
    other = Mesh(np.array(jax.devices()).reshape(2, 4), ("rows", "cols"))
    sh = Shardings(CFG, other, {"heads": "cols", "batch": "rows"})
    assert sh.params["blocks_0"]["attn"]["q"].spec == P(None, "cols", None)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'col' \(did you mean 'cols'\?\); the mesh axes are data, "
                                         r"fsdp, tensor, expert, rows, cols"):
        Shardings(CFG, other, {"heads": "col"})
    # a mesh axis that does not divide a dimension still drops out (by design), and a size-1 one too
    sh = Shardings(CFG, make_mesh("tensor=8"), "latency")
    assert sh.params["blocks_0"]["attn"]["k"].spec == P(None, None, None)  # 4 kv heads over tensor=8
    assert sh.params["blocks_0"]["attn"]["q"].spec == P(None, "tensor", None)


# ------------------------------------------------------------------ rules files and ml_collections entries
def _as_json(rules) -> dict:
    return {name: (list(t) if isinstance(t, tuple) else t) for name, t in rules}


@needs_8
def test_a_rules_file_or_mapping_is_accepted_beside_the_built_in_sets(tmp_path):
    mesh = make_mesh("expert=2,tensor=4")
    same = tmp_path / "latency.json"
    same.write_text(json.dumps(_as_json(RULE_SETS["latency"]), indent=1))
    assert rules_for(str(same)) == RULE_SETS["latency"]
    assert Shardings(CFG, mesh, str(same)).params == Shardings(CFG, mesh, "latency").params
    # a different rule set from a file: the experts whole on tensor only, the vocabulary replicated
    own = tmp_path / "own.json"
    own.write_text(json.dumps({"batch": "data", "experts": "tensor", "heads": ["tensor", "expert"], "vocab": None}))
    sh = Shardings(CFG, mesh, str(own))
    assert sh.rules_name == str(own)
    assert sh.params["blocks_0"]["moe"]["gate_up"].spec == P("tensor", None, None)
    assert sh.params["embedding"].spec == P(None, None)
    assert sh.params["blocks_0"]["attn"]["q"].spec == P(None, ("tensor", "expert"), None)
    # an ml_collections entry (a recipe's train.rules) and its to_dict() as the trainer reads it
    entry = ml_collections.ConfigDict({"batch": ("data", "fsdp"), "experts": "expert", "embed": "fsdp"})
    assert dict(check_rules(entry)) == dict(check_rules(entry.to_dict())) == {
        "batch": ("data", "fsdp"), "experts": "expert", "embed": "fsdp"}
    assert Shardings(CFG, mesh, entry).params["blocks_0"]["moe"]["gate_up"].spec == P("expert", None, None)
    # errors name the file and the fix
    with pytest.raises(ValueError, match=r"rules file '.*missing.json' does not exist"):
        rules_for(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"batch": "data",}')
    with pytest.raises(ValueError, match=r"rules file '.*bad.json' is not valid JSON: .*line 1"):
        rules_for(str(bad))
    bad.write_text('[["batch", "data"]]')
    with pytest.raises(ValueError, match=r"rules file '.*bad.json' must hold a JSON object .* it holds a list"):
        rules_for(str(bad))
    bad.write_text('{"batch": 2}')
    with pytest.raises(ValueError, match=r"rules file '.*bad.json': the rule for 'batch' must be a mesh axis, a list "
                                         r"of mesh axes or null"):
        rules_for(str(bad))
    bad.write_text('{"embedd": "fsdp"}')
    with pytest.raises(ValueError, match=r"rules file '.*bad.json': unknown logical axis 'embedd' \(did you mean "
                                         r"'embed'\?\)"):
        rules_for(str(bad))


# ------------------------------------------------------------------ meshes on the topology
@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """What mesh_utils reads of a TPU device."""

    id: int
    slice_index: int
    coords: tuple
    device_kind: str = "TPU v5 lite"
    platform: str = "tpu"
    core_on_chip: int = 0
    process_index: int = 0


def two_slices(kind: str, bounds: tuple) -> list:
    """Two slices of chips at every coordinate in `bounds` (x fastest), ids slice * 100 + index, listed
    slice 1 first: the mesh must not depend on the order it is given the devices in."""
    out = []
    for s in (1, 0):
        coords = [(x, y, z) for z in range(bounds[2]) for y in range(bounds[1]) for x in range(bounds[0])]
        out += [FakeTpu(s * 100 + i, s, c, kind, process_index=s) for i, c in enumerate(coords)]
    return out


def test_the_hybrid_mesh_of_two_slices_puts_the_slices_outermost_and_each_slice_on_its_torus():
    # two v5e-8 slices (2x4 chips each); 8-way expert parallel in a slice, the slices 2-way data
    devs = two_slices("TPU v5 lite", (2, 4, 1))
    assert mesh_sizes("expert=8", 16, 2) == ({"data": 1, "fsdp": 1, "tensor": 1, "expert": 8},
                                             {"data": 2, "fsdp": 1, "tensor": 1, "expert": 1})
    arr = device_array("expert=8", devs)
    assert arr.shape == (2, 1, 1, 8)
    # each slice's chips in the v5e tray's ring order: (0,0) (1,0) (0,1) (1,1) (1,3) (0,3) (1,2) (0,2)
    ring = [0, 1, 2, 3, 7, 6, 5, 4]
    assert [[d.id for d in row] for row in arr[:, 0, 0, :]] == [ring, [100 + i for i in ring]]
    # a plain reshape of the list (the old make_mesh) gives neither the slice order nor the ring
    assert [d.id for d in np.asarray(devs).reshape(2, 8)[0]] == list(range(100, 108))

    # two v4 2x2x2 slices (no handler: the general torus assignment), the slices on the expert axis
    devs = two_slices("TPU v4", (2, 2, 2))
    arr = device_array("tensor=4,expert=2,dcn_expert=2", devs)
    assert arr.shape == (1, 1, 4, 4) and parse_mesh("tensor=4,expert=2,dcn_expert=2", 16, 2) == {
        "data": 1, "fsdp": 1, "tensor": 4, "expert": 4}
    # the busiest axis (expert, the last) takes one physical axis (x), tensor the y-z plane (index y * 2 + z),
    # and the slices are the outer factor of expert: expert index = slice * 2 + x
    ids = [[d.id for d in row] for row in arr[0, 0]]
    assert ids == [[0, 1, 100, 101], [4, 5, 104, 105], [2, 3, 102, 103], [6, 7, 106, 107]]
    for t in range(4):
        for e in range(4):
            d = arr[0, 0, t, e]
            assert (d.slice_index, d.coords[0]) == divmod(e, 2) and d.coords[1] * 2 + d.coords[2] == t

    with pytest.raises(ValueError, match=r"mesh expert=16 uses 16 devices per slice, which does not divide the 8 "
                                         r"there are \(across the 2 slices: dcn_AXIS=N, e.g. dcn_data=2\)"):
        device_array("expert=16", two_slices("TPU v5 lite", (2, 4, 1)))
    with pytest.raises(ValueError, match=r"splits slices \(dcn_AXIS=N\) but the devices are on one slice"):
        device_array("expert=8,dcn_data=2", two_slices("TPU v5 lite", (2, 4, 1))[8:])
    with pytest.raises(ValueError, match=r"different device counts \[7, 8\]"):
        device_array("expert=8", two_slices("TPU v5 lite", (2, 4, 1))[:-1])


def test_a_real_two_slice_topology_builds_the_hybrid_mesh():
    """The same on the TPU compiler's own description of two v5e-8 slices (compile-only devices)."""
    pytest.importorskip("libtpu")
    from jax.experimental import topologies

    from dgemma_jax.perf import aot

    topo = aot.topology("v5e-8")
    with aot.quiet_libtpu_load():
        devs = topologies.get_topology_desc(platform="tpu", topology_name=topo.name, chip_config_name=topo.chip_config,
                                            chips_per_host_bounds=topo.host_bounds, num_slices=2,
                                            wrap=(False, False, False)).devices
    mesh = make_mesh("expert=8", devs)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 1, "expert": 8}
    rows = [[(d.slice_index, tuple(d.coords[:2])) for d in row] for row in mesh.devices[:, 0, 0, :]]
    ring = [(0, 0), (1, 0), (0, 1), (1, 1), (1, 3), (0, 3), (1, 2), (0, 2)]
    assert rows == [[(0, c) for c in ring], [(1, c) for c in ring]]


@needs_8
def test_meshes_by_name_or_axis_list_on_the_cpu_devices():
    devs = jax.devices()[:8]
    assert dict(make_mesh("expert", devs).shape) == {"data": 1, "fsdp": 1, "tensor": 1, "expert": 8}
    assert dict(make_mesh("tensor=2,expert", devs).shape) == {"data": 1, "fsdp": 1, "tensor": 2, "expert": 4}
    assert dict(make_mesh({"fsdp": 4}, devs).shape) == {"data": 2, "fsdp": 4, "tensor": 1, "expert": 1}
    # CPU devices have no torus: jax.devices()'s order, as before
    assert [d.id for d in make_mesh("tensor=4,expert=2", devs).devices.flat] == [d.id for d in devs]
    with pytest.raises(ValueError, match=r"only one axis can take the rest"):
        make_mesh("tensor,expert", devs)
    assert MESH_AXES == ("data", "fsdp", "tensor", "expert")


@needs_8
def test_a_recipe_takes_its_rules_from_an_ml_collections_entry(tmp_path):
    from dgemma_jax.training.train import Run, load_config

    recipe = os.path.join(ROOT, "configs", "train_tiny.py")
    over = {"train.workdir": str(tmp_path), "train.mesh": "fsdp=2,expert=4",
            "train.rules": {"batch": ["data", "fsdp"], "experts": "expert", "embed": "fsdp"}}  # as --set parses it
    config = load_config(recipe, over)
    assert isinstance(config.train.rules, ml_collections.ConfigDict)
    run = Run(config)
    want = {"batch": ("data", "fsdp"), "experts": "expert", "embed": "fsdp"}
    assert dict(run.shardings.rules) == dict(run.runtime.rules) == want
    assert run.shardings.params["blocks_0"]["moe"]["gate_up"].spec == P("expert", "fsdp", None)
    with pytest.raises(ValueError, match=r"rule for 'experts' names unknown mesh axis 'experts' \(did you mean "
                                         r"'expert'\?\)"):
        Run(load_config(recipe, {**over, "train.rules": {"experts": "experts"}}))
