"""Text for people: byte sizes, compact layouts, and the one table renderer of the reports."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from dtensor.core.layout import UNSHARDED, Layout
from dtensor.core.tree import is_leaf, path_str

__all__ = ["compact_layout", "elide_middle", "human_bytes", "layouts_table", "render", "sizes_text"]


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


_SHORT_DTYPES = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64"}


def compact_layout(layout: Layout) -> str:
    """A layout's specs in a few characters: ``[·, model]`` (``·``: not split).

    Examples:
        >>> import dtensor
        >>> mesh = dtensor.create_mesh([("data", 4), ("model", 2)])
        >>> compact_layout(dtensor.Layout([None, "model"], mesh))
        '[·, model]'
        >>> compact_layout(dtensor.Layout([("data", "model"), None], mesh))
        '[data+model, ·]'
    """
    parts = [
        "·" if s == UNSHARDED else s if isinstance(s, str) else "+".join(s)
        for s in layout.sharding_specs
    ]
    text = "[" + ", ".join(parts) + "]"
    return text + (f" partial({','.join(layout.partial_axes)})" if layout.partial_axes else "")


def elide_middle(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters by dropping its middle (``blocks/0/…/kernel``).

    Examples:
        >>> elide_middle("blocks/0/attention/query/kernel", 20)
        'blocks/0/…ery/kernel'
        >>> elide_middle("short", 20)
        'short'
    """
    if len(text) <= width:
        return text
    if width <= 1:
        return text[:width]
    head = (width - 1) // 2
    tail = width - 1 - head
    return text[:head] + "…" + text[len(text) - tail :]


def layouts_table(
    tree: Any,
    layouts: Any,
    rules: Any = None,
    *,
    title: str = "variables",
    width: int = 80,
) -> Table:
    """One line per array leaf: path, shape, dtype, layout, rule and bytes per device.

    ``layouts`` and ``rules`` are as :func:`dtensor.resolve_layouts` returns
    them. Layouts are written compactly (``[·, model]``) and paths are
    elided in the middle so that each row fits in ``width`` columns.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> tree = {"w": jnp.zeros((8, 4))}
        >>> table = layouts_table(tree, *dtensor.resolve_layouts(tree, dtensor.LayoutMap(mesh, [("w", ("x", None))])))
        >>> print(render(table, width=80).splitlines()[4].strip())
        w      8×4     [x, ·]         16 B
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
    rows = []
    total = 0
    for (path, leaf), layout, rule in zip(leaves, lay, rule_leaves, strict=False):
        if layout is None:
            continue
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        shape = tuple(np.shape(value))
        per = math.prod(layout.local_shape(shape)) * np.dtype(value.dtype).itemsize
        total += per
        dtype = str(np.dtype(value.dtype))
        rows.append(
            [
                path_str(path),
                "×".join(map(str, shape)) or "scalar",
                _SHORT_DTYPES.get(dtype, dtype),
                compact_layout(layout),
                elide_middle(rule or "-", 20 if width <= 100 else 60),
                human_bytes(per),
            ]
        )
    headers = ["path", "shape", "dtype", "layout", "rule", "per device"]
    notes = []
    for name in ("rule", "dtype"):  # a column with one value throughout: say it once
        i = headers.index(name)
        values = {r[i] for r in rows}
        if len(values) == 1 and rows:
            notes.append(f"{name} {values.pop()}")
            headers.pop(i)
            for r in rows:
                r.pop(i)

    def build(path_width: int) -> Table:
        table = Table(title=title, box=box.SIMPLE_HEAD)
        for col in headers:
            table.add_column(col, justify="right" if col == "per device" else "left", no_wrap=True)
        for row in rows:
            table.add_row(*(Text(c) for c in [elide_middle(row[0], path_width), *row[1:]]))
        return table

    def natural_width() -> int:
        return Console(width=10_000).measure(build(longest)).maximum

    longest = max([len(r[0]) for r in rows] + [4])
    full = natural_width()
    if "rule" in headers and longest - (full - width) < min(longest, 28):
        i = headers.index("rule")  # paths matter more than rule names: drop the column
        headers.pop(i)
        for r in rows:
            r.pop(i)
        notes.append(f"rules shown at {full}+ columns")
    excess = natural_width() - width
    table = build(max(12, longest - excess) if excess > 0 else longest)
    meshes = [lay_.mesh for lay_ in lay if lay_ is not None]
    caption = [f"{meshes[0]!r}", f"{human_bytes(total)} per device"] if meshes else []
    table.caption = "; ".join(caption + notes) or None
    return table


def render(renderable: Any, width: int = 110) -> str:
    """Render a rich object to plain text."""
    buf = io.StringIO()
    Console(
        file=buf, width=width, force_terminal=False, force_jupyter=False, color_system=None
    ).print(renderable)
    return buf.getvalue()
