"""The library picks the plan: ``python -m dtensor.aot --search`` on MaxText's rows.

    python -m benchmarks.search [--rows 0] [--max-compiles 6] [--limit maxtext,hbm] [--cache-dir D]
    python -m benchmarks.search --markdown      # the guide's table, from the results file

Each row searches ``HybridStrategy`` plans for ``examples/train.py``'s decoder from the model
flags alone (no axis size, precision or remat given; ``--attention xla`` as the MaxText
side-by-side, splash at 32768 tokens), within MaxText's peak per chip (``--limit maxtext``: the issue's target is a plan at or
under MaxText's peak and floor) and within the chip's usable HBM (``--limit hbm``: the
fastest plan that fits), compiling at most ``--max-compiles`` plans with libtpu (no TPU), each in its
own process and cached on disk as ``--search`` caches (a rerun reads them back). It records
every plan compiled (its flags, peak per chip, step-time floor and bound, MFU ceiling, the
analytic estimate and the compiled/estimated ratios), the choice with its ``HybridStrategy``
line and command, the compiles and the search's time on this machine, beside MaxText's
compile of the same model and batch (``benchmarks/results/maxtext_side.json``). Writes
``benchmarks/results/search.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, NamedTuple

from . import common

DECODER = "examples/train.py"


class Row(NamedTuple):
    """A row: one sequence a chip, as MaxText's ``per_device_batch_size=1``."""

    size: str
    topology: str
    slices: int
    batch: int
    seq: int
    side: str  # MaxText's row in maxtext_side.json
    extra: tuple[str, ...]  # the script's fixed flags
    script: str = DECODER  # the training script searched, from the repository's root


XLA = common.XLA_ATTENTION
_ROWS: list[tuple[Any, ...]] = [
    ("2b", "v5e:4x4", 1, 16, 1024, "v5e:4x4", XLA),
    ("7b", "v5e:4x4", 1, 16, 1024, "v5e:4x4", XLA),
    ("gemma3-12b", "v5e:4x4", 1, 16, 1024, "v5e:4x4", XLA),
    ("llama2-70b", "v5p:4x4x4", 1, 64, 1024, "v5p:4x4x4", XLA),
    ("llama2-70b", "v5p:4x4x2", 2, 64, 1024, "2 x v5p:4x4x2", XLA),
    # 32768 tokens: XLA's attention would hold [heads, 32768, 32768] scores; MaxText's
    # compile runs its splash kernel, so ours does too
    (
        "llama3.1-8b",
        "v5p:4x4x2",
        1,
        32,
        32768,
        "v5p:4x4x2 context 32768",
        ("--attention", "splash"),
    ),
    ("mixtral-8x7b", "v5p:4x4x2", 1, 32, 1024, "v5p:4x4x2", XLA),
    ("llama3.1-405b", "v5p:8x8x8", 1, 512, 1024, "v5p:8x8x8", XLA),
    # a model this project did not write: Flax's own Gemma 3 12B (benchmarks/flax_gemma_model.py)
    ("gemma3-12b", "v5e:4x4", 1, 16, 1024, "v5e:4x4", (), "benchmarks/flax_gemma_model.py"),
]
ROWS: list[Row] = [Row(*r) for r in _ROWS]
#: How the guide's table names a row's model, by its script.
MODEL_NAMES = {"benchmarks/flax_gemma_model.py": "{size} (Flax's own)"}


def _maxtext(size: str, topology: str) -> dict[str, Any] | None:
    path = common.RESULTS / "maxtext_side.json"
    if not path.exists():
        return None
    rows = json.loads(path.read_text())["rows"]
    return next((r for r in rows if r["size"] == size and r["topology"] == topology), None)


def label(topology: str, slices: int, seq: int) -> str:
    """A row's topology as the table writes it: ``2 x v5p:4x4x2``, ``v5p:4x4x2, 32768 tokens``."""
    tokens = f", {seq} tokens" if seq != 1024 else ""
    return (f"{slices} x " if slices > 1 else "") + topology + tokens


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    where = r["topology"], r.get("num_slices", 1), r.get("seq", 1024)
    return r.get("script", DECODER), r["size"], *where, r.get("limit")


