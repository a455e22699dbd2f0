"""Rich tables for people: the layout of every variable of a model or pytree."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dtensor.core.layout import Layout
from dtensor.core.tree import is_leaf, path_str

__all__ = ["human_bytes", "layouts_table", "render", "sizes_text"]


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units, as the reports print them.

    Examples:
        >>> from dtensor.core.text import human_bytes
        >>> human_bytes(512), human_bytes(3 * 2**20)
        ('512 B', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def sizes_text(named: Sequence[tuple[str, int]], *, unit: str = "rows", shown: int = 4) -> str:
    """Distinct sizes, each with the first names that have it, compactly (not every name).

    Examples:
        >>> from dtensor.core.text import sizes_text
        >>> sizes_text([("x", 8), ("y", 6), ("z", 8), ("w", 8), ("v", 4)])
        '8 rows (x and 2 more), 6 rows (y), 4 rows (v)'
        >>> sizes_text([(f"a{i}", i) for i in range(6)], unit="items", shown=2)
        '0 items (a0), 1 items (a1) and 4 other sizes'
    """
    by_size: dict[int, list[str]] = {}
    for name, size in named:
        by_size.setdefault(int(size), []).append(name)
    parts = [
        f"{size} {unit} ({names[0]}" + (f" and {len(names) - 1} more)" if len(names) > 1 else ")")
        for size, names in list(by_size.items())[:shown]
    ]
    rest = len(by_size) - shown
    return ", ".join(parts) + (f" and {rest} other sizes" if rest > 0 else "")


def layouts_table(tree: Any, layouts: Any, rules: Any = None, *, title: str = "variables") -> Table:
    """A table of path, shape, dtype, layout, rule and bytes per device for each array leaf.

    ``layouts`` and ``rules`` are as :func:`dtensor.resolve_layouts` returns them.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> tree = {"w": jnp.zeros((8, 4))}
        >>> table = dtensor.core.text.layouts_table(tree, *dtensor.resolve_layouts(tree, dtensor.LayoutMap(mesh, [("w", ("x", None))])))
        >>> "w" in dtensor.core.text.render(table)
        True
    """
    from flax import nnx

    if isinstance(tree, nnx.Module | nnx.Optimizer):
        tree = nnx.state(tree)
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)
    lay = jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout) or v is None)
    rule_leaves = (
        jax.tree.leaves(rules, is_leaf=lambda v: v is None or isinstance(v, str))
        if rules is not None
        else [None] * len(lay)
    )
    table = Table(title=title)
    for col in ("path", "shape", "dtype", "layout", "rule", "per device"):
        table.add_column(col, justify="right" if col == "per device" else "left", overflow="fold")
    total = 0
    for (path, leaf), layout, rule in zip(leaves, lay, rule_leaves, strict=False):
        if layout is None:
            continue
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        shape = tuple(np.shape(value))
        per = math.prod(layout.local_shape(shape)) * np.dtype(value.dtype).itemsize
        total += per
        specs = ", ".join(s if isinstance(s, str) else "+".join(s) for s in layout.sharding_specs)
        cells = (
            path_str(path),
            str(shape),
            str(np.dtype(value.dtype)),
            f"[{specs}]",
            rule or "-",
            human_bytes(per),
        )
        table.add_row(*(Text(c) for c in cells))
    meshes = [lay_.mesh for lay_ in lay if lay_ is not None]
    table.caption = f"{meshes[0]!r}; {human_bytes(total)} per device" if meshes else None
    return table


def render(renderable: Any, width: int = 110) -> str:
    """Render a rich object to plain text."""
    buf = io.StringIO()
    Console(
        file=buf, width=width, force_terminal=False, force_jupyter=False, color_system=None
    ).print(renderable)
    return buf.getvalue()
