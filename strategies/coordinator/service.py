"""The parameter server and the worker of a multi-process ``ClusterCoordinator`` job.

:func:`dtensor.runtime.serve` runs one of these on every task but the chief
(registered below). Both answer JSON requests from the chief and move arrays
with ``jax.experimental.transfer`` (:mod:`dtensor.runtime.rpc`):

- :class:`ParameterService` (a ``ps`` task) holds the variables of each
  registered builder's nodes (model and optimizer) on its devices, split by
  the partitioner's choice over a ``("ps",)`` mesh; ``read`` offers a snapshot
  of the modules a closure reads, ``commit`` pulls a worker's changes and
  gradients and applies them in commit order (the optimizer state stays
  here), exactly once per closure, counting staleness.
- :class:`WorkerService` (a ``worker`` task) pulls a snapshot, runs the
  registered step compiled for its own devices, and offers the changes and
  the output for the parameter server and the chief to pull.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import jax
import numpy as np
from flax import nnx

import dtensor
from dtensor.runtime import rpc
from dtensor.runtime.roles import TaskRole
from dtensor.runtime.serve import register_service
from strategies.coordinator import step as cs
from strategies.coordinator.plan import (
    Plan,
    abstract_of,
    change_splits,
    part,
    part_spec,
    resolve_value,
    split_across,
    splits_of,
    structure,
)
from strategies.coordinator.remote import lookup
from strategies.replica.values import InputContext

__all__ = ["ParameterService", "WorkerService"]


def _abstract_args(message: dict[str, Any], nodes: tuple[Any, ...]) -> tuple[Any, Any]:
    def no_dataset(*_: Any) -> Any:
        raise ValueError("an abstract closure description still names a dataset")

    args = resolve_value(message["args"], nodes, no_dataset)
    return args[0], args[1]


class _Group:
    """One builder's nodes on the parameter server, and its commit bookkeeping."""

    def __init__(self, nodes: tuple[Any, ...]) -> None:
        self.nodes = nodes
        self.lock = threading.Lock()
        self.version = 0
        self.staleness: list[int] = []
        self.committed: set[int] = set()
        self.order: list[int] = []  # the closures applied, in the order applied
        self.staged: dict[int, Any] = {}  # closure -> its pulled changes, until applied
        self.applies: dict[Any, Any] = {}


