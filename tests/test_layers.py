"""The package's import graph runs one way: each module imports only from its own layer or below.

Layers, low to high (a module's layer is the first pattern that matches its dotted name):
errors/backends/config/paths/compile_cache < the logical-axis rules and the runtime < the model <
parallel (meshes, multi-host, and the shardings that place a model's parameters and cache on a mesh) <
sampling < the engine < io < training < chat_session < pipeline < serving, the perf reports and the
CLI's runners < the CLI and the package root. Every `from dgemma_jax... import` counts, at module level or inside a function.

`sampling/` holds traceable code only: a host driver over the compiled programs (a generator, a read of a
device value into the host) is the engine's (`test_sampling_holds_traceable_code_only`).

Imports sit at the top of their module: one inside a function defers a heavy or optional dependency
on purpose and says why in a comment (`test_no_imports_inside_functions_without_a_reason`).
"""

import ast
import io
import os
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "dgemma_jax")

LAYERS = [
    ("dgemma_jax.errors", "dgemma_jax.backends", "dgemma_jax.config", "dgemma_jax.paths", "dgemma_jax.compile_cache",
     "dgemma_jax.progress"),
    ("dgemma_jax.axis_rules", "dgemma_jax.runtime"),
    ("dgemma_jax.model",),
    ("dgemma_jax.parallel",),
    ("dgemma_jax.sampling",),
    ("dgemma_jax.engine",),
    ("dgemma_jax.io",),
    ("dgemma_jax.training",),
    ("dgemma_jax.chat_session",),
    ("dgemma_jax.pipeline",),
    ("dgemma_jax.serving", "dgemma_jax.perf", "dgemma_jax.cli_run"),
    ("dgemma_jax.cli",),
]
PACKAGE_ROOT = len(LAYERS) - 1  # `dgemma_jax` itself (its __init__), not every module under it


def layer_of(module: str) -> int:
    if module == "dgemma_jax":
        return PACKAGE_ROOT
    best, best_len = None, -1
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best_len:
                best, best_len = i, len(n)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best


def _modules():
    for dirpath, _, names in os.walk(PACKAGE):
        for n in names:
            if n.endswith(".py"):
                path = os.path.join(dirpath, n)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                yield (rel[: -len(".__init__")] if rel.endswith(".__init__") else rel), path


def _nodes(tree):
    """Every node of the tree, except what sits under `if TYPE_CHECKING:` (imports for annotations only,
    never run)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _imports(path: str, module_name: str | None = None):
    """(module imported, line) of every package import in the file of module `module_name` (default:
    read from the path); relative imports resolved against it."""
    tree = ast.parse(open(path).read(), path)
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".") if module_name is None else module_name
    is_package = path.endswith("__init__.py")
    rel = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
    package = rel if is_package else rel.rsplit(".", 1)[0]
    for node in _nodes(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module if isinstance(node, ast.ImportFrom) else None
        if isinstance(node, ast.ImportFrom) and module and module.split(".")[0] == "dgemma_jax":
            for alias in node.names:  # `from dgemma_jax.x import y` may name a submodule y
                sub = f"{module}.{alias.name}"
                yield sub if any(sub == m for m, _ in MODULES) else module, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dgemma_jax":
                    yield alias.name, node.lineno


MODULES = list(_modules())


def test_no_import_runs_from_a_lower_layer_to_a_higher_one():
    bad = []
    for module, path in MODULES:
        mine = layer_of(module)
        for target, line in _imports(path):
            if layer_of(target) > mine:
                bad.append(f"{os.path.relpath(path, ROOT)}:{line} imports {target} "
                           f"(layer {layer_of(target)} over its own {mine})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_parallel_is_one_floor_above_the_model():
    """Every module of `dgemma_jax.parallel` sits on one floor, above the model (placement of its
    parameters and cache); what the model and the runtime read about axes (`axis_rules`) sits below
    them, so nothing under the model imports from `parallel`."""
    parallel = {layer_of(m) for m, _ in MODULES if m == "dgemma_jax.parallel" or m.startswith("dgemma_jax.parallel.")}
    assert parallel == {layer_of("dgemma_jax.parallel")}, parallel
    assert layer_of("dgemma_jax.parallel") == layer_of("dgemma_jax.model") + 1
    low = [f"{m} imports {t}" for m, p in MODULES if layer_of(m) <= layer_of("dgemma_jax.model")
           for t, _ in _imports(p) if t == "dgemma_jax.parallel" or t.startswith("dgemma_jax.parallel.")]
    assert not low, low


def _layout_decisions(path: str) -> list[str]:
    """Where a module decides the layer layout itself: a comparison of a `layers` / `layout` value with
    "auto", or a read of the per-platform / per-entry tables."""
    found = []
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Compare):
            sides = [node.left] + list(node.comparators)
            named = any("layer" in ast.unparse(x).lower() or "layout" in ast.unparse(x).lower() for x in sides
                        if not isinstance(x, ast.Constant))
            if named and any(isinstance(x, ast.Constant) and x.value == "auto" for x in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Name, ast.Attribute)) and \
                (node.id if isinstance(node, ast.Name) else node.attr) in ("LAYER_DEFAULTS", "ENTRY_LAYERS"):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_layer_layout_is_resolved_in_one_place():
    """"auto" becomes "unrolled" or "scan" only in `runtime.resolve_layers` (called where a Runtime is
    built, and by the entry points for themselves): no other module decides it, and the model's passes
    read the runtime's concrete layout."""
    from dgemma_jax.runtime import Runtime

    bad = {m: found for m, p in MODULES if m != "dgemma_jax.runtime" and (found := _layout_decisions(p))}
    assert not bad, bad
    for platform in ("cpu", "tpu"):
        assert Runtime(platform=platform).layers == "unrolled"
        assert Runtime(platform=platform, layers="auto").replace(moe_dispatch="dense").layers == "unrolled"


