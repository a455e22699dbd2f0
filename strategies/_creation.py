"""Laying out NNX models as they are built inside ``strategy.scope()``.

Flax has no public hook that runs when a Variable or a Module is created. Inside
a scope we wrap the NNX Pytree metaclass's ``__call__`` (restored on exit): when
the *outermost* Module or Optimizer construction returns, its variables are
placed by the strategy's policies (with their paths, so path rules apply).
Objects built under a JAX trace (``nnx.eval_shape``, ``jax.jit``) are left alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.core
from flax import nnx
from flax.nnx import pytreelib

if TYPE_CHECKING:
    from .base import Strategy

_local = threading.local()
_lock = threading.Lock()
_original_call = pytreelib.PytreeMeta.__call__
_installed = 0


def _wrapped_call(cls: Any, *args: Any, **kwargs: Any) -> Any:
    strategy = getattr(_local, "strategy", None)
    if strategy is None:
        return _original_call(cls, *args, **kwargs)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        obj = _original_call(cls, *args, **kwargs)
    finally:
        _local.depth -= 1
    if (
        _local.depth == 0
        and isinstance(obj, nnx.Module | nnx.Optimizer)
        and not isinstance(obj, nnx.Rngs)
    ):
        leaves = jax.tree.leaves(nnx.state(obj))
        if leaves and not any(isinstance(v, jax.core.Tracer) for v in leaves):
            strategy.distribute_variables(obj)
    return obj


@contextlib.contextmanager
def placing(strategy: Strategy) -> Iterator[None]:
    """While active (in this thread), outermost NNX constructions are laid out by ``strategy``."""
    global _installed
    with _lock:
        if _installed == 0:
            pytreelib.PytreeMeta.__call__ = _wrapped_call  # type: ignore[method-assign]
        _installed += 1
    prev = getattr(_local, "strategy", None)
    _local.strategy = strategy
    try:
        yield
    finally:
        _local.strategy = prev
        with _lock:
            _installed -= 1
            if _installed == 0:
                pytreelib.PytreeMeta.__call__ = _original_call  # type: ignore[method-assign]
