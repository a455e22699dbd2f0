"""``python -m dtensor.checkpoint verify DIR [--step N]``: a table per step; exit 1 if one is damaged."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.verify import check_steps
from dtensor.core.text import human_bytes

_STYLE = {"ok": "green", "damaged": "bold red", "unverified": "yellow"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor.checkpoint", description="Check dtensor checkpoints."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    v = sub.add_parser("verify", help="check every step's recorded checksums without restoring")
    v.add_argument("directory")
    v.add_argument("--step", type=int, default=None, help="check this step only")
    args = parser.parse_args(argv)
    console = Console(width=160)
    try:
        checks = check_steps(args.directory, args.step)
    except CheckpointError as e:
        console.print(f"[bold red]error:[/] {e}", markup=True, highlight=False)
        return 2
    table = Table(title=f"checkpoints in {args.directory}")
    for name in ("step", "arrays", "bytes", "status", "problem"):
        table.add_column(name, justify="right" if name in ("step", "arrays", "bytes") else "left")
    for c in checks:
        problem = ""
        if c.error is not None:
            e = c.error
            problem = f"array {e.array or '-'}, file {e.file or '-'}: {e.problem}"
        table.add_row(
            str(c.step),
            str(c.arrays) if c.status != "damaged" else "-",
            human_bytes(c.bytes) if c.status == "ok" else "-",
            f"[{_STYLE[c.status]}]{c.status}[/]",
            problem,
        )
    console.print(table)
    bad = [c.step for c in checks if c.status == "damaged"]
    if bad:
        console.print(f"damaged steps: {bad}", highlight=False)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
