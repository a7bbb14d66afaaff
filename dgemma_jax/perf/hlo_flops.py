"""Matrix-product FLOPs of a compiled program, read from its HLO with every loop counted per trip.

XLA:TPU's `cost_analysis()` counts a while loop's body once, so a scanned program (`layers="scan"`, the
head's vocabulary chunks, any `lax.scan` / `fori_loop`) is undercounted by its trip count. A
program's FLOPs are nearly all in its matrix products, which the TPU compiler writes as `convolution`
ops (XLA:CPU and GPU as `dot`), inside fusions or bare, and its grouped matmuls (`lax.ragged_dot`)
as Mosaic custom calls. `dot_flops(hlo_text)` sums them over the entry computation and what it
calls: a dot 2 x output size x contracted size; a convolution 2 x output size x the kernel's input
features x the window taps that meet the input (`conv_flops`: XLA:TPU writes some products as a
window sliding over padding, where counting the whole window counted the 26B head's logits 16x and
some projections 4x, the 3.6x the first version of this reader found on the 26B's serving tick);
a grouped matmul 2 x its rows x K x N; a loop body times its trip count (`trip_count`); a
conditional its largest branch. A Pallas kernel is one opaque custom call: its FLOPs come from the
runtime's observer (`perf.aot.KernelFlops`).

What runs against the upper bound: a loop of blocks whose products all sit in a conditional whose
other branch does none (the ragged MoE's per-shard blocks, skipped past the shard's last pair,
`moe.dispatch_ragged`) counts one trip in "flops" (at a balanced load the first block, of
`moe_shard_rows_factor` x the shard's mean pairs, holds all of them) and every trip in
"flops_upper_bound". Work the program does beyond the useful FLOPs (`perf.roofline`) stays in both:
the grouped matmul's padded rows (`moe_shard_rows_factor`), the largest of a conditional's branches
(the capacity dispatch's buffer levels), the server tick's commit pass. Elementwise and reduction
work (the VPU's, not the matrix units') is not counted.
"""

from __future__ import annotations

import math
import re
from collections import Counter

from dgemma_jax.perf.hbm_traffic import _ARRAY, _parse, _scope

_CALLS = re.compile(r"calls=%?([\w.\-]+)")
# XLA:TPU's grouped matmul (`lax.ragged_dot`): a Mosaic custom call, tagged with its tiling
_RAGGED_DOT = re.compile(r'ragged_dot_tiling=|custom_call_target="[^"]*ragged[_-]?dot', re.I)


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


