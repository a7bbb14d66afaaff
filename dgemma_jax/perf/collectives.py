"""Collectives of a compiled program and the time they take on a TPU slice's inter-chip links (ICI).

The roofline projection of a step, max(FLOPs / peak, HBM bytes / bandwidth), leaves out the
traffic between chips: on an expert- or tensor-parallel mesh every layer ends in an all-reduce
of its partial outputs. `collectives(hlo_text)` lists every collective of the compiled module
(all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute, in their synchronous and
async `-start` forms, and wherever they sit: inside fusions, custom-call fusions, calls and the
computations of `async-start` wrappers; an async pair, start and done, counts once): kind, bytes,
group size, and how many times the program runs it (the layer scan's body once per layer group, any
other loop body once, like `perf.hbm_traffic`; a conditional its largest branch).

`ici_seconds` prices them with the ring algorithms' wire bytes over the chip's public link
bandwidth plus a latency per ring step:

    all-reduce       2 (n-1)/n * B  over 2 (n-1) steps       (reduce-scatter, then all-gather)
    all-gather       (n-1)/n * B_out over (n-1) steps
    reduce-scatter   (n-1)/n * B_in  over (n-1) steps
    all-to-all       (n-1)/n * B * n/4 (a piece crosses n/4 hops on a bidirectional ring), n-1 steps
    collective-permute  B over one link, 1 step

with the bandwidth of one ring through the slice: a bidirectional ring uses one port of each chip
in and one out, i.e. `ici_bidirectional_bytes_per_s / ici_ports` (v5e 400 GB/s over 4 ports, v6e
800 GB/s over 4, v5p 1200 GB/s over 6; Cloud TPU system architecture pages). XLA can use more
rings on a 2-D torus, so this is a conservative (slow) price. The hop latency (default 1 us) is an
assumption, not a published figure; it is a parameter and reported. Nothing here is a measurement.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Iterable

from dgemma_jax.perf.hbm_traffic import _arrays, _parse, loop_runs

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DEFAULT_HOP_LATENCY_S = 1e-6


def _kind(op: str) -> str | None:
    base = op[:-len("-start")] if op.endswith("-start") else op
    return base if base in KINDS else None


def group_size(rest: str, default: int) -> int:
    """Devices in each replica group of a collective, from its attribute text. Three spellings:
    `replica_groups={{0,1,2,3}}`, the iota form `replica_groups=[2,4]<=[8]` and the mesh-axes form
    `replica_groups=mesh['x'=2,'y'=4] {'y'}` (a `device_ids=(...)` may come before the braces);
    `default` (every device) when there are none."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", rest)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in (p.split("=") for p in m.group(1).split(",") if "=" in p)}
        axes = [a.strip("' ") for a in m.group(2).split(",") if a.strip("' ")]
        n = 1
        for a in axes:
            n *= sizes.get(a, 1)
        return n
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([^}]*)\}", rest)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"source_target_pairs=\{([^}]*(?:\}[^}]*)*)\}", rest)
    if m:
        return 2
    return default


