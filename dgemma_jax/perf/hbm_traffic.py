"""HBM traffic of a compiled TPU program, read from its HLO's memory spaces.

`cost_analysis()["bytes accessed"]` adds up every operand and result of every op, wherever it
lives. The TPU compiler stages weights and small activations through on-chip VMEM (memory space
S(1) in the compiled module's layouts): an async `copy-start` / `slice-start` moves them from HBM
once, and the fusions then read the VMEM copy. cost_analysis counts such a weight once for the
transfer and again for every read, so it overstates what the chip's HBM must deliver (a weight
prefetched by the model's grouped matmul counts ~3x its size).

`hbm_traffic(hlo_text)` counts only HBM: for each op of the entry computation (and of the loop
bodies and conditional branches it runs), the operands and results whose layout has no memory-space
annotation; a transfer counts its bytes on the HBM side; a fusion operand that the fusion only
slices or gathers counts the rows it takes, not the whole array; an update in place (a scatter or
dynamic-update-slice into its first operand, a KV-cache write) counts the rows it writes, not the
whole buffer. The loops of a fixed length (`COUNTED_LOOPS`: the model's scan over layer groups, the
int4 grouped matmul's blocks, the one-chip head's vocab chunks) count once per trip; any other loop
body counts once, like
cost_analysis (per-step figures come from the step program); a conditional counts its largest
branch. This is our reading of the compiler's output, not a hardware measurement.
"""

from __future__ import annotations

import re
from collections import Counter

from dgemma_jax.model.layout import LAYER_LOOP_SCOPE
from dgemma_jax.model.moe import BLOCK_LOOP_SCOPE
from dgemma_jax.sampling.fused import VOCAB_LOOP_SCOPE

# loops that run a fixed number of times, from a counter at 0: the layer groups' scan, the int4 grouped
# matmul's blocks and the one-chip head's vocab chunks
COUNTED_LOOPS = (LAYER_LOOP_SCOPE, BLOCK_LOOP_SCOPE, VOCAB_LOOP_SCOPE)

_ITEMSIZE = {"s4": 0.5, "u4": 0.5, "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8}
# dtype[dims]{layout}; the layout may hold tiling "(8,128)" and a memory space "S(1)"
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\](\{[^{}]*\})?")
_INST = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(, .*)?$")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "iota"}
_SLICING = {"dynamic-slice", "slice", "gather"}
# ops that update operand 0 in its own buffer: {op: the operand index of the update}
_IN_PLACE = {"scatter": 2, "dynamic-update-slice": 1}


