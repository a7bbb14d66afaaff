"""Matrix-product FLOPs of a compiled program, read from its HLO with every loop counted per trip.

XLA:TPU's `cost_analysis()` counts a while loop's body once, so a scanned program (`layers="scan"`, the
one-chip head's vocabulary chunks, any `lax.scan` / `fori_loop`) is undercounted by its trip count. A
program's FLOPs are nearly all in its matrix products, which the TPU compiler writes as `convolution`
ops (XLA:CPU and GPU as `dot`), inside fusions or bare. `dot_flops(hlo_text)` sums 2 x output size x
contracted size over every such op of the entry computation and of what it calls, a loop body times
its trip count (`trip_count`), a conditional its largest branch. A Pallas kernel is one opaque
custom call here too: its FLOPs come from the runtime's observer (`perf.aot.KernelFlops`).

A loop of skipped blocks (the "ragged" MoE's per-shard blocks, whose body is a conditional that
does nothing past the shard's last pair) counts as if every block ran: an upper bound there.
Elementwise and reduction work (the VPU's, not the matrix units') is not counted.

Not yet used by the compile reports (`perf.aot`, whose `flops` stay cost_analysis's plus the kernels'):
on the 26B's serving tick for v6e-8 this reader counted 3.6x the useful FLOPs (38.5 vs 10.6 TFLOP per
chip at 32 slots), which the loops of skipped MoE blocks alone do not explain; until that is found
the reports would turn HBM-bound steps FLOP-bound.
"""

from __future__ import annotations

import math
import re

from dgemma_jax.perf.hbm_traffic import _ARRAY, _parse

_CALLS = re.compile(r"calls=%?([\w.\-]+)")


