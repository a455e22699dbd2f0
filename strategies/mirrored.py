"""`MirroredStrategy`: variables replicated, the batch split over the local devices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import dtensor

from .base import Strategy


class MirroredStrategy(Strategy):
    """Synchronous data parallelism on one host: replicated variables, batch split on ``replica``.

    Gradients are all-reduced by XLA (one combined all-reduce per step).

    Examples:
        >>> import strategies
        >>> s = strategies.MirroredStrategy()
        >>> s.mesh, s.num_replicas_in_sync
        (Mesh(replica=8), 8)
    """

    name = "mirrored"

    def __init__(self, devices: Sequence[Any] | None = None, *, cross_device_ops: Any = None) -> None:
        if cross_device_ops is not None:
            raise ValueError(
                f"MirroredStrategy(cross_device_ops={cross_device_ops!r}) is not supported yet; XLA "
                "emits one all-reduce per step. Leave cross_device_ops=None."
            )
        devices = list(devices) if devices is not None else jax.local_devices()
        super().__init__(dtensor.create_mesh([("replica", len(devices))], devices=devices), batch_axes=("replica",))