class ParameterService:
    """A ``ps`` task: the variables, their snapshots, and the commits (see the module docstring)."""

    def __init__(self, role: TaskRole, client: Any, transfers: rpc.Transfers) -> None:
        self.role, self.transfers = role, transfers
        self.lanes = role.num_workers + 1  # one per chief thread driving a worker, one for control
        devices = jax.local_devices()
        self.mesh = dtensor.create_mesh([("ps", len(devices))], devices=devices)
        self.groups: dict[str, _Group] = {}
        self._traces: dict[Any, Any] = {}

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        return getattr(self, "_" + message["op"])(message)

    def _sharding(self, shape: tuple[int, ...], split: bool) -> Any:
        size = self.mesh.size
        spec = ("ps",) if split and shape and shape[0] % size == 0 else ()
        return jax.sharding.NamedSharding(self.mesh.jax_mesh, jax.sharding.PartitionSpec(*spec))

    def _init(self, m: dict[str, Any]) -> dict[str, Any]:
        nodes = structure(m["builder"])
        graphdef, abstract = nnx.split(nodes)
        leaves, treedef = jax.tree.flatten(abstract)
        n, k = self.role.num_ps, self.role.task_index
        across = [split_across(x.shape, s, n) for x, s in zip(leaves, m["split"], strict=True)]
        specs = [part_spec(rpc.spec_of(x), a, n) for x, a in zip(leaves, across, strict=True)]
        if specs != m["specs"]:
            raise ValueError(
                f"builder {m['builder']!r} made different variables on the chief and on ps {k} "
                f"({len(m['specs'])} vs {len(specs)} arrays, or other shapes). The builder must "
                "be deterministic: build the same model on every task."
            )
        pulled = self.transfers.pull(m["address"], m["uuid"], specs)
        placed = [
            jax.device_put(x, self._sharding(x.shape, split))
            for x, split in zip(pulled, m["split"], strict=True)
        ]
        state = jax.tree.unflatten(treedef, placed)
        self.groups[m["builder"]] = _Group(tuple(nnx.merge(graphdef, state)))
        return {"arrays": len(placed)}

    def _read(self, m: dict[str, Any]) -> dict[str, Any]:
        group = self.groups[m["builder"]]
        with group.lock:
            modules = tuple(group.nodes[i] for i in m["modules"])
            leaves = jax.tree.leaves(nnx.split(modules)[1])
            uuid = self.transfers.offer(leaves)
        return {"uuid": uuid, "specs": [rpc.spec_of(x) for x in leaves]}

    def _trace(self, m: dict[str, Any]) -> Any:
        key = (m["fn"], repr(m["args"]))
        traced = self._traces.get(key)
        if traced is None:
            nodes = structure(m["builder"])
            args, kwargs = _abstract_args(m, nodes)
            plan = Plan(lookup(m["fn"]).fn, args, kwargs)
            step, shapes = plan.trace()
            idx = [next(i for i, n in enumerate(nodes) if n is x) for x in plan.modules]
            opt = [next(i for i, n in enumerate(nodes) if n is x) for x in plan.optimizers]
            full = jax.tree.leaves(plan.module_state()[1])
            traced = self._traces[key] = (key, step, shapes, idx, opt, full)
        return traced

    def _stage(self, m: dict[str, Any]) -> dict[str, Any]:
        """Pull a closure's changes (this task's rows of them) from its worker; apply later."""
        group = self.groups[m["builder"]]
        key, step, shapes, idx, opt, full = self._trace(m)
        if not (step.deltas or step.updates):
            return {}
        with group.lock:
            modules = tuple(group.nodes[i] for i in idx)
            mod_leaves = jax.tree.leaves(nnx.split(modules)[1])
        splits = change_splits(step, splits_of(mod_leaves, full))
        flat, treedef = jax.tree.flatten((shapes[0], shapes[1]))
        n = self.role.num_ps
        specs = [part_spec(rpc.spec_of(x), s, n) for x, s in zip(flat, splits, strict=True)]
        pulled = self.transfers.pull(m["address"], m["uuid"], specs)
        deltas, updates = jax.tree.unflatten(treedef, pulled)
        with group.lock:
            group.staged[m["closure"]] = (key, step, idx, opt, deltas, updates)
        return {}

    def _drop(self, m: dict[str, Any]) -> dict[str, Any]:
        with self.groups[m["builder"]].lock:
            self.groups[m["builder"]].staged.pop(m["closure"], None)
        return {}

    def _apply(self, m: dict[str, Any]) -> dict[str, Any]:
        """Apply a staged closure, in the order the chief sends these (the commit order)."""
        group = self.groups[m["builder"]]
        with group.lock:
            if m["closure"] in group.committed:
                return {"duplicate": True}
            staged = group.staged.pop(m["closure"], None)
            if staged is None:
                return {}
            key, step, idx, opt, deltas, updates = staged
            modules = tuple(group.nodes[i] for i in idx)
            optimizers = tuple(group.nodes[i] for i in opt)
            mod_leaves = jax.tree.leaves(nnx.split(modules)[1])
            replicated = jax.sharding.NamedSharding(
                self.mesh.jax_mesh, jax.sharding.PartitionSpec()
            )
            delta_sh, update_sh = cs.targets_shardings(step, mod_leaves, replicated)
            deltas = jax.device_put(deltas, delta_sh)
            updates = [jax.device_put(u, sh) for u, sh in zip(updates, update_sh, strict=True)]
            nodes = (*modules, *optimizers)
            ps_graphdef, ps_state = nnx.split(nodes)
            akey = (key, tuple(x.sharding for x in jax.tree.leaves(ps_state)))
            apply = group.applies.get(akey)
            if apply is None:
                apply = cs.compile_apply(ps_graphdef, len(modules), ps_state, step, deltas, updates)
                group.applies[akey] = apply
            nnx.update(nodes, apply(ps_state, deltas, updates))
            group.committed.add(m["closure"])
            group.order.append(m["closure"])
            group.version += 1
            return {"version": group.version}

    def _state(self, m: dict[str, Any]) -> dict[str, Any]:
        """Offer every variable of a builder's nodes (the chief's ``fetch_variables``), with
        the closures applied so far, in their order."""
        group = self.groups[m["builder"]]
        with group.lock:
            leaves = jax.tree.leaves(nnx.split(group.nodes)[1])
            specs = [rpc.spec_of(x) for x in leaves]
            uuid = self.transfers.offer(leaves)
            return {"uuid": uuid, "specs": specs, "order": list(group.order)}

    def _load(self, m: dict[str, Any]) -> dict[str, Any]:
        """Replace a builder's variables by the chief's (a restored checkpoint), in our layouts."""
        group = self.groups[m["builder"]]
        with group.lock:
            state = nnx.split(group.nodes)[1]
            leaves, treedef = jax.tree.flatten(state)
            pulled = self.transfers.pull(m["address"], m["uuid"], [rpc.spec_of(x) for x in leaves])
            placed = [
                jax.device_put(x, old.sharding) for x, old in zip(pulled, leaves, strict=True)
            ]
            nnx.update(group.nodes, jax.tree.unflatten(treedef, placed))
            return {"version": group.version}