def _dims(type_text: str) -> list[int]:
    """The dimensions of the first array in an HLO type."""
    m = _ARRAY.search(type_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _through(insts: dict, name: str) -> tuple:
    """The instruction `name` names, looking through copies and bitcasts."""
    inst = insts.get(name)
    while inst is not None and inst[1] in ("copy", "bitcast") and inst[2]:
        inst = insts.get(inst[2][0])
    return inst


_INT_CONSTANT = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = [su](?:8|16|32|64)\[\]\S* constant\((-?\d+)\)", re.M)


def _constant(insts: dict, consts: dict, name: str) -> int | None:
    """The value of the integer scalar constant `name` names (through copies), or None."""
    while name in insts and insts[name][1] in ("copy", "bitcast") and insts[name][2]:
        name = insts[name][2][0]
    return consts.get(name)


def trip_count(comps: dict, param_index: dict, consts: dict, parent: str, while_inst: tuple) -> int | None:
    """How many times a while loop runs its body, or None when the HLO does not say.

    From the loop's `known_trip_count` (XLA:CPU and GPU write it in the backend config), else from its
    induction pattern, which XLA:TPU leaves in the text: the condition is `i < N` (N a constant, the
    compare possibly inside a fusion the condition calls), the body's result at i's tuple index is
    i + 1, and the loop's initial tuple holds a constant there."""
    _, _, _, args, rest = while_inst
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', rest)
    if m:
        return int(m.group(1))
    cond = re.search(r"condition=%?([\w.\-]+)", rest)
    body = re.search(r"body=%?([\w.\-]+)", rest)
    if not cond or not body or cond.group(1) not in comps or body.group(1) not in comps:
        return None

    def table(comp):
        return {n: (t, op, a, r) for n, t, op, a, r in comps.get(comp, [])}

    def index_of(insts, name):  # the tuple index a get-tuple-element of the loop's parameter reads
        inst = _through(insts, name)
        if inst is None or inst[1] != "get-tuple-element":
            return None
        m = re.search(r"index=(\d+)", inst[3])
        return int(m.group(1)) if m else None

    # the condition: compare(gte(param, i), constant N), direction=LT, maybe inside a called fusion
    cinsts = table(cond.group(1))
    root = comps[cond.group(1)][-1]
    index = bound = None
    if root[2] == "compare" and "direction=LT" in root[4]:
        index, bound = index_of(cinsts, root[3][0]), _constant(cinsts, consts, root[3][1])
    elif root[2] == "fusion" and (called := _CALLS.search(root[4])):
        finsts = table(called.group(1))
        froot = comps[called.group(1)][-1]
        if froot[2] == "compare" and "direction=LT" in froot[4]:
            # the fusion's parameters stand for the condition's operands, in order
            fparams = {n: param_index[n] for n, (t, op, a, r) in finsts.items() if op == "parameter"}
            lhs, rhs = froot[3][0], froot[3][1]
            lhs_op = root[3][fparams[lhs]] if lhs in fparams else None
            bound = _constant(finsts, consts, rhs)
            if bound is None and rhs in fparams:
                bound = _constant(cinsts, consts, root[3][fparams[rhs]])
            index = index_of(cinsts, lhs_op) if lhs_op else None
    if index is None or bound is None:
        return None
    # the body: its root tuple's element `index` is add(gte(param, index), constant 1)
    binsts = table(body.group(1))
    broot = comps[body.group(1)][-1]
    if broot[2] != "tuple" or index >= len(broot[3]):
        return None
    step = _through(binsts, broot[3][index])
    if step is None or step[1] != "add" or len(step[2]) != 2:
        return None
    a, b = step[2]
    if not ((index_of(binsts, a) == index and _constant(binsts, consts, b) == 1)
            or (index_of(binsts, b) == index and _constant(binsts, consts, a) == 1)):
        return None
    # the start: the loop's initial tuple holds a constant at `index`
    pinsts = table(parent)
    init = _through(pinsts, args[0]) if args else None
    if init is None or init[1] != "tuple" or index >= len(init[2]):
        return None
    start = _constant(pinsts, consts, init[2][index])
    return None if start is None else max(0, bound - start)


def dot_flops(hlo_text: str) -> dict:
    """{"flops": matrix-product FLOPs of the program, loops counted per trip, "loops": [(loop op name,
    trips or None), ...], "uncounted_loops": how many loops' trip counts the HLO did not give (each
    body counted once)}."""
    comps, entry, param_index = _parse(hlo_text)
    consts = {n: int(v) for n, v in _INT_CONSTANT.findall(hlo_text)}
    loops: list[tuple[str, int | None]] = []
    memo: dict[str, float] = {}

    def walk(comp: str) -> float:
        if comp in memo:
            return memo[comp]
        shapes = {n: t for n, t, *_ in comps.get(comp, [])}
        total = 0.0
        for name, typ, op, args, rest in comps.get(comp, []):
            if op == "dot":
                lhs = _dims(shapes.get(args[0], ""))
                contracted = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                k = math.prod(lhs[int(i)] for i in contracted.group(1).split(",") if i) if contracted else 1
                total += 2.0 * math.prod(_dims(typ)) * k
            elif op == "convolution":
                rhs = _dims(shapes.get(args[1], ""))
                labels = re.search(r"dim_labels=[^_]*_([^-]*)->", rest)
                out_feature = labels.group(1).index("o") if labels and "o" in labels.group(1) else None
                per_output = math.prod(d for i, d in enumerate(rhs) if i != out_feature)
                groups = re.search(r"feature_group_count=(\d+)", rest)
                per_output //= int(groups.group(1)) if groups else 1
                total += 2.0 * math.prod(_dims(typ)) * per_output
            elif op == "fusion" and (called := _CALLS.search(rest)):
                total += walk(called.group(1))
            elif op == "call" and (called := re.search(r"to_apply=%?([\w.\-]+)", rest)):
                total += walk(called.group(1))
            elif op == "while":
                trips = trip_count(comps, param_index, consts, comp, (name, typ, op, args, rest))
                loops.append((name, trips))
                total += walk(re.search(r"body=%?([\w.\-]+)", rest).group(1)) * (1 if trips is None else trips)
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                         [re.search(k + r"=%?([\w.\-]+)", rest).group(1)
                          for k in ("true_computation", "false_computation")])
                total += max(walk(b) for b in names)
        memo[comp] = total
        return total

    flops = walk(entry)
    return {"flops": flops, "loops": loops, "uncounted_loops": sum(t is None for _, t in loops)}
