"""MaxText's compiled program read as :func:`dtensor.explain` reads ours.

:func:`analyse` takes a row's HLO text and the driver's record (:mod:`benchmarks.maxtext_driver`)
through our HLO parser and step floor: peak per chip (:func:`peak_bytes`), the collectives by
network, the floor and MFU ceiling (with our decoder's model FLOPs, :func:`model_flops_of`),
and the bytes of the copies libtpu's async collective fusions repeat (counted once);
:func:`result_row` is a results row from a row's cache folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from dtensor.analysis.host_link import host_transfers
from dtensor.analysis.roofline import hbm_roofline

from .maxtext_driver import Row, seq_of

__all__ = ["GIB", "analyse", "model_flops_of", "peak_bytes", "result_row"]

GIB = float(1 << 30)


def peak_bytes(memory: dict[str, int]) -> int:
    """MaxText's peak per chip as the side-by-side table counts it: arguments + outputs -
    aliased + temporaries + generated code (``compiled.memory_analysis()`` fields).

    Examples:
        >>> peak_bytes({"argument_size_in_bytes": 10, "output_size_in_bytes": 10,
        ...             "alias_size_in_bytes": 9, "temp_size_in_bytes": 5,
        ...             "generated_code_size_in_bytes": 1})
        17
    """
    m = memory
    return (
        m["argument_size_in_bytes"]
        + m["output_size_in_bytes"]
        - m["alias_size_in_bytes"]
        + m["temp_size_in_bytes"]
        + m["generated_code_size_in_bytes"]
    )


def analyse(hlo_text: str, record: dict[str, Any], model_flops: float | None) -> dict[str, Any]:
    """The floor of a compiled program from its HLO text and the driver's ``record``
    (``mesh_shape``, ``slices``, ``device_kind``, ``matmul_flops``, ``memory``), the way
    :func:`dtensor.explain` takes ours: collectives by
    :func:`~dtensor.analysis.hlo.parse_collectives`, split by network, and
    :func:`~dtensor.analysis.floor.step_floor` on the chip of the hardware table.
    ``model_flops`` (one step's) gives the MFU ceiling.
    """
    from dtensor.analysis.floor import step_floor
    from dtensor.analysis.hardware import CHIPS
    from dtensor.analysis.hlo import parse_collectives

    mesh_shape = [(str(a), int(s)) for a, s in record["mesh_shape"]]
    collectives = parse_collectives(hlo_text, mesh_shape, slices=record["slices"])
    by_network: dict[str, float] = {"ici": 0.0, "dcn": 0.0}
    by_kind: dict[str, float] = {}
    for c in collectives:
        by_network[c.network] = by_network.get(c.network, 0.0) + c.total_bytes_per_device
        key = f"{c.network} {c.kind}"
        by_kind[key] = by_kind.get(key, 0.0) + c.total_bytes_per_device
    every = parse_collectives(hlo_text, mesh_shape, slices=record["slices"], chained_copies=True)
    repeated = sum(c.total_bytes_per_device for c in every) - sum(
        c.total_bytes_per_device for c in collectives
    )
    devices = len(record["slices"])
    chip = CHIPS[record["device_kind"]]
    moved = host_transfers(hlo_text)
    floor = step_floor(
        record["matmul_flops"] / devices,
        by_network["ici"],
        by_network["dcn"],
        chip,
        devices=devices,
        host_bytes_per_device=max(moved.to_host_bytes, moved.from_host_bytes),
        roofline=(
            hbm_roofline(hlo_text, chip.hbm_bytes_per_s, chip.peak_flops)
            if chip.hbm_bytes_per_s
            else None
        ),
    )
    return {
        "peak_bytes_per_chip": peak_bytes(record["memory"]),
        "memory": record["memory"],
        "devices": devices,
        "mesh": {a: s for a, s in mesh_shape if s > 1},
        "step_floor": floor.to_dict(),
        "step_time_floor_seconds": floor.seconds,
        "model_flops": model_flops,
        "mfu_ceiling": floor.mfu_ceiling(model_flops) if model_flops else None,
        "ici_bytes_per_device": by_network["ici"],
        "dcn_bytes_per_device": by_network["dcn"],
        "comm_by_kind": dict(sorted(by_kind.items())),
        # libtpu's async collective fusions repeat a collective (same channel) in the fusion
        # that starts it, each continuation and the one that ends it; the floor counts it
        # once, as explain does. These are the bytes of the copies after the first.
        "async_repeat_bytes_per_device": repeated,
        # libtpu's collective matmuls (windowed einsums: a loop of collective-permutes
        # beside the matmul's blocks), as while loops in the HLO
        "collective_matmul_loops": len(
            re.findall(r"body=%?(?:wide\.)?windowed_dot_general_body", hlo_text)
        ),
        "collectives": len(collectives),
    }


def model_flops_of(size: str, topology: str, devices: int, seq: int = 1024) -> float | None:
    """One step's model FLOPs of our decoder at the row's shapes (MaxText's
    ``per_device_batch_size=1``: one sequence of ``seq`` per chip), the count our rows'
    MFU ceilings use; ``None`` for a size our decoder lacks."""
    from examples.decoder import CONFIGS, model_flops

    cfg = CONFIGS.get(size)
    return None if cfg is None else model_flops(cfg, devices, seq)


def result_row(row: Row, out: Path) -> dict[str, Any]:
    """A results row from a row's cache folder (the driver's files): what it compiled, with
    :func:`analyse`'s figures."""
    size, topology, overrides, _ = row
    record = json.loads((out / "compiled.json").read_text())
    devices = len(record["slices"])
    ours = model_flops_of(size, topology, devices, seq_of(overrides))
    theirs = record["maxtext_tflops_per_device"] * 1e12 * devices
    figures = analyse((out / "hlo.txt").read_text(), record, ours or theirs)
    return {
        "size": size,
        "topology": topology,
        "overrides": list(overrides),
        "libtpu": record["libtpu"],
        "jax": record["jax"],
        "maxtext": record["maxtext"],
        "compile_seconds": round(record["compile_seconds"], 1),
        "trace_seconds": round(record["trace_seconds"], 1),
        "model_flops_source": "ours (examples.decoder.model_flops)" if ours else "MaxText's",
        "maxtext_model_flops": theirs,
        **figures,
    }
