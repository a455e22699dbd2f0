"""The canonical form of a saved tree: plain containers, raw key data, host values as NumPy.

NNX modules, optimizers and ``State`` become pure dicts of their state, Linen
boxes are unboxed, typed PRNG keys become their raw key data. NumPy scalars and
Python scalars are saved as 0-d NumPy arrays; the manifest records what they
were (``kind``) so that a restore gives back the same type and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtensor.core.tree import is_box, is_node

__all__ = [
    "as_host",
    "canon",
    "fmt",
    "host_kind",
    "is_key",
    "key_impl",
    "rebuild",
    "shape_dtype",
    "to_kind",
]

_PY_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}


def _is_state(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.State)


def is_key(x: Any) -> bool:
    """Whether ``x`` (an array or abstract array) holds typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _is_container_leaf(x: Any) -> bool:
    """Nodes that the canonical form replaces by plain containers."""
    return is_node(x) or _is_state(x) or is_box(x)


def canon(tree: Any) -> Any:
    """``tree`` with NNX objects as pure dicts of their state and Linen boxes unboxed."""

    def one(x: Any) -> Any:
        if is_node(x):
            from flax import nnx

            return canon(nnx.state(x).to_pure_dict())
        if _is_state(x):
            return canon(x.to_pure_dict())
        if is_box(x):
            return canon(x.unbox())
        return x

    return jax.tree.map(one, tree, is_leaf=_is_container_leaf)


def host_kind(x: Any) -> str | None:
    """How a host value was given: ``numpy``, ``numpy_scalar``, ``int``/``float``/...; else None."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if isinstance(x, np.generic):
        return "numpy_scalar"
    for name, kind in _PY_SCALARS.items():
        if type(x) is kind:
            return name
    return None


def as_host(x: Any) -> Any:
    """A NumPy scalar or Python scalar as the 0-d NumPy array orbax can store (others unchanged)."""
    kind = host_kind(x)
    return np.asarray(x) if kind is not None and kind != "numpy" else x


def to_kind(value: Any, kind: str | None, dtype: str) -> Any:
    """A restored host value back in the type it was saved as (``kind`` from the manifest)."""
    if kind is None or kind == "numpy":
        return np.asarray(value, dtype=np.dtype(dtype)) if kind == "numpy" else value
    arr = np.asarray(value, dtype=np.dtype(dtype))
    if kind == "numpy_scalar":
        return arr[()]
    return _PY_SCALARS[kind](arr.item())


def rebuild(target: Any, restored: Any) -> Any:
    """Put restored canonical values back into the shape (and leaf types) of ``target``."""

    def one(t: Any, r: Any) -> Any:
        if is_node(t):
            from flax import nnx

            state = nnx.state(t)
            nnx.replace_by_pure_dict(state, rebuild(state.to_pure_dict(), r))
            nnx.update(t, state)
            return t
        if _is_state(t):
            from flax import nnx

            state = jax.tree.map(lambda v: v, t)
            nnx.replace_by_pure_dict(state, rebuild(t.to_pure_dict(), r))
            return state
        if is_box(t):
            return t.replace_boxed(rebuild(t.unbox(), r))
        if is_key(t) and not is_key(r):
            return jax.random.wrap_key_data(r, impl=key_impl(t))
        kind = host_kind(t)
        if kind is not None and kind != "numpy":
            return to_kind(r, kind, str(np.asarray(t).dtype))
        return r

    return jax.tree.map(one, target, restored, is_leaf=_is_container_leaf)


def key_impl(x: Any) -> str | None:
    """The name of the PRNG implementation of a (possibly abstract) key array."""
    if isinstance(x, jax.ShapeDtypeStruct):  # no public accessor on an abstract key's dtype
        return getattr(getattr(x.dtype, "_impl", None), "name", None)
    return str(jax.random.key_impl(x))


def shape_dtype(x: Any) -> tuple[tuple[int, ...], str]:
    """The stored shape and dtype name of a leaf (raw key data for typed keys)."""
    if is_key(x):
        out = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), x.dtype))
        return tuple(out.shape), str(out.dtype)
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return tuple(int(s) for s in np.shape(x)), str(np.dtype(dtype))


def fmt(shape: Sequence[int], dtype: str) -> str:
    """``float32[16,8]``."""
    return f"{dtype}[{','.join(str(s) for s in shape)}]"
