"""The two compiled programs behind one closure of :class:`ClusterCoordinator`.

- The *worker step* runs the user's function on a worker's copy of the NNX
  modules. Each ``nnx.Optimizer`` argument is replaced by a :class:`_Recorder`
  whose ``update(model, grads)`` only records the gradients. The step returns
  the closure's output, the recorded gradients, and the change of every
  variable the function itself modified (found at trace time: an untouched
  variable leaves the step as the very tracer it came in as).
- The *apply step* runs on the parameter devices: it adds the changes to the
  current variables and calls the real optimizers' ``update`` with the
  gradients, so the optimizer state (Adam moments, step) lives with the
  parameters, as in TensorFlow's asynchronous parameter-server training.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__: list[str] = []

MODULE, OPTIMIZER, ARRAY = "module", "optimizer", "array"


class Static:
    """A non-array argument: part of the compile key, closed over by the step."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def _key(self) -> Any:
        try:
            hash(self.value)
        except TypeError:
            return ("id", id(self.value))
        return ("value", type(self.value), self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


@dataclasses.dataclass(frozen=True)
class Update:
    """One ``optimizer.update(model, grads)`` call recorded on a worker."""

    optimizer: int  # index among the closure's optimizers
    module: int  # index among the closure's modules
    grads_treedef: Any
    kwargs_treedef: Any
    targets: tuple[
        int, ...
    ]  # for each gradient leaf, the module-state leaf it updates (-1: unknown)


@dataclasses.dataclass(frozen=True)
class WorkerStep:
    """A worker step compiled for one worker, and what its outputs mean."""

    compiled: Callable[..., Any]
    deltas: tuple[tuple[int, str], ...]  # (module-state leaf, "add" | "set")
    updates: tuple[Update, ...]


class _Recorder:
    """Stands in for an ``nnx.Optimizer`` inside a worker step: records the gradients."""

    def __init__(self, index: int, modules: tuple[Any, ...]) -> None:
        self.index = index
        self._modules = modules
        self.calls: list[tuple[int, Any, dict[str, Any]]] = []

    def update(self, model: Any, grads: Any, /, **kwargs: Any) -> None:
        for j, m in enumerate(self._modules):
            if m is model:
                self.calls.append((j, grads, kwargs))
                return
        raise ValueError(
            f"optimizer.update() inside a scheduled closure got model {type(model).__name__}, which "
            "is not one of the closure's arguments, so the coordinator cannot tell which parameters "
            "to update. Pass the model the optimizer was built for to schedule(fn, args=(model, "
            "optimizer, ...))."
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"optimizer.{name} inside a scheduled closure: the optimizer's state lives on the "
            "parameter devices and only optimizer.update(model, grads) is available on a worker. "
            "Read optimizer attributes outside the closure, after coordinator.join()."
        )


def _delta_mode(x: Any) -> str:
    dtype = x.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or dtype == jnp.bool_:
        return "set"
    return "add"


def _path_index(mod_state: Any) -> dict[tuple[int, str], int]:
    """(module index, key path inside the module) -> module-state leaf index."""
    out: dict[tuple[int, str], int] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(mod_state)[0]):
        rest = jax.tree_util.keystr(tuple(path[1:]))
        head = int(getattr(path[0], "idx", getattr(path[0], "key", -1)))
        out[(head, rest)] = i
        if rest.endswith(".value"):
            out.setdefault((head, rest[: -len(".value")]), i)
    return out


def compile_worker_step(
    fn: Callable[..., Any],
    treedef: Any,
    kinds: list[Any],
    mod_graphdef: Any,
    num_optimizers: int,
    mod_state: Any,
    arrays: list[Any],
) -> WorkerStep:
    """Trace and compile ``fn`` for the worker that holds ``mod_state`` and ``arrays``."""
    step, info = worker_step_fn(fn, treedef, kinds, mod_graphdef, num_optimizers, mod_state)
    compiled = jax.jit(step).lower(mod_state, arrays).compile()
    return WorkerStep(compiled, info["deltas"], info["updates"])


def trace_worker_step(
    fn: Callable[..., Any],
    treedef: Any,
    kinds: list[Any],
    mod_graphdef: Any,
    num_optimizers: int,
    mod_state: Any,
    arrays: list[Any],
) -> tuple[WorkerStep, Any]:
    """Trace ``fn`` abstractly (no compile): what it changes, and the shapes of its results.

    The tasks that do not run a step (the parameter server applying it, the
    chief receiving its output) learn its structure this way from the same
    registered function instead of receiving it over the network.
    """
    step, info = worker_step_fn(fn, treedef, kinds, mod_graphdef, num_optimizers, mod_state)
    shapes = jax.eval_shape(step, mod_state, arrays)
    return WorkerStep(None, info["deltas"], info["updates"]), shapes  # type: ignore[arg-type]


