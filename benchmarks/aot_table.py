"""The TPU AOT reports (`dgemma compile --out`) side by side: memory, HBM traffic against what the step must
read, the projected step with and without its collectives on the ICI, as a markdown table.

    python benchmarks/aot_table.py benchmarks/results/aot_26b_*_step.json

Every number is read from the reports, which are projections from the TPU compiler's output (FLOPs, HBM
traffic, collectives priced by `dgemma_jax.perf.collectives`), not measurements on a TPU.
"""

from __future__ import annotations

import argparse
import json

COLUMNS = ("slice", "weights", "step GB/chip (limit)", "step HBM GB", "required GB (ratio)", "step ms (HBM/FLOPs)",
           "ICI ms (bandwidth + latency)", "step ms, ICI after", "step ms, ICI hidden", "commit ms", "tokens/s, ICI after")


def row(report: dict) -> list[str]:
    step = report["programs"]["denoise_step"]
    commit = report["programs"].get("commit", {})
    ici = step.get("ici", {})
    proj = report.get("projection", {})
    ms = lambda s: f"{1e3 * s:.2f}"  # noqa: E731
    return [
        report["topology"],
        "int8" if report.get("quantize") == "int8" else report.get("dtype", "bfloat16"),
        f"{step['total_bytes'] / 1e9:.2f} ({report['hbm_limit_bytes'] / 1e9:.2f})",
        f"{step['hbm_bytes'] / 1e9:.2f}",
        f"{step['required_bytes'] / 1e9:.2f} ({step['hbm_bytes_ratio']:.2f}x)",
        ms(step["projected_seconds"]),
        f"{ms(ici.get('seconds', 0.0))} ({ms(ici.get('bandwidth_seconds', 0.0))} + {ms(ici.get('latency_seconds', 0.0))})",
        ms(step.get("projected_seconds_with_ici", step["projected_seconds"])),
        ms(step.get("projected_seconds_ici_overlapped", step["projected_seconds"])),
        ms(commit["projected_seconds"]) if "projected_seconds" in commit else "-",
        f"{proj['tokens_per_second_with_ici']:.0f}" if proj.get("tokens_per_second_with_ici") else "-",
    ]


def table(reports: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in reports]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", help="JSON files written by dgemma compile --out")
    args = ap.parse_args(argv)
    reports = []
    for path in args.reports:
        with open(path) as f:
            reports.append(json.load(f))
    print(table(reports))


if __name__ == "__main__":
    main()
