"""`MultiWorkerMirroredStrategy`: Mirrored over the devices of every process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import dtensor

from .base import Strategy


class MultiWorkerMirroredStrategy(Strategy):
    """Replicated variables; the batch split over all devices of all processes.

    The mesh is ``("worker", "replica")``: processes by their local devices, so
    each process feeds its own part of the batch
    (``distribute_datasets_from_function`` gives each its ``input_pipeline_id``).
    Call ``dtensor.initialize()`` first in multi-process runs.

    Examples:
        >>> import strategies
        >>> strategies.MultiWorkerMirroredStrategy().mesh
        Mesh(worker=1, replica=8)
    """

    name = "multi_worker_mirrored"

    def __init__(self, devices: Sequence[Any] | None = None, *, communication_options: Any = None) -> None:
        if communication_options is not None:
            raise ValueError(
                f"MultiWorkerMirroredStrategy(communication_options={communication_options!r}) is "
                "not supported yet; leave it None (XLA's all-reduce)."
            )
        devices = list(devices) if devices is not None else jax.devices()
        processes = sorted({d.process_index for d in devices})
        by_process = [[d for d in devices if d.process_index == p] for p in processes]
        if len({len(g) for g in by_process}) != 1:
            raise ValueError(
                f"MultiWorkerMirroredStrategy needs the same number of devices in every process; got "
                f"{[len(g) for g in by_process]} per process. Give each process as many devices."
            )
        ordered = [d for g in by_process for d in g]
        mesh = dtensor.create_mesh([("worker", len(processes)), ("replica", len(by_process[0]))], devices=ordered)
        super().__init__(mesh, batch_axes=("worker", "replica"))
