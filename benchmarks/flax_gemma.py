"""Flax's own Gemma 3 12B (the flax sdist's ``examples/gemma``, unchanged) under FullyShardedStrategy.

    python -m benchmarks.flax_gemma [--options "bf16 + remat + offload optimizer,..."]
        [--first-fit] [--merge] [--markdown]

Builds Flax's ``Transformer`` at ``TransformerConfig.gemma3_12b`` abstractly
(``benchmarks/flax_gemma_model.py``, the ``aot_step`` script), trains one AdamW
next-token step on a global batch of 16 x 1024 and compiles it ahead of time
for TPU ``v5e:4x4`` (16 chips; libtpu from PyPI, no TPU): first ``--fit``'s
ladder (:func:`dtensor.tpu.search.ladder`) from the preset as issue 30 states
it, ``mixed_precision=MixedPrecision()`` and ``remat=(modules.Block,)``, so the
row it chooses is the one ``python -m dtensor.aot --fit`` prints; then each
option of :data:`OPTIONS` named by ``--options`` (remat policies and units,
reads, offload). Each compile runs in its own process through
:func:`dtensor.tpu.search.fit`, cached on disk as ``--fit`` caches. Writes
``benchmarks/results/flax_gemma.json`` (``--merge``: keep the rows of options
not compiled now) and prints the table; ``--markdown`` prints the docs' table
from the file and compiles nothing. Needs ``make third-party``.
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from . import common

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path("benchmarks") / "flax_gemma_model.py"
TOPOLOGY = "v5e:4x4"
BATCH, SEQ = 16, 1024
#: MaxText's own peak for gemma3-12b on v5e:4x4, 16 x 1024 (issue 30's table)
MAXTEXT_GIB = 14.30
BASE = ["--strategy", "fully_sharded", "--model-size", "gemma3-12b"]
BASE += ["--batch-size", str(BATCH), "--seq-len", str(SEQ)]

#: the preset as issue 30 states it: MixedPrecision() and remat=(modules.Block,)
PRESET = ["--mixed-precision", "bf16", "--remat"]
#: more options to compile beside --fit's ladder (name -> the script's extra flags)
OPTIONS: dict[str, list[str]] = {
    "bf16 + remat (dots_with_no_batch_dims_saveable)": [
        *PRESET,
        "--remat-policy",
        "dots_with_no_batch_dims_saveable",
    ],
    "bf16 + remat FeedForward": [*PRESET, "--remat-class", "FeedForward"],
    "bf16 + remat + offload optimizer": [*PRESET, "--offload-optimizer"],
    "bf16 compute + remat + gather at reads": [
        "--mixed-precision",
        "bf16-compute",
        "--remat",
        "--gather-at-reads",
    ],
}


def run(
    names: list[str], *, first_fit: bool, cache_dir: str | None, timeout: float
) -> dict[str, Any]:
    """``--fit``'s ladder from the preset (to the first fit with ``first_fit``), then ``names``."""
    from dtensor.tpu.search import Rung, fit, ladder

    def log(line: str) -> None:
        print("  " + line, flush=True)

    from .flax_gemma_model import SEARCH_FLAGS

    # the rungs whose flags the script takes (its search_facts flags: no --scan)
    taken = set(SEARCH_FLAGS)
    rungs = [r for r in ladder(BASE + PRESET) if all(f in taken for f in r.flags if f[:2] == "--")]
    print(f"--fit from {' '.join(PRESET)} on {TOPOLOGY}:", flush=True)
    if first_fit:  # stop at the first rung that fits (not the faster rungs after it)
        rungs = [r for r in rungs if not r.faster_than_previous]
    chosen = fit(SCRIPT, BASE + PRESET, topology=TOPOLOGY, rungs=rungs, cache_dir=cache_dir,
                 timeout=timeout, log=log)  # fmt: skip
    rows = [_row(e) for e in chosen.tried]
    if names:
        extra = [Rung(n, tuple(OPTIONS[n]), True) for n in names]  # each compiled
        more = fit(SCRIPT, BASE, topology=TOPOLOGY, rungs=extra, cache_dir=cache_dir,
                   timeout=timeout, log=log)  # fmt: skip
        rows += [_row(e) for e in more.tried]
    return {
        "rows": rows,
        "fit": {
            "from": PRESET,
            "first_fit_only": first_fit,
            "tried": [_row(e) for e in chosen.tried],
            "best": chosen.best and chosen.best["name"],
            "command": chosen.command(),
        },
    }


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    keep = ("name", "argv", "fits", "peak_bytes_per_chip", "limit_bytes_per_chip",
            "step_time_floor_seconds", "mfu_ceiling", "compile_seconds", "error")  # fmt: skip
    row = {k: entry[k] for k in keep if entry.get(k) is not None}
    row["option"] = {"as given": "bf16 + remat (as given)"}.get(row["name"], row["name"])
    del row["name"]
    return row


