"""What ``python -m dtensor.aot --search`` / ``--fit`` print: a progress bar over the compiles,
the ranked table, the winner as a preset to paste and a command line, and why nothing fits."""

from __future__ import annotations

import io
import math
from typing import Any

from dtensor.core.text import human_bytes

__all__ = ["CompileProgress", "line", "no_fit_message", "render"]


def _gib(n: float | None) -> str:
    return "-" if not n else human_bytes(n)


def _ms(s: float | None) -> str:
    if not s:
        return "-"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def line(entry: dict[str, Any]) -> str:
    """One compiled plan in a line: ``bf16 + remat: fits, peak 4.1 GiB per chip, floor ...``."""
    peak = entry.get("peak_bytes_per_chip")
    floor = entry.get("step_time_floor_seconds")
    mfu = entry.get("mfu_ceiling")
    parts = [
        f"{entry['name']}: " + ("fits" if entry["fits"] else "does not fit"),
        f"peak {human_bytes(peak)} per chip" if peak else entry.get("error", ""),
        f"floor {_ms(floor)}" if floor else "",
        f"MFU ceiling {mfu:.1%}" if mfu else "",
    ]
    text = ", ".join(p for p in parts if p)
    return text + (" (cached)" if entry.get("cached") else "")


def no_fit_message(result: Any, limit: float) -> str:
    """Nothing compiled fits: the smallest peak seen, and what would make it fit."""
    seen = [t for t in result.tried if t.get("peak_bytes_per_chip")]
    if not seen:
        errors = [t.get("error") for t in result.tried if t.get("error")]
        why = f" (the first error: {errors[0]})" if errors else ""
        return f"nothing fits: no plan compiled{why}."
    low = min(seen, key=lambda t: t["peak_bytes_per_chip"])
    peak = low["peak_bytes_per_chip"]
    over = peak / limit
    where = "compiled" if low.get("compiled") else "estimated"
    text = (
        f"nothing fits: the smallest peak seen is {human_bytes(peak)} per chip ({where}: "
        f"{low['name']}), {over:.2f}x the {human_bytes(limit)} a chip can hold. It would fit "
        f"with about {math.ceil(over)}x the chips (the state divides by their number), or a "
        f"global batch of at most {max(1, int(_batch(low) / over))} (the activations scale with "
        "it), or with headroom freed by a rung not yet tried"
    )
    if result.mode == "fit":
        text += "; --search also tries the tensor, stage, context and expert axes"
    else:
        text += (
            " (--offload-optimizer keeps the optimizer state in host memory: a rung the search "
            "does not try, as the floor does not count its host transfers)"
        )
    return text + "."


def _batch(entry: dict[str, Any]) -> int:
    argv = entry.get("argv") or []
    if "--batch-size" in argv[:-1]:
        return int(argv[argv.index("--batch-size") + 1])
    return 1


def render(result: Any, *, width: int = 140) -> str:
    """The ranked table, then the winner (preset line and command) or the no-fit message."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=io.StringIO(), width=width, color_system=None, force_terminal=False)
    compiled = [t for t in result.tried if t.get("compiled")]
    rest = [t for t in result.tried if not t.get("compiled")]
    ranked = (
        sorted(
            compiled,
            key=lambda t: (not t["fits"], t.get("step_time_floor_seconds") or math.inf),
        )
        + rest
    )
    table = Table(title=f"{result.mode}: {result.topology}" + (
        f" x {result.num_slices} slices" if result.num_slices > 1 else ""))  # fmt: skip
    for name in ("#", "plan", "peak per chip", "fits", "floor", "bound", "MFU ceiling",
                 "figures", "compiled / estimate"):  # fmt: skip
        table.add_column(name, justify="left" if name in ("plan", "bound", "figures") else "right")
    for i, t in enumerate(ranked, 1):
        ratio = t.get("ratio") or {}
        rtext = " ".join(
            f"{k} {ratio[k]:.2f}" for k in ("peak", "floor") if ratio.get(k) is not None
        )
        source = ("cached" if t.get("cached") else "compiled") if t.get("compiled") else "estimated"
        mfu = t.get("mfu_ceiling")
        mark = "*" if result.best is not None and t is result.best else ""
        table.add_row(
            f"{i}{mark}",
            t["name"] if not t.get("error") else f"{t['name']} ({t['error'][:60]})",
            _gib(t.get("peak_bytes_per_chip")),
            "yes" if t["fits"] else "no",
            _ms(t.get("step_time_floor_seconds")),
            t.get("bound") or "-",
            f"{mfu:.1%}" if mfu else "-",
            source,
            rtext or "-",
        )
    fresh = result.compiles
    table.caption = (
        f"{len(compiled)} of {result.candidates} plans compiled ({fresh} new, "
        f"{len(compiled) - fresh} from the cache) in {result.seconds:.0f} s; limit "
        f"{_gib(result.limit_bytes_per_chip)} a chip; * the choice"
    )
    console.print(table)
    best = result.best
    if best is None:
        console.print(result.message, highlight=False, markup=False, soft_wrap=True)
    else:
        mfu = best.get("mfu_ceiling")
        console.print(
            f"{'fits' if result.mode == 'fit' else 'best'}: {best['name']}: peak {_gib(best.get('peak_bytes_per_chip'))} per chip, "
            f"step-time floor {_ms(best.get('step_time_floor_seconds'))}"
            + (f" ({best['bound']}-bound)" if best.get("bound") else "")
            + (f", MFU ceiling {mfu:.1%}" if mfu else ""),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
        if best.get("strategy"):
            console.print(best["strategy"], highlight=False, markup=False, soft_wrap=True)
        console.print(result.command(), highlight=False, markup=False, soft_wrap=True)
    return console.file.getvalue()  # type: ignore[attr-defined]


class CompileProgress:
    """A rich progress bar over a search's compiles (``with CompileProgress() as p:
    search_plans(..., progress=p)``); prints a line as each compile ends."""

    def __init__(self, console: Any = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            SpinnerColumn,
            TextColumn,
            TimeElapsedColumn,
        )

        self.console = console or Console()
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]compile[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            transient=True,
        )
        self.task: Any = None

    def __enter__(self) -> CompileProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def start(self, name: str, done: int, budget: int) -> None:
        """A compile of ``name`` begins (``done`` of at most ``budget`` so far)."""
        if self.task is None:
            self.task = self.progress.add_task(name, total=budget)
        self.progress.update(self.task, description=name, completed=done, total=budget)

    def done(self, entry: dict[str, Any]) -> None:
        """A compile ended: print its line above the bar."""
        self.progress.advance(self.task)
        ratio = entry.get("ratio") or {}
        est = " ".join(f"{k} x{v:.2f}" for k, v in ratio.items())
        self.progress.console.print(
            "  " + line(entry) + (f"; compiled/estimate {est}" if est else ""),
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
