"""`FullyShardedStrategy`: ZeRO-3 / FSDP — every large variable split over all devices."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout

from .base import Strategy, _value

__all__ = ["FullyShardedStrategy", "shard_largest_dim"]


def shard_largest_dim(specs: list[Any], shape: Sequence[int], axis: str, size: int) -> list[Any]:
    """Put ``axis`` (of ``size``) on the largest still-unsharded dimension it divides.

    Ties go to the earlier dimension; ``specs`` is returned unchanged when no
    dimension divides.

    Examples:
        >>> from strategies.fsdp import shard_largest_dim
        >>> shard_largest_dim([None, None], (6, 16), "fsdp", 8)
        [None, 'fsdp']
        >>> shard_largest_dim([None], (6,), "fsdp", 8)
        [None]
    """
    candidates = [d for d in range(len(shape)) if specs[d] is None and shape[d] % size == 0 and shape[d] >= size]
    if not candidates or size <= 1:
        return specs
    best = max(candidates, key=lambda d: (shape[d], -d))
    out = list(specs)
    out[best] = axis
    return out


def nbytes(leaf: Any) -> int:
    """The bytes of an array (or abstract array) leaf."""
    value = _value(leaf)
    return math.prod(np.shape(value)) * np.dtype(value.dtype).itemsize


class FullyShardedStrategy(Strategy):
    """Each variable (and its optimizer state) split on its largest divisible dimension.

    Variables smaller than ``min_shard_bytes`` stay replicated. The batch is
    split over the same ``fsdp`` axis, so parameters are all-gathered for
    compute and gradients reduce-scattered.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.FullyShardedStrategy(min_shard_bytes=1024)
        >>> s.variable_layout("dense/kernel", jnp.zeros((64, 256)))
        Layout([UNSHARDED, 'fsdp'], mesh=Mesh(fsdp=8))
        >>> s.variable_layout("dense/bias", jnp.zeros((64,))).is_fully_replicated()
        True
    """

    name = "fully_sharded"
    shards_variables = True

    def __init__(self, devices: Sequence[Any] | None = None, *, min_shard_bytes: int = 16 << 10) -> None:
        if min_shard_bytes < 0:
            raise ValueError(f"min_shard_bytes={min_shard_bytes} is negative; use 0 to shard every variable.")
        self.min_shard_bytes = min_shard_bytes
        devices = list(devices) if devices is not None else jax.devices()
        super().__init__(dtensor.create_mesh([("fsdp", len(devices))], devices=devices), batch_axes=("fsdp",))

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        shape = np.shape(_value(leaf))
        specs: list[Any] = [None] * len(shape)
        if nbytes(leaf) >= self.min_shard_bytes:
            specs = shard_largest_dim(specs, shape, "fsdp", self.mesh.shape["fsdp"])
        return Layout(specs, self.mesh)
