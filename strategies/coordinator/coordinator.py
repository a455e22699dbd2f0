"""`ClusterCoordinator`: asynchronous parameter-server training (TensorFlow's names).

The strategy's devices split into a *parameter group* (the first ``num_ps``
devices, a ``("ps",)`` mesh holding the variables, split by the partitioner)
and *worker groups* (the other devices, one device or a ``("worker",)`` mesh
each). One dispatcher thread per worker takes closures from a shared queue.

How user code is written. TF's closure reads and updates variables captured
from the scope; a compiled JAX step cannot capture mutable variables, so here
the variables' owners are *arguments*. Write an ordinary Flax NNX step and pass
the model and optimizer to ``schedule``::

    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    coordinator = strategies.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    losses = [coordinator.schedule(train_step, args=(model, optimizer, iterator)) for _ in range(n)]
    coordinator.join()

What one closure does on worker ``w``:

1. its arguments are resolved for ``w``: a per-worker iterator gives its next
   element (the worker calls ``next``, as TF's step does), a
   :class:`PerWorkerValues` its ``w``-th value, a :class:`RemoteValue` its result;
2. *read*: the current variables of the modules are copied from the parameter
   group to ``w``'s devices (a consistent snapshot, taken under the lock);
3. *compute*: the step runs there, compiled for ``w`` (one compile per worker
   and input signature); inside it the optimizer is a stand-in whose
   ``update(model, grads)`` only records the gradients;
4. *apply*: under the lock, in commit order, a program on the parameter
   devices adds the changes the step made to variables (TF's ``assign_add``)
   and runs the real ``optimizer.update`` with the gradients, so optimizer
   state lives with the parameters. Other workers have committed meanwhile:
   the gradients are stale by that many updates (``stats().staleness``), as in
   TF's asynchronous training.

A closure *commits* at step 4; until then nothing it did is visible, so a
closure whose worker fails before committing is re-run elsewhere, and one that
committed never runs again. Each worker runs one closure at a time and waits
for its results before committing, which bounds the work queued on XLA (see
JAX-NOTES on simulated CPU devices).

Across processes and hosts. Under :func:`dtensor.runtime.join_cluster` (a job
of ``chief``, ``ps`` and ``worker`` tasks, TF's names, every task running the
same script) the chief's coordinator drives the other tasks instead of local
devices (:mod:`strategies.coordinator.cluster`): the parameter server holds the
variables, each worker task runs closures on its own devices, and the same
four steps travel as JSON messages through the coordination service's
key-value store, with arrays pulled point to point through
``jax.experimental.transfer`` (no collective: JAX's multi-controller
programs stay per task). Steps, dataset functions and model builders are
named by ``@strategies.remote_function``, never pickled. A worker that dies
fails its closure (run again elsewhere); a restarted one rejoins.
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import itertools
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax

import dtensor.checkpoint
from dtensor import compat
from dtensor.core.tree import is_node
from dtensor.runtime.roles import current_role
from strategies.coordinator import step as cs
from strategies.coordinator.params import ParameterGroup
from strategies.coordinator.support import (
    CoordinatorStats,
    _check_addressable,
    _is_remote,
    _is_worker_failure,
    _resolve,
)
from strategies.coordinator.values import (
    PerWorkerDataset,
    RemoteDataset,
    RemoteValue,
    StaleCommit,
)
from strategies.presets.parameter_server import ParameterServerStrategy
from strategies.replica.values import InputContext

__all__ = ["ClusterCoordinator", "CoordinatorStats"]


class _Closure:
    __slots__ = ("id", "fn", "args", "kwargs", "remote", "failures")

    def __init__(
        self, cid: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        self.id, self.fn, self.args, self.kwargs = cid, fn, args, kwargs
        self.remote = RemoteValue(cid)
        self.failures = 0


class ClusterCoordinator:
    """Schedules closures onto worker groups that train against a parameter group.

    Args:
        strategy: a :class:`ParameterServerStrategy`; its first ``num_ps``
            devices hold the variables, the others are the workers.
        num_workers: how many worker groups to split the other devices into
            (default: one device each).
        max_retries: how many worker failures one closure may meet before it
            fails for good (its error then surfaces on ``join()``).

    Examples:
        >>> import strategies, optax, numpy as np
        >>> from flax import nnx
        >>> strategy = strategies.ParameterServerStrategy(num_ps=2)
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def step(model, optimizer, x):
        ...     loss, grads = nnx.value_and_grad(lambda m: ((m(x) - 1.0) ** 2).mean())(model)
        ...     optimizer.update(model, grads)
        ...     return loss
        >>> with strategies.ClusterCoordinator(strategy, num_workers=2) as coordinator:
        ...     losses = [coordinator.schedule(step, args=(model, optimizer, np.ones((4, 3), np.float32))) for _ in range(6)]
        >>> coordinator.stats().completed, int(optimizer.step[...])
        (6, 6)
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        num_workers: int | None = None,
        *,
        max_retries: int = 3,
        max_staleness: int | None = None,
        worker_timeout_s: float = 4.0,
    ) -> None:
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                f"ClusterCoordinator(strategy={strategy!r}): asynchronous training needs a "
                "ParameterServerStrategy (its partitioner lays out the variables on the parameter "
                "devices). Build one, e.g. strategies.ParameterServerStrategy(num_ps=2)."
            )
        self.strategy = strategy
        self.max_retries = max_retries
        self._remote: Any = None
        role = current_role()
        if role is not None:  # a multi-process job: drive the ps and worker tasks by message
            if not role.is_chief:
                raise RuntimeError(
                    f"ClusterCoordinator on a '{role.task_type}' task: only the chief runs the "
                    "training loop; the others call dtensor.runtime.serve()."
                )
            from strategies.coordinator.cluster import ClusterBackend

            self._remote = ClusterBackend(
                strategy,
                role,
                compat.distributed_client(),
                max_staleness=max_staleness,
                worker_timeout_s=worker_timeout_s,
                on_worker_back=lambda w: self.set_worker_available(w, True),
            )
            self._ps_mesh, self._workers = None, tuple(range(role.num_workers))
        else:
            self._ps_mesh = strategy.parameter_mesh()
            self._workers = strategy.worker_meshes(num_workers)
            _check_addressable(strategy.mesh.device_list)
            self._params = ParameterGroup(strategy, self._ps_mesh, max_staleness=max_staleness)
        self._nodes: list[Any] = []  # the modules and optimizers scheduled so far
        self._cond = threading.Condition()  # the queue and the bookkeeping below
        self._queue: collections.deque[_Closure] = collections.deque()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._available = [True] * len(self._workers)
        self._closed = False
        self._ids = itertools.count()
        self._per_worker = [0] * len(self._workers)
        self._retries = 0
        self._steps: list[dict[Any, cs.WorkerStep]] = [{} for _ in self._workers]
        self._threads = [
            threading.Thread(target=self._work, args=(w,), name=f"ps-worker-{w}", daemon=True)
            for w in range(len(self._workers))
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------- API
    @property
    def num_workers(self) -> int:
        """How many worker groups run closures."""
        return len(self._workers)

    @property
    def worker_meshes(self) -> tuple[Any, ...]:
        """Each worker group's ``("worker",)`` mesh."""
        return self._workers

    def schedule(
        self,
        fn: Callable[..., Any],
        args: Iterable[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        NNX modules and optimizers among the arguments are the variables: they
        are moved to the parameter group (first time seen) and updated there by
        the closure. Per-worker values and iterators, and remote values, are
        resolved on the worker that runs it. If an earlier closure failed, that
        error is raised here (and cleared), as TF does.
        """
        self._raise_error()
        if self._closed:
            raise RuntimeError(
                "schedule() on a closed ClusterCoordinator: close() (or leaving its `with` block) "
                "stopped its workers. Create a new ClusterCoordinator."
            )
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        for node in jax.tree.leaves((args, kwargs), is_leaf=is_node):
            if is_node(node):
                (self._remote or self._params).place(node)
                if not any(n is node for n in self._nodes):
                    self._nodes.append(node)
        closure = _Closure(next(self._ids), fn, args, kwargs)
        with self._cond:
            self._queue.append(closure)
            self._cond.notify_all()
        return closure.remote

    def join(self) -> None:
        """Wait until every scheduled closure has finished; raise the first error (and clear it)."""
        with self._cond:
            while self._queue or self._in_flight:
                if self._error is not None:
                    break
                if self._in_flight == 0 and not any(self._available):
                    raise RuntimeError(
                        f"{len(self._queue)} closures are waiting but all {self.num_workers} workers "
                        "are unavailable (they raised WorkerFailure or were marked so). Bring one back "
                        "with coordinator.set_worker_available(i, True), or check the failures."
                    )
                self._cond.wait(timeout=1.0)
        self._raise_error()

    def done(self) -> bool:
        """Whether every scheduled closure has finished; raises the first error (and clears it)."""
        self._raise_error()
        with self._cond:
            return not self._queue and self._in_flight == 0

    def fetch(self, values: Any) -> Any:
        """``fetch()`` every :class:`RemoteValue` in a pytree (waiting for each)."""
        return jax.tree.map(
            lambda v: v.fetch() if isinstance(v, RemoteValue) else v, values, is_leaf=_is_remote
        )

    def create_per_worker_dataset(
        self, dataset_fn: Callable[..., Iterable[Any]]
    ) -> PerWorkerDataset:
        """Call ``dataset_fn`` once per worker (with an :class:`InputContext` if it takes an argument).

        ``iter()`` of the result gives a per-worker iterator: passed to
        ``schedule``, the closure receives the next element of the iterator of
        the worker that runs it. After a worker failure, the re-run takes its
        element from the new worker's iterator (the failed worker's element is
        skipped, as in TF).
        """
        if self._remote is not None:
            from strategies.coordinator.cluster import _named

            name = _named(dataset_fn, "create_per_worker_dataset()")
            return RemoteDataset(0, name, self.num_workers)  # type: ignore[return-value]
        takes_ctx = any(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
            for p in inspect.signature(dataset_fn).parameters.values()
        )
        n = self.num_workers
        made = [
            dataset_fn(
                InputContext(num_input_pipelines=n, input_pipeline_id=w, num_replicas_in_sync=n)
            )
            if takes_ctx
            else dataset_fn()
            for w in range(n)
        ]
        return PerWorkerDataset(tuple(made))

    def fetch_variables(self) -> tuple[Any, ...]:
        """Copy the parameter servers' current values into the scheduled modules and optimizers.

        In one process they are the same objects (nothing to copy); across
        processes the chief's objects hold their initial values until this
        is called (for an evaluation or a summary on the chief). Returns them.
        """
        if self._remote is not None:
            for node in self._nodes:
                self._remote.fetch_variables(node)
        return tuple(self._nodes)

    def parameter_shards(self) -> dict[str, list[dict[str, Any]]]:
        """Across processes: each ps task's own copy, by builder (TF's ``ShardedVariable.variables``).

        For each builder, one entry per ps task, in task order: ``"variables"``
        (path -> host array: its rows of each variable the partitioner splits,
        the whole of the others) and ``"applied"`` (the closures it committed,
        in the order it applied them). In one process the variables are global
        arrays: read their ``.addressable_shards`` instead.

        Examples:
            >>> import strategies
            >>> c = strategies.ClusterCoordinator(strategies.ParameterServerStrategy(num_ps=2))
            >>> c.parameter_shards()  # doctest: +IGNORE_EXCEPTION_DETAIL
            Traceback (most recent call last):
            RuntimeError: parameter_shards() in one process: there are no ps tasks ...
            >>> c.close()
        """
        if self._remote is None:
            raise RuntimeError(
                "parameter_shards() in one process: there are no ps tasks, the variables are "
                "global arrays on the parameter devices; read x.addressable_shards instead."
            )
        return {name: self._remote.shards(node) for name, node in self._remote.builders()}

    def save(self, directory: str, step: int) -> None:
        """Checkpoint the variables (and optimizer state) where they live, layout-aware.

        Across processes the chief reads them from the parameter server and
        writes them alone with :mod:`dtensor.checkpoint` (one directory per
        builder under ``directory``; :meth:`restore` sends them back, and the
        parameter server lays them out by its partitioner); in one process the
        scheduled objects are saved as they are laid out. Wait
        for :meth:`join` first for a checkpoint of a quiet moment.
        """
        if self._remote is not None:
            for name, node in self._remote.builders():
                self._remote.save(node, f"{directory}/{name}", step)
            return
        dtensor.checkpoint.save(directory, list(self._nodes), step=step)

    def restore(self, directory: str, *nodes: Any, step: int | None = None) -> None:
        """Load :meth:`save`'s checkpoint into the variables where they live (latest step by default).

        ``nodes`` (the model, the optimizer) are placed first, as by a
        ``schedule``; then every object the coordinator has seen is restored.
        """
        for node in nodes:
            (self._remote or self._params).place(node)
            if not any(n is node for n in self._nodes):
                self._nodes.append(node)
        if self._remote is not None:
            for name, node in self._remote.builders():
                self._remote.restore(node, f"{directory}/{name}", step)
            return
        with self._cond:
            dtensor.checkpoint.restore(directory, list(self._nodes), step=step)
            for node in self._nodes:
                self._params.place(node)

    def set_worker_available(self, worker: int, available: bool) -> None:
        """Mark a worker as up or down (for tests, or a health check that saw its devices go).

        A worker marked down takes no closures; the closure it is running, if
        any, is not committed and runs again on another worker.
        """
        if not 0 <= worker < self.num_workers:
            raise ValueError(
                f"set_worker_available(worker={worker!r}): there are {self.num_workers} workers; "
                f"pass an index in 0..{self.num_workers - 1}."
            )
        with self._cond:
            self._available[worker] = bool(available)
            self._cond.notify_all()

    def stats(self) -> CoordinatorStats:
        """What has run so far (see :class:`CoordinatorStats`)."""
        if self._remote is not None:
            staleness, moved = tuple(self._remote.staleness), self._remote.bytes_moved
        else:
            staleness, moved = self._params.staleness(), 0
        with self._cond:
            return CoordinatorStats(
                sum(self._per_worker), tuple(self._per_worker), staleness, self._retries, moved
            )

    def close(self) -> None:
        """Stop the workers after their current closures; queued closures are cancelled."""
        with self._cond:
            self._closed = True
            for c in self._queue:
                c.remote._fail(
                    concurrent.futures.CancelledError(f"closure {c.id}: the coordinator was closed")
                )
            self._queue.clear()
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join()
        if self._remote is not None:
            self._remote.close()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self.join()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"ClusterCoordinator(parameters={self._ps_mesh!r}, workers={self.num_workers})"

    # ------------------------------------------------------------- internals
    def _raise_error(self) -> None:
        with self._cond:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _work(self, w: int) -> None:
        while True:
            with self._cond:
                while not self._closed and (not self._queue or not self._available[w]):
                    self._cond.wait()
                if self._closed:
                    return
                closure = self._queue.popleft()
                self._in_flight += 1
            try:
                out = self._run(w, closure)
            except BaseException as e:  # noqa: BLE001 - every error is surfaced or retried
                self._failed(w, closure, e)
            else:
                with self._cond:
                    self._in_flight -= 1
                    self._per_worker[w] += 1
                    self._cond.notify_all()
                closure.remote._set(out)

    def _failed(self, w: int, closure: _Closure, error: BaseException) -> None:
        with self._cond:
            self._in_flight -= 1
            if isinstance(error, StaleCommit):  # not the worker's fault: run it again
                self._retries += 1
                self._queue.appendleft(closure)
                self._cond.notify_all()
                return
            if _is_worker_failure(error) or not self._available[w]:
                self._available[w] = getattr(error, "rejoined", False)  # a new incarnation is up
                closure.failures += 1
                if closure.failures <= self.max_retries and not self._closed:
                    self._retries += 1
                    self._queue.appendleft(closure)
                    self._cond.notify_all()
                    return
                last = error
                error = RuntimeError(
                    f"closure {closure.id} ({getattr(closure.fn, '__name__', closure.fn)}) met "
                    f"{closure.failures} worker failures, more than max_retries={self.max_retries}; "
                    "the last is chained below. Check the workers, or raise max_retries."
                )
                error.__cause__ = last
            closure.remote._fail(error)
            if self._error is None:
                self._error = error
                for c in self._queue:  # as TF: an error cancels what has not started
                    c.remote._fail(
                        concurrent.futures.CancelledError(
                            f"closure {c.id} was cancelled: an earlier closure failed"
                        )
                    )
                self._queue.clear()
            self._cond.notify_all()

    def _run(self, w: int, closure: _Closure) -> Any:
        if self._remote is not None:
            return self._remote.run(w, closure.id, closure.fn, closure.args, closure.kwargs)
        args, kwargs = _resolve((closure.args, closure.kwargs), w)
        return self._params.run(
            closure.fn,
            args,
            kwargs,
            worker=w,
            mesh=self._workers[w],
            steps=self._steps[w],
            committable=lambda: self._available[w],
            what=f"closure {closure.id}",
        )
