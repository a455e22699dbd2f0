"""Input functions' batches, checked against the share of the global batch they must hold."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from dtensor import LayoutError
from strategies.values import InputContext

__all__ = ["CheckedShares"]


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
        ctx, n = self.ctx, self.global_batch_size
        share = n // ctx.num_input_pipelines
        for i, batch in enumerate(self.source):
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
            yield batch
