"""A step's arguments, sorted: NNX nodes (state), arrays (placed), everything else (static)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dtensor import Layout
from dtensor.core.tree import is_array, is_node, is_variable

__all__ = [
    "ARRAY",
    "NODE",
    "Static",
    "abstract_value",
    "arg_name",
    "check_callable",
    "flatten_args",
    "var_or_layout",
]

NODE = "node"
ARRAY = "array"


class Static:
    """A non-array argument: part of the compile key, closed over by the compiled step."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Static) and static_key(self.value) == static_key(other.value)

    def __hash__(self) -> int:
        return hash(static_key(self.value))

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


def static_key(v: Any) -> Any:
    """What a static argument is compared by: its value when hashable, else its identity."""
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return ("value", type(v), v)


def arg_name(path: Any) -> str:
    """A ``run`` argument's pytree path as the user wrote it: ``args[2]['x']``, ``kwargs['batch']``."""
    head, *rest = path
    return ("args" if head.idx == 0 else "kwargs") + jax.tree_util.keystr(tuple(rest))


def flatten_args(args: Any, kwargs: Any) -> tuple[list[tuple[Any, Any]], Any]:
    """``(args, kwargs)`` flattened to ``(path, leaf)`` pairs, NNX nodes kept whole."""
    if not isinstance(args, tuple | list):
        raise TypeError(
            f"run(args={_short(args)}): args must be a tuple of the step's positional arguments, "
            f"got a {type(args).__name__}. Wrap a single argument in a tuple: args=(x,)."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(
            f"run(kwargs={_short(kwargs)}): kwargs must be a dict of keyword arguments, got a "
            f"{type(kwargs).__name__}. Pass kwargs={{'name': value}}, or None."
        )
    return jax.tree_util.tree_flatten_with_path((tuple(args), kwargs or {}), is_leaf=is_node)


def check_callable(fn: Any, method: str) -> Callable[..., Any]:
    """``fn`` if it is callable, else a four-part ``TypeError``."""
    if not callable(fn):
        hint = (
            f" (the name of a function, {fn!r}?). Pass the function itself: {method}(train_step, ...)"
            if isinstance(fn, str)
            else f". Pass the step function itself: {method}(train_step, args=(...))"
        )
        raise TypeError(
            f"{method}(fn={_short(fn)}): fn must be a callable step, got a "
            f"{type(fn).__name__}{hint}."
        )
    return fn


def kind_of(leaf: Any) -> Any:
    """``NODE``, ``ARRAY`` or a :class:`Static` for one flattened argument leaf."""
    if is_node(leaf):
        return NODE
    if is_array(leaf):
        return ARRAY
    return Static(leaf)


def _short(v: Any) -> str:
    if hasattr(v, "shape") and hasattr(v, "dtype"):  # arrays: their type, not their values
        return f"<{type(v).__name__} {v.dtype}{list(v.shape)}>"
    text = " ".join(repr(v).split())
    return text if len(text) <= 60 else text[:57] + "..."


def var_or_layout(x: Any) -> bool:
    """A Variable or a Layout: the leaves of a tree of variables and of its layouts."""
    return is_variable(x) or isinstance(x, Layout)


def abstract_value(
    value: Any, layout: Layout | None, *, memory_kind: str | None = None
) -> jax.ShapeDtypeStruct:
    """``value`` as an abstract array in ``layout`` (and ``memory_kind``); nothing allocated."""
    sharding = None if layout is None else layout.sharding
    if sharding is not None and memory_kind is not None:
        sharding = sharding.with_memory_kind(memory_kind)
    return jax.ShapeDtypeStruct(np.shape(value), value.dtype, sharding=sharding)