def collectives(hlo_text: str, num_devices: int = 1) -> list[dict]:
    """Every collective the program runs: [{"kind", "bytes", "group", "count", "scope"}], equal
    collectives merged (count = how many times they run per program execution). `bytes`: the result
    for all-reduce, all-gather, all-to-all and collective-permute; the operand for reduce-scatter."""
    comps, entry, _ = _parse(hlo_text)
    memo: dict[str, Counter] = {}

    def count(comp: str, stack: tuple = ()) -> Counter:
        """Collective key -> runs per execution of `comp`."""
        if comp in memo:
            return memo[comp]
        found: Counter = Counter()
        if comp not in comps or comp in stack:
            return found
        shapes = {name: typ for name, typ, *_ in comps[comp]}

        def add(sub: Counter, times: int):
            for k, v in sub.items():
                found[k] += v * times

        for _, typ, op, args, rest in comps[comp]:
            if op == "while":
                n = loop_runs(hlo_text, rest)
                add(count(re.search(r"body=%?([\w.\-]+)", rest).group(1), stack + (comp,)), n)
            elif op == "conditional":
                m = re.search(r"branch_computations=\{([^}]*)\}", rest)
                names = ([b.strip().lstrip("%") for b in m.group(1).split(",")] if m else
                         [x.group(1) for k in ("true_computation", "false_computation")
                          if (x := re.search(k + r"=%?([\w.\-]+)", rest))])
                subs = [count(b, stack + (comp,)) for b in names]
                if subs:
                    add(max(subs, key=lambda s: sum(k[1] * v for k, v in s.items())), 1)
            elif _kind(op) is not None:
                kind = _kind(op)
                if kind == "reduce-scatter":
                    size = sum(b for a in args for b, _ in _arrays(shapes.get(a, "")))
                elif op.endswith("-start"):
                    # an async start's result holds the operands and then the outputs: the output half
                    parts = [b for b, _ in _arrays(typ)]
                    size = sum(parts[len(parts) // 2:]) if len(parts) > 1 else sum(parts)
                else:
                    size = sum(b for b, _ in _arrays(typ))
                found[(kind, int(size), group_size(rest, num_devices), _scope(rest))] += 1
            elif op.endswith(("-done", "-update")):
                continue  # the second half of an async pair: its start (or async-start) counted it
            else:
                # a call, fusion, custom-call or async-start: the collectives of what it calls, once
                for callee in _callees(rest):
                    add(count(callee, stack + (comp,)), 1)
        memo[comp] = found
        return found

    return [{"kind": kind, "bytes": size, "group": group, "count": runs, "scope": scope}
            for (kind, size, group, scope), runs in sorted(count(entry).items(), key=lambda kv: -kv[0][1] * kv[1])]


def _callees(rest: str) -> list[str]:
    """The computations an instruction calls, from its attributes: `calls=`, `to_apply=` and
    `called_computations={...}` (a fusion, a call, an async wrapper, a custom-call fusion)."""
    names = re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest)
    for group in re.findall(r"\b(?:called_computations|calls)=\{([^}]*)\}", rest):
        names += [n.strip().lstrip("%") for n in group.split(",") if n.strip()]
    return list(dict.fromkeys(names))


def _scope(rest: str) -> str:
    m = re.search(r'op_name="([^"]*)"', rest)
    name = re.sub(r"^jit\([^)]*\)/", "", m.group(1)) if m else ""
    return re.sub(r"blocks_\d+", "blocks_N", name)


def wire_bytes_and_steps(kind: str, size: float, n: int) -> tuple[float, int]:
    """(bytes each chip sends on the ring, sequential ring steps) for one collective (module docstring)."""
    if n <= 1:
        return 0.0, 0
    frac = (n - 1) / n
    if kind == "all-reduce":
        return 2 * frac * size, 2 * (n - 1)
    if kind in ("all-gather", "reduce-scatter"):
        return frac * size, n - 1
    if kind == "all-to-all":
        return frac * size * max(1.0, n / 4), n - 1
    if kind == "collective-permute":
        return float(size), 1
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {', '.join(KINDS)}")


def ici_seconds(items: Iterable[dict], ring_bytes_per_s: float, hop_latency_s: float = DEFAULT_HOP_LATENCY_S) -> dict:
    """The collectives' time on the links, run one after another: {"seconds", "bandwidth_seconds",
    "latency_seconds", "by_kind": {kind: seconds}, "bytes_on_wire"}."""
    by_kind: Counter = Counter()
    bw_s = lat_s = wire = 0.0
    for c in items:
        sent, steps = wire_bytes_and_steps(c["kind"], c["bytes"], c["group"])
        t_bw, t_lat = c["count"] * sent / ring_bytes_per_s, c["count"] * steps * hop_latency_s
        bw_s += t_bw
        lat_s += t_lat
        wire += c["count"] * sent
        by_kind[c["kind"]] += t_bw + t_lat
    return {"seconds": bw_s + lat_s, "bandwidth_seconds": bw_s, "latency_seconds": lat_s,
            "bytes_on_wire": wire, "by_kind": dict(by_kind)}


def summary(items: Iterable[dict]) -> dict:
    """{kind: {"count", "bytes"}} totals per kind (bytes x count)."""
    out: dict = {}
    for c in items:
        k = out.setdefault(c["kind"], {"count": 0, "bytes": 0})
        k["count"] += c["count"]
        k["bytes"] += c["count"] * c["bytes"]
    return out