def worker_step_fn(
    fn: Callable[..., Any],
    treedef: Any,
    kinds: list[Any],
    mod_graphdef: Any,
    num_optimizers: int,
    mod_state: Any,
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """The worker step as a function of ``(module state, arrays)``, and the dict its trace fills."""
    info: dict[str, Any] = {}
    index = _path_index(mod_state) if mod_graphdef is not None else {}

    def step(state: Any, arrays: list[Any]) -> Any:
        old = jax.tree.leaves(state)  # before fn runs: merge shares the Variables with `state`
        modules = tuple(nnx.merge(mod_graphdef, state)) if mod_graphdef is not None else ()
        recorders = [_Recorder(k, modules) for k in range(num_optimizers)]
        values = iter(arrays)
        flat = []
        for kind in kinds:
            if isinstance(kind, Static):
                flat.append(kind.value)
            elif kind == ARRAY:
                flat.append(next(values))
            else:
                what, i = kind
                flat.append(modules[i] if what == MODULE else recorders[i])
        args, kwargs = jax.tree.unflatten(treedef, flat)
        out = fn(*args, **kwargs)
        deltas, delta_info = [], []
        if modules:
            new = jax.tree.leaves(nnx.state(modules))
            if len(old) != len(new):
                raise ValueError(
                    f"the scheduled closure {getattr(fn, '__name__', fn)!r} added or removed NNX variables "
                    f"(the modules had {len(old)} array leaves before and {len(new)} after); a closure may "
                    "change variables' values, not the set of variables. Create variables before scheduling."
                )
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a is not b:
                    mode = _delta_mode(b)
                    delta_info.append((i, mode))
                    deltas.append(b - a if mode == "add" else b)
        updates, update_info = [], []
        for rec in recorders:
            for j, grads, kw in rec.calls:
                paths_leaves, gtd = jax.tree_util.tree_flatten_with_path(grads)
                kw_leaves, kwtd = jax.tree.flatten(kw)
                targets = tuple(
                    index.get((j, jax.tree_util.keystr(p)), -1) for p, _ in paths_leaves
                )
                update_info.append(Update(rec.index, j, gtd, kwtd, targets))
                updates.append(([leaf for _, leaf in paths_leaves], kw_leaves))
        info["deltas"], info["updates"] = tuple(delta_info), tuple(update_info)
        return deltas, updates, out

    return step, info


def compile_apply(
    ps_graphdef: Any, num_modules: int, ps_state: Any, step: WorkerStep, deltas: Any, updates: Any
) -> Callable[..., Any]:
    """Compile the parameter-device program that applies one worker step's results."""

    def apply(state: Any, deltas: list[Any], updates: list[Any]) -> Any:
        nodes = nnx.merge(ps_graphdef, state)
        modules, optimizers = tuple(nodes[:num_modules]), tuple(nodes[num_modules:])
        if step.deltas:
            leaves, tdef = jax.tree.flatten(nnx.state(modules))
            for (i, mode), d in zip(step.deltas, deltas, strict=True):
                leaves[i] = (leaves[i] + d).astype(leaves[i].dtype) if mode == "add" else d
            nnx.update(modules, jax.tree.unflatten(tdef, leaves))
        for u, (grad_leaves, kw_leaves) in zip(step.updates, updates, strict=True):
            grads = jax.tree.unflatten(u.grads_treedef, grad_leaves)
            optimizers[u.optimizer].update(
                modules[u.module], grads, **jax.tree.unflatten(u.kwargs_treedef, kw_leaves)
            )
        return nnx.state(nodes)

    out_shardings = jax.tree.map(lambda x: x.sharding, ps_state)
    return jax.jit(apply, out_shardings=out_shardings).lower(ps_state, deltas, updates).compile()


def targets_shardings(
    step: WorkerStep, mod_leaves: list[Any], replicated: Any
) -> tuple[list[Any], list[Any]]:
    """Where each delta and gradient leaf goes on the parameter devices."""
    delta_sh = [mod_leaves[i].sharding for i, _ in step.deltas]
    update_sh = [
        ([mod_leaves[t].sharding if t >= 0 else replicated for t in u.targets], replicated)
        for u in step.updates
    ]
    return delta_sh, update_sh


def array_signature(arrays: list[Any]) -> tuple[Any, ...]:
    return tuple((np.shape(a), str(getattr(a, "dtype", type(a)))) for a in arrays)
