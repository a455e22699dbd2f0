"""Run every benchmark (``make bench``): comm_memory, overhead, peers, the plot, then
coordinator, checkpoint_verify, safetensors_load, tpu_presets, gpu_presets, fsdp_scale,
flax_gemma, experts, long_context, pipeline, measured_steps and checkpoint_tiers (skipped
with ``--quick``). Not run: checkpoint_gcs (needs the ``gcs``
extra), hosts_link (needs root and iproute2), maxtext_side (needs a MaxText venv), search
(run by hand: ``python -m benchmarks.search --rows ...``).

    python -m benchmarks.run_all [--quick] [--out DIR]

``--quick`` uses tiny settings (a smoke run, about a minute).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import comm_memory, common, overhead, peers, plot

QUICK = ["--features=16", "--hidden=64", "--batch=16"]
QUICK_TIMED = [*QUICK, "--rounds=2", "--steps=3"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    common.ensure_devices()
    out = ["--out", str(args.out)] if args.out else []
    comm_memory.main([*(QUICK if args.quick else []), *out])
    overhead.main([*(QUICK_TIMED if args.quick else []), *out])
    peers.main([*(QUICK_TIMED if args.quick else []), *out])
    plot.main(["--results", str(args.out or common.RESULTS)])
    if not args.quick:
        from . import (
            checkpoint_tiers,
            checkpoint_verify,
            coordinator,
            experts,
            flax_gemma,
            fsdp_scale,
            gpu_presets,
            long_context,
            measured_steps,
            pipeline,
            safetensors_load,
            tpu_presets,
        )

        coordinator.main(["--out", str((args.out or common.RESULTS) / "coordinator.json")])
        checkpoint_verify.main(out)
        safetensors_load.main(out)
        tpu_presets.main(out)
        gpu_presets.main(out)
        fsdp_scale.main(out)
        flax_gemma.main(out)
        experts.main(out)
        long_context.main(out)
        pipeline.main(out)
        measured_steps.main(out)
        checkpoint_tiers.main(out)


if __name__ == "__main__":
    main()
