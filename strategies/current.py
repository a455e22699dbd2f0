"""The current strategy (tf.distribute's ``get_strategy`` / ``has_strategy``)."""

from __future__ import annotations

import threading

from strategies import context
from strategies.base import Strategy
from strategies.presets.one_device import OneDeviceStrategy

__all__ = ["get_strategy", "has_strategy"]

_default = threading.local()


def get_strategy() -> Strategy:
    """The strategy whose ``scope()`` is active, else a default one-device strategy.

    Examples:
        >>> import strategies
        >>> s = strategies.MirroredStrategy()
        >>> with s.scope():
        ...     strategies.get_strategy() is s
        True
        >>> type(strategies.get_strategy()).__name__
        'OneDeviceStrategy'
    """
    current = context.innermost()
    if current is not None:
        return current
    if not hasattr(_default, "strategy"):
        _default.strategy = OneDeviceStrategy()
    return _default.strategy


def has_strategy() -> bool:
    """Whether a strategy's ``scope()`` is active in this thread (tf.distribute's name).

    Examples:
        >>> import strategies
        >>> strategies.has_strategy()
        False
        >>> with strategies.MirroredStrategy().scope():
        ...     strategies.has_strategy()
        True
    """
    return context.innermost() is not None
