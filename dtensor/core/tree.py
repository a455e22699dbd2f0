"""Pytree helpers with one meaning each: paths, leaves, values, NNX nodes.

Every module that walks a model, a batch or a checkpoint asks these, so
"is this an NNX node" or "what array does this leaf hold" has one answer
across ``distribute``, ``run``, checkpoints and the coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "is_array",
    "is_box",
    "is_leaf",
    "is_node",
    "is_variable",
    "leaf_value",
    "path_str",
    "replace_value",
]


def path_str(path: Sequence[Any]) -> str:
    """A key path as ``a/b/0/c`` (an NNX Variable's trailing ``value`` dropped).

    Examples:
        >>> import jax
        >>> from dtensor.core.tree import path_str
        >>> [path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path({"w": [1, 2]})]
        ['w/0', 'w/1']
    """
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value" and len(path) and hasattr(path[-1], "name"):
        parts.pop()
    return "/".join(parts)


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a Flax NNX ``Variable``."""
    from flax import nnx

    return isinstance(x, nnx.Variable)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a Flax Linen metadata box (``nn.Partitioned`` and kin)."""
    from flax.core import meta

    return isinstance(x, meta.AxisMetadata)


def is_leaf(x: Any) -> bool:
    """Leaves for layout purposes: NNX Variables and Linen boxes (arrays are leaves anyway)."""
    return is_variable(x) or is_box(x)


def is_node(x: Any) -> bool:
    """Whether ``x`` is an NNX graph node: a Module, an Optimizer, ``Rngs``, any ``nnx.Pytree``.

    Nodes are mutable objects that own Variables: ``run`` updates them in
    place, ``distribute`` places their Variables, checkpoints save their state.
    An ``nnx.State`` (a plain mapping of Variables) and a Variable are not nodes.

    Examples:
        >>> from flax import nnx
        >>> from dtensor.core.tree import is_node
        >>> layer = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
        >>> is_node(layer), is_node(nnx.state(layer)), is_node(layer.kernel)
        (True, False, False)
    """
    from flax import nnx

    return isinstance(x, nnx.Pytree) and not isinstance(x, nnx.State | nnx.Variable)


def is_array(x: Any) -> bool:
    """Whether ``x`` is array data: a JAX or NumPy array, a NumPy scalar, or an abstract array.

    Examples:
        >>> import numpy as np, jax
        >>> from dtensor.core.tree import is_array
        >>> is_array(np.ones(2)), is_array(np.float32(1)), is_array(jax.ShapeDtypeStruct((2,), np.float32)), is_array(3)
        (True, True, True, False)
    """
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def leaf_value(leaf: Any) -> Any:
    """The array a leaf holds: a Variable's value, a Linen box's content, else the leaf."""
    if is_variable(leaf):
        return leaf.get_value()
    if is_box(leaf):
        return leaf.unbox()
    return leaf


def replace_value(leaf: Any, value: Any) -> Any:
    """``leaf`` holding ``value`` instead (a new Variable or box; a plain leaf is replaced)."""
    if is_variable(leaf):
        return leaf.replace(value)
    if is_box(leaf):
        return leaf.replace_boxed(value)
    return value
