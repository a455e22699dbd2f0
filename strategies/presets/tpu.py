"""`TPUStrategy`: data parallelism over TPU cores with a topology-aware mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import dtensor
from strategies.base import Strategy
from strategies.reads.mixed_precision import MixedPrecision


class TPUStrategy(Strategy):
    """Replicated variables, the batch split over TPU cores (ICI all-reduce).

    On a machine without TPUs it raises, unless ``devices=`` is given
    explicitly (tests pass CPU devices, ahead-of-time compiles pass
    ``dtensor.tpu_topology(...)``).

    Examples:
        >>> import jax, strategies
        >>> strategies.TPUStrategy(devices=jax.devices()).mesh
        Mesh(replica=8)
    """

    name = "tpu"

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if devices is None:
            platforms = sorted({d.platform for d in jax.devices()})
            if platforms != ["tpu"]:
                raise ValueError(
                    f"TPUStrategy() found no TPU devices: this machine has {platforms} devices. Run "
                    "on a Cloud TPU VM, or pass devices= explicitly (e.g. devices=jax.devices() to "
                    "test on CPU, or dtensor.tpu_topology('v5e:4x4') to compile ahead of time)."
                )
            mesh = dtensor.create_mesh([("replica", -1)])
        else:
            mesh = dtensor.create_mesh([("replica", len(list(devices)))], devices=list(devices))
        super().__init__(mesh, batch_axes=("replica",), mixed_precision=mixed_precision)
