"""Sharding rules that several presets share: split the largest dimension, count bytes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtensor.core.tree import leaf_value

__all__ = ["nbytes", "one_device_per_process", "shard_largest_dim"]


def shard_largest_dim(
    specs: list[Any], shape: Sequence[int], axis: str | tuple[str, ...], size: int
) -> list[Any]:
    """Put ``axis`` (of ``size``; a tuple of axes: their product) on the largest
    still-unsharded dimension it divides.

    Ties go to the earlier dimension; ``specs`` is returned unchanged when no
    dimension divides.

    Examples:
        >>> from strategies.placement.sharding import shard_largest_dim
        >>> shard_largest_dim([None, None], (6, 16), "fsdp", 8)
        [None, 'fsdp']
        >>> shard_largest_dim([None], (6,), "fsdp", 8)
        [None]
    """
    candidates = [
        d
        for d in range(len(shape))
        if specs[d] is None and shape[d] % size == 0 and shape[d] >= size
    ]
    if not candidates or size <= 1:
        return specs
    best = max(candidates, key=lambda d: (shape[d], -d))
    out = list(specs)
    out[best] = axis
    return out


def nbytes(leaf: Any) -> int:
    """The bytes of an array (or abstract array) leaf.

    Examples:
        >>> import numpy as np
        >>> from strategies.placement.sharding import nbytes
        >>> nbytes(np.zeros((4, 8), np.float32))
        128
    """
    value = leaf_value(leaf)
    return math.prod(np.shape(value)) * np.dtype(value.dtype).itemsize


def one_device_per_process(devices: Sequence[Any]) -> list[Any]:
    """The first of ``devices`` on each process that has one, in process order.

    What a single-device role (OneDevice's device, CentralStorage's parameter device)
    becomes in a job of several processes: every process runs the step, so each needs
    a device of its own in it.

    Examples:
        >>> import jax
        >>> from strategies.placement.sharding import one_device_per_process
        >>> one_device_per_process(jax.devices()) == [jax.devices()[0]]   # one process
        True
    """
    firsts: dict[int, Any] = {}
    for d in devices:
        firsts.setdefault(d.process_index, d)
    return [firsts[p] for p in sorted(firsts)]
