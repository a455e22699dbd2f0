"""One row of :mod:`benchmarks.fsdp_scale`: a configuration compiled and read.

:data:`OPTIONS` maps each option name to the ``examples/train.py`` flags it adds;
:func:`measure` compiles one ``(size, topology, option)`` in this process (the TPU or GPU
compiler through :mod:`dtensor.tpu.aot`, or 8 CPU devices) and returns its row: peak per
chip, ideal peak, communication against its minimum, collectives by kind, network and
dtype, the step-time floor; :func:`child_row` runs it in a fresh process
(``python -m benchmarks.fsdp_scale --row ...``), :func:`skipped_row` stands for an option
this version of the preset does not take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from . import common
from .fsdp_tables import split_slices

__all__ = [
    "DEMO",
    "NEEDS",
    "OPTIONS",
    "PRECISION",
    "ROOT",
    "child_row",
    "measure",
    "skipped_row",
    "unavailable",
]

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train.py"

#: option name -> extra train.py arguments
OPTIONS: dict[str, list[str]] = {
    "default": [],
    "gather at reads": ["--gather-at-reads"],
    "gather at reads, reshard off": ["--gather-at-reads", "--no-reshard-after-forward"],
    "xla plan": ["--xla-plan"],
    "f32 highest": [],
    "bf16": ["--mixed-precision", "bf16"],
    "bf16 + remat": ["--mixed-precision", "bf16", "--remat"],
    "bf16 + remat + gather at reads": ["--mixed-precision", "bf16", "--remat", "--gather-at-reads"],
    "bf16 + remat + scan": ["--mixed-precision", "bf16", "--remat", "--scan"],
    "bf16 + remat + scan + gather layers": [
        "--mixed-precision",
        "bf16",
        "--remat",
        "--scan",
        "--gather-layers",
    ],
    "bf16 + remat + scan + offload": [
        "--mixed-precision",
        "bf16",
        "--remat",
        "--scan",
        "--offload-optimizer",
    ],
    **{
        f"hybrid tensor={t} + bf16 + remat + scan": [
            "--strategy",
            "hybrid",
            "--tensor",
            str(t),
            "--mixed-precision",
            "bf16",
            "--remat",
            "--scan",
        ]
        for t in (2, 4, 8)
    },
    **{
        f"hybrid across {a} + bf16 + remat + scan": [
            "--strategy",
            "hybrid",
            "--across-slices",
            a,
            "--mixed-precision",
            "bf16",
            "--remat",
            "--scan",
        ]
        for a in ("data", "fsdp")
    },
}

# per-tensor memory plans (remat_policy=, MaxText's names) on the hand-configured 70B plan
for _policy in ("qkv_proj_offloaded", "minimal_offloaded", "layer_input_offloaded"):
    OPTIONS[f"hybrid tensor=2 + bf16 + remat ({_policy}) + scan"] = [
        *OPTIONS["hybrid tensor=2 + bf16 + remat + scan"],
        *("--remat-policy", _policy),
    ]

# the search's choice for Llama 3.1 405B: the loss by token slices
OPTIONS["hybrid tensor=4 + bf16 + remat + scan + loss by tokens"] = [
    *OPTIONS["hybrid tensor=4 + bf16 + remat + scan"],
    *("--loss-chunks", "8", "--loss-tiling", "tokens"),
]

#: options compiled with another default matmul precision. "f32 highest" is the float32
#: reference for the all-gather target: at DEFAULT precision the TPU compiler already
#: gathers the float32 operands of matmuls in bfloat16 (one-pass bf16 dots).
PRECISION: dict[str, str] = {"f32 highest": "highest"}


def measure(size: str, topology: str, option: str, batch: int, seq: int) -> dict[str, Any]:
    """Compile one configuration in this process; the row."""
    from dtensor.analysis.memory import WillNotFitError
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    argv = ["--strategy", "fully_sharded", "--model-size", size, "--batch-size", str(batch)]
    argv += ["--seq-len", str(seq), *common.XLA_ATTENTION, *OPTIONS[option]]
    row: dict[str, Any] = {"size": size, "topology": topology, "option": option, "argv": argv}
    row["global_batch"] = batch
    if option in PRECISION:
        import jax

        jax.config.update("jax_default_matmul_precision", PRECISION[option])
        row["matmul_precision"] = PRECISION[option]
    t0 = time.perf_counter()
    try:
        if topology == "cpu":
            import jax

            strategy, step, args = module.aot_step(argv, devices=jax.devices()[:8])
            report = strategy.explain(step, args=tuple(args))
        else:
            name, slices = split_slices(topology)
            report = aot.compile_script(module, argv, topology=name, num_slices=slices).report
    except WillNotFitError as err:
        row.update(
            fits=False,
            required_bytes=err.required,
            compile_seconds=round(time.perf_counter() - t0, 1),
            applied=dict(module.LAST_OPTIONS),
            error=str(err)[:400],
        )
        return row
    fit = report.memory_fit
    kinds = report.by_kind()
    row.update(
        applied=dict(module.LAST_OPTIONS),
        compile_seconds=round(time.perf_counter() - t0, 1),
        peak_bytes_per_chip=fit.bytes_per_chip if fit else report.peak_bytes_per_device,
        xla_peak_bytes_per_device=report.peak_bytes_per_device,
        ideal_peak_bytes_per_device=report.ideal_peak_bytes_per_device,
        ideal_peak_terms=report.to_dict()["ideal_peak_terms"],
        peak_ratio=report.peak_ratio,
        hbm_bytes_per_chip=fit.hbm_bytes_per_chip if fit else None,
        fits=fit.fits if fit else None,
        argument_bytes_per_device=report.argument_bytes_per_device,
        temp_bytes_per_device=report.temp_bytes_per_device,
        state_bytes_per_device=report.state_bytes_per_device,
        comm_bytes_per_device=report.comm_bytes_per_device,
        min_comm_bytes_per_device=report.min_comm_bytes_per_device,
        comm_ratio=report.to_dict()["comm_ratio"],
        all_gather_bytes_per_device=kinds.get("all-gather", 0.0),
        comm_by_kind=kinds,
        ici_bytes_per_device=report.ici_bytes_per_device,
        dcn_bytes_per_device=report.dcn_bytes_per_device,
        dcn_by_kind=_by_kind(c for c in report.collectives if c.network == "dcn"),
        all_gather_dtypes=sorted({c.dtype for c in report.collectives if c.kind == "all-gather"}),
        reduce_bytes_by_dtype=_reduce_bytes_by_dtype(report.collectives),
        min_comm_references=report.min_comm_references,
        step_time_floor_seconds=report.step_time_floor_seconds,
        mfu_ceiling=report.mfu_ceiling,
        step_floor=report.to_dict()["step_floor"],
        mesh=report.mesh,
        libtpu=_libtpu(),
    )
    if topology != "cpu":
        from dtensor.tpu.slices import SliceError, describe_slice

        try:  # the slice as compiled: Cloud TPU's name, grid and links
            row["slice"] = str(describe_slice(split_slices(topology)[0]))
        except SliceError:
            pass
    return row


def _libtpu() -> str | None:
    from importlib import metadata

    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _by_kind(collectives: Any) -> dict[str, float]:
    """Bytes per device by collective kind."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0.0) + c.total_bytes_per_device
    return dict(sorted(out.items()))


