"""`ParameterServerStrategy` (synchronous mode): variables split over a ``ps`` axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout

from .base import Strategy, _value
from .partitioners import Partitioner

__all__ = ["ParameterServerStrategy"]


class ParameterServerStrategy(Strategy):
    """Variables sharded on dimension 0 over ``ps`` by a partitioner; compute data-parallel.

    The mesh is ``("ps", "worker")``; ``ps`` has ``num_ps`` devices (default:
    the partitioner's ``max_shards``, or 1). A variable the partitioner splits
    (more than one shard) is split into ``num_ps`` shards on dimension 0 when
    that divides, else kept whole (an XLA layout needs even shards). The batch
    is split over every device. The asynchronous mode is ``ClusterCoordinator``.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2))
        >>> s.mesh
        Mesh(ps=2, worker=4)
        >>> s.variable_layout("w", jnp.zeros((10, 3)))
        Layout(['ps', UNSHARDED], mesh=Mesh(ps=2, worker=4))
    """

    name = "parameter_server"
    shards_variables = True

    def __init__(
        self,
        variable_partitioner: Partitioner | None = None,
        num_ps: int | None = None,
        *,
        devices: Sequence[Any] | None = None,
    ) -> None:
        if variable_partitioner is not None and not callable(getattr(variable_partitioner, "num_shards", None)):
            raise TypeError(
                f"variable_partitioner={variable_partitioner!r} is not a partitioner; use "
                "FixedShardsPartitioner(n), MinSizePartitioner(...) or MaxSizePartitioner(...)."
            )
        devices = list(devices) if devices is not None else jax.devices()
        if num_ps is None:
            num_ps = variable_partitioner.max_shards if variable_partitioner is not None else 1
            num_ps = min(num_ps, len(devices))
        if not isinstance(num_ps, int) or num_ps < 1 or len(devices) % num_ps:
            raise ValueError(
                f"num_ps={num_ps!r} must be a positive number of devices that divides the "
                f"{len(devices)} devices; pick a divisor such as {[d for d in range(1, len(devices) + 1) if len(devices) % d == 0]}."
            )
        self.variable_partitioner = variable_partitioner
        self.num_ps = num_ps
        mesh = dtensor.create_mesh([("ps", num_ps), ("worker", len(devices) // num_ps)], devices=devices)
        super().__init__(mesh, batch_axes=("ps", "worker"))

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        value = _value(leaf)
        shape = np.shape(value)
        specs: list[Any] = [None] * len(shape)
        if self.variable_partitioner is not None and shape and self.num_ps > 1:
            shards = self.variable_partitioner.num_shards(shape, value.dtype)
            if shards > 1 and shape[0] % self.num_ps == 0:
                specs[0] = "ps"
        return Layout(specs, self.mesh)

    def __repr__(self) -> str:
        return f"ParameterServerStrategy({self.variable_partitioner!r}, mesh={self.mesh!r})"
