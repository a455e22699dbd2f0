"""Functions known by name on every task of a parameter-server job (no code crosses the network).

Every task runs the same script, so a function defined at the top of it
exists on every task. :func:`remote_function` registers it under its module
and qualified name; the chief then names it in messages and the parameter
servers and workers look it up. Three kinds are used by
:class:`strategies.ClusterCoordinator` across processes:

- the *step* passed to ``schedule`` (``train_step(model, optimizer, batch)``);
- the *dataset function* passed to ``create_per_worker_dataset`` (each worker
  builds its own dataset from it);
- the *builder* of the model and optimizer: calling it on the chief records
  which NNX nodes it made, so the other tasks can build the same structure
  (``nnx.eval_shape`` of the same builder) and receive only array values.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from typing import Any

from dtensor.core.tree import is_node

__all__ = ["RemoteFunction", "lookup", "nodes_of_call", "origin", "remote_function"]

_registry: dict[str, RemoteFunction] = {}
_made: weakref.WeakKeyDictionary[Any, Origin] = weakref.WeakKeyDictionary()
_results: dict[int, tuple[Any, ...]] = {}  # the latest call of each builder, by call number


@dataclasses.dataclass(frozen=True)
class Origin:
    """Which builder call made an NNX node: the builder's name and the node's place in its result."""

    builder: str
    index: int
    call: int


class RemoteFunction:
    """A function registered by name on every task (see :func:`remote_function`)."""

    _calls = 0

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        items = out if isinstance(out, tuple) else (out,)
        if items and all(is_node(x) for x in items):
            RemoteFunction._calls += 1
            call = RemoteFunction._calls
            for old in [c for c, r in _results.items() if _made[r[0]].builder == self.name]:
                del _results[old]  # keep one result per builder alive, not every call's
            _results[call] = tuple(items)
            for i, node in enumerate(items):
                _made[node] = Origin(self.name, i, call)
        return out

    def __repr__(self) -> str:
        return f"remote_function({self.name!r})"


def remote_function(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Register ``fn`` by name so every task of a parameter-server job can run it.

    Use it as a decorator on the step, the dataset function and the model
    builder of a script that every task runs. The name defaults to
    ``module.qualname`` (the same on every task running the same script).

    Examples:
        >>> import strategies
        >>> @strategies.remote_function
        ... def double(x):
        ...     return 2 * x
        >>> double(3), double.name.rsplit(".", 1)[-1]
        (6, 'double')
    """
    if fn is None:
        return functools.partial(remote_function, name=name)
    if isinstance(fn, RemoteFunction):
        return fn
    key = name or f"{fn.__module__}.{fn.__qualname__}"
    if "<locals>" in key and name is None:
        raise ValueError(
            f"remote_function({fn.__qualname__}): a function defined inside another function "
            "cannot be found by name on the other tasks. Define it at the top level of the "
            "script, or give it a name: remote_function(fn, name='my_step')."
        )
    made = RemoteFunction(fn, key)
    _registry[key] = made
    return made


def lookup(name: str) -> RemoteFunction:
    """The function registered as ``name`` on this task."""
    try:
        return _registry[name]
    except KeyError:
        raise LookupError(
            f"no function named {name!r} is registered on this task; registered: "
            f"{sorted(_registry)}. Every task must run the same script, whose top level defines "
            "the step, dataset and builder functions with @strategies.remote_function."
        ) from None


def nodes_of_call(made: Origin) -> tuple[Any, ...]:
    """Every node the builder call that made a node returned (model, optimizer...)."""
    try:
        return _results[made.call]
    except KeyError:
        raise ValueError(
            f"the nodes of an earlier call of builder {made.builder!r} were passed after the "
            "builder was called again; pass the nodes of its latest call."
        ) from None


def origin(node: Any) -> Origin | None:
    """Which registered builder call made ``node`` (``None``: not made by one)."""
    try:
        return _made.get(node)
    except TypeError:
        return None
