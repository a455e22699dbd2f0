"""Caches of compiled steps and NNX graphs, kept the way ``jax.jit`` keeps its own.

Bounded (least recently used first out) and weak on what the user owns: an
entry keyed by a step function goes when the function is garbage, and a
walked NNX graph goes when any of its models does. So a fresh closure per
``run`` call costs a compile but never memory that stays.
"""

from __future__ import annotations

import collections
import inspect
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
from flax import nnx

__all__ = [
    "CachedGraphKey",
    "FunctionKey",
    "GraphCache",
    "GraphCaches",
    "LRUCache",
    "RecompileMonitor",
]


class _Strong:
    """A reference that is not weak (for callables that refuse weak references)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __call__(self) -> Any:
        return self.obj


class FunctionKey:
    """A hashable, weak stand-in for a step function.

    A bound method is held as its function and its instance (a new bound
    method object is made at every attribute access, so it cannot be the
    key itself). ``on_death`` runs once when any part is garbage collected.
    """

    __slots__ = ("_refs", "_hash", "__weakref__")

    def __init__(self, fn: Callable[..., Any], on_death: Callable[[Any], None] | None = None):
        parts = (fn.__func__, fn.__self__) if inspect.ismethod(fn) else (fn,)
        refs: list[Any] = []
        for part in parts:
            try:
                refs.append(weakref.ref(part, on_death) if on_death else weakref.ref(part))
            except TypeError:
                refs.append(_Strong(part))
        self._refs = tuple(refs)
        self._hash = hash(tuple(id(p) for p in parts))

    def get(self) -> Callable[..., Any]:
        """The function (a bound method again for methods); raises if it is gone."""
        parts = [r() for r in self._refs]
        if any(p is None for p in parts):
            raise ReferenceError("the step function of this compiled step was garbage collected")
        return types.MethodType(parts[0], parts[1]) if len(parts) == 2 else parts[0]

    def holds(self, ref: Any) -> bool:
        """Whether ``ref`` (the weak reference an ``on_death`` call gets) is one of this key's."""
        return any(r is ref for r in self._refs)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FunctionKey) or len(other._refs) != len(self._refs):
            return False
        mine = [r() for r in self._refs]
        return all(
            a is not None and a is b for a, b in zip(mine, (r() for r in other._refs), strict=True)
        )


class LRUCache:
    """A dictionary that keeps its ``maxsize`` most recently used entries."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.maxsize:
            self._entries.popitem(last=False)

    def discard_where(self, predicate: Callable[[Hashable], bool]) -> None:
        """Drop every entry whose key satisfies ``predicate``."""
        for key in [k for k in self._entries if predicate(k)]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)


class RecompileMonitor:
    """Warns once when one piece of code compiles as many different function objects.

    That is a fresh ``lambda`` or closure per ``run`` call: each is a new
    function, so each call compiles again.
    """

    def __init__(self, threshold: int = 8) -> None:
        self.threshold = threshold
        self._counts: collections.Counter[Any] = collections.Counter()
        self._warned: set[Any] = set()

    def compiled(self, fn: Callable[..., Any]) -> None:
        code = getattr(getattr(fn, "__func__", fn), "__code__", None)
        if code is None:
            return
        self._counts[code] += 1
        if self._counts[code] >= self.threshold and code not in self._warned:
            self._warned.add(code)
            warnings.warn(
                f"strategy.run compiled the step {code.co_name!r} ({code.co_filename}:"
                f"{code.co_firstlineno}) {self._counts[code]} times, each for a different function "
                "object: a new lambda or closure per call defeats the compile cache. Define the "
                "step once (a named function) and pass that same function to every run call.",
                RuntimeWarning,
                stacklevel=4,
            )


class GraphCache:
    """The NNX graph of some nodes, walked once: their graphdef and live Variables.

    ``read()`` gives a state to pass to the compiled step and ``write_back``
    stores its result in the same Variables, with no graph traversal. The
    nodes themselves are not kept alive (see :class:`GraphCaches`).
    """

    def __init__(self, nodes: list[Any]) -> None:
        self.graphdef, state = nnx.split(tuple(nodes))
        self.variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.treedef = jax.tree.structure(state)
        if self.treedef.num_leaves != len(self.variables):
            raise ValueError(
                "run(..., cache_graph=True) needs every Variable of the models to hold one array; "
                "some hold none or several. Call run without cache_graph."
            )
        self.key = CachedGraphKey(self.graphdef)
        self.layouts: Any = None
        self._values: list[Any] = []
        self._written: list[Any] = []

    def read(self) -> Any:
        self._values = [v.get_value() for v in self.variables]
        return self.treedef.unflatten(self._values)

    def unchanged(self) -> bool:
        """Whether every Variable still holds what the last step wrote."""
        return len(self._written) == len(self._values) and all(
            a is b for a, b in zip(self._values, self._written, strict=True)
        )

    def write_back(self, state: Any) -> None:
        new = jax.tree.leaves(state)
        if len(new) != len(self.variables):
            raise ValueError(
                f"the step changed its models' structure ({len(self.variables)} variables before, "
                f"{len(new)} after), which run(..., cache_graph=True) cannot follow; call run "
                "without cache_graph."
            )
        for var, value in zip(self.variables, new, strict=True):
            var.set_value(value)
        self._written = new


class GraphCaches:
    """:class:`GraphCache` per tuple of nodes: bounded, and dropped when any node dies."""

    def __init__(self, maxsize: int = 16) -> None:
        self._lru = LRUCache(maxsize)

    def get(self, nodes: list[Any]) -> GraphCache:
        key = tuple(map(id, nodes))
        cached = self._lru.get(key)
        if cached is None:
            cached = GraphCache(nodes)
            self._lru.put(key, cached)
            lru = weakref.ref(self._lru)
            for node in nodes:  # an id is only a node's while it lives
                weakref.finalize(node, _discard, lru, key)
        return cached

    def __len__(self) -> int:
        return len(self._lru)


def _discard(lru: weakref.ref[LRUCache], key: Any) -> None:
    cache = lru()
    if cache is not None:
        cache.discard_where(lambda k: k == key)


class CachedGraphKey:
    """A compile-cache key for a cached graph: hashed once (graphdefs hash slowly)."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: Any) -> None:
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, CachedGraphKey) and self.graphdef == other.graphdef
        )
