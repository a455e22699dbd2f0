"""Rich tables of which device holds which block (no dtensor types here).

The drawing under :func:`dtensor.visualize` and :meth:`dtensor.Layout.visualize`:
it takes what a ``jax.sharding.Sharding`` reports (``devices_indices_map``), so
:mod:`dtensor.core.layout` can use it without importing the array operations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

__all__ = ["blocks_table", "device_grid"]

_COLORS = ["cyan", "magenta", "green", "yellow", "blue", "red", "bright_cyan", "bright_magenta"]


def _block(sl: slice, size: int) -> tuple[int, int]:
    start, stop, _ = sl.indices(size)
    return start, stop


def blocks_table(
    title: str,
    index_map: Mapping[Any, Sequence[slice]],
    shape: tuple[int, ...],
    *,
    show: bool = True,
) -> Table:
    """The picture of ``index_map`` (device -> its block's slices) for an array of ``shape``.

    Rows are blocks of dimension 0, columns blocks of dimension 1; each cell
    lists the ids of the devices holding that block and the ranges of any
    further split dimensions.

    Examples:
        >>> from collections import namedtuple
        >>> Device = namedtuple("Device", "id")
        >>> index_map = {Device(0): (slice(0, 2),), Device(1): (slice(2, 4),)}
        >>> blocks_table("x", index_map, (4,), show=False).row_count
        2
    """
    rank = len(shape)
    grid_dims = [0, 1] if rank >= 2 else [0] if rank == 1 else []
    cells: dict[tuple[tuple[int, int], ...], list[int]] = {}
    extra: dict[tuple[tuple[int, int], ...], set[str]] = {}
    for device, index in index_map.items():
        blocks = [_block(index[d], shape[d]) for d in range(rank)]
        key = tuple(blocks[d] for d in grid_dims)
        cells.setdefault(key, []).append(device.id)
        rest = [
            f"d{d}[{a}:{b}]"
            for d, (a, b) in enumerate(blocks)
            if d not in grid_dims and (a, b) != (0, shape[d])
        ]
        if rest:
            extra.setdefault(key, set()).add(" ".join(rest))
    rows = sorted({k[0] for k in cells}) if rank else [(0, 0)]
    cols = sorted({k[1] for k in cells}) if rank >= 2 else [None]
    table = Table(title=title, show_header=rank >= 2, show_lines=True)
    for c in cols:
        table.add_column("" if c is None else f"[{c[0]}:{c[1]}]", justify="center")
    for i, r in enumerate(rows):
        row = []
        for j, c in enumerate(cols):
            key = (r,) if c is None else (r, c)
            if rank == 0:
                key = ()
            ids = sorted(cells.get(key, []))
            label = "dev " + ",".join(map(str, ids))
            if rank:
                label = f"[{r[0]}:{r[1]}]\n{label}" if c is None or j == 0 else label
            if key in extra:
                label += "\n" + "; ".join(sorted(extra[key]))
            row.append(Text(label, style=_COLORS[(i * len(cols) + j) % len(_COLORS)]))
        table.add_row(*row)
    if show:
        Console().print(table)
    return table


def device_grid(mesh: Any, *, max_columns: int = 16) -> Group:
    r"""The mesh's device ids as a grid: rows along its first axis, columns along the rest.

    A 1-D mesh is one row (wrapped every ``max_columns`` devices); headers are
    indices, so the grid fits an 80-column terminal.

    Examples:
        >>> import dtensor
        >>> from dtensor.core.text import render
        >>> text = render(device_grid(dtensor.create_mesh([("data", 2), ("model", 4)])))
        >>> print("\n".join(line.rstrip() for line in text.strip().splitlines()))
        Mesh(data=2, model=4) on 8 cpu devices
        <BLANKLINE>
          data \ model   0   1   2   3
         ──────────────────────────────
          0              0   1   2   3
          1              4   5   6   7
    """
    devices = np.asarray(mesh.devices)
    names = mesh.dim_names
    if devices.ndim > 1:
        grid = devices.reshape(devices.shape[0], -1)
        corner = f"{names[0]} \\ {' x '.join(names[1:])}"
        labels = [str(i) for i in range(grid.shape[0])]
    else:
        flat = devices.reshape(-1)
        cols = min(len(flat), max_columns)
        rows = -(-len(flat) // cols)
        grid = np.full((rows, cols), None, dtype=object)
        grid.flat[: len(flat)] = flat
        corner = names[0]
        labels = [f"device {r * cols}+" if rows > 1 else "device" for r in range(rows)]
    platform = devices.reshape(-1)[0].platform
    table = Table(box=box.SIMPLE_HEAD)
    table.add_column(corner, justify="left", no_wrap=True)
    for j in range(grid.shape[1]):
        table.add_column(str(j), justify="right", no_wrap=True)
    for label, row in zip(labels, grid, strict=True):
        table.add_row(label, *("" if d is None else str(d.id) for d in row))
    return Group(Text(f"{mesh!r} on {devices.size} {platform} devices", style="italic"), table)
