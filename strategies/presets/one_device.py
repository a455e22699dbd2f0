"""`OneDeviceStrategy`: everything on one device."""

from __future__ import annotations

from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.reads.mixed_precision import MixedPrecision


class OneDeviceStrategy(Strategy):
    """All variables and computation on one device (the first, by default).

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
            device = devices[0] if devices else jax.devices()[0]
        elif isinstance(device, str):
            platform, _, index = device.rpartition(":")
            device = jax.devices(platform.lower().strip("/").split("/")[-1] or None)[
                int(index or 0)
            ]
        self.device = device
        super().__init__(
            dtensor.create_mesh([("device", 1)], devices=[device]),
            batch_axes=(),
            mixed_precision=mixed_precision,
        )
