"""`FullyShardedStrategy`: ZeRO-3 / FSDP — every large variable split over all devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import dtensor
from dtensor import Layout
from dtensor.core.tree import leaf_value
from strategies.base import Strategy
from strategies.param_reads import gather_at_reads
from strategies.sharding import nbytes, shard_largest_dim

__all__ = ["FullyShardedStrategy"]


class FullyShardedStrategy(Strategy):
    """Each variable (and its optimizer state) split on its largest divisible dimension.

    Variables smaller than ``min_shard_bytes`` stay replicated. The batch is
    split over the same ``fsdp`` axis. In a step on Flax NNX modules each
    read of a sharded variable is all-gathered for compute (activations stay
    split by batch) and its gradient is reduce-scattered, whatever XLA's own
    propagation would pick: the step is traced with the ``fsdp`` axis
    Explicit and every such read goes through
    :func:`strategies.fsdp_ops.gather_for_compute`. Pass
    ``gather_at_read=False`` to leave the plan to XLA (it then all-reduces
    full-size gradients, or gathers activations for small batches). Steps on
    plain pytrees (Linen, pure JAX) always leave it to XLA: their parameter
    reads cannot be intercepted.

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

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        min_shard_bytes: int = 16 << 10,
        gather_at_read: bool = True,
    ) -> None:
        if min_shard_bytes < 0:
            raise ValueError(
                f"min_shard_bytes={min_shard_bytes} is negative; use 0 to shard every variable."
            )
        self.min_shard_bytes = min_shard_bytes
        self.gather_at_read = gather_at_read
        devices = list(devices) if devices is not None else jax.devices()
        super().__init__(
            dtensor.create_mesh([("fsdp", len(devices))], devices=devices), batch_axes=("fsdp",)
        )

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        shape = np.shape(leaf_value(leaf))
        specs: list[Any] = [None] * len(shape)
        if nbytes(leaf) >= self.min_shard_bytes:
            specs = shard_largest_dim(specs, shape, "fsdp", self.mesh.shape["fsdp"])
        return Layout(specs, self.mesh)

    def trace_step(
        self,
        call: Callable[[Any, list[Any]], Any],
        state: Any,
        arrays: list[Any],
        layouts: Any,
        shardings: list[Any],
    ) -> Any:
        """Each read of a sharded variable gathered for compute, its gradient reduce-scattered."""
        if not self.gather_at_read:
            return call(state, arrays)
        return gather_at_reads(call, state, arrays, layouts, shardings, self.mesh, self.batch_axes)