class WorkerService:
    """A ``worker`` task: runs closures on its own devices (see the module docstring)."""

    def __init__(self, role: TaskRole, client: Any, transfers: rpc.Transfers) -> None:
        self.role, self.transfers = role, transfers
        self.lanes = 1
        devices = jax.local_devices()
        self.mesh = dtensor.create_mesh([("worker", len(devices))], devices=devices)
        self.replicated = jax.sharding.NamedSharding(
            self.mesh.jax_mesh, jax.sharding.PartitionSpec()
        )
        self.datasets: dict[int, Any] = {}
        self.steps: dict[Any, cs.WorkerStep] = {}

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        return getattr(self, "_" + message["op"])(message)

    def _next(self, dataset_id: int, fn_name: str) -> Any:
        it = self.datasets.get(dataset_id)
        if it is None:
            fn = lookup(fn_name).fn
            ctx = InputContext(
                num_input_pipelines=self.role.num_workers,
                input_pipeline_id=self.role.task_index,
                num_replicas_in_sync=self.role.num_workers,
            )
            takes_ctx = bool(inspect.signature(fn).parameters)
            it = self.datasets[dataset_id] = iter(fn(ctx) if takes_ctx else fn())
        try:
            return jax.tree.map(np.asarray, next(it))
        except StopIteration:
            raise RuntimeError(
                f"the per-worker dataset of worker {self.role.task_index} is exhausted, so the "
                "closure got no batch. Make dataset_fn repeat, or schedule fewer closures."
            ) from None

    def _run(self, m: dict[str, Any]) -> dict[str, Any]:
        nodes = structure(m["builder"])
        args, kwargs = resolve_value(m["args"], nodes, self._next)
        plan = Plan(lookup(m["fn"]).fn, args, kwargs)
        graphdef, abstract = plan.module_state()
        full, treedef = jax.tree.flatten(abstract)
        parts = []
        for snap in m["snapshots"]:  # one per ps task: its rows of split variables, all of the rest
            try:
                parts.append(self.transfers.pull(snap["address"], snap["uuid"], snap["specs"]))
            except rpc.PeerGone as e:
                error = f"UNAVAILABLE: a parameter server ({snap['address']}) was lost: {e}"
                return {"error": error, "kind": "ps"}
        mod_split = splits_of(parts[0], full)
        joined = [
            jax.numpy.concatenate([p[i] for p in parts]) if s else parts[0][i]
            for i, s in enumerate(mod_split)
        ]
        state = jax.tree.unflatten(treedef, [jax.device_put(x, self.replicated) for x in joined])
        arrays = [jax.device_put(a, _batch_sharding(self.mesh, a)) for a in plan.arrays]
        key = (m["fn"], graphdef, tuple(plan.kinds), cs.array_signature(arrays), plan.treedef)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = cs.compile_worker_step(
                plan.fn, plan.treedef, plan.kinds, graphdef, len(plan.optimizers), state, arrays
            )
        deltas, updates, out = step.compiled(state, arrays)
        changes = jax.tree.leaves((deltas, updates))
        jax.block_until_ready((changes, out))
        splits = change_splits(step, mod_split)
        n = len(parts)
        offers = [
            self.transfers.offer([part(x, s, k, n) for x, s in zip(changes, splits, strict=True)])
            for k in range(n)
        ]
        return {
            "args": abstract_of((args, kwargs), nodes),
            "changes": offers,
            "out": self.transfers.offer(jax.tree.leaves(out)),
        }


def _batch_sharding(mesh: Any, a: Any) -> Any:
    split = np.ndim(a) > 0 and np.shape(a)[0] % mesh.size == 0
    spec = jax.sharding.PartitionSpec("worker") if split else jax.sharding.PartitionSpec()
    return jax.sharding.NamedSharding(mesh.jax_mesh, spec)


register_service("ps", ParameterService)
register_service("worker", WorkerService)
