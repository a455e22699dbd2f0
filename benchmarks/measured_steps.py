"""Floors beside steps measured on real TPUs: a floor must stay below each (it is a bound).

Each row compiles ``examples/train.py`` ahead of time (libtpu, no TPU) with the model, slice,
global batch and options of a step someone measured on that slice, and sets our figures
beside the measurement: the step-time floor, the HBM roofline reported beside it
(:mod:`dtensor.analysis.roofline`) and ``measured / floor``, the headroom a user reads.

    python -m benchmarks.measured_steps             # every row (minutes each)
    python -m benchmarks.measured_steps --rows 0    # one row, the others kept
    python -m benchmarks.measured_steps --markdown  # the guide's table

The measured steps (their sources):

- Llama 3.1 70B on Ironwood, tpu7x-128 (4x4x4, 64 chips), global batch 256 x 8192 tokens,
  bf16: 12.20 s a step (AI-Hypercomputer/tpu-recipes, training/ironwood/README.md: 1207
  TFLOP/s a chip). Ours: ``FullyShardedStrategy`` with ``MixedPrecision()``, ``remat=(Block,)``,
  scanned layers and the loss by token slices (the recipe's MaxText config: fsdp over every
  device, full remat).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common

REPO = Path(__file__).resolve().parents[1]

#: ``(size, topology, strategy, global batch, sequence length, extra train.py arguments,
#: the measured step in seconds, its source)``.
ROWS: list[tuple[str, str, str, int, int, tuple[str, ...], float, str]] = [
    (
        "llama3.1-70b",
        "tpu7x-128",
        "fully_sharded",
        256,
        8192,
        ("--loss-chunks", "8", "--loss-tiling", "tokens"),
        12.20,
        "tpu-recipes training/ironwood/README.md, Llama 3.1 70B bf16",
    ),
]


def measure(row: tuple[str, str, str, int, int, tuple[str, ...], float, str]) -> dict[str, Any]:
    """Compile one row in its own process; its figures beside the measured step."""
    size, topology, strategy, batch, seq, extra, step, source = row
    args = ["--model-size", size, "--batch-size", str(batch), "--seq-len", str(seq), *extra]
    args += ["--mixed-precision", "bf16", "--remat", "--scan"]
    data, seconds, shown = common.aot_train(topology, strategy, args)
    report = data["report"]
    figures = common.memory_figures(report)
    floor = report.get("step_floor") or {}
    floor_s = figures["floor_ms"] / 1e3
    return {
        "size": size,
        "topology": topology,
        "strategy": strategy,
        "global_batch": batch,
        "seq_len": seq,
        "options": " ".join(extra),
        **{k: figures[k] for k in ("mesh", "peak_gib", "fits", "floor_ms", "floor_bound")},
        "hbm_roofline_ms": round(floor.get("hbm_seconds", 0.0) * 1e3, 1),
        "measured_s": step,
        "measured_source": source,
        "measured_over_floor": round(step / floor_s, 3),
        "floor_is_below": floor_s < step,
        "roofline_is_below": floor.get("hbm_seconds", 0.0) < step,
        "compile_seconds": round(seconds, 1),
        "command": " ".join(shown),
    }


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["size"], row["topology"], row["global_batch"], row["seq_len"], row["options"]


def _key_of_spec(spec: tuple[Any, ...]) -> tuple[Any, ...]:
    size, topology, _, batch, seq, extra, _, _ = spec
    return size, topology, batch, seq, " ".join(extra)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The guide's table of ``rows``."""
    lines = [
        "| model | slice | global batch | ours | peak | floor | HBM roofline | measured | measured / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['topology']} | {r['global_batch']} x {r['seq_len']} | "
            f"`{r['strategy']}` {r['mesh']} | {r['peak_gib']:.2f} GiB | {r['floor_ms']:.1f} ms "
            f"({r['floor_bound']}) | {r['hbm_roofline_ms']:.1f} ms | {r['measured_s']:.2f} s | "
            f"{r['measured_over_floor']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markdown", action="store_true", help="print the guide's table and exit")
    args = p.parse_args(argv)
    path = (args.out or REPO / "benchmarks" / "results") / "measured_steps.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())["rows"]))
        return 0
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    rows = common.measure_rows(
        "measured_steps",
        ROWS,
        picked,
        measure,
        _key,
        _key_of_spec,
        args.out,
        merge=bool(args.rows),
    )
    common.print_table(
        "Floors beside steps measured on TPUs",
        [
            "model",
            "slice",
            "tokens",
            "peak GiB",
            "floor ms",
            "HBM roofline ms",
            "measured s",
            "ratio",
        ],
        [
            [
                r["size"],
                r["topology"],
                f"{r['global_batch']} x {r['seq_len']}",
                r["peak_gib"],
                r["floor_ms"],
                r["hbm_roofline_ms"],
                r["measured_s"],
                r["measured_over_floor"],
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
