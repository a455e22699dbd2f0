"""The rest of tf.distribute's ``Strategy`` surface that custom training loops call.

:meth:`Strategy.experimental_local_results`, :attr:`Strategy.extended` and
:attr:`Strategy.cluster_resolver` are short methods on the base class that
delegate here. Each keeps tf.distribute's meaning where it has one on a JAX
mesh, and says so where it differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dtensor.runtime import resolve_cluster
from strategies.replica.values import PerReplica

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["ClusterResolver", "StrategyExtended", "cluster_resolver", "local_results"]


# ------------------------------------------------------------- local results
def _local_rows(value: jax.Array) -> list[tuple[int, Any]]:
    """(replica index, that replica's value) for the replicas held by this process."""
    if not isinstance(value, jax.Array) or value.is_fully_addressable:
        return [(i, value[i]) for i in range(value.shape[0])]
    rows: dict[int, Any] = {}
    for shard in value.addressable_shards:
        start = shard.index[0].start or 0
        for j in range(shard.data.shape[0]):
            rows.setdefault(start + j, shard.data[j])
    return sorted(rows.items(), key=lambda kv: kv[0])


def local_results(value: Any) -> tuple[Any, ...]:
    """This process's replicas' values, as a tuple (tf.distribute's ``experimental_local_results``).

    A :class:`PerReplica` value gives one entry per replica held by this
    process (all replicas in a single process); a pytree with
    :class:`PerReplica` leaves gives one tree per local replica; anything else
    (a global array, a Python number) gives ``(value,)``.

    Examples:
        >>> import strategies, numpy as np
        >>> s = strategies.MirroredStrategy()
        >>> v = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
        >>> [float(x) for x in s.experimental_local_results(v)][:3]
        [0.0, 1.0, 2.0]
        >>> s.experimental_local_results(3.0)
        (3.0,)
    """
    is_pr = lambda v: isinstance(v, PerReplica)  # noqa: E731
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_pr)
    if not any(is_pr(leaf) for leaf in leaves):
        return (value,)
    per_leaf = [_local_rows(leaf.value) if is_pr(leaf) else None for leaf in leaves]
    indices = next(p for p in per_leaf if p is not None)
    results = []
    for k in range(len(indices)):
        row = [leaf if p is None else p[k][1] for leaf, p in zip(leaves, per_leaf, strict=True)]
        results.append(jax.tree.unflatten(treedef, row))
    return tuple(results)


