"""The parameter group of asynchronous training: where variables live, and how closures read and commit.

:class:`ParameterGroup` is the parameter devices' side of a
:class:`strategies.ClusterCoordinator` (see its module for the four steps of a
closure): it lays out the variables by the strategy's partitioner, gives a
worker a consistent snapshot of them, and commits each closure's changes in
order under one lock, counting how stale each commit's read was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtensor.core.tree import is_node, path_str
from strategies.coordinator import step as cs
from strategies.coordinator.values import StaleCommit, WorkerFailure

__all__ = ["ParameterGroup"]


class ParameterGroup:
    """The variables of asynchronous training, on the strategy's parameter mesh.

    Args:
        strategy: the :class:`strategies.ParameterServerStrategy` (its
            partitioner gives each variable's layout).
        mesh: its parameter devices' ``("ps",)`` mesh.
        max_staleness: refuse (and re-run) a commit whose read is more than
            this many commits old; ``None``: no bound.
    """

    def __init__(self, strategy: Any, mesh: Any, *, max_staleness: int | None = None) -> None:
        self.strategy = strategy
        self.max_staleness = max_staleness
        self.mesh = mesh
        self.replicated = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec())
        self._lock = threading.Lock()  # snapshots and commits
        self._version = 0
        self._staleness: list[int] = []
        self._applies: dict[Any, Any] = {}

    def staleness(self) -> tuple[int, ...]:
        """For each commit, in order, how many other commits came between its read and itself."""
        with self._lock:
            return tuple(self._staleness)

    def place(self, node: Any) -> None:
        """Lay a node's variables out on the parameter group (once, or again if moved)."""
        with self._lock:
            state = nnx.state(node)

            def place(path: Any, var: Any) -> Any:
                value = var.get_value() if isinstance(var, nnx.Variable) else var
                if not isinstance(value, jax.Array | np.ndarray | np.generic):
                    return var
                if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                    sharding = self.replicated
                else:
                    sharding = self.strategy.parameter_layout(path_str(path), value).sharding
                if isinstance(value, jax.Array) and value.sharding == sharding:
                    return var
                moved = jax.device_put(value, sharding)
                return var.replace(moved) if isinstance(var, nnx.Variable) else moved

            placed = jax.tree_util.tree_map_with_path(
                place, state, is_leaf=lambda v: isinstance(v, nnx.Variable)
            )
            nnx.update(node, placed)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        worker: int,
        mesh: Any,
        steps: dict[Any, cs.WorkerStep],
        committable: Callable[[], bool],
        what: str,
    ) -> Any:
        """Run ``fn`` on ``worker``'s ``mesh`` against a snapshot of the variables, then commit.

        ``steps`` caches the worker's compiled steps; ``committable()`` is
        asked, under the lock, just before the commit (a worker marked down
        raises :class:`WorkerFailure` instead, so the closure runs again).
        """
        flat, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
        modules: list[Any] = []
        optimizers: list[Any] = []
        kinds: list[Any] = []
        arrays: list[Any] = []
        for v in flat:
            if isinstance(v, nnx.Optimizer):
                kinds.append(_index_of(optimizers, v, cs.OPTIMIZER))
            elif is_node(v):
                kinds.append(_index_of(modules, v, cs.MODULE))
            elif isinstance(v, jax.Array | np.ndarray | np.generic):
                kinds.append(cs.ARRAY)
                arrays.append(jax.device_put(v, _batch_sharding(mesh, np.ndim(v), np.shape(v))))
            else:
                kinds.append(cs.Static(v))
        replicated = jax.sharding.NamedSharding(mesh.jax_mesh, jax.sharding.PartitionSpec())
        mod_graphdef, worker_state, mod_leaves = None, None, []
        with self._lock:
            read_version = self._version
            if modules:
                mod_graphdef, mod_state = nnx.split(tuple(modules))
                mod_leaves = jax.tree.leaves(mod_state)
                worker_state = jax.device_put(
                    mod_state, replicated
                )  # queued before any later commit
        key = (fn, treedef, mod_graphdef, tuple(kinds), cs.array_signature(arrays))
        step = steps.get(key)
        if step is None:
            step = cs.compile_worker_step(
                fn, treedef, kinds, mod_graphdef, len(optimizers), worker_state, arrays
            )
            steps[key] = step
        deltas, updates, out = step.compiled(worker_state, arrays)
        delta_sh, update_sh = cs.targets_shardings(step, mod_leaves, self.replicated)
        deltas = jax.device_put(deltas, delta_sh)
        updates = [jax.device_put(u, sh) for u, sh in zip(updates, update_sh, strict=True)]
        jax.block_until_ready((out, deltas, updates))  # the worker's part is done (or failed) here
        if not (step.deltas or step.updates):
            return out
        with self._lock:
            if not committable():
                raise WorkerFailure(
                    f"worker {worker} was marked unavailable before {what} committed"
                )
            stale = self._version - read_version
            if self.max_staleness is not None and stale > self.max_staleness:
                raise StaleCommit(
                    f"{what} read parameters {stale} commits old, more than "
                    f"max_staleness={self.max_staleness}: it runs again"
                )
            nodes = (*modules, *optimizers)
            ps_graphdef, ps_state = nnx.split(nodes)
            sig = tuple(x.sharding for x in jax.tree.leaves(ps_state))
            akey = (ps_graphdef, len(modules), step.deltas, step.updates, sig)
            apply = self._applies.get(akey)
            if apply is None:
                apply = cs.compile_apply(ps_graphdef, len(modules), ps_state, step, deltas, updates)
                self._applies[akey] = apply
            nnx.update(nodes, apply(ps_state, deltas, updates))
            self._staleness.append(self._version - read_version)
            self._version += 1
        return out


def _index_of(items: list[Any], v: Any, what: str) -> tuple[str, int]:
    for i, x in enumerate(items):
        if x is v:
            return (what, i)
    items.append(v)
    return (what, len(items) - 1)


def _batch_sharding(mesh: Any, rank: int, shape: tuple[int, ...]) -> jax.sharding.NamedSharding:
    split = rank > 0 and shape[0] % mesh.size == 0
    spec = jax.sharding.PartitionSpec("worker") if split else jax.sharding.PartitionSpec()
    return jax.sharding.NamedSharding(mesh.jax_mesh, spec)
