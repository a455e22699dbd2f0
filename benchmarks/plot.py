"""Draw ``results/ratios.png``: comm/min and memory/ideal per preset, and run/jit overhead.

Reads ``comm_memory.json`` and ``overhead.json`` (whichever exist) from the
results folder.

    python -m benchmarks.plot [--results DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--results", type=Path, default=common.RESULTS)
    parser.add_argument(
        "--out", type=Path, default=None, help="PNG path (default <results>/ratios.png)"
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def load(name: str) -> dict[str, Any] | None:
        path = args.results / f"{name}.json"
        return json.loads(path.read_text()) if path.exists() else None

    comm, over = load("comm_memory"), load("overhead")
    panels: list[tuple[dict[str, Any], str]] = []
    if comm is not None:
        panels += [(comm, "comm"), (comm, "memory")]
    if over is not None:
        panels.append((over, "overhead"))
    if not panels:
        print(f"nothing to plot in {args.results}")
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (data, what) in zip(axes[0], panels, strict=True):
        if what == "overhead":
            rows = [r for r in data["results"] if "ratio" in r]
            names = [r["preset"] for r in rows]
            med = [r["ratio"]["median"] for r in rows]
            lo = [m - r["ratio"]["min"] for m, r in zip(med, rows, strict=True)]
            hi = [r["ratio"]["max"] - m for m, r in zip(med, rows, strict=True)]
            ax.bar(names, med, yerr=[lo, hi], color="tab:gray", capsize=3)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_title("strategy.run / jax.jit per step (median, min-max)")
        else:
            key = "comm_ratio" if what == "comm" else "argument_ratio"
            presets = list(dict.fromkeys(r["preset"] for r in data["results"]))
            width = 0.4
            for i, model in enumerate(("mlp", "transformer")):
                vals = {r["preset"]: r[key] for r in data["results"] if r["model"] == model}
                xs = [j + (i - 0.5) * width for j in range(len(presets))]
                ax.bar(xs, [vals.get(p) or 0.0 for p in presets], width, label=model)
            ax.set_xticks(range(len(presets)), presets)
            ax.axhline(1.0, color="k", lw=0.8)
            if what == "memory":
                ax.set_yscale("log")
            ax.set_title(
                "communication / minimum" if what == "comm" else "argument bytes / ideal (log)"
            )
            ax.legend()
        ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    out = args.out or args.results / "ratios.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
