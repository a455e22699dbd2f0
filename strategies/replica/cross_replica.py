"""Cross-replica values of a strategy: ``Strategy.reduce`` and ``Strategy.gather``."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dtensor
from dtensor import Layout, Mesh, ReduceOp
from strategies.replica.values import PerReplica

__all__ = ["gather", "reduce", "values_from_function"]


def reduce(op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
    """:meth:`strategies.Strategy.reduce`: combine replicas (and ``axis`` of each value)."""
    op = ReduceOp.parse(op)
    _check_reduce_axis(value, axis)
    fns = {
        ReduceOp.SUM: jnp.sum,
        ReduceOp.MEAN: jnp.mean,
        ReduceOp.MAX: jnp.max,
        ReduceOp.MIN: jnp.min,
    }
    reducer = fns[op]

    def one(v: Any) -> Any:
        if isinstance(v, PerReplica):
            # Dimension `axis` of each replica's value is `axis + 1` of the stacked one.
            axes = (0,) if axis is None else (0, axis % (v.value.ndim - 1) + 1)
            return _jit_reduce(reducer, axes)(v.value)
        if axis is None:
            return v
        return _jit_reduce(reducer, (axis,))(v)

    return jax.tree.map(one, value, is_leaf=lambda v: isinstance(v, PerReplica))


def gather(mesh: Mesh, value: Any, axis: int = 0) -> Any:
    """:meth:`strategies.Strategy.gather`: replicas concatenated along ``axis``, on ``mesh``."""

    def one(v: Any) -> Any:
        if isinstance(v, PerReplica):
            stacked = v.value
            moved = jnp.moveaxis(stacked, 0, axis)
            merged = moved.reshape(*moved.shape[:axis], -1, *moved.shape[axis + 2 :])
            return dtensor.relayout(merged, Layout.replicated(mesh, merged.ndim))
        return dtensor.relayout(v, Layout.replicated(mesh, np.ndim(v)))

    return jax.tree.map(one, value, is_leaf=lambda v: isinstance(v, PerReplica))


def _check_reduce_axis(value: Any, axis: int | None) -> None:
    """A four-part ``ValueError`` unless ``axis`` is a dimension of every leaf of ``value``."""
    if axis is None:
        return
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(
            f"strategy.reduce(..., axis={axis!r}): axis must be an int or None, got a "
            f"{type(axis).__name__}. Pass one dimension (axis=0), or None to reduce across "
            "replicas only."
        )
    leaves = jax.tree_util.tree_leaves_with_path(value, is_leaf=lambda v: isinstance(v, PerReplica))
    for path, leaf in leaves:
        where = f" at {jax.tree_util.keystr(path)}" if path else ""
        if isinstance(leaf, PerReplica):
            shape = np.shape(leaf.value)[1:]
            what = f"each replica's value{where} has rank {len(shape)} (shape {tuple(shape)})"
            fix = "Pass axis=None to reduce across replicas only."
        else:
            shape = np.shape(leaf)
            what = (
                f"the value{where} is one global array of rank {len(shape)} (shape "
                f"{tuple(shape)}; its batch dimension already spans all replicas)"
            )
            fix = "Pass axis=None to get it back unchanged, or a dimension it has."
        if not -len(shape) <= axis < len(shape):
            valid = (
                "axis must be None (a scalar has no dimensions)"
                if not shape
                else f"axis must be None or in [{-len(shape)}, {len(shape) - 1}]"
            )
            raise ValueError(f"strategy.reduce(..., axis={axis}): {what}, so {valid}. {fix}")


@functools.lru_cache(maxsize=64)
def _jit_reduce(reducer: Any, axes: tuple[int, ...]) -> Any:
    return jax.jit(lambda x: reducer(x, axis=axes))


def values_from_function(strategy: Any, value_fn: Any) -> Any:
    """:meth:`strategies.Strategy.experimental_distribute_values_from_function`."""
    from strategies.replica.values import ValueContext

    n = strategy.num_replicas_in_sync
    per = [value_fn(ValueContext(i, n)) for i in range(n)]
    stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *per)
    return jax.tree.map(
        lambda x: PerReplica(dtensor.copy_to_mesh(x, strategy.batch_layout(x.ndim))), stacked
    )
