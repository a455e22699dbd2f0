"""Which strategy is current, and which replica a per-replica step runs as (thread-local).

A leaf module: the strategy stack that ``scope()`` pushes, and the replica
context that a per-replica ``run`` sets while its step is traced.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strategies.replica.values import ReplicaContext

__all__ = [
    "entered",
    "get_replica_context",
    "in_cross_replica_context",
    "innermost",
    "replica_context",
]

_local = threading.local()


def _stack() -> list[Any]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def innermost() -> Any:
    """The strategy whose ``scope()`` is active in this thread (``None`` outside any)."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def entered(strategy: Any) -> Iterator[None]:
    """Push ``strategy`` as current for this thread; one strategy at a time (re-entering it is fine)."""
    stack = _stack()
    if stack and stack[-1] is not strategy:
        raise ValueError(
            f"cannot enter the scope of {strategy!r} inside the scope of {stack[-1]!r}: one "
            "strategy at a time. Leave the outer `with strategy.scope():` block first."
        )
    stack.append(strategy)
    try:
        yield
    finally:
        stack.pop()


def get_replica_context() -> ReplicaContext | None:
    """The replica context inside a per-replica ``run``; ``None`` elsewhere.

    Examples:
        >>> import strategies
        >>> strategies.get_replica_context() is None
        True
    """
    return getattr(_local, "replica_context", None)


def in_cross_replica_context() -> bool:
    """Whether code runs outside any per-replica ``run`` (tf.distribute's name).

    Examples:
        >>> import strategies
        >>> strategies.in_cross_replica_context()
        True
    """
    return get_replica_context() is None


@contextlib.contextmanager
def replica_context(ctx: ReplicaContext) -> Iterator[None]:
    """Make ``ctx`` this thread's replica context while a per-replica step is traced."""
    prev = getattr(_local, "replica_context", None)
    _local.replica_context = ctx
    try:
        yield
    finally:
        _local.replica_context = prev
