"""The chief's side of a multi-process ``ClusterCoordinator``: drives ps and worker tasks by message.

One closure on worker ``w`` (each step a JSON message on the coordination
service's key-value store, arrays through ``jax.experimental.transfer``):

1. the chief asks the parameter server to ``read``: it offers a snapshot of
   the modules the closure reads, taken under its lock (its version is noted);
2. the chief asks worker ``w`` to ``run`` the registered step: the worker
   pulls the snapshot, takes its next element of its own dataset, runs the
   step compiled for its devices, and offers the changes and the output;
3. the chief pulls the output (the closure's :class:`RemoteValue`);
4. the chief asks the parameter server to ``commit``: it pulls the changes
   from the worker and applies them in commit order, at most once per
   closure, with the number of commits since its read as the staleness
   (above ``max_staleness`` the commit is refused and the closure runs again).

With several ``ps`` tasks, a variable the partitioner splits is split by
rows over them (its optimizer state with it) and the others are kept whole on
each: step 1 asks every ps (the worker joins the rows), and step 4 first has
every ps pull its rows of the changes (``stage``), then, under one lock,
every ps apply them (``apply``), so reads see every ps at the same commit and
every ps applies the commits in the same order.

A worker that dies (its heartbeat stops, or it comes back as a new
incarnation) fails its closure with :class:`WorkerFailure` before step 4
completes; the coordinator runs it again on another worker. A worker that
comes back is given closures again.
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
from flax import nnx

import dtensor.checkpoint
from dtensor.checkpoint.processes import this_process_only
from dtensor.core.tree import is_node
from dtensor.runtime import rpc
from dtensor.runtime.roles import TaskRole
from dtensor.runtime.serve import stop_services
from strategies.coordinator.plan import (
    Plan,
    encode_value,
    part,
    resolve_value,
    split_across,
    structure,
)
from strategies.coordinator.remote import RemoteFunction, lookup, nodes_of_call, origin
from strategies.coordinator.values import StaleCommit, WorkerFailure

__all__ = ["ClusterBackend"]


def _named(fn: Any, what: str) -> str:
    if isinstance(fn, RemoteFunction):
        return fn.name
    raise TypeError(
        f"{what} across processes got {getattr(fn, '__qualname__', fn)!r}, a function the other "
        "tasks cannot find: only registered functions are sent, by name. Decorate it with "
        "@strategies.remote_function at the top level of the script every task runs."
    )


class ClusterBackend:
    """Talks to the ps and worker tasks for :class:`strategies.ClusterCoordinator` on the chief."""

    def __init__(
        self,
        strategy: Any,
        role: TaskRole,
        client: Any,
        *,
        max_staleness: int | None,
        worker_timeout_s: float,
        on_worker_back: Any,
        join_timeout_s: float = 120,
    ) -> None:
        self.strategy, self.role, self.client = strategy, role, client
        self.max_staleness, self.worker_timeout_s = max_staleness, worker_timeout_s
        # bound where the ps tasks reach it (they pull the chief's initial values)
        self.transfers = rpc.Transfers()
        rpc.announce(role, self.transfers.address())
        self._on_worker_back = on_worker_back
        self._lock = threading.Lock()
        self._splits: dict[str, list[bool]] = {}  # builder -> which leaves the partitioner splits
        self._calls: dict[str, int] = {}  # builder -> the call whose nodes the ps holds
        self._builders: dict[str, Any] = {}  # builder -> one of those nodes
        self._traces: dict[Any, Any] = {}
        self.staleness: list[int] = []
        self.bytes_moved = 0
        self._version = 0  # commits so far, in the order every ps applied them
        self._commit_lock = threading.Lock()  # reads and applies across all ps: consistent
        self.ps = [
            rpc.TaskInfo.wait(client, role.process_of("ps", k), join_timeout_s)
            for k in range(role.num_ps)
        ]
        lanes = range(role.num_workers + 1)  # one per worker thread, the last for control
        self._ps_lanes = [[rpc.Channel(client, ps, lane) for lane in lanes] for ps in self.ps]
        self._ps_watch = [rpc.Watch(client, ps, 10 * worker_timeout_s) for ps in self.ps]
        self.workers = [
            rpc.TaskInfo.wait(client, role.process_of("worker", w), join_timeout_s)
            for w in range(role.num_workers)
        ]
        self._channels = [rpc.Channel(client, info, 0) for info in self.workers]
        self._watches = [rpc.Watch(client, info, worker_timeout_s) for info in self.workers]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._rejoins, name="ps-rejoin", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- variables
    def place(self, node: Any) -> None:
        """Send a builder's initial variables to the parameter server (once per builder call)."""
        made = self._origin(node, "schedule()")
        with self._lock:
            if self._calls.get(made.builder) == made.call:
                return
            self._calls[made.builder] = made.call
            self._builders[made.builder] = node
        leaves = jax.tree.leaves(nnx.split(nodes_of_call(made))[1])
        partitioner = getattr(self.strategy, "variable_partitioner", None)
        split = [
            partitioner is not None
            and bool(x.ndim)
            and partitioner.num_shards(tuple(x.shape), x.dtype) > 1
            for x in leaves
        ]
        self._send_parts("init", made.builder, leaves, split=split)

    def _send_parts(self, op: str, builder: str, leaves: list[Any], **extra: Any) -> None:
        """Offer each ps task its rows of ``leaves`` (as split at ``init``) and send it ``op``."""
        n = self.role.num_ps
        across = self._across(builder, leaves, extra.get("split"))
        for k in range(n):
            mine = [part(x, a, k, n) for x, a in zip(leaves, across, strict=True)]
            message: dict[str, Any] = {"op": op, "builder": builder}
            message.update(address=self.transfers.address())
            message.update(uuid=self.transfers.offer(mine), specs=[rpc.spec_of(x) for x in mine])
            self._call_ps(k, self.role.num_workers, {**message, **extra})

    def _across(self, builder: str, leaves: list[Any], split: list[bool] | None) -> list[bool]:
        if split is not None:
            self._splits[builder] = split
        split = self._splits[builder]
        n = self.role.num_ps
        return [split_across(tuple(x.shape), s, n) for x, s in zip(leaves, split, strict=True)]

    def _states(self, builder: str) -> list[tuple[list[Any], list[int]]]:
        """Each ps task's own values of a builder's variables, and the closures it applied."""
        parts = []
        for k in range(self.role.num_ps):
            reply = self._call_ps(k, self.role.num_workers, {"op": "state", "builder": builder})
            pulled = self.transfers.pull(self.ps[k].address, reply["uuid"], reply["specs"])
            parts.append((pulled, reply["order"]))
        return parts

    def shards(self, node: Any) -> list[dict[str, Any]]:
        """For each ps task: ``{"variables": {path: host array}, "applied": [closure ids]}``."""
        made = self._origin(node, "parameter_shards()")
        state = nnx.to_pure_dict(nnx.split(nodes_of_call(made))[1])  # leaves in state order
        paths = [
            jax.tree_util.keystr(path, simple=True, separator="/")
            for path, _ in jax.tree_util.tree_leaves_with_path(state)
        ]
        return [
            {
                "variables": dict(zip(paths, jax.device_get(leaves), strict=True)),
                "applied": applied,
            }
            for leaves, applied in self._states(made.builder)
        ]

    def fetch_variables(self, node: Any) -> tuple[Any, ...]:
        """Copy the parameter servers' current values into the chief's nodes of ``node``'s builder."""
        made = self._origin(node, "fetch_variables()")
        nodes = nodes_of_call(made)
        leaves, treedef = jax.tree.flatten(nnx.split(nodes)[1])
        across = self._across(made.builder, leaves, None)
        parts = [pulled for pulled, _ in self._states(made.builder)]
        joined = [
            np.concatenate([np.asarray(p[i]) for p in parts]) if a else parts[0][i]
            for i, a in enumerate(across)
        ]
        placed = [jax.device_put(p, x.sharding) for p, x in zip(joined, leaves, strict=True)]
        nnx.update(nodes, jax.tree.unflatten(treedef, placed))
        return nodes

    def builders(self) -> list[tuple[str, Any]]:
        """The builders whose variables the parameter server holds, with one of their nodes."""
        with self._lock:
            return sorted(self._builders.items())

    def save(self, node: Any, directory: str, step: int) -> None:
        """Checkpoint ``node``'s builder's variables, read from the parameter server, on the chief.

        The chief writes alone (``this_process_only``: the other tasks take no
        part) host copies of every variable and optimizer state, so any
        layout can restore them (:func:`dtensor.checkpoint.restore`).
        """
        nodes = self.fetch_variables(node)
        state = jax.device_get(nnx.to_pure_dict(nnx.split(nodes)[1]))
        with this_process_only():
            dtensor.checkpoint.save(directory, state, step=step)

    def restore(self, node: Any, directory: str, step: int | None) -> None:
        """Load a :meth:`save` into the chief's nodes and send them to the parameter server."""
        made = self._origin(node, "restore()")
        nodes = nodes_of_call(made)
        state = nnx.split(nodes)[1]
        with this_process_only():
            restored = dtensor.checkpoint.restore(
                directory, jax.device_get(nnx.to_pure_dict(state)), step=step
            )
        live = nnx.to_pure_dict(state)
        placed = jax.tree.map(
            lambda x, old: jax.device_put(np.asarray(x), old.sharding), restored, live
        )
        nnx.replace_by_pure_dict(state, placed)
        nnx.update(nodes, state)
        self._send_parts("load", made.builder, jax.tree.leaves(nnx.split(nodes)[1]))

    @staticmethod
    def _origin(node: Any, what: str) -> Any:
        made = origin(node)
        if made is None:
            raise TypeError(
                f"{what} across processes got a {type(node).__name__} that no registered builder "
                "made, so the other tasks cannot build its structure. Build the model and "
                "optimizer in a @strategies.remote_function (e.g. `model, optimizer = build()` "
                "inside strategy.scope()) and pass those objects."
            )
        return made

    # ---------------------------------------------------------------- closures
    def run(self, w: int, cid: int, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run closure ``cid`` on worker ``w`` (the four steps of the module docstring)."""
        name = _named(fn, "schedule()")
        made = [origin(v) for v in jax.tree.leaves((args, kwargs), is_leaf=is_node) if is_node(v)]
        builders = {o.builder for o in made if o is not None}
        if len(builders) > 1:
            raise ValueError(
                f"a closure across processes reads nodes of {len(builders)} builders "
                f"({sorted(builders)}); build everything one closure uses in one builder."
            )
        builder = builders.pop() if builders else ""
        nodes = structure(builder) if builder else ()
        encoded = encode_value(
            (tuple(args), dict(kwargs)), lambda v: self._origin(v, "schedule()").index
        )
        snapshots, version = [], self._version
        if builder:
            read = {"op": "read", "builder": builder, "modules": self._modules(encoded, nodes)}
            with self._commit_lock:  # every ps at the same commit: a consistent snapshot
                version = self._version
                for k, ps in enumerate(self.ps):
                    reply = self._call_ps(k, w, read)
                    snapshots.append({"address": ps.address, **reply})
        message = {"op": "run", "closure": cid, "fn": name, "builder": builder, "args": encoded}
        message.update(snapshots=snapshots)
        info = self.workers[w]
        try:
            ran = self._channels[w].call(message, self._watches[w].alive)
            self._check(ran, w, cid)
            step, shapes, snapshot_bytes = self._trace(name, ran["args"], nodes)
            out_leaves, out_tree = jax.tree.flatten(shapes[2])
            specs = [rpc.spec_of(x) for x in out_leaves]
            outs = self.transfers.pull(info.address, ran["out"], specs, timeout_s=30)
        except (rpc.PeerGone, WorkerFailure) as e:
            failure = WorkerFailure(f"worker {w}: {e}")
            failure.rejoined = self.workers[w].incarnation != info.incarnation  # type: ignore[attr-defined]
            raise failure from None
        moved = snapshot_bytes + _nbytes(shapes)
        if builder and (step.deltas or step.updates):
            self._commit(w, cid, name, builder, ran, info, version)
        with self._lock:
            self.bytes_moved += int(moved)
        return jax.tree.unflatten(out_tree, outs)

    def _commit(
        self,
        w: int,
        cid: int,
        name: str,
        builder: str,
        ran: dict[str, Any],
        info: Any,
        version: int,
    ) -> None:
        """Every ps pulls its rows of the changes (staged), then all apply them in one order."""
        base = {"closure": cid, "fn": name, "builder": builder, "args": ran["args"]}
        for k in range(self.role.num_ps):
            staged = self._call_ps(
                k, w, {"op": "stage", **base, "address": info.address, "uuid": ran["changes"][k]}
            )
            self._check(staged, w, cid)
        with self._commit_lock:
            staleness = self._version - version
            if self.max_staleness is not None and staleness > self.max_staleness:
                for k in range(self.role.num_ps):
                    self._call_ps(k, w, {"op": "drop", **base})
                raise StaleCommit(
                    f"closure {cid} read parameters {staleness} commits old, more than "
                    f"max_staleness={self.max_staleness}: it runs again"
                )
            replies = [
                self._call_ps(k, w, {"op": "apply", **base}) for k in range(self.role.num_ps)
            ]
            if not any(r.get("duplicate") for r in replies):
                self._version += 1
                with self._lock:
                    self.staleness.append(staleness)

    def _modules(self, encoded: Any, nodes: tuple[Any, ...]) -> list[int]:
        args, kwargs = resolve_value(encoded, nodes, lambda *_: None)
        plan = Plan(_noop, args, kwargs)
        return [next(i for i, n in enumerate(nodes) if n is m) for m in plan.modules]

    def _trace(self, name: str, abstract: Any, nodes: tuple[Any, ...]) -> Any:
        key = (name, repr(abstract))
        traced = self._traces.get(key)
        if traced is None:
            args, kwargs = resolve_value(abstract, nodes, lambda *_: None)
            plan = Plan(lookup(name).fn, args, kwargs)
            step, shapes = plan.trace()
            snapshot = _nbytes(plan.module_state()[1])
            traced = self._traces[key] = (step, shapes, snapshot)
        return traced

    @staticmethod
    def _check(reply: dict[str, Any], w: int, cid: int) -> None:
        if "error" not in reply:
            return
        if reply.get("kind") == "ps":  # "UNAVAILABLE: ...": the runtime names the lost ps
            raise RuntimeError(reply["error"])
        if reply.get("kind") == "peer":
            raise WorkerFailure(
                f"worker {w} was lost before closure {cid} committed: {reply['error']}"
            )
        raise RuntimeError(
            f"closure {cid} failed on worker {w}: {reply['error']}\n{reply.get('traceback', '')}"
        )

    def _call_ps(self, k: int, lane: int, message: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = self._ps_lanes[k][lane].call(message, self._ps_watch[k].alive)
        except rpc.PeerGone as e:
            raise RuntimeError(
                f"UNAVAILABLE: the parameter server (ps {k}) was lost: {e}"
            ) from None
        if "error" in reply and reply.get("kind") != "peer":
            raise RuntimeError(
                f"the parameter server failed on {message['op']!r}: {reply['error']}"
            )
        return reply

    # ---------------------------------------------------------------- rejoins
    def _rejoins(self) -> None:
        while not self._stop.wait(0.5):
            for w in range(self.role.num_workers):
                info = rpc.TaskInfo.read(self.client, self.workers[w].process)
                if info is not None and info.incarnation != self.workers[w].incarnation:
                    self._channels[w] = rpc.Channel(self.client, info, 0)
                    self._watches[w] = rpc.Watch(self.client, info, self.worker_timeout_s)
                    self.workers[w] = info
                    self._on_worker_back(w)

    def close(self) -> None:
        self._stop.set()
        stop_services(self.client)


def _nbytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _noop(*args: Any, **kwargs: Any) -> None:
    return None