def _reduce_bytes_by_dtype(collectives: Any) -> dict[str, float]:
    """Bytes per device of gradient reductions (all-reduce, reduce-scatter) by element type."""
    out: dict[str, float] = {}
    for c in collectives:
        if c.kind in ("all-reduce", "reduce-scatter"):
            out[c.dtype] = out.get(c.dtype, 0.0) + c.total_bytes_per_device
    return dict(sorted(out.items()))


#: options the preset must take itself (no fallback in the model)
NEEDS = {
    "gather at reads, reshard off": "reshard_after_forward",
    "gather at reads": "gather_at_read",
    "xla plan": "gather_at_read",
}


def skipped_row(size: str, topology: str, option: str) -> dict[str, Any] | None:
    """The row of an option this version of FullyShardedStrategy does not take (not compiled)."""
    import strategies
    from strategies.step.memory_advice import accepts

    need = NEEDS.get(option)
    if need is None or accepts(strategies.FullyShardedStrategy, need):
        return None
    return {
        "size": size,
        "topology": topology,
        "option": option,
        "applied": {need: "not available"},
    }


def unavailable(row_options: dict[str, str]) -> bool:
    """Whether a row's applied options include one this version does not take."""
    return any(v == "not available" for v in row_options.values())


def child_row(
    size: str, topology: str, option: str, batch: int, seq: int, timeout: int
) -> dict[str, Any]:
    """Run :func:`measure` in a fresh process (8 CPU devices), return its row."""
    cmd = [sys.executable, "-m", "benchmarks.fsdp_scale", "--row", size, topology, option]
    cmd += ["--batch", str(batch), "--seq", str(seq)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {
            "size": size,
            "topology": topology,
            "option": option,
            "error": f"timeout after {timeout} s",
        }
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("ROW "):
            return json.loads(line[4:])
    return {
        "size": size,
        "topology": topology,
        "option": option,
        "error": (done.stderr or done.stdout)[-600:],
        "compile_seconds": round(time.perf_counter() - t0, 1),
    }
