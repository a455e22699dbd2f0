"""Every preset's demo train step, compiled by the real TPU compiler for v5e:4x4 (no TPU needed).

    python -m benchmarks.tpu_presets [--topology v5e:4x4] [--num-slices 1] [--model-size small]
    python -m benchmarks.tpu_presets --markdown    # the docs' table from the results file

For each preset: the mesh, the TPU compiler's per-chip memory (and the fit
against the chip's HBM), the step's communication per chip split into ICI and
DCN, its ratio to the minimum for the layouts, and the compile time. Writes
``benchmarks/results/tpu_presets.json`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common

DEMO = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def run(
    topology: str = "v5e:4x4", num_slices: int = 1, model_size: str = "small", batch_size: int = 64
) -> dict[str, Any]:
    """Compile the demo under every preset for the topology; the rows of the table."""
    import strategies
    from dtensor.analysis.memory import WillNotFitError
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    rows = []
    for name in strategies.PRESET_NAMES:
        argv = ["--strategy", name, "--model-size", model_size, "--batch-size", str(batch_size)]
        try:
            result = aot.compile_script(module, argv, topology=topology, num_slices=num_slices)
        except WillNotFitError as err:
            rows.append({"strategy": name, "fits": False, "error": str(err)})
            continue
        r, fit = result.report, result.report.memory_fit
        rows.append(
            {
                "strategy": name,
                "mesh": r.mesh,
                "compile_seconds": round(result.seconds, 2),
                "argument_bytes_per_chip": r.argument_bytes_per_device,
                "temp_bytes_per_chip": r.temp_bytes_per_device,
                "peak_bytes_per_chip": fit.bytes_per_chip,
                "hbm_bytes_per_chip": fit.hbm_bytes_per_chip,
                "fits": fit.fits,
                "state_bytes_per_chip": r.state_bytes_per_device,
                "comm_bytes_per_chip": r.comm_bytes_per_device,
                "ici_bytes_per_chip": r.ici_bytes_per_device,
                "dcn_bytes_per_chip": r.dcn_bytes_per_device,
                "min_comm_bytes_per_chip": r.min_comm_bytes_per_device,
                "comm_by_kind": r.by_kind(),
                "collective_ops": sum(c.count for c in r.collectives),
            }
        )
    return {
        "topology": topology,
        "num_slices": num_slices,
        "model_size": model_size,
        "global_batch": batch_size,
        "device_kind": result.devices[0].device_kind if rows else None,
        "rows": rows,
    }


def markdown(payload: dict[str, Any]) -> str:
    """The results' rows as the Markdown table of the presets guide, per chip.

    Presets whose cells are all equal share a row (``mirrored, central_storage, tpu``).
    """

    def mib(n: float | None) -> str:
        return "—" if n is None else "0" if not n else f"{n / 2**20:.2f} MiB"

    groups: dict[tuple[str, ...], list[str]] = {}
    for r in payload["rows"]:
        if not r.get("fits", True) or "mesh" not in r:
            cells = ("—", "does not fit", "—", "—", "—", "—")
        else:
            comm, least = r["comm_bytes_per_chip"], r["min_comm_bytes_per_chip"]
            cells = (
                f"`{r['mesh']}`",
                mib(r["peak_bytes_per_chip"]),
                mib(r["state_bytes_per_chip"]),
                mib(comm),
                mib(least),
                f"{comm / least:.2f}" if least else "—",
            )
        groups.setdefault(cells, []).append(r["strategy"])
    out = [
        "| preset | mesh | peak memory | variables | communication | minimum | comm / min |",
        "|---|---|---|---|---|---|---|",
    ]
    out += [f"| {', '.join(names)} | {' | '.join(cells)} |" for cells, names in groups.items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5e:4x4")
    p.add_argument("--num-slices", type=int, default=1)
    p.add_argument("--model-size", default="small")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default benchmarks/results)"
    )
    p.add_argument(
        "--markdown",
        action="store_true",
        help="print the results file's table as Markdown (compiles nothing)",
    )
    args = p.parse_args(argv)
    if args.markdown:
        print(markdown(json.loads(((args.out or common.RESULTS) / "tpu_presets.json").read_text())))
        return
    common.ensure_devices()
    payload = run(args.topology, args.num_slices, args.model_size, args.batch_size)
    path = common.write_json("tpu_presets", payload, args.out)
    h = common_human
    table = [
        (
            row["strategy"],
            row.get("mesh", "-"),
            h(row.get("state_bytes_per_chip")),
            h(row.get("peak_bytes_per_chip")),
            "yes" if row["fits"] else "NO",
            h(row.get("ici_bytes_per_chip")),
            h(row.get("dcn_bytes_per_chip")),
            "-"
            if not row.get("min_comm_bytes_per_chip")
            else f"{row['comm_bytes_per_chip'] / row['min_comm_bytes_per_chip']:.2f}",
            f"{row.get('compile_seconds', 0):.1f}",
        )
        for row in payload["rows"]
    ]
    slices = f" x {args.num_slices} slices" if args.num_slices > 1 else ""
    common.print_table(
        f"demo ({args.model_size}, batch {args.batch_size}) compiled for {args.topology}{slices}, per chip",
        [
            "preset",
            "mesh",
            "state",
            "peak memory",
            "fits",
            "ICI / step",
            "DCN / step",
            "comm / min",
            "compile s",
        ],
        table,
    )
    print(f"wrote {path}")


def common_human(n: float | None) -> str:
    from dtensor.core.text import human_bytes as _human

    return "-" if n is None else _human(n)


if __name__ == "__main__":
    main()
