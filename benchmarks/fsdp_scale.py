"""FullyShardedStrategy at Gemma 2B / 7B scale, compiled ahead of time for TPU topologies.

    python -m benchmarks.fsdp_scale [--sizes 2b,7b] [--topologies v5e:4x4,v5p:2x2x2] [--out DIR]

For each model size, topology and preset option (the default gather-at-read
plan; ``reshard_after_forward=False``; ``gather_at_read=False``, XLA's own
plan; bfloat16 mixed precision; bfloat16 + remat) the demo's decoder train
step (``examples/train.py --model-size SIZE``, global batch 16 x 1024, AdamW)
is compiled by the TPU compiler (``dtensor.tpu_topology``: no TPU needed),
and, for the tiny decoder, by the CPU compiler over 8 simulated devices. Each
row: XLA's peak per chip, the ideal peak (the ZeRO formula,
``dtensor.analysis.peak``), communication over its minimum, all-gather bytes,
compile seconds, and how each option was applied (by the preset, by the
model when the preset does not take it, or "not available"). Each compile
runs in its own process (a 7B compile holds several GiB). Writes
``benchmarks/results/fsdp_scale.json`` (after every row) and prints the
table and the targets. GPU topologies (``h100:1x8``, :func:`dtensor.gpu_topology`,
compiled by XLA:GPU) write ``benchmarks/results/fsdp_scale_gpu.json`` instead::

    python -m benchmarks.fsdp_scale --sizes 2b --topologies h100:1x8 --cpu-sizes "" \
        --options "default,gather at reads,bf16 + remat,bf16 + remat + gather at reads"
    python -m benchmarks.fsdp_scale --sizes llama2-70b --topologies h100:8x8 --cpu-sizes "" \
        --options "bf16 + remat + scan" --merge
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import shlex
import sys
import threading
from pathlib import Path
from typing import Any

from . import common
from .fsdp_measure import (
    DEMO,
    NEEDS,
    OPTIONS,
    PRECISION,
    ROOT,
    child_row,
    measure,
    skipped_row,
    unavailable,
)
from .fsdp_tables import (
    BATCH,
    MAXTEXT_GIB,
    MAXTEXT_ORDER,
    MAXTEXT_ROWS,
    OPTION_TEXT,
    compact,
    markdown,
    results_name,
    side_by_side,
    slices_table,
)

__all__ = [
    "BATCH",
    "DEMO",
    "MAXTEXT_GIB",
    "MAXTEXT_ROWS",
    "NEEDS",
    "OPTIONS",
    "OPTION_TEXT",
    "PRECISION",
    "PRIORITY",
    "ROOT",
    "markdown",
    "measure",
    "results_name",
    "side_by_side",
    "targets",
]

#: the cases the targets are judged on come first (the whole run takes a while)
PRIORITY = [
    ("7b", "v5e:4x4", "bf16 + remat"),
    ("2b", "v5e:4x4", "default"),
    ("2b", "v5e:4x4", "bf16"),
    ("2b", "v5e:4x4", "f32 highest"),
    ("2b", "v5e:4x4", "gather at reads"),
    ("2b", "v5e:4x4", "bf16 + remat"),
    ("2b", "v5e:4x4", "bf16 + remat + gather at reads"),
    ("2b", "v5e:4x4", "gather at reads, reshard off"),
    ("2b", "v5p:2x2x2", "default"),
    ("7b", "v5p:2x2x2", "bf16 + remat"),
]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the figures it was judged on (``None``: not measured)."""

    def get(size: str, topo: str, option: str) -> dict[str, Any]:
        return next(
            (r for r in rows if (r["size"], r["topology"], r["option"]) == (size, topo, option)), {}
        )

    out = []
    d, g = get("2b", "v5e:4x4", "default"), get("2b", "v5e:4x4", "gather at reads")
    for name, other in (
        ("XLA's own plan", get("2b", "v5e:4x4", "xla plan")),
        ("gather at reads", g),
    ):
        if d.get("peak_bytes_per_chip") and other.get("peak_bytes_per_chip"):
            out.append(
                {
                    "target": f"v5e:4x4 2b default peak <= {name}",
                    "value": d["peak_bytes_per_chip"] / other["peak_bytes_per_chip"],
                    "met": d["peak_bytes_per_chip"] <= other["peak_bytes_per_chip"],
                }
            )
    if d.get("peak_bytes_per_chip") and d.get("ideal_peak_bytes_per_device"):
        ratio = d["peak_bytes_per_chip"] / d["ideal_peak_bytes_per_device"]
        out.append(
            {"target": "v5e:4x4 2b default peak <= 1.3x ideal", "value": ratio, "met": ratio <= 1.3}
        )
    b = get("2b", "v5e:4x4", "bf16")
    for name, ref in (("float32 (HIGHEST)", get("2b", "v5e:4x4", "f32 highest")), ("default", d)):
        if ref.get("all_gather_bytes_per_device") and b.get("all_gather_bytes_per_device"):
            ratio = b["all_gather_bytes_per_device"] / ref["all_gather_bytes_per_device"]
            out.append(
                {
                    "target": f"v5e:4x4 2b bf16 all-gathers <= 0.55x {name}",
                    "value": ratio,
                    "met": ratio <= 0.55,
                }
            )
    for option in ("bf16 + remat", "bf16 + remat + gather at reads"):
        s = get("7b", "v5e:4x4", option)
        if not s:
            continue
        out.append(
            {
                "target": f"v5e:4x4 7b batch 16x1024 fits with {option}",
                "value": s.get("peak_bytes_per_chip") or s.get("required_bytes"),
                "met": bool(s.get("fits")),
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2b,7b")
    p.add_argument("--topologies", default="v5e:4x4,v5p:2x2x2")
    p.add_argument(
        "--options",
        default=None,
        help="options to measure, separated by ',' (or ';' where a name has a comma); default all",
    )
    p.add_argument(
        "--cpu-sizes", default="tiny", help="sizes also compiled for 8 CPU devices ('' for none)"
    )
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    p.add_argument("--jobs", type=int, default=1, help="compiles at once (each in its own process)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of the existing results file that this run does not measure",
    )
    p.add_argument("--row", nargs=3, metavar=("SIZE", "TOPOLOGY", "OPTION"), help=argparse.SUPPRESS)
    p.add_argument(
        "--maxtext",
        action="store_true",
        help="measure the rows of the side-by-side table with MaxText (MAXTEXT_ROWS) instead "
        "of --sizes x --topologies x --options",
    )
    p.add_argument(
        "--markdown",
        metavar="TOPOLOGY",
        help="print the results file's rows for TOPOLOGY as a Markdown table (compiles nothing; "
        "GPU topologies read fsdp_scale_gpu.json; 'maxtext': the side by side with MaxText; "
        "'slices': the rows on several slices, with what crosses DCN; 'compact': the README's "
        "one row a model against MaxText)",
    )
    args = p.parse_args(argv)
    if args.markdown:
        side = (args.out or common.RESULTS) / "maxtext_side.json"  # MaxText's floors
        theirs = json.loads(side.read_text()) if side.exists() else None
        mine = {
            "maxtext": lambda p: side_by_side(p, theirs),
            "slices": slices_table,
            "compact": lambda p: compact(p, theirs or {"rows": []}),
        }
        name = "fsdp_scale" if args.markdown in mine else results_name([args.markdown])
        payload = json.loads(((args.out or common.RESULTS) / f"{name}.json").read_text())
        printer = mine.get(args.markdown)
        print(printer(payload) if printer else markdown(payload, args.markdown))
        return
    if args.row:
        common.ensure_devices()
        size, topology, option = args.row
        batch = BATCH.get(size, args.batch) if topology != "cpu" else args.batch
        print("ROW " + json.dumps(measure(size, topology, option, batch, args.seq), sort_keys=True))
        return
    sep = ";" if args.options is not None and ";" in args.options else ","
    given = args.options.split(sep) if args.options is not None else list(OPTIONS)
    options = [o.strip() for o in given if o.strip()]
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        p.error(f"--options: {unknown} are not options; valid: {', '.join(OPTIONS)}")
    pairs = [(s, t) for s in args.sizes.split(",") if s for t in args.topologies.split(",") if t]
    pairs += [(s, "cpu") for s in args.cpu_sizes.split(",") if s]
    plan = [(s, t, o) for s, t in pairs for o in options]
    if args.maxtext:
        plan = [MAXTEXT_ROWS[i] for i in MAXTEXT_ORDER]
    try:
        name = results_name(sorted({t for _, t, _ in plan}))
    except ValueError as err:
        p.error(str(err))
    # The judged cases first, then the quick CPU rows, then the rest.
    if not args.maxtext:
        plan.sort(
            key=lambda c: PRIORITY.index(c) if c in PRIORITY else len(PRIORITY) + (c[1] != "cpu")
        )
    rows: list[dict[str, Any]] = []
    given_argv = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", "-m", "benchmarks.fsdp_scale", *given_argv])
    payload: dict[str, Any] = {"global_batch": args.batch, "seq_len": args.seq, "rows": rows}
    payload["commands"] = [command]
    done: dict[tuple[str, str, str], dict[str, Any]] = {}
    lock = threading.Lock()
    if args.merge:
        path = (args.out or common.RESULTS) / f"{name}.json"
        if path.exists():
            before = json.loads(path.read_text())
            payload["commands"] = [*before.get("commands", []), command]
            for row in before.get("rows", []):
                case = (row["size"], row["topology"], row["option"])
                if case not in plan:
                    plan.append(case)
                    done[case] = row

    def one(case: tuple[str, str, str]) -> None:
        size, topology, option = case
        seq = args.seq if topology != "cpu" else 64
        batch = BATCH.get(size, args.batch) if topology != "cpu" else args.batch
        row = skipped_row(size, topology, option) or child_row(
            size, topology, option, batch, seq, args.timeout
        )
        if unavailable(row.get("applied", {})):
            row["note"] = "an option is not available in this version of FullyShardedStrategy"
        with lock:
            done[case] = row
            rows[:] = [done[c] for c in plan if c in done]
            payload["targets"] = targets(rows)
            common.write_json(name, payload, args.out)
            print(f"{size} {topology} {option}: {_brief(row)}", flush=True)

    common.ensure_devices()
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(one, [c for c in plan if c not in done]))
    path = common.write_json(name, payload, args.out)
    _print(payload)
    print(f"wrote {path}")


def _brief(row: dict[str, Any]) -> str:
    h = common_human
    if "error" in row and row.get("fits") is not False:
        return "error: " + row["error"].splitlines()[-1][:200] if row["error"] else "error"
    return (
        f"peak {h(row.get('peak_bytes_per_chip') or row.get('required_bytes'))}, "
        f"ideal {h(row.get('ideal_peak_bytes_per_device'))}, fits {row.get('fits')}, "
        f"{row.get('compile_seconds')} s, applied {row.get('applied')}"
    )


def _print(payload: dict[str, Any]) -> None:
    h = common_human
    table = []
    for r in payload["rows"]:
        applied = r.get("applied") or {}
        how = (
            ", ".join(
                f"{k} by {v.split(' ')[0]}" if v != "not available" else f"{k} n/a"
                for k, v in applied.items()
            )
            or "-"
        )
        table.append(
            (
                f"{r['size']} {r['topology']}",
                r["option"],
                h(r.get("peak_bytes_per_chip") or r.get("required_bytes")),
                h(r.get("ideal_peak_bytes_per_device")),
                "-" if r.get("fits") is None else ("yes" if r["fits"] else "NO"),
                "-" if r.get("comm_ratio") is None else f"{r['comm_ratio']:.2f}",
                h(r.get("all_gather_bytes_per_device")),
                "-" if r.get("compile_seconds") is None else f"{r['compile_seconds']:.0f}",
                how if "error" not in r or r.get("fits") is False else "error",
            )
        )
    common.print_table(
        f"FullyShardedStrategy, decoder, global batch {payload['global_batch']} x {payload['seq_len']}, per chip",
        [
            "model / topology",
            "option",
            "peak",
            "ideal peak",
            "fits",
            "comm/min",
            "all-gather",
            "compile s",
            "applied",
        ],
        table,
    )
    common.print_table(
        "targets",
        ["target", "value", "met"],
        [
            (
                t["target"],
                t["value"] if isinstance(t["value"], float) else h(t["value"]),
                "yes" if t["met"] else "NO",
            )
            for t in payload.get("targets", [])
        ],
    )


def common_human(n: float | None) -> str:
    from dtensor.core.text import human_bytes

    return "-" if n is None else human_bytes(n)


if __name__ == "__main__":
    main()
