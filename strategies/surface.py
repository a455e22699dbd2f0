"""`DistributeMethods`: tf.distribute's replica-facing ``Strategy`` methods on a mesh.

Local results, ``extended``, ``cluster_resolver``, ``reduce``/``gather`` across
replicas, per-replica values and distributed datasets. Each is a short method
that delegates to the module that does the work (:mod:`strategies.tf_compat`,
:mod:`strategies.replica.cross_replica`, :mod:`strategies.datasets`);
:class:`strategies.Strategy` inherits them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import dtensor
from dtensor import Mesh, ReduceOp
from strategies import datasets, tf_compat
from strategies.replica import cross_replica
from strategies.replica.values import InputContext, ValueContext

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["DistributeMethods"]


class DistributeMethods:
    """tf.distribute's cross-replica methods (see the module docstring).

    Examples:
        >>> import strategies, numpy as np
        >>> s = strategies.MirroredStrategy()
        >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.float32(1))
        >>> float(s.reduce("sum", x)), s.input_context().num_input_pipelines
        (8.0, 1)
    """

    mesh: Mesh

    @property
    def _strategy(self) -> Strategy:
        return cast("Strategy", self)  # mixed into Strategy only

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's replicas' values as a tuple; a plain value gives ``(value,)``.

        See :func:`strategies.tf_compat.local_results`.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> out = s.run(lambda x: x.sum(), args=(np.ones((16, 2), "f4"),), per_replica=True)
            >>> [float(v) for v in s.experimental_local_results(out)]
            [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
        """
        return tf_compat.local_results(value)

    @functools.cached_property
    def extended(self) -> tf_compat.StrategyExtended:
        """tf.distribute's ``strategy.extended``: devices, checkpoint/summary roles,
        ``variable_created_in_scope`` (see :class:`strategies.tf_compat.StrategyExtended`)."""
        return tf_compat.StrategyExtended(self._strategy)

    @property
    def cluster_resolver(self) -> tf_compat.ClusterResolver | None:
        """This process's place in a multi-process job, or ``None`` for one process
        (see :class:`strategies.tf_compat.ClusterResolver`)."""
        return tf_compat.cluster_resolver()

    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce a value across replicas (and along ``axis`` of each replica's value).

        A :class:`PerReplica` value (from ``run(..., per_replica=True)``) is
        combined over its replicas; a global array is already one value, so
        ``axis`` reduces along that dimension of the global array (the batch
        dimension spans all replicas).

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
            >>> float(s.reduce("sum", x)), float(s.reduce("max", x))
            (28.0, 7.0)
        """
        return cross_replica.reduce(op, value, axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """All replicas' values concatenated along ``axis``, whole on every device.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.full((2,), ctx.replica_id_in_sync_group))
            >>> s.gather(x, axis=0).tolist()
            [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
        """

        return cross_replica.gather(self.mesh, value, axis)

    # ---------------------------------------------------------------- values
    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Call ``value_fn`` once per replica and hold the results as :class:`PerReplica` values."""
        return cross_replica.values_from_function(self._strategy, value_fn)

    # --------------------------------------------------------------- datasets
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], *, pad: bool = False, prefetch: int = 2
    ) -> dtensor.DTensorDataset:
        """Each element (a pytree of host arrays: the *global* batch) as global arrays in the batch layout.

        With ``pad=True`` a batch whose rows do not divide over the replicas is
        padded and each element becomes ``(batch, weights)``: per-row weights
        (1 real, 0 padding) that keep means exact.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> batches = [{"x": np.ones((16, 3))}] * 2
            >>> [b["x"].shape for b in s.experimental_distribute_dataset(batches)]
            [(16, 3), (16, 3)]
        """
        return datasets.distribute_dataset(self._strategy, dataset, pad=pad, prefetch=prefetch)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        *,
        pad: bool = False,
        prefetch: int = 2,
    ) -> dtensor.DTensorDataset:
        """``dataset_fn(InputContext)`` gives this process's share; shares are stitched into global arrays."""
        return datasets.datasets_from_function(
            self._strategy, dataset_fn, pad=pad, prefetch=prefetch
        )

    def input_context(self) -> InputContext:
        """This process's :class:`InputContext`."""
        return datasets.input_context(self._strategy)
