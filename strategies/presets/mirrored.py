"""`MirroredStrategy`: variables replicated, the batch split over the local devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.reads.mixed_precision import MixedPrecision
from strategies.replica import cross_device_ops as cdo


class MirroredStrategy(Strategy):
    """Synchronous data parallelism on one host: replicated variables, batch split on ``replica``.

    By default XLA all-reduces the gradients (one combined all-reduce per
    step). ``cross_device_ops`` picks an explicit reduction instead (see
    :mod:`strategies.replica.cross_device_ops`); ``HierarchicalCopyAllReduce`` lays the
    devices out as ``("group", "replica")``, ``num_groups`` (default 2) groups
    in device order.

    Examples:
        >>> import strategies
        >>> s = strategies.MirroredStrategy()
        >>> s.mesh, s.num_replicas_in_sync
        (Mesh(replica=8), 8)
        >>> strategies.MirroredStrategy(cross_device_ops=strategies.HierarchicalCopyAllReduce()).mesh
        Mesh(group=2, replica=4)
    """

    name = "mirrored"

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        cross_device_ops: Any = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        devices = list(devices) if devices is not None else jax.local_devices()
        if isinstance(cross_device_ops, cdo.HierarchicalCopyAllReduce):
            groups = cross_device_ops.num_groups or 2
            if len(devices) % groups or len(devices) == groups:
                raise cdo.CrossDeviceOpsError(
                    f"MirroredStrategy with {cross_device_ops!r} splits its {len(devices)} devices "
                    f"into {groups} groups, which needs a multiple of {groups} and more than one "
                    "device per group. Give num_groups= dividing the devices, or another "
                    "cross_device_ops."
                )
            dims = [("group", groups), ("replica", len(devices) // groups)]
            mesh = dtensor.create_mesh(dims, devices=devices)
            super().__init__(mesh, batch_axes=("group", "replica"), mixed_precision=mixed_precision)
        else:
            mesh = dtensor.create_mesh([("replica", len(devices))], devices=devices)
            super().__init__(mesh, batch_axes=("replica",), mixed_precision=mixed_precision)
        self.gradient_reduction = cdo.resolve(
            cross_device_ops, self.mesh, self.batch_axes, what="MirroredStrategy"
        )
        self.cross_device_ops = cross_device_ops
