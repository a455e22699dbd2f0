"""Small pieces of :class:`strategies.ClusterCoordinator`: its statistics, and how arguments and errors are read."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import jax

from dtensor.core.tree import is_node
from strategies.coordinator.values import PerWorkerValues, RemoteValue, WorkerFailure

__all__ = ["CoordinatorStats"]

_FAILURE_CODES = ("UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED")


@dataclasses.dataclass(frozen=True)
class CoordinatorStats:
    """Counters of a coordinator: what ran where, and how stale its updates were.

    Attributes:
        completed: closures that finished successfully.
        per_worker: successful closures per worker.
        staleness: for each committed update, in commit order, how many other
            updates were committed between its read of the parameters and its own.
        retries: closures put back on the queue after a worker failure.
        bytes_moved: across processes, the bytes the closures moved between
            tasks (snapshots, changes, outputs); 0 in one process.
    """

    completed: int
    per_worker: tuple[int, ...]
    staleness: tuple[int, ...]
    retries: int
    bytes_moved: int = 0


# ------------------------------------------------------------------- helpers
def _is_remote(x: Any) -> bool:
    return isinstance(x, RemoteValue)


def _resolve(tree: Any, worker: int) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, PerWorkerValues):
            return v.resolve(worker)
        if isinstance(v, RemoteValue):
            return v.get()
        return v

    return jax.tree.map(
        one, tree, is_leaf=lambda v: isinstance(v, PerWorkerValues | RemoteValue) or is_node(v)
    )


def _is_worker_failure(error: BaseException) -> bool:
    if isinstance(error, WorkerFailure):
        return True
    if isinstance(error, jax.errors.JaxRuntimeError):
        return str(error).split(":", 1)[0].strip() in _FAILURE_CODES
    return False


def _check_addressable(devices: Iterable[Any]) -> None:
    here = jax.process_index()
    remote = [d for d in devices if d.process_index != here]
    if remote:
        raise ValueError(
            f"ClusterCoordinator needs every device in this process (process {here}), but "
            f"{len(remote)} belong to other processes (e.g. {remote[0]!r} of process "
            f"{remote[0].process_index}). The asynchronous mode is single-controller: build the "
            "strategy over jax.local_devices(), or train across hosts with the synchronous "
            "ParameterServerStrategy."
        )
