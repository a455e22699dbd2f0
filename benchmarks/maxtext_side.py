"""MaxText's own training step compiled for the side-by-side topologies, read by our floor code.

    python -m benchmarks.maxtext_side [--rows 0,1] [--venv /work/.venv-maxtext] [--cache DIR]
    python -m benchmarks.maxtext_side --report      # the table from the results file only

For each row of :data:`ROWS` (the side-by-side table's MaxText configurations,
:data:`benchmarks.fsdp_tables.MAXTEXT_GIB`, and optionally Llama 3.1 405B), a
small driver (written into the cache folder, run by the MaxText venv's Python:
``maxtext==0.2.5``, ``jax[tpu]==0.12.0.1``, Python 3.12) runs MaxText's
``train_compile`` with its defaults and the row's overrides, compiling the train
step ahead of time for ``jax.experimental.topologies`` (no TPU). It replaces
``train_compile.jit_and_compile`` by one that also traces the step, so it can
write, beside the compiled program's HLO text (``compiled.as_text()``) and
``memory_analysis()``: the step's matmul FLOPs, counted on its jaxpr by
:func:`dtensor.analysis.floor.matmul_flops` (the count ``explain`` uses), the
mesh (axes, each device's slice) and the chip. The libtpu of each row is pinned
(``TPU_LIBRARY_PATH`` to a ``pip install --target`` folder) and recorded.

Then, in our venv, :func:`analyse` reads the HLO with
:func:`dtensor.analysis.hlo.parse_collectives` and takes the floor with
:func:`dtensor.analysis.floor.step_floor`, as ``explain`` does for our programs:
the ICI term is the collectives within slices, the DCN term those between. The
MFU ceiling divides the model FLOPs of our row (the same model, batch and
sequence, :func:`examples.decoder.model_flops`) by ``devices x peak x floor``,
so it compares with our column as the floors do; MaxText's own count
(``calculate_tflops_training_per_device``) is kept beside it. Writes
``benchmarks/results/maxtext_side.json`` after every row and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import common
from .maxtext_driver import (
    CACHE,
    DRIVER,
    FLOPS_VERSION,
    LIBTPU_DIRS,
    REPO,
    ROWS,
    VENV,
    Row,
    compile_row,
    row_key,
    seq_of,
)
from .maxtext_read import GIB, analyse, model_flops_of, peak_bytes, result_row

__all__ = [
    "CACHE",
    "DRIVER",
    "FLOPS_VERSION",
    "GIB",
    "LIBTPU_DIRS",
    "REPO",
    "ROWS",
    "VENV",
    "Row",
    "analyse",
    "by_row",
    "compile_row",
    "load",
    "main",
    "merge",
    "model_flops_of",
    "ours_best",
    "peak_bytes",
    "print_results",
    "result_row",
    "row_key",
    "seq_of",
    "table_rows",
]


def load(path: Path) -> dict[str, Any]:
    """The results file's payload (``{"rows": []}`` when absent)."""
    return json.loads(path.read_text()) if path.exists() else {"rows": []}