def _window(rest: str) -> list[dict]:
    """A convolution's window, one dict per spatial dimension: size, stride, pad (lo, hi), lhs_dilate,
    rhs_dilate (XLA's defaults where the text leaves them out)."""
    m = re.search(r"window=\{([^}]*)\}", rest)
    fields = dict(kv.split("=", 1) for kv in m.group(1).split()) if m else {}
    sizes = [int(x) for x in fields.get("size", "").split("x") if x]
    n = len(sizes)

    def ints(key, default):
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

    pads = [tuple(int(v) for v in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    return [dict(size=sizes[i], stride=ints("stride", 1)[i], pad=pads[i], lhs_dilate=ints("lhs_dilate", 1)[i],
                 rhs_dilate=ints("rhs_dilate", 1)[i]) for i in range(n)]


def _taps(w: dict, in_size: int, out_size: int) -> int:
    """Multiply-accumulates one spatial dimension of a convolution really does, summed over its output
    positions: the window taps that land on an input element (not on padding, nor between the
    elements of a dilated input)."""
    span = (in_size - 1) * w["lhs_dilate"] + 1
    total = 0
    for p in range(out_size):
        for k in range(w["size"]):
            at = p * w["stride"] + k * w["rhs_dilate"] - w["pad"][0]
            total += 0 <= at < span and at % w["lhs_dilate"] == 0
    return total


def conv_flops(out_type: str, lhs_type: str, rhs_type: str, rest: str) -> float:
    """FLOPs of an HLO convolution: 2 x the multiply-accumulates it does. Each output element contracts
    the kernel's input features (one group's, under feature_group_count) over the window taps that land
    on the input. XLA:TPU writes some matrix products as a convolution whose window slides over
    padding (the head's `bld,cd->blc` on 16 rows: window 16, pad 15 on each side, an input of 1), where
    only one tap of 16 meets an input element: counting the whole window counted that product 16x."""
    labels = re.search(r"dim_labels=([^_]*)_([^-]*)->(\S+?)(?:,|$)", rest)
    out, lhs, rhs = _dims(out_type), _dims(lhs_type), _dims(rhs_type)
    if not labels:
        return 2.0 * math.prod(out) * math.prod(rhs[:-1])
    lhs_l, rhs_l, out_l = labels.group(1), labels.group(2), labels.group(3)
    window = _window(rest)
    total = 2.0 * math.prod(out[i] for i, c in enumerate(out_l) if not c.isdigit()) * rhs[rhs_l.index("i")]
    for d, w in enumerate(window):
        total *= _taps(w, lhs[lhs_l.index(str(d))], out[out_l.index(str(d))])
    return total


def _ragged_dot_flops(out_type: str, operand_types: list[str]) -> float:
    """FLOPs of XLA:TPU's grouped matmul (a custom call): its rows [M, K] each by their group's [K, N]
    kernel into [M, N], every one of the M rows (rows past the groups are computed and dropped)."""
    out = _dims(out_type)
    rows = [d for d in (_dims(t) for t in operand_types) if len(d) == 2 and d[0] == out[0]]
    return 2.0 * math.prod(out) * rows[0][1] if rows and len(out) == 2 else 0.0


def dot_flops(hlo_text: str) -> dict:
    """The program's matrix-product FLOPs, per chip (see the module docstring):

    {"flops": what runs, loops counted per trip, except a loop of skipped blocks, one trip;
     "flops_upper_bound": every loop counted per trip (each skipped block as if it ran);
     "by_scope": {source scope (`hbm_traffic._scope`, layers folded): "flops"'s part};
     "loops": [(loop op name, trips or None), ...]; "uncounted_loops": loops whose trip count the HLO
     did not give (each body counted once); "skipped_block_loops": loops counted as one trip}."""
    comps, entry, param_index = _parse(hlo_text)
    consts = {n: int(v) for n, v in _INT_CONSTANT.findall(hlo_text)}
    loops: list[tuple[str, int | None]] = []
    skipping: list[str] = []
    memo: dict[tuple, tuple] = {}

    def scaled(c: Counter, n: int) -> Counter:
        return Counter({k: v * n for k, v in c.items()})

    def walk(comp: str, within: str = "") -> tuple[Counter, float, float]:
        """(FLOPs by scope as run, the upper bound, the part of the FLOPs under a conditional one of
        whose branches does no products)."""
        if (comp, within) in memo:
            return memo[(comp, within)]
        shapes = {n: t for n, t, *_ in comps.get(comp, [])}
        total: Counter = Counter()
        upper = gated = 0.0
        for name, typ, op, args, rest in comps.get(comp, []):
            here = _scope(op, rest, within)
            flops = 0.0
            if op == "dot":
                lhs = _dims(shapes.get(args[0], ""))
                contracted = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
                k = math.prod(lhs[int(i)] for i in contracted.group(1).split(",") if i) if contracted else 1
                flops = 2.0 * math.prod(_dims(typ)) * k
            elif op == "convolution":
                flops = conv_flops(typ, shapes.get(args[0], ""), shapes.get(args[1], ""), rest)
            elif op == "custom-call" and _RAGGED_DOT.search(rest):
                flops = _ragged_dot_flops(typ, [shapes.get(a, "") for a in args])
            elif op in ("fusion", "call") and (called := _CALLS.search(rest) or
                                                 re.search(r"to_apply=%?([\w.\-]+)", rest)):
                c, u, g = walk(called.group(1), within)
                total += c
                upper, gated = upper + u, gated + g
            elif op == "while":
                trips = trip_count(comps, param_index, consts, comp, (name, typ, op, args, rest))
                loops.append((name, trips))
                c, u, g = walk(re.search(r"body=%?([\w.\-]+)", rest).group(1), here)
                n = 1 if trips is None else trips
                body = sum(c.values())
                # a loop of blocks each run only while work is left (the MoE's per-shard blocks: a
                # conditional whose other branch does nothing): one trip, the block that runs at a
                # balanced load; every trip in the upper bound
                skip = trips is not None and trips > 1 and body > 0 and g >= body
                if skip:
                    skipping.append(name)
                total += c if skip else scaled(c, n)
                upper += u * n
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                         [re.search(k + r"=%?([\w.\-]+)", rest).group(1)
                          for k in ("true_computation", "false_computation")])
                branches = [walk(b, here) for b in names]
                c, u, g = max(branches, key=lambda b: sum(b[0].values()))
                total += c
                upper += max(b[1] for b in branches)
                empty = min(sum(b[0].values()) for b in branches) == 0
                gated += sum(c.values()) if empty else g
            if flops:
                total[here] += flops
                upper += flops
        memo[(comp, within)] = (total, upper, gated)
        return memo[(comp, within)]

    counts, upper, _ = walk(entry)
    return {"flops": float(sum(counts.values())), "flops_upper_bound": float(upper),
            "by_scope": {k: float(v) for k, v in counts.most_common()},
            "loops": loops, "uncounted_loops": sum(t is None for _, t in loops), "skipped_block_loops": skipping}
