"""Input functions' batches, checked against the share of the global batch they must hold.

The check keeps the source iterator's ``get_state()``/``set_state()`` (a Grain
iterator's), so the distributed dataset's position can still be checkpointed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

import dtensor
from dtensor import LayoutError
from dtensor.data.dataset import input_pipelines
from strategies.replica.values import InputContext

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["CheckedShares", "datasets_from_function", "distribute_dataset", "input_context"]


class CheckedShares:
    """An input function's batches, each checked to hold this pipeline's share of the global batch."""

    def __init__(
        self, source: Iterable[Any], ctx: InputContext, global_batch_size: int, *, pad: bool
    ) -> None:
        self.source = source
        self.ctx = ctx
        self.global_batch_size = global_batch_size
        self.pad = pad

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return _CheckedIterator(iter(self.source), self.check)

    def check(self, i: int, batch: Any) -> None:
        """Raise when ``batch`` (the ``i``-th) is not this pipeline's share of the global batch."""
        ctx, n = self.ctx, self.global_batch_size
        share = n // ctx.num_input_pipelines
        rows = {int(np.shape(x)[0]) for x in jax.tree.leaves(batch) if np.ndim(x) > 0}
        if rows and (rows != {share} if not self.pad else max(rows) > share):
            raise LayoutError(
                f"the dataset function's batch {i} has {sorted(rows)[-1]} rows, but this input "
                f"pipeline's share of the global batch {n} is {share} rows ({n} / "
                f"{ctx.num_input_pipelines} input pipelines). distribute_datasets_from_function "
                "wants each pipeline's share, not one replica's: batch by "
                f"ctx.get_per_pipeline_batch_size({n})"
                + (" (or pass pad=True for a short last batch)." if not self.pad else ".")
            )


class _CheckedIterator:
    """Checks each batch; ``get_state``/``set_state`` are the source iterator's, where it has them."""

    def __init__(self, it: Iterator[Any], check: Any) -> None:
        self._it = it
        self._check = check
        self._i = 0

    def __iter__(self) -> _CheckedIterator:
        return self

    def __next__(self) -> Any:
        batch = next(self._it)
        self._check(self._i, batch)
        self._i += 1
        return batch

    def __getattr__(self, name: str) -> Any:
        if name in ("get_state", "set_state"):
            return getattr(self._it, name)
        raise AttributeError(name)


def batch_dim(strategy: Strategy) -> str | tuple[str, ...]:
    """The mesh axis (or axes) a strategy splits the batch's first dimension over."""
    axes = strategy.batch_axes
    if not axes:
        return strategy.mesh.dim_names[0]  # a size-1 axis: the batch stays whole
    return axes[0] if len(axes) == 1 else tuple(axes)


def input_context(strategy: Strategy) -> InputContext:
    """This process's :class:`InputContext` under ``strategy``.

    One input pipeline per set of processes holding the same rows: each
    process on a data-parallel mesh, fewer where stages (or tensor, context
    groups) span processes (:func:`dtensor.data.dataset.input_pipelines`).
    """
    count, index = input_pipelines(strategy.mesh, batch_dim(strategy))
    return InputContext(
        num_input_pipelines=count,
        input_pipeline_id=index,
        num_replicas_in_sync=strategy.num_replicas_in_sync,
    )


def distribute_dataset(
    strategy: Strategy, dataset: Iterable[Any], *, pad: bool, prefetch: int
) -> dtensor.DTensorDataset:
    """:meth:`strategies.Strategy.experimental_distribute_dataset`."""
    return dtensor.DTensorDataset(
        dataset, strategy.mesh, batch_dim=batch_dim(strategy), prefetch=prefetch, pad=pad
    )


def datasets_from_function(
    strategy: Strategy,
    dataset_fn: Callable[[InputContext], Iterable[Any]],
    *,
    pad: bool,
    prefetch: int,
) -> dtensor.DTensorDataset:
    """:meth:`strategies.Strategy.distribute_datasets_from_function`."""
    ctx = input_context(strategy)
    source = dataset_fn(ctx)
    global_batch_size = ctx.requested_global_batch_size
    if global_batch_size is not None:  # the function told us the global batch: check its shares
        source = CheckedShares(source, ctx, global_batch_size, pad=pad)
    return dtensor.DTensorDataset(
        source,
        strategy.mesh,
        global_batch_size=global_batch_size,
        batch_dim=batch_dim(strategy),
        process_local=True,
        prefetch=prefetch,
        pad=pad,
    )
