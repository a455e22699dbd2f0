"""`OneDeviceStrategy`: everything on one device."""

from __future__ import annotations

from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.placement.sharding import one_device_per_process
from strategies.reads.mixed_precision import MixedPrecision


class OneDeviceStrategy(Strategy):
    """All variables and computation on one device (the first, by default).

    In a job of several processes (``dtensor.launch``, a multi-host VM) every process
    runs the step, so without ``device=`` the preset takes one device *per process*
    (each process's first): the variables replicated on them and the batch split over
    them, each process feeding its share, as TensorFlow runs a single-device strategy on
    each worker but with one set of variables. An explicit ``device`` must be one this
    process owns (a process-local computation).

    Examples:
        >>> import strategies
        >>> strategies.OneDeviceStrategy().num_replicas_in_sync
        1
    """

    name = "one_device"

    def __init__(
        self,
        device: Any = None,
        *,
        devices: Any = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if device is None:
            chosen = list(devices) if devices else jax.devices()
            # One process (ahead-of-time topologies included: their hosts are not processes
            # of this job): the first device. Several: one a process.
            chosen = one_device_per_process(chosen) if jax.process_count() > 1 else chosen[:1]
        else:
            if isinstance(device, str):
                platform, _, index = device.rpartition(":")
                device = jax.devices(platform.lower().strip("/").split("/")[-1] or None)[
                    int(index or 0)
                ]
            if jax.process_count() > 1 and device.process_index != jax.process_index():
                raise ValueError(
                    f"OneDeviceStrategy(device={device}) names a device of process "
                    f"{device.process_index}, but this is process {jax.process_index()} of "
                    f"{jax.process_count()}: every process runs the step, so each needs a "
                    "device of its own. Leave device= out for one device per process, or "
                    "pass one of jax.local_devices()."
                )
            chosen = [device]
        mine = [d for d in chosen if d.process_index == jax.process_index()]
        self.device = mine[0] if mine else chosen[0]
        super().__init__(
            dtensor.create_mesh([("device", len(chosen))], devices=chosen),
            batch_axes=("device",) if len(chosen) > 1 else (),
            mixed_precision=mixed_precision,
        )
