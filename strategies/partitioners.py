"""Variable partitioners for `ParameterServerStrategy`, with TensorFlow's meanings.

A partitioner is called with a variable's shape and dtype and returns how many
shards to split its dimension 0 into (TF returns a list with that number at
index 0; ``partitions(shape, dtype)`` gives that list).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner"]


class Partitioner:
    """The interface: ``num_shards(shape, dtype) -> int`` (shards of dimension 0)."""

    max_shards: int = 1

    def num_shards(self, shape: Sequence[int], dtype: Any) -> int:
        raise NotImplementedError

    def __call__(self, shape: Sequence[int], dtype: Any, axis: int = 0) -> list[int]:
        """TF's form: the number of partitions per dimension."""
        parts = [1] * len(shape)
        if parts:
            parts[axis] = self.num_shards(shape, dtype)
        return parts


def _positive_int(value: Any, name: str, cls: str) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"{cls}({name}={value!r}): {name} must be a positive integer, e.g. {name}=2."
        )
    return int(value)


class FixedShardsPartitioner(Partitioner):
    """Every variable in ``num_shards`` shards (fewer when dimension 0 is smaller).

    Examples:
        >>> from strategies import FixedShardsPartitioner
        >>> FixedShardsPartitioner(2)((10, 4), "float32")
        [2, 1]
    """

    def __init__(self, num_shards: int) -> None:
        self.max_shards = _positive_int(num_shards, "num_shards", "FixedShardsPartitioner")

    def num_shards(self, shape: Sequence[int], dtype: Any) -> int:
        return min(self.max_shards, shape[0]) if shape else 1

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner({self.max_shards})"


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Examples:
        >>> from strategies import MinSizePartitioner
        >>> MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=4)((1024, 256), "float32")
        [4, 1]
        >>> MinSizePartitioner(min_shard_bytes=256 << 10, max_shards=4)((64, 64), "float32")
        [1, 1]
    """

    def __init__(
        self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16
    ) -> None:
        self.min_shard_bytes = _positive_int(
            min_shard_bytes, "min_shard_bytes", "MinSizePartitioner"
        )
        self.max_shards = _positive_int(max_shards, "max_shards", "MinSizePartitioner")
        self.bytes_per_string = bytes_per_string

    def num_shards(self, shape: Sequence[int], dtype: Any) -> int:
        if not shape:
            return 1
        total = math.prod(shape) * np.dtype(dtype).itemsize
        return max(1, min(self.max_shards, shape[0], total // self.min_shard_bytes))

    def __repr__(self) -> str:
        return f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, max_shards={self.max_shards})"


class MaxSizePartitioner(Partitioner):
    """The fewest shards that keep each at most ``max_shard_bytes``, at most ``max_shards``.

    Examples:
        >>> from strategies import MaxSizePartitioner
        >>> MaxSizePartitioner(max_shard_bytes=4096, max_shards=8)((64, 64), "float32")
        [4, 1]
    """

    def __init__(
        self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16
    ) -> None:
        self.max_shard_bytes = _positive_int(
            max_shard_bytes, "max_shard_bytes", "MaxSizePartitioner"
        )
        self.max_shards = (
            _positive_int(max_shards, "max_shards", "MaxSizePartitioner")
            if max_shards is not None
            else 1 << 30
        )
        self.bytes_per_string = bytes_per_string

    def num_shards(self, shape: Sequence[int], dtype: Any) -> int:
        if not shape:
            return 1
        total = math.prod(shape) * np.dtype(dtype).itemsize
        return max(1, min(self.max_shards, shape[0], -(-total // self.max_shard_bytes)))

    def __repr__(self) -> str:
        return f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, max_shards={self.max_shards})"
