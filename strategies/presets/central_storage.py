"""`CentralStorageStrategy`: one copy of the variables; compute on every device."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout
from dtensor.core.tree import leaf_value
from strategies.base import Strategy
from strategies.placement.sharding import one_device_per_process
from strategies.reads.mixed_precision import MixedPrecision
from strategies.reads.offload import HOST_MEMORY, has_host_memory

__all__ = ["CentralStorageStrategy"]


class CentralStorageStrategy(Strategy):
    """Variables kept once, on ``parameter_device``; each step copies them to the
    compute devices, runs data-parallel, and stores the update back.

    ``parameter_device`` defaults to the first compute device; in a job of several
    processes (all of which run the step) to each process's first, the copy kept once
    per process as TensorFlow keeps it once per worker. In a step on
    Flax NNX modules the single copy is kept in that device's host memory
    (``memory_kind="pinned_host"``) between steps, where the platform has
    one (else in its device memory); functional (pytree) variables stay in
    its device memory.

    Examples:
        >>> import strategies, jax.numpy as jnp, dtensor
        >>> s = strategies.CentralStorageStrategy()
        >>> w = s.distribute_variables({"w": jnp.ones((4, 4))})["w"]
        >>> len(w.devices()), s.num_replicas_in_sync
        (1, 8)
    """

    name = "central_storage"

    def __init__(
        self,
        compute_devices: Sequence[Any] | None = None,
        parameter_device: Any = None,
        *,
        devices: Sequence[Any] | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        if compute_devices is not None and devices is not None:
            raise ValueError(
                "CentralStorageStrategy got both compute_devices= and devices= (the same thing); "
                "pass one of them."
            )
        compute_devices = compute_devices if compute_devices is not None else devices
        compute = list(compute_devices) if compute_devices is not None else jax.local_devices()
        if parameter_device is not None:
            storage = [parameter_device]
        elif jax.process_count() > 1:
            # Every process of a job runs the step: the one copy is kept once per process
            # (on each one's first compute device), as TensorFlow keeps it once per worker.
            storage = one_device_per_process(compute)
        else:
            storage = compute[:1]
        mine = [d for d in storage if d.process_index == jax.process_index()]
        self.parameter_device = mine[0] if mine else storage[0]
        self._storage_mesh = dtensor.create_mesh([("device", len(storage))], devices=storage)
        super().__init__(
            dtensor.create_mesh([("replica", len(compute))], devices=compute),
            batch_axes=("replica",),
            mixed_precision=mixed_precision,
        )
        self.host_storage = has_host_memory(self.parameter_device)

    def storage_layout(self, path: str, leaf: Any) -> Layout:
        return Layout.replicated(self._storage_mesh, np.ndim(leaf_value(leaf)))

    def memory_kind(self, path: str, leaf: Any) -> str | None:
        """Host memory (``pinned_host``) for every variable, where the parameter device has it."""
        return HOST_MEMORY if self.host_storage else None

    def compute_layout(self, storage: Layout) -> Layout:
        return Layout.replicated(self.mesh, storage.rank)

    def adopt(self, x: jax.Array, mesh: dtensor.Mesh) -> jax.Array | None:
        # Functional (Linen/optax) variables placed by distribute_variables live
        # on the parameter device; each step copies them to the compute devices.
        if mesh == self._storage_mesh:
            return dtensor.relayout(x, Layout.replicated(self.mesh, x.ndim))
        return None
