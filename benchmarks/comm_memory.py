"""Every preset on an MLP and a small transformer: communication and memory against the minimum.

Deterministic: all figures come from the compiled program (``strategy.explain``),
nothing runs. ``comm_ratio`` is bytes communicated per device over the
theoretical minimum for the preset's layouts (see ``dtensor.analysis.explain``);
``argument_ratio`` is XLA's argument bytes per device (variables, optimizer
state and the batch) over the ideal (variables and optimizer state split evenly
over all devices) — replicated presets sit near the device count by design.

    python -m benchmarks.comm_memory [--hidden 1024] [--batch 64] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from . import common


def measure(preset: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    import strategies

    strategy = strategies.from_name(preset)
    if kind == "mlp":
        factory = common.mlp_model(args.features, args.hidden, args.features)
        batch = common.mlp_batch(args.batch, args.features, args.features)
    else:
        factory = common.transformer_model()
        batch = common.transformer_batch(args.batch)
    model, opt = common.build(strategy, factory)
    rep = strategy.explain(common.train_step(kind), args=(model, opt, batch))
    ideal = rep.ideal_state_bytes_per_device
    zero = (rep.min_comm_references or {}).get("weights gathered (ZeRO)")
    return {
        "preset": preset,
        "model": kind,
        "comm_bytes_per_device": rep.comm_bytes_per_device,
        "min_comm_bytes_per_device": rep.min_comm_bytes_per_device,
        "comm_ratio": None if rep.comm_ratio == float("inf") else rep.comm_ratio,
        # Against the ZeRO reference alone (weights gathered), where variables are split over
        # the data axes: how close a sharded plan comes to gathering each weight once.
        "zero_ratio": None if not zero else rep.comm_bytes_per_device / zero,
        "by_kind": rep.by_kind(),
        "argument_bytes_per_device": rep.argument_bytes_per_device,
        "temp_bytes_per_device": rep.temp_bytes_per_device,
        "state_bytes_per_device": rep.state_bytes_per_device,
        "ideal_state_bytes_per_device": ideal,
        "argument_ratio": None
        if not ideal or rep.argument_bytes_per_device is None
        else rep.argument_bytes_per_device / ideal,
        "state_ratio": None if not ideal else rep.state_bytes_per_device / ideal,
        "warnings": [w.kind for w in rep.warnings],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--features", type=int, default=256, help="MLP input/output width")
    parser.add_argument("--hidden", type=int, default=1024, help="MLP hidden width")
    parser.add_argument("--batch", type=int, default=64, help="global batch (a multiple of 8)")
    parser.add_argument("--presets", default="all", help="comma-separated preset names, or 'all'")
    parser.add_argument(
        "--out", type=Path, default=None, help="results folder (default benchmarks/results)"
    )
    args = parser.parse_args(argv)
    common.ensure_devices()
    import strategies

    presets = list(strategies.PRESET_NAMES) if args.presets == "all" else args.presets.split(",")
    rows = [measure(p, kind, args) for kind in ("mlp", "transformer") for p in presets]
    payload = {
        "settings": {
            "features": args.features,
            "hidden": args.hidden,
            "batch": args.batch,
            "devices": common.N_DEVICES,
        },
        "results": rows,
    }
    path = common.write_json("comm_memory", payload, args.out)

    def fmt(v: Any) -> Any:
        return "-" if v is None else v

    common.print_table(
        f"communication and memory per device ({path.name})",
        [
            "preset",
            "model",
            "comm (B)",
            "min (B)",
            "comm/min",
            "args/ideal",
            "state/ideal",
            "kinds",
        ],
        [
            (
                r["preset"],
                r["model"],
                int(r["comm_bytes_per_device"]),
                int(r["min_comm_bytes_per_device"]),
                fmt(r["comm_ratio"]),
                fmt(r["argument_ratio"]),
                fmt(r["state_ratio"]),
                ", ".join(sorted(r["by_kind"])),
            )
            for r in rows
        ],
    )
    return payload


if __name__ == "__main__":
    main()
