"""Distributed values and contexts: `PerReplica`, `InputContext`, `ReplicaContext`, `ValueContext`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

from dtensor import ReduceOp

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["InputContext", "PerReplica", "ReplicaContext", "ValueContext"]


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What an input function needs to know to read its share (tf.distribute's names).

    Examples:
        >>> from strategies import InputContext
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
        >>> ctx.get_per_replica_batch_size(64)
        8
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1
    # The global batch sizes the input function asked about (to check its shares).
    _global_batch_sizes: list[int] = dataclasses.field(
        default_factory=list, compare=False, repr=False
    )

    @property
    def requested_global_batch_size(self) -> int | None:
        """The global batch size the input function last asked about (``None``: it asked none)."""
        return self._global_batch_sizes[-1] if self._global_batch_sizes else None

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; raises if it does not divide."""
        self._global_batch_sizes.append(int(global_batch_size))
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size {global_batch_size} does not divide over "
                f"{self.num_replicas_in_sync} replicas; use a multiple of {self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync

    def get_per_pipeline_batch_size(self, global_batch_size: int) -> int:
        """The rows this input pipeline (process) reads of each global batch."""
        self._global_batch_sizes.append(int(global_batch_size))
        if global_batch_size % self.num_input_pipelines:
            raise ValueError(
                f"the global batch size {global_batch_size} does not divide over "
                f"{self.num_input_pipelines} input pipelines; use a multiple of {self.num_input_pipelines}."
            )
        return global_batch_size // self.num_input_pipelines


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Passed to ``experimental_distribute_values_from_function``'s function."""

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


@dataclasses.dataclass(frozen=True)
class PerReplica:
    """One value per replica, held as a global array whose dimension 0 is the replicas.

    Examples:
        >>> import strategies, numpy as np
        >>> s = strategies.MirroredStrategy()
        >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
        >>> [float(x) for x in v.values][:3]
        [0.0, 1.0, 2.0]
    """

    value: jax.Array

    @property
    def values(self) -> tuple[jax.Array, ...]:
        """Each replica's value, in replica order."""
        return tuple(self.value[i] for i in range(self.value.shape[0]))

    def __len__(self) -> int:
        return int(self.value.shape[0])


class ReplicaContext:
    """Available inside ``strategy.run(fn, ..., per_replica=True)`` via ``get_replica_context()``."""

    def __init__(self, strategy: Strategy, axes: tuple[str, ...], num_replicas: int) -> None:
        self.strategy = strategy
        self._axes = axes
        self.num_replicas_in_sync = num_replicas

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index (a traced integer)."""
        if not self._axes:
            return jax.numpy.int32(0)
        return jax.lax.axis_index(self._axes)

    def all_reduce(self, op: ReduceOp | str, value: Any) -> Any:
        """Combine ``value`` (a pytree) across replicas; every replica gets the result."""
        op = ReduceOp.parse(op)
        if not self._axes:
            return value
        return jax.tree.map(lambda v: op.across(v, self._axes), value)