def test_the_layout_check_sees_a_second_resolver(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("def f(rt, params):\n    if rt.layers == 'auto':\n        return is_stacked(params)\n")
    assert _layout_decisions(str(fake)) == ["line 2: rt.layers == 'auto'"]
    fake.write_text("from dgemma_jax.runtime import ENTRY_LAYERS\n\nx = ENTRY_LAYERS['serve']\n")
    assert _layout_decisions(str(fake)) == ["line 3: ENTRY_LAYERS"]


def test_the_perf_reports_are_used_only_by_the_cli():
    users = sorted({module for module, path in MODULES for target, _ in _imports(path)
                    if target.startswith("dgemma_jax.perf") and not module.startswith("dgemma_jax.perf")})
    assert users == ["dgemma_jax.cli"], users


@pytest.mark.parametrize("module", ["dgemma_jax.model.attention", "dgemma_jax.sampling.loop",
                                    "dgemma_jax.runtime", "dgemma_jax.io.tokenizer"])
def test_the_check_sees_a_violation(module, tmp_path):
    # the checker itself: a higher layer imported from a low module is reported
    path = dict(MODULES)[module]
    fake = tmp_path / "m.py"
    fake.write_text(open(path).read() + "\nfrom dgemma_jax.cli import main\n")
    assert any(layer_of(t) > layer_of(module) for t, _ in _imports(str(fake)))


_MUTATORS = {"append", "pop", "remove", "add", "update", "setdefault", "clear", "extend", "insert"}


def _hidden_state(path: str) -> list[str]:
    """Module-level state a trace could read: thread-locals, `global` rebinding, and module-level
    lists / dicts / sets that the module's functions mutate."""
    tree = ast.parse(open(path).read(), path)
    found = []
    containers = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, (ast.List, ast.Dict, ast.Set)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            containers.update(t.id for t in targets if isinstance(t, ast.Name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"line {node.lineno}: global {', '.join(node.names)}")
        elif isinstance(node, ast.Attribute) and node.attr == "local" and getattr(node.value, "id", "") == "threading":
            found.append(f"line {node.lineno}: threading.local()")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
              and isinstance(node.func.value, ast.Name) and node.func.value.id in containers):
            found.append(f"line {node.lineno}: {node.func.value.id}.{node.func.attr}(...)")
    return found


def test_what_a_pass_computes_depends_only_on_its_arguments():
    """No hidden state under the engine: the model, the sampler and the runtime read no module-level
    state that a context manager or a registry changes (the Runtime is passed explicitly)."""
    traced = [(m, p) for m, p in MODULES if m.startswith(("dgemma_jax.model", "dgemma_jax.sampling",
                                                              "dgemma_jax.runtime", "dgemma_jax.parallel"))]
    assert len(traced) > 15
    bad = {m: found for m, p in traced if (found := _hidden_state(p))}
    assert not bad, bad


def test_the_hidden_state_check_sees_a_violation(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("import threading\n_STACK = []\n_T = threading.local()\n\n\ndef enter(x):\n"
                    "    _STACK.append(x)\n")
    assert [f.split(":")[1].strip() for f in _hidden_state(str(fake))] == ["threading.local()", "_STACK.append(...)"]


# ---------------------------------------------------------------------------- sampling/ is traceable code
# `sampling/` holds what the engine traces; the host drivers that loop over the compiled programs and
# read their results between them are the engine's (`engine/drivers.py`, `engine/rows.py`,
# `engine/infill.py`). A generator (a driver yields between programs) or a read of a device value into
# the host under `sampling/` fails this test. The functions below read host values, not device ones:
SAMPLING_HOST_READS = {
    ("dgemma_jax.sampling.loop", "seed_key"),             # the two words of an int seed
    ("dgemma_jax.sampling.loop", "row_keys"),             # the caller's seeds (a host list or array)
    ("dgemma_jax.sampling.settings", "knob_values"),      # the samplers' settings (declarations) as columns
    ("dgemma_jax.sampling.generate", "GenerateOutput.tokens_per_forward"),  # a finished result's metric
}
_HOST_READS = {"np.asarray", "np.array", "numpy.asarray", "numpy.array", "jax.device_get"}
_HOST_READ_METHODS = {"block_until_ready", "item", "tolist"}


def _host_code(path: str, module: str) -> set:
    """(module, function, what) of every generator (`yield`) and every read into the host in the file:
    np.asarray / np.array / jax.device_get, `.block_until_ready()` / `.item()` / `.tolist()`, and
    int / float / bool of a jax expression. `function` is the qualified name (`Class.method`, `f.inner`)."""
    found = set()

    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = child.name if where == "<module>" else f"{where}.{child.name}"
            if isinstance(child, (ast.Yield, ast.YieldFrom)):
                found.add((module, where, "yield"))
            elif isinstance(child, ast.Call):
                func = ast.unparse(child.func)
                if func in _HOST_READS or (isinstance(child.func, ast.Attribute)
                                           and child.func.attr in _HOST_READ_METHODS):
                    found.add((module, where, func))
                elif func in ("int", "float", "bool") and child.args and any(
                        isinstance(n, ast.Name) and n.id in ("jnp", "jax") for n in ast.walk(child.args[0])):
                    found.add((module, where, f"{func}(jax value)"))
            walk(child, inner)

    walk(ast.parse(open(path).read(), path), "<module>")
    return found


def test_sampling_holds_traceable_code_only():
    """No host driver under `sampling/`: no generator, and no read of a device value into the host
    but the declared reads of host values (`SAMPLING_HOST_READS`)."""
    sampling = [(m, p) for m, p in MODULES if m.startswith("dgemma_jax.sampling")]
    assert len(sampling) >= 8
    found = {s for m, p in sampling for s in _host_code(p, m)}
    bad = sorted(s for s in found if s[2] == "yield" or s[:2] not in SAMPLING_HOST_READS)
    assert not bad, ("host code under sampling/ (a driver over the compiled programs belongs in engine/):\n"
                     + "\n".join(f"{m}.{f}: {what}" for m, f, what in bad))


def test_the_sampling_check_sees_a_host_driver(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("import jax.numpy as jnp\nimport numpy as np\n\n\n"
                    "def drive(programs, state):\n    while True:\n        state = programs.step(state)\n"
                    "        yield np.asarray(state.argmax)\n        if bool(jnp.all(state.done)):\n            return\n\n\n"
                    "class Out:\n    def read(self):\n        return self.tokens.tolist()\n\n\n"
                    "def pure(x):\n    return jnp.asarray(x) + int(3)\n")
    assert _host_code(str(fake), "m") == {("m", "drive", "yield"), ("m", "drive", "np.asarray"),
                                          ("m", "drive", "bool(jax value)"), ("m", "Out.read", "self.tokens.tolist")}

# ---------------------------------------------------------------------------- imports inside functions
def _uncommented_imports_in_functions(path: str) -> list[int]:
    """Lines of the imports inside a function body (at any depth) with no comment saying why: a
    comment on the import's own line(s) or on the line above counts."""
    source = open(path, encoding="utf-8").read()
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    tree = ast.parse(source, path)
    inner = {}  # lineno -> node, each import once even in nested functions
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    inner[node.lineno] = node
    return [line for line, node in sorted(inner.items())
            if not comments & set(range(line - 1, node.end_lineno + 1))]


def test_no_imports_inside_functions_without_a_reason():
    # an import belongs at the top of its module; one inside a function defers a heavy or optional
    # dependency on purpose (matplotlib, orbax, the Hub client, the web stack, ...) and says so in a comment
    bad = [f"{os.path.relpath(path, ROOT)}:{line}" for _, path in MODULES
           for line in _uncommented_imports_in_functions(path)]
    assert not bad, ("imports inside functions without a comment saying why they are deferred (move them to the "
                     "top of the module, or comment them):\n" + "\n".join(bad))


def test_the_import_check_sees_an_uncommented_import(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("import os\n\n\ndef f():\n    import json\n    import re\n\n    return json, re\n\n\n"
                    "def g():\n    # deferred: a reason\n    import json\n    import re\n"
                    "    import sys  # deferred: another\n\n    import ast\n    return json, re, sys, ast\n")
    assert _uncommented_imports_in_functions(str(fake)) == [5, 6, 14, 17]


def test_the_package_never_imports_torch_or_transformers():
    """The reference (torch, transformers) lives under tests/: nothing in dgemma_jax imports it, deferred or not."""
    bad = []
    for module, path in MODULES:
        for node in ast.walk(ast.parse(open(path).read(), path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{module}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("torch", "transformers")]
    assert not bad, bad


# ---------------------------------------------------------------------------- import circles
def _graph(modules=None) -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level or inside a function)."""
    modules = MODULES if modules is None else modules
    return {m: {t for t, _ in _imports(p, m) if t != m} for m, p in modules}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph (its modules, the first repeated at the end), or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circles():
    # a circle inside a layer (model.layers <-> model.layout, training.bundled <-> training.train) forced
    # deferred imports and made the import order matter
    found = _cycle(_graph())
    assert found is None, "import circle: " + " -> ".join(found)


def test_the_circle_check_sees_a_circle(tmp_path):
    path = dict(MODULES)["dgemma_jax.model.layout"]
    fake = tmp_path / "layers.py"
    fake.write_text(open(dict(MODULES)["dgemma_jax.model.layers"]).read()
                    + "\n\ndef f():\n    from dgemma_jax.model.layout import PER_GROUP  # a test\n")
    modules = [(m, str(fake) if m == "dgemma_jax.model.layers" else p) for m, p in MODULES]
    found = _cycle(_graph(modules))
    assert found is not None and "dgemma_jax.model.layers" in found and "dgemma_jax.model.layout" in found
    assert path
    # a relative import is the same import; one under `if TYPE_CHECKING:` (annotations only) never runs
    fake.write_text(open(dict(MODULES)["dgemma_jax.model.layers"]).read()
                    + "\n\ndef f():\n    from .layout import PER_GROUP  # a test\n")
    found = _cycle(_graph(modules))
    assert found is not None and "dgemma_jax.model.layout" in found
    fake.write_text(open(dict(MODULES)["dgemma_jax.model.layers"]).read()
                    + "\n\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .layout import PER_GROUP\n")
    assert _cycle(_graph(modules)) is None


# ---------------------------------------------------------------------------- who compiles
# The engine owns every compiled program that runs the model (`dgemma_jax/engine/`), the trainer
# its train and eval steps (`training/step.py`). The other jits below compile no model pass, or are
# the checked one-call passes of `model/api.py` (prefill / denoise / soft_embed for a caller's own
# code, which cannot import the engine from the model layer); any new one fails this test.
JIT_OWNERS = {"dgemma_jax.engine.engine", "dgemma_jax.engine.placement", "dgemma_jax.training.step"}
OTHER_JITS = {
    ("dgemma_jax.model.api", "init_params"),       # random parameters
    ("dgemma_jax.model.api", "_prefill"),          # the checked passes for callers (see above)
    ("dgemma_jax.model.api", "_denoise"),
    ("dgemma_jax.model.api", "_soft_embed"),
    ("dgemma_jax.model.api", "_image_features"),  # the vision tower's output for a caller
    ("dgemma_jax.model.quant", "<module>"),        # quantizing one kernel
    ("dgemma_jax.io.finite", "_all_finite"),       # the load-time all-finite check (no model code)
    ("dgemma_jax.parallel.shardings", "init_cache"),   # allocating a sharded cache / parameters
    ("dgemma_jax.parallel.shardings", "init_params"),
}


def _jit_sites(path: str, module: str):
    """(module, enclosing function or <module>) of every jax.jit / jit / pjit use in the file."""
    tree = ast.parse(open(path).read(), path)
    sites = set()

    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, (ast.Attribute, ast.Name)):
                name = child.attr if isinstance(child, ast.Attribute) else child.id
                base = ast.unparse(child.value) if isinstance(child, ast.Attribute) else ""
                if name in ("jit", "pjit") and base in ("", "jax", "jax.experimental.pjit"):
                    # a decorator names the function it decorates
                    sites.add((module, inner if inner != where or not isinstance(node, ast.FunctionDef)
                               else node.name))
            walk(child, inner)

    walk(tree, "<module>")
    return sites


def test_only_the_engine_and_the_trainer_compile_model_code():
    sites = {s for m, p in MODULES for s in _jit_sites(p, m)}
    others = {s for s in sites if s[0] not in JIT_OWNERS}
    assert others <= OTHER_JITS, f"jit outside the engine and the trainer: {sorted(others - OTHER_JITS)}"
    assert any(m == "dgemma_jax.engine.engine" for m, _ in sites)


def test_the_jit_check_sees_a_jit(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("import jax\n\ndef run(params, x):\n    return jax.jit(forward)(params, x)\n")
    assert _jit_sites(str(fake), "dgemma_jax.sampling.loop") == {("dgemma_jax.sampling.loop", "run")}
    fake.write_text("import functools, jax\n\n@functools.partial(jax.jit, static_argnums=1)\ndef step(x, n):\n"
                    "    return x\n")
    assert _jit_sites(str(fake), "dgemma_jax.pipeline") == {("dgemma_jax.pipeline", "step")}


# the one place logical axis names become mesh axes (`Runtime.spec`), and where the rules themselves live
PLACEMENT_OWNERS = {"dgemma_jax.runtime", "dgemma_jax.axis_rules"}


def _placement_sites(path: str, module: str) -> set:
    """(module, line) of every call of `spec_for` or construction of a `Runtime` with a mesh in the file."""
    tree = ast.parse(open(path).read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name == "spec_for" or (name == "Runtime" and any(k.arg == "mesh" for k in node.keywords)):
                out.add((module, node.lineno))
    return out


def test_one_owner_of_the_mesh_and_its_rules():
    """Logical names become mesh axes only in `Runtime.spec`; the only Runtime built with a mesh is
    the one a `Shardings` holds (`Shardings.placement`), which every runtime on that mesh derives from."""
    sites = {s for m, p in MODULES for s in _placement_sites(p, m) if m not in PLACEMENT_OWNERS}
    assert {m for m, _ in sites} == {"dgemma_jax.parallel.shardings"}, sorted(sites)
    assert len(sites) == 1, sorted(sites)


def test_the_placement_check_sees_a_second_owner(tmp_path):
    fake = tmp_path / "m.py"
    fake.write_text("from dgemma_jax.axis_rules import spec_for\n\ndef f(x, rules, mesh):\n"
                    "    return spec_for(x.shape, ('batch',), rules, mesh)\n")
    assert _placement_sites(str(fake), "dgemma_jax.model.moe") == {("dgemma_jax.model.moe", 4)}
    fake.write_text("from dgemma_jax.runtime import Runtime\n\nrt = Runtime(mesh=m, rules=r)\n")
    assert _placement_sites(str(fake), "dgemma_jax.engine.engine") == {("dgemma_jax.engine.engine", 3)}
