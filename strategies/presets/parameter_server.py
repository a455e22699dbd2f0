"""`ParameterServerStrategy` (synchronous mode): variables split over a ``ps`` axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout
from dtensor.core.tree import leaf_value
from dtensor.runtime.roles import current_role
from strategies.base import Strategy
from strategies.partitioners import Partitioner
from strategies.reads.mixed_precision import MixedPrecision

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
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if variable_partitioner is not None and not callable(
            getattr(variable_partitioner, "num_shards", None)
        ):
            raise TypeError(
                f"variable_partitioner={variable_partitioner!r} is not a partitioner; use "
                "FixedShardsPartitioner(n), MinSizePartitioner(...) or MaxSizePartitioner(...)."
            )
        if devices is None:  # the chief of a multi-process job keeps its variables local
            devices = jax.local_devices() if current_role() is not None else jax.devices()
        devices = list(devices)
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
        mesh = dtensor.create_mesh(
            [("ps", num_ps), ("worker", len(devices) // num_ps)], devices=devices
        )
        super().__init__(mesh, batch_axes=("ps", "worker"), mixed_precision=mixed_precision)

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        value = leaf_value(leaf)
        shape = np.shape(value)
        specs: list[Any] = [None] * len(shape)
        if self.variable_partitioner is not None and shape and self.num_ps > 1:
            shards = self.variable_partitioner.num_shards(shape, value.dtype)
            if shards > 1 and shape[0] % self.num_ps == 0:
                specs[0] = "ps"
        return Layout(specs, self.mesh)

    # ------------------------------------------------ groups for ClusterCoordinator
    def parameter_mesh(self) -> dtensor.Mesh:
        """The ``("ps",)`` mesh over the first ``num_ps`` devices: where the asynchronous
        mode (:class:`ClusterCoordinator`) keeps the variables.

        Examples:
            >>> import strategies
            >>> strategies.ParameterServerStrategy(num_ps=2).parameter_mesh()
            Mesh(ps=2)
        """
        return dtensor.create_mesh(
            [("ps", self.num_ps)], devices=self.mesh.device_list[: self.num_ps]
        )

    def parameter_layout(self, path: str, leaf: Any) -> Layout:
        """:meth:`variable_layout` moved onto :meth:`parameter_mesh` (same split on ``ps``)."""
        layout = self.variable_layout(path, leaf)
        specs = ["ps" if "ps" in layout.axes(d) else None for d in range(layout.rank)]
        return Layout(specs, self.parameter_mesh())

    def worker_meshes(self, num_workers: int | None = None) -> tuple[dtensor.Mesh, ...]:
        """The worker groups of the asynchronous mode: the devices after the first
        ``num_ps``, split in order into ``num_workers`` ``("worker",)`` meshes
        (default: one device each). With no device left over, the workers share
        the parameter devices.

        Examples:
            >>> import strategies
            >>> strategies.ParameterServerStrategy(num_ps=2).worker_meshes(3)
            (Mesh(worker=2), Mesh(worker=2), Mesh(worker=2))
        """
        rest = self.mesh.device_list[self.num_ps :] or self.mesh.device_list
        if num_workers is None:
            num_workers = len(rest)
        if (
            not isinstance(num_workers, int)
            or isinstance(num_workers, bool)
            or num_workers < 1
            or len(rest) % num_workers
        ):
            raise ValueError(
                f"num_workers={num_workers!r} must be a positive number that divides the {len(rest)} "
                f"worker devices of {self!r}; pick one of "
                f"{[d for d in range(1, len(rest) + 1) if len(rest) % d == 0]}, or leave it None (one device each)."
            )
        size = len(rest) // num_workers
        return tuple(
            dtensor.create_mesh([("worker", size)], devices=rest[i * size : (i + 1) * size])
            for i in range(num_workers)
        )

    def __repr__(self) -> str:
        return f"ParameterServerStrategy({self.variable_partitioner!r}, mesh={self.mesh!r})"
