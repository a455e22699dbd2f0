"""Pipelines: ``HybridStrategy(stage=S)`` across slices (and hosts), compiled ahead of time.

Every schedule: GPipe, circular, 1F1B (at 8, 16 and 32 microbatches of 32 rows beside
GPipe's, to show what each holds as ``M`` grows), interleaved 1F1B and zero-bubble.

    python -m benchmarks.pipeline [--rows 0,1] [--out DIR]
    python -m benchmarks.pipeline --markdown      # the guide's table, from the results file

Each row compiles ``examples/train.py``'s decoder train step (AdamW, bfloat16
``MixedPrecision``, ``remat=(Block,)``, scanned layers) with ``python -m
dtensor.aot`` in its own process, for a TPU topology (libtpu, no TPU) or a GPU
one (XLA:GPU, no GPU), and keeps from the JSON report: the peak per chip
(arguments + outputs - aliased + temporaries + code, as MaxText's figure), its
parts, whether it fits, the step-time floor (the bubble's idle computation is
in the compiled program, so in the floor), the schedule and its bubble
fraction, and the collective permutes over ``stage`` by network. The same
model with data parallelism across the slices is measured in the same run,
and MaxText's figure (maxtext 0.2.5, libtpu 0.0.50, from the issue) printed
beside. Writes ``benchmarks/results/pipeline.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common


def _staged(microbatches: int, schedule: str | None = None) -> tuple[str, ...]:
    """``train.py``'s arguments for two stages of ``microbatches`` (and a schedule)."""
    args = ("--stage", "2", "--microbatches", str(microbatches))
    return args + (("--schedule", schedule) if schedule else ())


#: ``(size, topology, slices, global batch, extra train.py arguments)``.
ROWS: list[tuple[str, str, int, int, tuple[str, ...]]] = [
    ("llama2-70b", "v5p:4x4x2", 2, 64, ("--stage", "2", "--microbatches", "2")),
    ("llama2-70b", "v5p:4x4x2", 2, 64, ("--stage", "2", "--microbatches", "4")),
    # MaxText's default schedule (one layer per stage per round, 40 rounds) on our stored
    # [layers] stack: re-stacked by stage over DCN in every step.
    (
        "llama2-70b",
        "v5p:4x4x2",
        2,
        64,
        ("--stage", "2", "--microbatches", "2", "--schedule", "circular"),
    ),
    ("llama2-70b", "v5p:4x4x2", 2, 64, ("--across-slices", "data")),
    # 1F1B (forward and backward interleaved, ~2S microbatches held) on the same batch; then
    # 32-row microbatches at M = 8, 16, 32 (the batch grows with M), 1F1B's beside GPipe's;
    # zero-bubble (its weight gradients run the layers' backward again) and interleaved 1F1B
    # (one layer a stage a round: 40 rounds, the stored stack re-stacked by stage as circular's).
    ("llama2-70b", "v5p:4x4x2", 2, 64, _staged(2, "1f1b")),
    *(("llama2-70b", "v5p:4x4x2", 2, 32 * m, _staged(m, "1f1b")) for m in (8, 16, 32)),
    *(("llama2-70b", "v5p:4x4x2", 2, 32 * m, _staged(m)) for m in (8, 16, 32)),
    ("llama2-70b", "v5p:4x4x2", 2, 64, _staged(2, "zero-bubble")),
    ("llama2-70b", "v5p:4x4x2", 2, 64, _staged(2, "interleaved-1f1b")),
    # 8 hosts of 8 H100s: stage 0 on hosts 0-3, stage 1 on hosts 4-7 (InfiniBand between).
    ("llama2-70b", "h100:8x8", 1, 64, ("--stage", "2", "--microbatches", "2")),
]

#: MaxText's peak per chip (GiB), by ``(size, topology, slices, global batch, options)``.
MAXTEXT: dict[tuple[Any, ...], dict[str, Any]] = {
    ("llama2-70b", "v5p:4x4x2", 2, 64, "--stage 2 --microbatches 2"): {
        "peak_gib": 24.30,
        "config": "maxtext 0.2.5, libtpu 0.0.50, dcn_pipeline_parallelism=2 "
        "dcn_data_parallelism=1 num_pipeline_microbatches=2 (arguments 12.1, temporaries 12.1)",
    },
    ("llama2-70b", "v5p:4x4x2", 2, 64, "--across-slices data"): {
        "peak_gib": 42.77,
        "config": "maxtext 0.2.5, libtpu 0.0.50, dcn_data_parallelism=2",
    },
}


