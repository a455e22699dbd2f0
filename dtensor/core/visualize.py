"""Pictures of layouts: which device holds which block (rich tables)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from rich.table import Table

from dtensor.core.arrays import fetch_layout
from dtensor.core.layout import Layout
from dtensor.core.picture import device_grid as device_grid

__all__ = ["device_grid", "visualize"]


def visualize(
    x: jax.Array | Layout, *, shape: Sequence[int] | None = None, show: bool = True
) -> Table:
    """Draw which device holds which block of an array (or of a layout).

    Rows are blocks of dimension 0, columns blocks of dimension 1 (a rank-1
    array is one row); each cell lists the devices holding that block, and the
    ranges of any further split dimensions.

    Args:
        x: a laid-out array, or a :class:`Layout` (then ``shape`` defaults to
            the number of shards of each dimension).
        shape: the global shape to draw for a layout.
        show: print the picture (to the terminal or notebook).

    Returns:
        The ``rich.table.Table``.

    Examples:
        >>> import dtensor
        >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
        >>> table = dtensor.Layout(["batch", "model"], mesh).visualize(show=False)
        >>> table.row_count, len(table.columns)
        (4, 2)
    """
    if isinstance(x, Layout):
        return x.visualize(shape, show=show)
    return fetch_layout(x).visualize(tuple(x.shape), show=show)
