"""HBM traffic of the sampling head's vocab-chunk scan on a vocabulary-split mesh, by row parts.

    python benchmarks/head_parts_projection.py --out benchmarks/results/head_parts_v6e-8.json

Compiles `sampling.fused.head_sample_stats_split` alone for the 26B's head shapes (hidden 2,816, vocab
262,144, bfloat16 table, 256-token canvases) on the serving mesh of a v6e-8 (`data=2,expert=4`) with the
TPU compiler (no TPU needed), once per `CARRY_ON_CHIP_BYTES` (the most bytes of running soft-embedding
sum one scan carries; rows past it are scanned in parts), and reads each program's HBM traffic
(`perf.hbm_traffic`) and temporaries. A projection from the compiler's output, not a TPU measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from dgemma_jax.parallel import make_mesh  # noqa: E402
from dgemma_jax.axis_rules import rules_for  # noqa: E402
from dgemma_jax.perf.aot import tpu_devices  # noqa: E402
from dgemma_jax.perf.hbm_traffic import hbm_traffic  # noqa: E402
from dgemma_jax.perf.report import write  # noqa: E402
from dgemma_jax.runtime import Runtime  # noqa: E402
from dgemma_jax.sampling import fused  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--topology", default="v6e-8")
    ap.add_argument("--mesh", default="data=2,expert=4")
    ap.add_argument("--slots", default="32")
    ap.add_argument("--carry", default="1000000000,33554432", help="CARRY_ON_CHIP_BYTES values (bytes)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    mesh = make_mesh(args.mesh, devices=tpu_devices(args.topology))
    rt = Runtime(platform="tpu", mesh=mesh, rules=rules_for("serving", mesh))
    length, hidden, vocab = 256, 2816, 262144
    sh = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    rows = []
    for slots in [int(x) for x in args.slots.split(",")]:
        h = jax.ShapeDtypeStruct((slots, length, hidden), jnp.bfloat16, sharding=sh(P("data")))
        table = jax.ShapeDtypeStruct((vocab, hidden), jnp.bfloat16, sharding=sh(P("expert")))
        keys = jax.ShapeDtypeStruct((slots, 2), jnp.uint32, sharding=sh(P("data")))
        temps = jax.ShapeDtypeStruct((slots, 1, 1), jnp.float32, sharding=sh(P("data")))
        for carry in [int(x) for x in args.carry.split(",")]:
            fused.CARRY_ON_CHIP_BYTES = carry
            t0 = time.time()
            compiled = jax.jit(lambda h, e, k, t: fused.head_sample_stats_split(h, e, 30.0, t, k, 5.0, rt)).lower(
                h, table, keys, temps).compile()
            row = {"slots": slots, "carry_on_chip_bytes": carry,
                   "hbm_gb": round(hbm_traffic(compiled.as_text())["total"] / 1e9, 3),
                   "temp_mb": round(compiled.memory_analysis().temp_size_in_bytes / 2 ** 20, 1),
                   "compile_seconds": round(time.time() - t0, 1)}
            print(row, flush=True)
            rows.append(row)
    write({"label": "projection from the TPU compiler's output (the 26B's sampling head alone, "
                              "per chip), not a measurement on a TPU",
                     "command": "python benchmarks/head_parts_projection.py " + " ".join(argv or sys.argv[1:]),
                     "topology": args.topology, "mesh": args.mesh, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