def run_row(row: Row, *, max_compiles: int,
            cache_dir: str | None, limit: str = "maxtext") -> dict[str, Any]:  # fmt: skip
    """Search one row; the result as the results file keeps it."""
    import dtensor.tpu
    from dtensor.tpu.views import CompileProgress, render

    size, topology, slices, batch, seq, side, extra, script = row
    path = str(common.REPO / script)
    argv = ["--model-size", size, "--batch-size", str(batch), "--seq-len", str(seq), *extra]
    mt = _maxtext(size, side)
    within = mt["peak_bytes_per_chip"] if limit == "maxtext" and mt is not None else None
    print(
        f"search: {size} on {topology}"
        + (f" x {slices}" if slices > 1 else "")
        + (f", within MaxText's {within / common.GIB:.2f} GiB" if within else ""),
        flush=True,
    )
    with CompileProgress() as progress:
        found = dtensor.tpu.search_plans(
            path, argv, topology=topology, num_slices=slices, max_compiles=max_compiles,
            cache_dir=cache_dir, progress=progress, max_bytes_per_chip=within,
        )  # fmt: skip
    print(render(found), flush=True)
    result = found.to_dict()
    result["script"] = script
    command = found.command()
    result["command"] = command.replace(path, script) if command else None
    result.update(size=size, seq=seq, maxtext=None, limit=limit, max_compiles=max_compiles,
                  limit_bytes_per_chip=found.limit_bytes_per_chip)  # fmt: skip
    if mt is not None:
        result["maxtext"] = {
            "peak_bytes_per_chip": mt["peak_bytes_per_chip"],
            "step_time_floor_seconds": mt["step_time_floor_seconds"],
        }
    return result


def markdown(payload: dict[str, Any]) -> str:
    """The guide's table: each row's choice beside MaxText's compile."""
    gib = common.GIB
    lines = [
        "| model | topology | within | the search's choice | peak per chip | MaxText | floor "
        "| MaxText | MFU ceiling | compiled (new) | search time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        best, mt = r["best"], r.get("maxtext") or {}
        limit = r.get("limit_bytes_per_chip")
        within = f"{limit / gib:.2f} GiB" if limit else "-"
        within += " (MaxText's peak)" if r.get("limit") == "maxtext" else " (usable HBM)"
        where = label(r["topology"], r.get("num_slices", 1), r.get("seq", 1024))
        model = MODEL_NAMES.get(r.get("script", DECODER), "{size}").format(size=r["size"])
        head = f"| {model} | {where} | {within} |"
        if best is None:
            seen = [t for t in r["tried"] if t.get("compiled") and t.get("peak_bytes_per_chip")]
            low = min(seen, key=lambda t: t["peak_bytes_per_chip"], default=None)
            mt_peak = (mt.get("peak_bytes_per_chip") or 0) / gib
            lines.append(
                f"{head} nothing fits"
                + (f" (smallest: `{low['name']}`) | {low['peak_bytes_per_chip'] / gib:.2f} GiB |"
                   if low else " | |")
                + (f" {mt_peak:.2f} GiB |" if mt_peak else " - |")
                + f" | | | {len(seen)} ({r['compiles']}) | {r['seconds'] / 60:.1f} min |"
            )  # fmt: skip
            continue
        compiled = sum(1 for t in r["tried"] if t["compiled"])
        mt_peak = mt.get("peak_bytes_per_chip")
        mt_floor = mt.get("step_time_floor_seconds")
        lines.append(
            f"{head} `{best['name']}` | {best['peak_bytes_per_chip'] / gib:.2f} GiB | "
            + (f"{mt_peak / gib:.2f} GiB" if mt_peak else "-")
            + f" | {best['step_time_floor_seconds'] * 1e3:.1f} ms | "
            + (f"{mt_floor * 1e3:.1f} ms" if mt_floor else "-")
            + f" | {best['mfu_ceiling']:.0%} | {compiled} ({r['compiles']}) | "
            f"{r['seconds'] / 60:.1f} min |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--rows", default="0", help="comma-separated row indices (default 0: 2b)")
    p.add_argument("--max-compiles", type=int, default=6)
    p.add_argument(
        "--limit",
        default="maxtext,hbm",
        help="comma-separated: fit within MaxText's peak per chip (maxtext) and/or the chip's "
        "usable HBM (hbm); each row is searched under each (default both)",
    )
    p.add_argument("--cache-dir", default=None, help="where compiles are cached (as --search's)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--markdown", action="store_true", help="print the guide's table and exit")
    args = p.parse_args(argv)
    out = Path(args.out) if args.out else common.RESULTS
    if args.markdown:
        print(markdown(json.loads((out / "search.json").read_text())))
        return 0
    rows = [run_row(ROWS[int(i)], max_compiles=args.max_compiles, cache_dir=args.cache_dir,
                    limit=limit) for i in args.rows.split(",")
            for limit in args.limit.split(",")]  # fmt: skip
    # Rows not searched this time are kept from the results file (a row is its model,
    # topology, slices, sequence and limit); a row searched again replaces its old entry.
    kept: list[dict[str, Any]] = []
    if (out / "search.json").exists():
        kept = json.loads((out / "search.json").read_text()).get("rows", [])
    fresh = {_key(r) for r in rows}
    merged = [r for r in kept if _key(r) not in fresh] + rows
    order = {(r.script, r.size, r.topology, r.slices, r.seq): i for i, r in enumerate(ROWS)}
    merged.sort(
        key=lambda r: (
            order.get(_key(r)[:5], len(ROWS)),
            r.get("limit") != "maxtext",
        )
    )
    payload = {"rows": merged}  # each row says its max_compiles
    path = common.write_json("search", payload, out)
    print(markdown(json.loads(path.read_text())))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
