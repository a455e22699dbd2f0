"""Every preset, and Gemma-scale decoders, compiled by XLA:GPU for H100 hosts (no GPU needed).

    python -m benchmarks.gpu_presets [--topology h100:2x8] [--model-size small] [--no-large]

Beside ``benchmarks.tpu_presets``: for each preset the demo's train step
compiled for ``h100:2x8`` (2 hosts of 8 H100s, :func:`dtensor.gpu_topology`),
with XLA:GPU's memory per GPU against what JAX's allocator lets one program
use, and the communication per GPU split into NVLink (within a host) and
InfiniBand/RoCE (between hosts). Then the large-model rows (:data:`LARGE`):
the decoder of ``examples/decoder.py`` under ``FullyShardedStrategy`` with the
TPU rows' options (``benchmarks.fsdp_scale``), each compiled in its own
process (``llama2-70b`` with scanned layers, as its TPU row); a size
``examples/train.py`` does not offer is recorded as not available. :data:`REFERENCES` are published GPU figures the
rows are set against. Writes ``benchmarks/results/gpu_presets.json`` and
prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import common

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train.py"

#: (size, topology, option, global batch, sequence length): the large-model rows.
LARGE: list[tuple[str, str, str, int, int]] = [
    ("7b", "h100:2x8", "bf16 + remat", 16, 1024),  # the TPU rows' batch and options
    ("7b", "h100:2x8", "default", 16, 1024),
    # torchtitan's Llama 3.1 8B row: 8 H100s, local batch 2 x 8192, bf16, activation checkpointing.
    ("7b", "h100:1x8", "bf16 + remat", 16, 8192),
    # The TPU row's (v5p:4x4x4) size, batch and options on 64 H100s (8 hosts).
    ("llama2-70b", "h100:8x8", "bf16 + remat + scan", 64, 1024),
    # torchtitan's Llama 3 70B row: 64 A100 80GB (8 hosts), local batch 1 x 8192, full AC.
    ("llama2-70b", "a100-80gb:8x8", "bf16 + remat + scan", 64, 8192),
    # the same tokens per GPU on 64 H100s
    ("llama2-70b", "h100:8x8", "bf16 + remat + scan", 64, 8192),
]

OPTIONS: dict[str, list[str]] = {
    "default": [],
    "bf16 + remat": ["--mixed-precision", "bf16", "--remat"],
    "bf16 + remat + gather at reads": ["--mixed-precision", "bf16", "--remat", "--gather-at-reads"],
    "bf16 + remat + scan": ["--mixed-precision", "bf16", "--remat", "--scan"],
}

#: Published GPU figures the large rows are compared with.
REFERENCES: list[dict[str, Any]] = [
    {
        "source": "torchtitan docs/performance.md, Table 1 (Llama 3.1 8B, 1D FSDP)",
        "hardware": "8 H100 (96 GB HBM2e), 1 host",
        "setup": "FSDP2, bf16 params / f32 reductions, selective activation checkpointing, "
        "local batch 2 x 8192 tokens",
        "memory_gib_per_gpu": {"FSDP": 82.4, "FSDP + torch.compile": 77.0},
        "compare_with": ("7b", "h100:1x8", "bf16 + remat"),
    },
    {
        "source": "torchtitan docs/performance.md, Llama 3 performance numbers (70B, FSDP2 "
        "on 64 A100 80GB)",
        "hardware": "64 A100 80GB, 8 hosts",
        "setup": "FSDP2, local batch 1 x 8192 tokens, full activation checkpointing; "
        "331 tokens/s per GPU",
        "memory_gib_per_gpu": None,
        "mfu": 0.517,
        "compare_with": ("llama2-70b", "a100-80gb:8x8", "bf16 + remat + scan"),
    },
]


def _row(report: Any, fit: Any) -> dict[str, Any]:
    return {
        "mesh": report.mesh,
        "argument_bytes_per_gpu": report.argument_bytes_per_device,
        "temp_bytes_per_gpu": report.temp_bytes_per_device,
        "peak_bytes_per_gpu": fit.bytes_per_chip,
        "hbm_bytes_per_gpu": fit.hbm_bytes_per_chip,
        "usable_bytes_per_gpu": fit.limit_bytes_per_chip,
        "fits": fit.fits,
        "state_bytes_per_gpu": report.state_bytes_per_device,
        "comm_bytes_per_gpu": report.comm_bytes_per_device,
        "nvlink_bytes_per_gpu": report.nvlink_bytes_per_device,
        "ib_bytes_per_gpu": report.ib_bytes_per_device,
        "min_comm_bytes_per_gpu": report.min_comm_bytes_per_device,
        "min_comm_references": report.min_comm_references,
        "comm_by_kind": report.by_kind(),
        "collective_ops": sum(c.count for c in report.collectives),
        "step_time_floor_seconds": report.step_time_floor_seconds,
        "mfu_ceiling": report.mfu_ceiling,
        "step_floor": report.to_dict()["step_floor"],
    }


def presets(
    topology: str, model_size: str, batch_size: int, names: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """The demo under every preset (or those ``names``), compiled for ``topology``; one row each."""
    import strategies
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    rows = []
    for name in strategies.PRESET_NAMES if names is None else names:
        argv = ["--strategy", name, "--model-size", model_size, "--batch-size", str(batch_size)]
        result = aot.compile_script(module, argv, topology=topology)
        row = {"strategy": name, "compile_seconds": round(result.seconds, 2)}
        rows.append(row | _row(result.report, result.report.memory_fit))
    return rows


def large_row(size: str, topology: str, option: str, batch: int, seq: int) -> dict[str, Any]:
    """One large-model configuration, compiled in this process."""
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    row: dict[str, Any] = {"size": size, "topology": topology, "option": option}
    row.update(global_batch=batch, seq_len=seq)
    if size not in getattr(module, "DECODER_SIZES", ()):
        return row | {"error": f"examples/train.py has no --model-size {size} yet"}
    argv = ["--strategy", "fully_sharded", "--model-size", size, "--batch-size", str(batch)]
    argv += ["--seq-len", str(seq), *common.XLA_ATTENTION, *OPTIONS[option]]
    result = aot.compile_script(module, argv, topology=topology)
    return (
        row
        | {"compile_seconds": round(result.seconds, 1)}
        | _row(result.report, result.report.memory_fit)
    )


def _child(case: tuple[str, str, str, int, int], timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.gpu_presets", "--large-row", *map(str, case)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return dict(zip(("size", "topology", "option"), case, strict=False)) | {
            "error": f"timeout after {timeout} s"
        }
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return dict(zip(("size", "topology", "option"), case, strict=False)) | {
        "error": (done.stderr or done.stdout)[-600:],
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }


def _h(n: float | None) -> str:
    from dtensor.core.text import human_bytes

    return "-" if n is None else human_bytes(n)


def _ms(seconds: float | None) -> str:
    return "-" if not seconds else f"{seconds * 1e3:.0f} ms"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _ratio(row: dict[str, Any]) -> str:
    m = row.get("min_comm_bytes_per_gpu")
    return "-" if not m else f"{row['comm_bytes_per_gpu'] / m:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="h100:2x8")
    p.add_argument("--model-size", default="small")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--no-large", action="store_true", help="skip the large-model rows")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per large compile")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--large-row", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    common.ensure_devices()
    if args.large_row:
        size, topo, option, batch, seq = args.large_row
        print("ROW " + json.dumps(large_row(size, topo, option, int(batch), int(seq))))
        return
    payload: dict[str, Any] = {
        "topology": args.topology,
        "model_size": args.model_size,
        "global_batch": args.batch_size,
        "rows": presets(args.topology, args.model_size, args.batch_size),
        "large": [],
        "references": REFERENCES,
    }
    common.write_json("gpu_presets", payload, args.out)
    for case in [] if args.no_large else LARGE:
        payload["large"].append(_child(case, args.timeout))
        common.write_json("gpu_presets", payload, args.out)
    path = common.write_json("gpu_presets", payload, args.out)
    common.print_table(
        f"demo ({args.model_size}, batch {args.batch_size}) compiled by XLA:GPU for "
        f"{args.topology}, per GPU",
        ["preset", "mesh", "state", "peak memory", "fits", "NVLink / step", "IB / step", "comm / min", "compile s"],
        [
            (r["strategy"], r["mesh"], _h(r["state_bytes_per_gpu"]), _h(r["peak_bytes_per_gpu"]),
             "yes" if r["fits"] else "NO", _h(r["nvlink_bytes_per_gpu"]), _h(r["ib_bytes_per_gpu"]),
             _ratio(r), f"{r['compile_seconds']:.1f}")
            for r in payload["rows"]
        ],
    )  # fmt: skip
    if payload["large"]:
        common.print_table(
            "FullyShardedStrategy, decoder of examples/decoder.py, per GPU",
            ["size", "topology", "option", "batch x seq", "peak", "fits", "NVLink", "IB", "comm / min",
             "floor", "MFU ceiling", "compile s"],
            [
                (r["size"], r["topology"], r["option"], f"{r.get('global_batch')} x {r.get('seq_len')}",
                 _h(r.get("peak_bytes_per_gpu")), {True: "yes", False: "NO"}.get(r.get("fits"), "-"),
                 _h(r.get("nvlink_bytes_per_gpu")), _h(r.get("ib_bytes_per_gpu")),
                 _ratio(r) if "comm_bytes_per_gpu" in r else r.get("error", "-")[:40],
                 _ms(r.get("step_time_floor_seconds")), _pct(r.get("mfu_ceiling")),
                 r.get("compile_seconds", "-"))
                for r in payload["large"]
            ],
        )  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