def _gib(n: float | None) -> str:
    return "—" if not n else f"{n / 2**30:.2f} GiB"


def markdown(payload: dict[str, Any]) -> str:
    """The docs' table: one line per compiled option, from the results file."""
    lines = [
        "| Flax's Gemma 3 12B: options | peak per chip | vs MaxText's "
        f"{MAXTEXT_GIB:.2f} GiB | fits v5e-16 | step-time floor | MFU ceiling |",
        "|---|---|---|---|---|---|",
    ]
    best = payload["fit"]["best"]
    rungs = {r["option"] for r in payload["fit"]["tried"]}
    for r in payload["rows"]:
        peak = r.get("peak_bytes_per_chip")
        floor = r.get("step_time_floor_seconds")
        mfu = r.get("mfu_ceiling")
        fits = "yes" if r.get("fits") else ("no" if peak else "does not compile")
        name = r["option"] + (" (`--fit`'s choice)" if r["option"] == best else "")
        name += "" if r["option"] in rungs else " (beside the ladder)"
        ratio = f"{peak / 2**30 / MAXTEXT_GIB:.2f}x" if peak else "—"
        lines.append(
            f"| {name} | {_gib(peak)} | {ratio} | {fits} | "
            + (f"{floor * 1e3:.0f} ms" if floor else "—")
            + " | "
            + (f"{mfu:.0%}" if mfu else "—")
            + " |"
        )
    return "\n".join(lines)


def _print(payload: dict[str, Any]) -> None:
    rows = [
        [
            r["option"],
            _gib(r.get("peak_bytes_per_chip")),
            "yes" if r.get("fits") else "no",
            r.get("step_time_floor_seconds") or "—",
            r.get("compile_seconds") or "—",
        ]
        for r in payload["rows"]
    ]
    common.print_table(
        f"Flax's Gemma 3 12B on {TOPOLOGY}, global batch {BATCH} x {SEQ} (limit 15.75 GiB)",
        ["option", "peak per chip", "fits", "floor (s)", "compile (s)"],
        rows,
    )
    fit = payload["fit"]
    print(
        f"--fit chooses: {fit['best'] or 'nothing fits'}"
        + (f": {fit['command']}" if fit["command"] else "")
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--options", default="", help="comma-separated OPTIONS names to add")
    p.add_argument(
        "--first-fit", action="store_true", help="stop --fit's ladder at the first rung that fits"
    )
    p.add_argument("--merge", action="store_true", help="keep rows of options not compiled now")
    p.add_argument("--markdown", action="store_true", help="print the docs' table and exit")
    p.add_argument("--cache-dir", default=None, help="where compiles are cached (as --fit's)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per compile")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    path = (args.out or common.RESULTS) / "flax_gemma.json"
    if args.markdown:
        print(markdown(json.loads(path.read_text())))
        return
    names = [n.strip() for n in args.options.split(",") if n.strip()]
    unknown = [n for n in names if n not in OPTIONS]
    if unknown:
        sys.exit(f"--options {unknown} are not in {list(OPTIONS)}")
    got = run(names, first_fit=args.first_fit, cache_dir=args.cache_dir, timeout=args.timeout)
    if args.merge and path.exists():
        old = json.loads(path.read_text())["rows"]
        now = {r["option"] for r in got["rows"]}
        got["rows"] = [r for r in old if r["option"] not in now] + got["rows"]
    payload = {"topology": TOPOLOGY, "global_batch": [BATCH, SEQ], "script": str(SCRIPT), **got}
    payload["libtpu"] = metadata.version("libtpu")
    payload["flax_examples"] = f"flax {metadata.version('flax')} sdist, examples/gemma"
    common.write_json("flax_gemma", payload, args.out)
    _print(payload)


if __name__ == "__main__":
    main()
