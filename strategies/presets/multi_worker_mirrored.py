"""`MultiWorkerMirroredStrategy`: Mirrored over the devices of every process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.reads.mixed_precision import MixedPrecision
from strategies.replica import cross_device_ops as cdo


class MultiWorkerMirroredStrategy(Strategy):
    """Replicated variables; the batch split over all devices of all processes.

    The mesh is ``("worker", "replica")``: processes by their local devices, so
    each process feeds its own part of the batch
    (``distribute_datasets_from_function`` gives each its ``input_pipeline_id``).
    Call ``dtensor.initialize()`` first in multi-process runs.

    ``communication_options`` (a :class:`strategies.CommunicationOptions`)
    picks the gradient reduction (``implementation``, ``bytes_per_pack``) and a
    step timeout (``timeout_seconds``); ``cross_device_ops`` takes one of
    :mod:`strategies.replica.cross_device_ops` directly (``HierarchicalCopyAllReduce``:
    groups are the workers).

    Examples:
        >>> import strategies
        >>> strategies.MultiWorkerMirroredStrategy().mesh
        Mesh(worker=1, replica=8)
    """

    name = "multi_worker_mirrored"

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        communication_options: cdo.CommunicationOptions | None = None,
        cross_device_ops: Any = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if communication_options is not None and not isinstance(
            communication_options, cdo.CommunicationOptions
        ):
            raise cdo.CrossDeviceOpsError(
                f"MultiWorkerMirroredStrategy(communication_options={communication_options!r}) is "
                "not a strategies.CommunicationOptions; build one with "
                "strategies.CommunicationOptions(implementation=..., bytes_per_pack=..., timeout_seconds=...)."
            )
        options = communication_options or cdo.CommunicationOptions()
        chosen = options.cross_device_ops()
        if chosen is not None and cross_device_ops is not None:
            raise cdo.CrossDeviceOpsError(
                f"MultiWorkerMirroredStrategy got both cross_device_ops={cross_device_ops!r} and "
                f"communication_options choosing {chosen!r}; give one of them."
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
        mesh = dtensor.create_mesh(
            [("worker", len(processes)), ("replica", len(by_process[0]))], devices=ordered
        )
        super().__init__(mesh, batch_axes=("worker", "replica"), mixed_precision=mixed_precision)
        ops = cross_device_ops if cross_device_ops is not None else chosen
        self.gradient_reduction = cdo.resolve(
            ops, self.mesh, self.batch_axes, what="MultiWorkerMirroredStrategy"
        )
        self.cross_device_ops = ops
        self.communication_options = options
        self._watchdog = (
            cdo.StepWatchdog(
                options.timeout_seconds,
                what=f"MultiWorkerMirroredStrategy on process {jax.process_index()}",
            )
            if options.timeout_seconds
            else None
        )

    def after_step(self, result: Any) -> None:
        """Watch the step's result: a step that does not finish in time stops the process."""
        leaves = jax.tree.leaves(result)
        if self._watchdog is not None and leaves:
            self._watchdog.watch(leaves[0])