# ------------------------------------------------------------------ extended
class StrategyExtended:
    """``strategy.extended``: the members of tf.distribute's ``StrategyExtended`` that loops use.

    ``worker_devices`` are this process's compute devices; ``parameter_devices``
    where variables are stored (for :class:`strategies.CentralStorageStrategy`
    the parameter device, for the others every device of the mesh, each
    holding its share). ``should_checkpoint`` is ``True`` on every process:
    each takes part in :func:`dtensor.checkpoint.save` (orbax writes every
    process's shards, so no per-worker temporary directories are needed);
    ``should_save_summary`` only on process 0 (the chief writes summaries).

    Examples:
        >>> import strategies
        >>> s = strategies.MirroredStrategy()
        >>> len(s.extended.worker_devices), s.extended.should_checkpoint
        (8, True)
    """

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[Any, ...]:
        """This process's compute devices, in mesh order."""
        return tuple(self._strategy.mesh.local_devices)

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        """The devices variables are stored on, in mesh order."""
        mesh = self._strategy.storage_layout("", np.zeros(())).mesh
        return tuple(np.asarray(mesh.devices).flat)

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process calls the checkpoint save (all do: orbax writes every process's shards)."""
        return True

    @property
    def should_save_summary(self) -> bool:
        """Whether this process writes summaries (process 0 only)."""
        return jax.process_index() == 0

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` (an array or an NNX variable) is laid out on this strategy's devices.

        tf.distribute answers "was it created inside ``scope()``"; JAX arrays
        carry no creation record, so this asks the equivalent question of where
        the array lives: on this strategy's mesh (or its parameter devices).
        """
        value = v.get_value() if hasattr(v, "get_value") else v
        sharding = getattr(value, "sharding", None)
        if sharding is None:
            return False
        ours = set(np.asarray(self._strategy.mesh.devices).flat) | set(self.parameter_devices)
        return set(sharding.device_set) <= ours

    def __repr__(self) -> str:
        return f"StrategyExtended({self._strategy!r})"


# ----------------------------------------------------------- cluster resolver
class ClusterResolver:
    """``strategy.cluster_resolver``: this process's place in a multi-process job.

    The shape of tf.distribute's ``ClusterResolver`` that training code reads.

    Attributes:
        task_type: ``"chief"`` or ``"worker"`` (from ``TF_CONFIG`` when the
            cluster came from it; otherwise ``"worker"``).
        task_id: this task's index within its task type (otherwise the process
            index).
        rpc_layer: always ``"grpc"`` (JAX's coordination service).

    Examples:
        >>> from strategies.tf_compat import ClusterResolver
        >>> r = ClusterResolver("worker", 1, {"chief": ["c:7"], "worker": ["w0:7", "w1:7"]})
        >>> r.task_type, r.task_id, r.cluster_spec()["worker"]
        ('worker', 1, ['w0:7', 'w1:7'])
    """

    rpc_layer = "grpc"

    def __init__(self, task_type: str, task_id: int, jobs: Mapping[str, list[str]]) -> None:
        self.task_type = task_type
        self.task_id = task_id
        self._jobs = {k: list(v) for k, v in jobs.items()}

    def cluster_spec(self) -> dict[str, list[str]]:
        """Task type → addresses, as ``ClusterSpec.as_dict()`` gives in TensorFlow.

        From ``TF_CONFIG`` when the cluster came from it. Otherwise one
        ``"worker"`` list with an entry per process: the coordinator's address
        for process 0, ``"process-<i>"`` for the others (JAX's coordination
        service does not publish their addresses).
        """
        return {k: list(v) for k, v in self._jobs.items()}

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None
    ) -> dict[str, int]:
        """This process's accelerators by kind, e.g. ``{"TPU": 4}`` (``{}`` on CPU)."""
        devices = jax.local_devices()
        kind = devices[0].platform.upper() if devices else "CPU"
        return {} if kind == "CPU" else {kind: len(devices)}

    def __repr__(self) -> str:
        return f"ClusterResolver(task_type={self.task_type!r}, task_id={self.task_id}, cluster_spec={self._jobs})"


def cluster_resolver(environ: Mapping[str, str] | None = None) -> ClusterResolver | None:
    """The :class:`ClusterResolver` of this job, or ``None`` for a single process.

    tf.distribute's ``MirroredStrategy.cluster_resolver`` is ``None`` too; a
    multi-process job (``dtensor.initialize()`` called with more than one
    process) gets one for any preset.

    Examples:
        >>> import strategies
        >>> strategies.MirroredStrategy().cluster_resolver is None  # one process
        True
    """
    env = os.environ if environ is None else environ
    count = jax.process_count()
    if count == 1:
        return None
    index = jax.process_index()
    spec = resolve_cluster(environ=env)
    if spec is not None and spec.source == "TF_CONFIG":
        config = json.loads(env["TF_CONFIG"])
        cluster = config["cluster"]
        jobs = {k: list(cluster[k]) for k in ("chief", "worker") if cluster.get(k)}
        task = config["task"]
        return ClusterResolver(str(task["type"]), int(task["index"]), jobs)
    coordinator = spec.coordinator_address if spec is not None else None
    workers = [coordinator or "process-0"] + [f"process-{i}" for i in range(1, count)]
    return ClusterResolver("worker", index, {"worker": workers})