def _arrays(type_text: str) -> list[tuple[int, bool]]:
    """(bytes, on_chip) for every array in an HLO type (a tuple type lists several)."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(type_text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        out.append((int(n * _ITEMSIZE[dtype]), bool(re.search(r"S\([1-9]\d*\)", layout or ""))))
    return out


def _hbm(type_text: str) -> int:
    return sum(b for b, on_chip in _arrays(type_text) if not on_chip)


def _parse(text: str):
    """({computation: [(name, type, op, operand names, rest)]}, entry name, {parameter name: index})."""
    comps: dict[str, list[tuple]] = {}
    index: dict[str, int] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if not line.startswith(" "):
            m = _HEADER.match(line)
            if m:
                cur = m.group(2)
                comps[cur] = []
                entry = cur if m.group(1) else entry
            continue
        m = _INST.match(line.strip())
        if cur is not None and m:
            name, typ, op, args, rest = m.groups()
            comps[cur].append((name, typ, op, re.findall(r"%([\w.\-]+)", args), rest or ""))
            if op == "parameter":
                index[name] = int(args)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return comps, entry, index




def loop_runs(hlo_text: str, rest: str) -> int:
    """How many times to count a while op's body (`rest`: its attributes): the trip count of a loop in
    one of `COUNTED_LOOPS` (its condition is `counter < N`, the counter from 0), 1 for any other loop
    (a body run a data-dependent number of times, like the MoE's skipped blocks, counts once)."""
    m = re.search(r'op_name="([^"]*)"', rest)
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    # the scope's own loop, not a loop nested in its body (whose op_name holds the scope too)
    if not m or not any(m.group(1).endswith(f"{scope}/while") for scope in COUNTED_LOOPS) or not cond:
        return 1
    body = _computation(hlo_text, cond.group(1))
    consts = re.findall(r"s32\[\][^ ]* constant\((\d+)\)", body)
    # the compare may sit in a fusion the condition calls (XLA:CPU wraps it)
    called = "".join(_computation(hlo_text, c) for c in re.findall(r"calls=%?([\w.\-]+)", body))
    if len(consts) != 1 or "direction=LT" not in body + called:
        raise ValueError(f"cannot read the trip count of the loop {m.group(1)} from condition {cond.group(1)}")
    return int(consts[0])


def _computation(hlo_text: str, name: str) -> str:
    """The instructions of computation `name` in an HLO module's text ("" when absent)."""
    m = re.search(r"^%?" + re.escape(name) + r" .*?\{\n(.*?)\n\}", hlo_text, re.S | re.M)
    return m.group(1) if m else ""


def _scope(op: str, rest: str, within: str = "") -> str:
    """The op's source scope (its `op_name` metadata, layer numbers folded: blocks_N). An op the
    compiler inserted (a copy, a prefetch: no metadata) takes the scope of the loop or branch whose
    body holds it (`within`), "<that scope>/<op>", or its op kind at the top level."""
    m = re.search(r'op_name="([^"]*)"', rest)
    name = re.sub(r"^jit\([^)]*\)/", "", m.group(1)) if m else (f"{within}/{op}" if within else op)
    return re.sub(r"blocks_\d+", "blocks_N", name)


def hbm_traffic(hlo_text: str) -> dict:
    """HBM reads + writes (see the module docstring): {"total": bytes, "by_op": {op kind: bytes},
    "by_scope": {source scope (layers folded): bytes}}."""
    comps, entry, param_index = _parse(hlo_text)  # instruction names are unique in a module

    def params_of(comp: str) -> dict[int, str]:
        return {param_index[n]: n for n, _, op, _, _ in comps.get(comp, []) if op == "parameter"}

    def read_of(comp: str, param: str, full: int) -> int:
        """Bytes computation `comp` reads of its parameter `param`: the slices, when all it does with
        the parameter is slice or gather it (looking through nested fusions)."""
        total = 0
        for name, typ, op, args, rest in comps.get(comp, []):
            if param not in args:
                continue
            if op in _SLICING and args[0] == param and param not in args[1:]:
                total += sum(b for b, _ in _arrays(typ))
            elif op == "fusion" and args == [param] and (inner := re.search(r"calls=%?([\w.\-]+)", rest)) \
                    and relayout(inner.group(1)):
                # a layout copy fused into what slices it: only the rows taken are read
                total += read_of(comp, name, full)
            elif op == "fusion" and (inner := re.search(r"calls=%?([\w.\-]+)", rest)):
                nested = params_of(inner.group(1))
                for j, a in enumerate(args):
                    if a == param:
                        total += read_of(inner.group(1), nested.get(j, ""), full)
            else:
                return full
        return min(total, full)

    def relayout(comp: str) -> bool:
        """Whether a fused computation only copies (relayouts) its one parameter."""
        return all(op in ("parameter", "copy", "bitcast") for _, _, op, _, _ in comps.get(comp, []))

    def in_place_update(comp: str) -> int | None:
        """The bytes a fusion writes when its root updates its first operand in place (a scatter or
        dynamic-update-slice into fusion parameter 0, as a KV-cache write is): its update's; else None.
        XLA runs such an update in the operand's own buffer (a copy, when one is needed, is a
        separate op), so neither the whole operand is read nor the whole result written."""
        insts = {n: (t, op, a) for n, t, op, a, _ in comps.get(comp, [])}
        root = comps[comp][-1][0] if comps.get(comp) else None
        while root in insts and insts[root][1] == "bitcast":
            root = insts[root][2][0]
        if root not in insts or insts[root][1] not in _IN_PLACE:
            return None
        _, op, args = insts[root]
        if insts.get(args[0], ("", ""))[1] != "parameter" or param_index.get(args[0]) != 0:
            return None
        return sum(b for b, _ in _arrays(insts.get(args[_IN_PLACE[op]], ("",))[0]))

    def operand_bytes(shapes, op, args, rest):
        sizes = [_hbm(shapes.get(a, "")) for a in args]
        called = re.search(r"calls=%?([\w.\-]+)", rest)
        if op != "fusion" or not called:
            return sum(sizes)
        params = params_of(called.group(1))
        return sum(read_of(called.group(1), params[j], size) if size and j in params else size
                   for j, size in enumerate(sizes))

    def walk(comp: str, within: str = "") -> Counter:
        shapes = {name: typ for name, typ, *_ in comps[comp]}
        out: Counter = Counter()
        for name, typ, op, args, rest in comps[comp]:
            if op == "while":
                body = walk(re.search(r"body=%?([\w.\-]+)", rest).group(1), _scope(op, rest, within))
                runs = loop_runs(hlo_text, rest)
                out += Counter({k: v * runs for k, v in body.items()})
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                         [re.search(k + r"=%?([\w.\-]+)", rest).group(1)
                          for k in ("true_computation", "false_computation")])
                out += max((walk(b, _scope(op, rest, within)) for b in names), key=lambda c: sum(c.values()))
            elif op == "call":
                out += walk(re.search(r"to_apply=%?([\w.\-]+)", rest).group(1), within)
            elif op in _NO_TRAFFIC or op.endswith("-done"):
                continue
            elif op in ("copy-start", "slice-start"):
                # the moved bytes, on whichever sides are HBM; the result types are
                # (destination, source, context) for a copy, ((source), destination, context) for a slice
                source = _arrays(shapes.get(args[0], ""))
                parts = _arrays(typ)
                dest = parts[:1] if op == "copy-start" else parts[len(source):][:1]
                if source and dest:
                    out[(op, _scope(op, rest, within))] += dest[0][0] * ((not source[0][1]) + (not dest[0][1]))
            elif op == "fusion" and (called := re.search(r"calls=%?([\w.\-]+)", rest)) and \
                    (written := in_place_update(called.group(1))) is not None:
                # the update's bytes written; the other operands (indices, the update) read as usual
                out[(op, _scope(op, rest, within))] += written + operand_bytes(shapes, op, [""] + args[1:], rest)
            elif op in _IN_PLACE:
                written = _hbm(shapes.get(args[_IN_PLACE[op]], ""))
                out[(op, _scope(op, rest, within))] += written + sum(_hbm(shapes.get(a, "")) for a in args[1:])
            else:
                out[(op, _scope(op, rest, within))] += _hbm(typ) + operand_bytes(shapes, op, args, rest)
        return out

    counts = walk(entry)
    by_op: Counter = Counter()
    by_scope: Counter = Counter()
    for (op, scope), v in counts.items():
        by_op[op] += v
        by_scope[scope] += v
    return {"total": float(sum(counts.values())), "by_op": {k: float(v) for k, v in by_op.most_common()},
            "by_scope": {k: float(v) for k, v in by_scope.most_common()}}
