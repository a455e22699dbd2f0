"""Mixtures of experts under ``HybridStrategy(expert=E)``, compiled ahead of time beside MaxText.

    python -m benchmarks.experts [--rows 0,1] [--out DIR]
    python -m benchmarks.experts --markdown      # the guide's table, from the results file

Each row compiles ``examples/train.py``'s decoder train step (AdamW, bfloat16
``MixedPrecision``, ``remat=(Block,)``, scanned layers; 1024 tokens) with
``python -m dtensor.aot --strategy hybrid ... --expert E`` in its own process,
for a TPU topology (libtpu, no TPU) or a GPU one (XLA:GPU, no GPU), and keeps
from the JSON report: the peak per chip (arguments + outputs - aliased +
temporaries + code, as MaxText's figure), its parts, the step-time floor and
MFU ceiling, the all-to-all bytes of the token dispatch, their minimum and the
receive buffers' capacity. MaxText's figure for the same model, topology and
batch (maxtext 0.2.5, libtpu 0.0.50, ``ici_expert_parallelism=8``, its
defaults: dropless routing, megablox grouped matmuls; measured with
``benchmarks.maxtext_side``'s driver, 21 min to compile on 2 cores) is
printed beside. Writes ``benchmarks/results/experts.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common

GIB = float(1 << 30)
REPO = Path(__file__).resolve().parents[1]

#: ``(size, topology, expert, global batch)``.
ROWS: list[tuple[str, str, int, int]] = [
    ("mixtral-8x7b", "v5p:4x4x2", 8, 32),
    ("mixtral-8x7b", "h100:2x8", 8, 16),
    ("tiny-moe", "v5e:2x4", 4, 8),
]

#: MaxText's peak per chip (GiB) and its parts, by ``(size, topology, global batch)``.
MAXTEXT: dict[tuple[str, str, int], dict[str, float | str]] = {
    ("mixtral-8x7b", "v5p:4x4x2", 32): {
        "peak_gib": 28.00,
        "arguments_gib": 16.3,
        "temporaries_gib": 11.6,
        "config": "maxtext 0.2.5, libtpu 0.0.50, ici_expert_parallelism=8 (fsdp 4), dropless, megablox",
    }
}


def measure(size: str, topology: str, expert: int, batch: int) -> dict[str, Any]:
    """Compile one row in its own process; its figures from the JSON report."""
    args = ["--model-size", size, "--expert", str(expert), "--batch-size", str(batch)]
    args += ["--mixed-precision", "bf16", "--remat", "--scan", *common.XLA_ATTENTION]
    data, seconds, shown = common.aot_train(topology, "hybrid", args)
    report, fit = data["report"], data["report"].get("memory_fit") or {}
    gib = lambda v: None if v is None else round(v / GIB, 2)  # noqa: E731
    row = {
        "size": size,
        "topology": topology,
        "expert": expert,
        "global_batch": batch,
        "mesh": report["mesh"],
        "peak_gib": gib(fit.get("bytes_per_chip", report["peak_bytes_per_device"])),
        "arguments_gib": gib(report["argument_bytes_per_device"]),
        "temporaries_gib": gib(report["temp_bytes_per_device"]),
        "fits": data.get("fits"),
        "floor_ms": round(report["step_time_floor_seconds"] * 1e3, 1),
        "floor_bound": (report.get("step_floor") or {}).get("bound"),
        "mfu_ceiling": report.get("mfu_ceiling"),
        "dispatch_mib": round(report["dispatch_bytes_per_device"] / (1 << 20), 2),
        "dispatch_min_mib": round(report["dispatch_min_bytes_per_device"] / (1 << 20), 2),
        "dispatch_capacity": report["dispatch_capacity"],
        "comm_gib": gib(report["comm_bytes_per_device"]),
        "compile_seconds": round(seconds, 1),
        "command": " ".join(shown),
    }
    row["ici_ms"] = round((report.get("step_floor") or {}).get("ici_seconds", 0.0) * 1e3, 1)
    side = MAXTEXT.get((size, topology, batch))
    if side:
        row["maxtext_peak_gib"] = side["peak_gib"]
        row["ratio_to_maxtext"] = round(row["peak_gib"] / side["peak_gib"], 3)
        row["maxtext"] = side
        row.update(maxtext_measured(size, topology))
    return row


def maxtext_measured(size: str, topology: str) -> dict[str, Any]:
    """MaxText's own compile of the row, from ``benchmarks.maxtext_side``'s results file
    (its row 6): peak, and the floor's ICI term. Its compute term is not comparable: the
    FLOPs of its megablox grouped matmuls (Pallas kernels whose grids depend on the
    routing) are not counted from its jaxpr, so its floor reads low."""
    path = REPO / "benchmarks" / "results" / "maxtext_side.json"
    rows = json.loads(path.read_text())["rows"] if path.exists() else []
    for r in rows:
        if (r["size"], r["topology"]) == (size, topology) and r.get("step_floor"):
            return {
                "maxtext_measured_peak_gib": round(r["peak_bytes_per_chip"] / GIB, 2),
                "maxtext_ici_ms": round(r["step_floor"]["ici_seconds"] * 1e3, 1),
                "maxtext_counted_tflops_per_chip": round(
                    r["step_floor"]["flops_per_device"] / 1e12, 1
                ),
                "maxtext_libtpu": r["libtpu"],
            }
    return {}


def markdown(rows: list[dict[str, Any]]) -> str:
    """The guide's table of ``rows``."""
    lines = [
        "| model | topology | mesh | global batch | peak per chip | MaxText | floor | MFU ceiling | dispatch all-to-all (minimum) | receive buffers |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mt = f"{r['maxtext_peak_gib']:.2f} GiB" if r.get("maxtext_peak_gib") else "-"
        mfu = f"{r['mfu_ceiling']:.1%}" if r.get("mfu_ceiling") else "-"
        lines.append(
            f"| {r['size']} | {r['topology']} | {r['mesh'].removeprefix('Mesh')} | "
            f"{r['global_batch']} x 1024 | {r['peak_gib']:.2f} GiB | {mt} | "
            f"{r['floor_ms']:.1f} ms ({r['floor_bound']}) | {mfu} | "
            f"{r['dispatch_mib']:,.2f} MiB ({r['dispatch_min_mib']:,.2f}) | "
            f"{r['dispatch_capacity']:.0f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markdown", action="store_true", help="print the guide's table and exit")
    args = p.parse_args(argv)
    path = (args.out or REPO / "benchmarks" / "results") / "experts.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())["rows"]))
        return 0
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    rows = []
    for spec in picked:
        rows.append(measure(*spec))
        common.write_json(
            "experts",
            {"benchmark": "experts", "rows": rows, "environment": common.environment()},
            args.out,
        )
    common.print_table(
        "HybridStrategy(expert=E): compiled ahead of time",
        [
            "model",
            "topology",
            "mesh",
            "peak GiB",
            "MaxText GiB",
            "floor ms",
            "dispatch MiB (min)",
            "capacity",
        ],
        [
            [
                r["size"],
                r["topology"],
                r["mesh"],
                r["peak_gib"],
                r.get("maxtext_peak_gib", "-"),
                r["floor_ms"],
                f"{r['dispatch_mib']} ({r['dispatch_min_mib']})",
                r["dispatch_capacity"],
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