def measure(row: tuple[str, str, int, int, tuple[str, ...]]) -> dict[str, Any]:
    """Compile one row in its own process; its figures from the JSON report."""
    size, topology, slices, batch, extra = row
    args = ["--model-size", size, "--batch-size", str(batch), *extra]
    args += ["--mixed-precision", "bf16", "--remat", "--scan", *common.XLA_ATTENTION]
    data, seconds, shown = common.aot_train(topology, "hybrid", args, num_slices=slices)
    report = data["report"]
    gib = float(1 << 30)
    result = {
        "size": size,
        "topology": topology,
        "slices": slices,
        "global_batch": batch,
        "options": " ".join(extra),
        **common.memory_figures(report),
        "schedule": report.get("pipeline_schedule") or "-",
        "bubble_fraction": report.get("bubble_fraction", 0.0),
        "stage_permute_gib": round(report.get("stage_bytes_per_device", 0.0) / gib, 3),
        "stage_permute_by_network_gib": {
            k: round(v / gib, 3) for k, v in (report.get("stage_bytes_by_network") or {}).items()
        },
        "compile_seconds": round(seconds, 1),
        "command": " ".join(shown),
    }
    side = MAXTEXT.get((size, topology, slices, batch, " ".join(extra)))
    if side:
        result["maxtext_peak_gib"] = side["peak_gib"]
        result["ratio_to_maxtext"] = round(result["peak_gib"] / side["peak_gib"], 3)
        result["maxtext"] = side
    return result


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["size"], row["topology"], row["slices"], row["global_batch"], row["options"]


def _key_of_spec(spec: tuple[str, str, int, int, tuple[str, ...]]) -> tuple[Any, ...]:
    size, topology, slices, batch, extra = spec
    return size, topology, slices, batch, " ".join(extra)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The guide's table of ``rows``."""
    lines = [
        "| model | topology | mesh | options | schedule | bubble | peak per chip | MaxText | floor | stage permutes | DCN / IB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        where = f"{r['slices']} x {r['topology']}" if r["slices"] > 1 else r["topology"]
        mt = f"{r['maxtext_peak_gib']:.2f} GiB" if r.get("maxtext_peak_gib") else "-"
        nets = r.get("stage_permute_by_network_gib") or {}
        permutes = (
            ", ".join(f"{k} {v:.2f} GiB" for k, v in sorted(nets.items()))
            if nets
            else (f"{r['stage_permute_gib']:.2f} GiB" if r["stage_permute_gib"] else "-")
        )
        cross = r.get("dcn_gib") if r["slices"] > 1 else r.get("ib_gib")
        lines.append(
            f"| {r['size']} | {where} | {r['mesh'].removeprefix('Mesh')} | `{r['options']}` | "
            f"{r['schedule']} | {r['bubble_fraction']:.0%} | {r['peak_gib']:.2f} GiB | {mt} | "
            f"{r['floor_ms']:.0f} ms ({r['floor_bound']}) | {permutes} | "
            f"{'-' if cross is None else f'{cross:.2f} GiB'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    p.add_argument("--out", default=None)
    p.add_argument("--markdown", action="store_true", help="print the guide's table and exit")
    args = p.parse_args(argv)
    out = None if args.out is None else Path(args.out)
    path = (out or common.RESULTS) / "pipeline.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())["rows"]))
        return 0
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    # --rows re-measures those rows and keeps the others of the results file.
    rows = common.measure_rows(
        "pipeline", ROWS, picked, measure, _key, _key_of_spec, out, merge=bool(args.rows)
    )
    common.print_table(
        "Pipelines: compiled ahead of time",
        [
            "model",
            "topology",
            "options",
            "schedule",
            "bubble",
            "peak GiB",
            "MaxText GiB",
            "floor ms",
        ],
        [
            [
                r["size"],
                f"{r['slices']} x {r['topology']}",
                r["options"],
                r["schedule"],
                f"{r['bubble_fraction']:.0%}",
                r["peak_gib"],
                r.get("maxtext_peak_gib", "-"),
                r["floor_ms"],
            ]
            for r in rows
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
