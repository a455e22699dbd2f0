"""Values of the asynchronous parameter-server mode (see :mod:`strategies.coordinator`).

`RemoteValue` (a closure's future result), `PerWorkerValues` (one value per
worker, resolved on the worker that runs a closure), the per-worker datasets
and iterators built by ``ClusterCoordinator.create_per_worker_dataset``, and
`WorkerFailure`, the marker that tells a worker failure from a user error.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Iterable
from typing import Any

import jax

__all__ = [
    "PerWorkerDataset",
    "PerWorkerIterator",
    "PerWorkerValues",
    "RemoteDataset",
    "RemoteIterator",
    "RemoteValue",
    "StaleCommit",
    "WorkerFailure",
]


class WorkerFailure(RuntimeError):
    """A worker (not the closure's code) failed: the closure is re-run on another worker.

    Raise it (or a subclass) from code that runs on a worker — an input
    pipeline, a health check — to mark the worker as down. The coordinator
    stops giving that worker closures (until ``set_worker_available``) and
    puts the closure back at the front of the queue. Any other exception is a
    user error: it is not retried, and surfaces on ``join()``/``fetch()``.

    Examples:
        >>> from strategies import WorkerFailure
        >>> isinstance(WorkerFailure("worker 3 lost its host"), RuntimeError)
        True
    """


class StaleCommit(WorkerFailure):
    """A closure read parameters more commits old than ``max_staleness``: it runs again.

    Examples:
        >>> from strategies.coordinator.values import StaleCommit, WorkerFailure
        >>> issubclass(StaleCommit, WorkerFailure)
        True
    """


class RemoteValue:
    """The result of a scheduled closure, available once it has run (TF's name).

    Examples:
        >>> import strategies, numpy as np
        >>> coordinator = strategies.ClusterCoordinator(strategies.ParameterServerStrategy(num_ps=2))
        >>> value = coordinator.schedule(lambda x: x * 2, args=(np.float32(3.0),))
        >>> float(value.fetch())
        6.0
        >>> coordinator.close()
    """

    def __init__(self, closure_id: int) -> None:
        self.closure_id = closure_id
        self._event = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set(self, value: Any) -> None:
        self._value = value
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def done(self) -> bool:
        """Whether the closure has finished (successfully or not)."""
        return self._event.is_set()

    def get(self) -> Any:
        """Wait for the closure and return its output as JAX arrays (on the worker's devices).

        Raises:
            The closure's error, or ``concurrent.futures.CancelledError`` when it
            was cancelled because an earlier closure failed.
        """
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def fetch(self) -> Any:
        """Wait for the closure and return its output copied to the host (NumPy)."""
        return jax.device_get(self.get())

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "done" if self.done() else "pending"
        return f"RemoteValue(closure={self.closure_id}, {state})"


@dataclasses.dataclass(frozen=True)
class PerWorkerValues:
    """One value per worker; a closure that runs on worker ``i`` receives ``values[i]``.

    Examples:
        >>> from strategies import PerWorkerValues
        >>> ids = PerWorkerValues((0, 1, 2))
        >>> len(ids), ids.resolve(1)
        (3, 1)
    """

    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))

    def __len__(self) -> int:
        return len(self.values)

    def resolve(self, worker: int) -> Any:
        """The value a closure running on ``worker`` receives."""
        return self.values[worker]


@dataclasses.dataclass(frozen=True)
class PerWorkerIterator(PerWorkerValues):
    """One iterator per worker; a closure on worker ``i`` receives ``next(values[i])``.

    TF's step calls ``next(iterator)`` itself; a compiled JAX step cannot, so the
    coordinator takes the next element on the worker, just before the step.
    """

    def resolve(self, worker: int) -> Any:
        try:
            return next(self.values[worker])
        except StopIteration:
            raise RuntimeError(
                f"the per-worker dataset of worker {worker} is exhausted, so the closure got no "
                "batch. Make dataset_fn repeat (e.g. itertools.cycle, or an endless generator) or "
                "schedule fewer closures."
            ) from None

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "next() on a PerWorkerIterator: it holds one iterator per worker, and which one to "
            "advance depends on the worker that runs the closure. Pass the iterator to "
            "coordinator.schedule(fn, args=(iterator,)); fn receives the next element."
        )


@dataclasses.dataclass(frozen=True)
class PerWorkerDataset:
    """The datasets ``dataset_fn`` made, one per worker; ``iter()`` gives a :class:`PerWorkerIterator`.

    Examples:
        >>> import strategies
        >>> coordinator = strategies.ClusterCoordinator(strategies.ParameterServerStrategy(num_ps=2), num_workers=3)
        >>> ds = coordinator.create_per_worker_dataset(lambda ctx: [ctx.input_pipeline_id] * 2)
        >>> len(iter(ds))
        3
        >>> coordinator.close()
    """

    datasets: tuple[Iterable[Any], ...]

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(tuple(iter(d) for d in self.datasets))

    def __len__(self) -> int:
        return len(self.datasets)


_datasets = itertools.count()


@dataclasses.dataclass(frozen=True)
class RemoteIterator:
    """A per-worker iterator of a multi-process job: each worker reads its own dataset."""

    dataset_id: int
    fn_name: str
    num_workers: int

    def __iter__(self) -> RemoteIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "next() on a per-worker iterator of a multi-process job: each worker reads its own "
            "dataset. Pass the iterator to coordinator.schedule(fn, args=(iterator,)); fn "
            "receives the next element on the worker that runs it."
        )

    def __len__(self) -> int:
        return self.num_workers


@dataclasses.dataclass(frozen=True)
class RemoteDataset:
    """``create_per_worker_dataset`` across processes: each worker calls the registered function."""

    dataset_id: int
    fn_name: str
    num_workers: int

    def __iter__(self) -> RemoteIterator:
        return RemoteIterator(next(_datasets), self.fn_name, self.num_workers)

    def __len__(self) -> int:
        return self.num_workers
