"""A closure as messages carry it: its arguments in JSON, and the plan every task derives from them.

The chief sends a closure as the *name* of its registered step and its
arguments encoded here: NNX nodes as their place in the registered builder's
result, per-worker iterators as the registered dataset function, other values
as JSON. The worker resolves them (the next element of its own dataset) and
answers with the *abstract* arguments (shapes and dtypes in the same
structure), from which the parameter server and the chief trace the same step
abstractly (:func:`strategies.coordinator.step.trace_worker_step`) to learn
what it changes and what it returns.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtensor.core.tree import is_node
from strategies.coordinator import step as cs
from strategies.coordinator.remote import lookup
from strategies.coordinator.values import RemoteIterator

__all__: list[str] = []


def encode_value(v: Any, node_index: Callable[[Any], int]) -> Any:
    """One argument as JSON (before resolution on the worker)."""
    if is_node(v):
        return {"node": node_index(v)}
    if isinstance(v, RemoteIterator):
        return {"dataset": [v.dataset_id, v.fn_name]}
    if isinstance(v, tuple | list):
        return {"seq": [encode_value(x, node_index) for x in v], "tuple": isinstance(v, tuple)}
    if isinstance(v, dict):
        return {"dict": {str(k): encode_value(x, node_index) for k, x in v.items()}}
    if v is None or isinstance(v, bool | int | float | str):
        return {"value": v}
    raise TypeError(
        f"schedule() across processes got an argument of type {type(v).__name__}; only NNX "
        "modules and optimizers made by a @strategies.remote_function builder, per-worker "
        "iterators, (nested tuples, lists, dicts of) numbers and strings can be sent to a "
        "worker. Read data on the workers with create_per_worker_dataset(dataset_fn)."
    )


def resolve_value(v: Any, nodes: tuple[Any, ...], next_of: Callable[[int, str], Any]) -> Any:
    """Decode :func:`encode_value` on a task: nodes from ``nodes``, datasets via ``next_of``."""
    if "node" in v:
        return nodes[v["node"]]
    if "dataset" in v:
        return next_of(*v["dataset"])
    if "seq" in v:
        items = [resolve_value(x, nodes, next_of) for x in v["seq"]]
        return tuple(items) if v["tuple"] else items
    if "dict" in v:
        return {k: resolve_value(x, nodes, next_of) for k, x in v["dict"].items()}
    if "array" in v:
        shape, dtype = v["array"]
        return jax.ShapeDtypeStruct(tuple(shape), jax.numpy.dtype(dtype))
    return v["value"]


def abstract_of(v: Any, nodes: tuple[Any, ...]) -> Any:
    """Resolved arguments back to JSON, arrays as their shape and dtype (the worker's answer)."""
    if is_node(v):
        return {"node": next(i for i, n in enumerate(nodes) if n is v)}
    if isinstance(v, tuple | list):
        return {"seq": [abstract_of(x, nodes) for x in v], "tuple": isinstance(v, tuple)}
    if isinstance(v, dict):
        return {"dict": {str(k): abstract_of(x, nodes) for k, x in v.items()}}
    if isinstance(v, jax.Array | np.ndarray | np.generic):
        return {"array": [list(np.shape(v)), str(jax.numpy.dtype(v.dtype))]}
    return {"value": v}


@functools.lru_cache(maxsize=64)
def structure(builder: str) -> tuple[Any, ...]:
    """The registered builder's nodes, built abstractly (the same structure on every task)."""
    made = nnx.eval_shape(lookup(builder).fn)
    return made if isinstance(made, tuple) else (made,)


class Plan:
    """How one closure's arguments map onto the worker step (as ``ParameterGroup.run`` does)."""

    def __init__(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        flat, self.treedef = jax.tree.flatten((args, kwargs), is_leaf=is_node)
        self.fn = fn
        self.modules: list[Any] = []
        self.optimizers: list[Any] = []
        self.kinds: list[Any] = []
        self.arrays: list[Any] = []
        for v in flat:
            if isinstance(v, nnx.Optimizer):
                self.kinds.append(_index_of(self.optimizers, v, cs.OPTIMIZER))
            elif is_node(v):
                self.kinds.append(_index_of(self.modules, v, cs.MODULE))
            elif isinstance(v, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
                self.kinds.append(cs.ARRAY)
                self.arrays.append(v)
            else:
                self.kinds.append(cs.Static(v))

    def module_state(self) -> tuple[Any, Any]:
        """``(graphdef, state)`` of the closure's modules (the snapshot a worker reads)."""
        return nnx.split(tuple(self.modules))

    def trace(self) -> tuple[cs.WorkerStep, Any]:
        graphdef, state = self.module_state()
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        arrays = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.arrays]
        return cs.trace_worker_step(
            self.fn, self.treedef, self.kinds, graphdef, len(self.optimizers), abstract, arrays
        )


def _index_of(items: list[Any], v: Any, what: str) -> tuple[str, int]:
    for i, x in enumerate(items):
        if x is v:
            return (what, i)
    items.append(v)
    return (what, len(items) - 1)


def node_indices(plan: Plan, nodes: tuple[Any, ...]) -> list[int]:
    """Where each of the plan's modules sits in the builder's result."""
    return [next(i for i, n in enumerate(nodes) if n is m) for m in plan.modules]


# ----------------------------------------------------- variables over several ps tasks
def part(x: Any, split: bool, k: int, num_ps: int) -> Any:
    """The rows of ``x`` that ps task ``k`` of ``num_ps`` holds (all of it when not split)."""
    if not split:
        return x
    n = x.shape[0] // num_ps
    return x[k * n : (k + 1) * n]


def part_spec(spec: list[Any], split: bool, num_ps: int) -> list[Any]:
    """:func:`part`'s ``[shape, dtype]``."""
    if not split:
        return spec
    shape = list(spec[0])
    return [[shape[0] // num_ps, *shape[1:]], spec[1]]


def splits_of(local: list[Any], full: list[Any]) -> list[bool]:
    """Which leaves a ps task holds only some rows of (its shape differs from the full one)."""
    return [tuple(a.shape) != tuple(b.shape) for a, b in zip(local, full, strict=True)]


def split_across(shape: tuple[int, ...], partitioned: bool, num_ps: int) -> bool:
    """Whether a variable the partitioner splits is split across ``num_ps`` ps tasks (dim 0)."""
    return partitioned and num_ps > 1 and len(shape) > 0 and shape[0] % num_ps == 0


def change_splits(step: cs.WorkerStep, mod_split: list[bool]) -> list[bool]:
    """For each leaf of a worker step's ``(deltas, updates)``, whether it is split by rows."""
    out = [mod_split[i] for i, _ in step.deltas]
    for u in step.updates:
        out += [mod_split[t] if t >= 0 else False for t in u.targets]
        out += [False] * u.kwargs_treedef.num_leaves
    return out