def merge(payload: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """``payload`` with ``row`` in place of the row of the same size and topology.

    Examples:
        >>> p = merge({"rows": [{"size": "2b", "topology": "v5e:4x4", "x": 1}]},
        ...           {"size": "2b", "topology": "v5e:4x4", "x": 2})
        >>> p["rows"]
        [{'size': '2b', 'topology': 'v5e:4x4', 'x': 2}]
    """
    rows = [
        r
        for r in payload.get("rows", [])
        if (r["size"], r["topology"]) != (row["size"], row["topology"])
    ]
    order = {(s, t): i for i, (s, t, _, _) in enumerate(ROWS)}
    rows.append(row)
    rows.sort(key=lambda r: order.get((r["size"], r["topology"]), len(order)))
    return {k: v for k, v in payload.items() if k not in ("benchmark", "environment")} | {
        "rows": rows
    }


def by_row(payload: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """The measured rows (with a floor) by ``(size, topology)``, as the side-by-side table
    looks them up."""
    return {
        (r["size"], r["topology"]): r
        for r in payload.get("rows", [])
        if r.get("step_time_floor_seconds")
    }


def ours_best(fsdp_scale: dict[str, Any]) -> dict[tuple[str, str], float]:
    """Our lowest step-time floor per ``(size, topology)`` in ``fsdp_scale.json``'s rows.

    Examples:
        >>> rows = [{"size": "2b", "topology": "v5e:4x4", "step_time_floor_seconds": s}
        ...         for s in (0.2, 0.1, None)]
        >>> ours_best({"rows": rows})
        {('2b', 'v5e:4x4'): 0.1}
    """
    best: dict[tuple[str, str], float] = {}
    for r in fsdp_scale.get("rows", []):
        floor, key = r.get("step_time_floor_seconds"), (r["size"], r["topology"])
        if floor and (key not in best or floor < best[key]):
            best[key] = floor
    return best


def table_rows(payload: dict[str, Any], ours: dict[tuple[str, str], float]) -> list[list[str]]:
    """The printed table: one line a row (``ours``: our lowest floor for it), a failed row
    with its error."""
    out = []
    for r in payload.get("rows", []):
        if not r.get("step_time_floor_seconds"):
            out.append([r["size"], r["topology"], r.get("libtpu") or "—"] + ["—"] * 6)
            out[-1].append(r.get("error", "")[:60])
            continue
        f = r["step_floor"]
        terms = f"{f['compute_seconds'] * 1e3:.0f} / {f['ici_seconds'] * 1e3:.0f} / " + (
            f"{f['dcn_seconds'] * 1e3:.0f}" if f.get("dcn_seconds") else "0"
        )
        mine = ours.get((r["size"], r["topology"]))
        out.append(
            [
                r["size"],
                r["topology"],
                r["libtpu"],
                f"{r['peak_bytes_per_chip'] / GIB:.2f} GiB",
                f"{r['step_time_floor_seconds'] * 1e3:.0f} ms",
                f"{r['mfu_ceiling']:.0%}",
                terms,
                f["bound"],
                "—" if mine is None else f"{mine * 1e3:.0f} ms",
                f"{r['compile_seconds']:.0f} s",
            ]
        )
    return out


def print_results(payload: dict[str, Any], out_dir: Path) -> None:
    """The rich table, with our lowest floor per row from ``fsdp_scale.json`` beside it."""
    path = out_dir / "fsdp_scale.json"
    ours = ours_best(load(path if path.exists() else common.RESULTS / "fsdp_scale.json"))
    common.print_table(
        "MaxText 0.2.5's own train step, read by our floor code",
        [
            "model",
            "topology",
            "libtpu",
            "peak per chip",
            "floor",
            "MFU ceiling",
            "compute / ICI / DCN ms",
            "bound",
            "ours (lowest)",
            "compile",
        ],
        table_rows(payload, ours),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument(
        "--rows",
        default="0,1,2,3,4",
        help="indices into ROWS (default: the side-by-side table's; 5 is 405B, 6 Mixtral 8x7B, "
        "7 llama2-70b pipelined, 8 llama3.1-8b context-parallel at 32768)",
    )
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--cache", type=Path, default=CACHE)
    parser.add_argument("--out", type=Path, default=common.RESULTS)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per compile")
    parser.add_argument("--report", action="store_true", help="print the results file only")
    args = parser.parse_args(argv)
    path = args.out / "maxtext_side.json"
    payload = load(path)
    if not args.report:
        for i in (int(x) for x in args.rows.split(",") if x.strip()):
            row = ROWS[i]
            out = args.cache / row_key(row[0], row[1])
            print(f"maxtext_side: {row[0]} on {row[1]} ...", flush=True)
            status = compile_row(row, venv=args.venv, cache=args.cache, timeout=args.timeout)
            if "error" in status:
                figures = {
                    "size": row[0],
                    "topology": row[1],
                    "overrides": list(row[2]),
                    "libtpu": row[3],
                    **status,
                }
            else:
                figures = result_row(row, out)
            payload = merge(payload, figures)
            common.write_json("maxtext_side", payload, args.out)
    print_results(payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
