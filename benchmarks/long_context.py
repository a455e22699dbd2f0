"""Long sequences: ``HybridStrategy(context=C)`` and the attention kernels, compiled ahead of time.

    python -m benchmarks.long_context [--rows 0,1] [--out DIR]
    python -m benchmarks.long_context --markdown      # the guide's table, from the results file

Each row compiles ``examples/train.py``'s decoder train step (AdamW, bfloat16
``MixedPrecision``, ``remat=(Block,)``, scanned layers) with ``python -m
dtensor.aot`` in its own process, for a TPU topology (libtpu, no TPU) or a GPU
one (XLA:GPU, no GPU), and keeps from the JSON report: the peak per chip
(arguments + outputs - aliased + temporaries + code, as MaxText's figure), its
parts, whether it fits, the step-time floor and MFU ceiling, and the bytes
:func:`dtensor.context_attention` moves over ``context``. MaxText's figure for
the same model, topology, batch and context size (maxtext 0.2.5, libtpu 0.0.50,
``ici_context_parallelism=8``, its defaults; from the issue) is printed beside.
Writes ``benchmarks/results/long_context.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common

GIB = float(1 << 30)
REPO = Path(__file__).resolve().parents[1]

#: ``(size, topology, strategy, global batch, sequence length, extra train.py arguments)``.
ROWS: list[tuple[str, str, str, int, int, tuple[str, ...]]] = [
    ("llama3.1-8b", "v5p:4x4x2", "hybrid", 32, 32768, ("--context", "8", "--attention", "splash")),
    (
        "llama3.1-8b",
        "v5p:4x4x2",
        "hybrid",
        32,
        32768,
        ("--context", "8", "--attention", "splash", "--loss-chunks", "8"),
    ),
    (
        "llama3.1-8b",
        "v5p:4x4x2",
        "hybrid",
        32,
        32768,
        (
            "--context",
            "8",
            "--attention",
            "splash",
            "--loss-chunks",
            "8",
            "--loss-tiling",
            "tokens",
        ),
    ),
    (
        "llama3.1-8b",
        "v5p:4x4x2",
        "hybrid",
        8,
        131072,
        ("--context", "8", "--attention", "splash", "--loss-chunks", "8"),
    ),
    # torchtitan's Llama 3 70B row (64 A100 80GB, local batch 1 x 8192, full AC) with cuDNN's
    # fused attention, and the same tokens per GPU on 64 H100s.
    ("llama2-70b", "a100-80gb:8x8", "fully_sharded", 64, 8192, ("--attention", "cudnn")),
    ("llama2-70b", "h100:8x8", "fully_sharded", 64, 8192, ("--attention", "cudnn")),
    # Ulysses: row 1 with q/k/v/out all-to-alls in place of the K/V gathers; and 131072
    # tokens over context 16 on 64 chips, past Llama 3.1 8B's 8 KV heads (each repeated
    # twice), where MaxText's Ulysses stops.
    (
        "llama3.1-8b",
        "v5p:4x4x2",
        "hybrid",
        32,
        32768,
        (
            "--context",
            "8",
            "--attention",
            "splash",
            "--loss-chunks",
            "8",
            "--context-mode",
            "ulysses",
        ),
    ),
    (
        "llama3.1-8b",
        "v5p:4x4x4",
        "hybrid",
        8,
        131072,
        (
            "--context",
            "16",
            "--attention",
            "splash",
            "--loss-chunks",
            "8",
            "--context-mode",
            "ulysses",
        ),
    ),
    # ... and the same by the gather
    (
        "llama3.1-8b",
        "v5p:4x4x4",
        "hybrid",
        8,
        131072,
        ("--context", "16", "--attention", "splash", "--loss-chunks", "8"),
    ),
]

#: MaxText's peak per chip (GiB), by ``(size, topology, global batch, sequence length)``.
MAXTEXT: dict[tuple[str, str, int, int], dict[str, float | str]] = {
    ("llama3.1-8b", "v5p:4x4x2", 32, 32768): {
        "peak_gib": 37.97,
        "config": "maxtext 0.2.5, libtpu 0.0.50, ici_context_parallelism=8 (fsdp 4), its defaults",
    }
}


def measure(row: tuple[str, str, str, int, int, tuple[str, ...]]) -> dict[str, Any]:
    """Compile one row in its own process; its figures from the JSON report."""
    size, topology, strategy, batch, seq, extra = row
    args = ["--model-size", size, "--batch-size", str(batch), "--seq-len", str(seq), *extra]
    args += ["--mixed-precision", "bf16", "--remat", "--scan"]
    data, seconds, shown = common.aot_train(topology, strategy, args)
    report = data["report"]
    figures = common.memory_figures(report)
    result = {
        "size": size,
        "topology": topology,
        "strategy": strategy,
        "global_batch": batch,
        "seq_len": seq,
        "options": " ".join(extra),
        **{k: figures[k] for k in _FIGURES},
        "context_gib": round(report.get("context_bytes_per_device", 0.0) / GIB, 2),
        "comm_gib": figures["comm_gib"],
        "compile_seconds": round(seconds, 1),
        "command": " ".join(shown),
    }
    side = MAXTEXT.get((size, topology, batch, seq))
    if side:
        result["maxtext_peak_gib"] = side["peak_gib"]
        result["ratio_to_maxtext"] = round(result["peak_gib"] / side["peak_gib"], 3)
        result["maxtext"] = side
    return result


_FIGURES = (
    "mesh",
    "peak_gib",
    "hbm_gib",
    "arguments_gib",
    "temporaries_gib",
    "fits",
    "floor_ms",
    "floor_bound",
    "mfu_ceiling",
)


def _key(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["size"], row["topology"], row["global_batch"], row["seq_len"], row["options"]


def _key_of_spec(spec: tuple[str, str, str, int, int, tuple[str, ...]]) -> tuple[Any, ...]:
    size, topology, _, batch, seq, extra = spec
    return size, topology, batch, seq, " ".join(extra)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The guide's table of ``rows``."""
    lines = [
        "| model | topology | mesh | global batch | options | peak per chip | MaxText | fits | floor | MFU ceiling | K/V over context |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mt = f"{r['maxtext_peak_gib']:.2f} GiB" if r.get("maxtext_peak_gib") else "-"
        mfu = f"{r['mfu_ceiling']:.1%}" if r.get("mfu_ceiling") else "-"
        ctx = f"{r['context_gib']:.2f} GiB" if r.get("context_gib") else "-"
        lines.append(
            f"| {r['size']} | {r['topology']} | {r['mesh'].removeprefix('Mesh')} | "
            f"{r['global_batch']} x {r['seq_len']} | `{r['options']}` | {r['peak_gib']:.2f} GiB | "
            f"{mt} | {'yes' if r['fits'] else 'no'} | {r['floor_ms']:.1f} ms ({r['floor_bound']}) "
            f"| {mfu} | {ctx} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated row indices (default: all)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--markdown", action="store_true", help="print the guide's table and exit")
    args = p.parse_args(argv)
    path = (args.out or REPO / "benchmarks" / "results") / "long_context.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())["rows"]))
        return 0
    picked = [ROWS[int(i)] for i in args.rows.split(",")] if args.rows else ROWS
    # --rows re-measures those rows and keeps the others of the results file, in ROWS' order.
    rows = common.measure_rows(
        "long_context", ROWS, picked, measure, _key, _key_of_spec, args.out, merge=bool(args.rows)
    )
    common.print_table(
        "Long context: compiled ahead of time",
        ["model", "topology", "mesh", "tokens", "options", "peak GiB", "MaxText GiB", "floor ms"],
        [
            [
                r["size"],
                r["topology"],
                r["mesh"],
                f"{r['global_batch']} x {r['seq_len']}",
                r["options"],
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
