"""Tests for dtensor.core.visualize: which device ids each cell of the picture names."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from rich.console import Console

import dtensor
from dtensor import Layout, copy_to_mesh, create_mesh, visualize


def _cells(table):
    """The table's cells as rows of strings."""
    cols = [[str(c) for c in col.cells] for col in table.columns]
    return [list(row) for row in zip(*cols, strict=True)]


def _ids(cell):
    (ids,) = re.findall(r"dev ([\d,]+)", cell)
    return [int(i) for i in ids.split(",")]


@pytest.fixture(scope="module")
def mesh():
    return create_mesh([("batch", 4), ("model", 2)])


def test_2d_layout_cells_name_device_ids(mesh):
    table = Layout(["batch", "model"], mesh).visualize(show=False)
    assert table.row_count == 4 and len(table.columns) == 2
    cells = _cells(table)
    for r in range(4):
        for c in range(2):
            assert _ids(cells[r][c]) == [mesh.devices[r, c].id]
    assert cells[1][0].startswith("[1:2]")  # the row's block range
    assert [col.header for col in table.columns] == ["[0:1]", "[1:2]"]


def test_transposed_layout(mesh):
    cells = _cells(Layout(["model", "batch"], mesh).visualize(show=False))
    assert len(cells) == 2 and len(cells[0]) == 4
    for r in range(2):
        for c in range(4):
            assert _ids(cells[r][c]) == [mesh.devices[c, r].id]


def test_replicated_dims_list_every_holder(mesh):
    table = visualize(Layout([None, "batch"], mesh), shape=(4, 8), show=False)
    cells = _cells(table)
    assert len(cells) == 1
    assert [_ids(c) for c in cells[0]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [col.header for col in table.columns] == ["[0:2]", "[2:4]", "[4:6]", "[6:8]"]
    rep = _cells(visualize(Layout.replicated(mesh, 2), shape=(3, 3), show=False))
    assert [[_ids(c) for c in row] for row in rep] == [[list(range(8))]]


def test_permuted_devices_and_array_input():
    devices = [jax.devices()[i] for i in (7, 3, 5, 1, 6, 2, 4, 0)]
    mesh = create_mesh([("x", 2), ("y", 4)], devices=devices)
    x = copy_to_mesh(np.zeros((4, 8)), Layout(["x", "y"], mesh))
    cells = _cells(visualize(x, show=False))
    assert [[_ids(c) for c in row] for row in cells] == [[[7], [3], [5], [1]], [[6], [2], [4], [0]]]
    assert cells[1][0].startswith("[2:4]")


def test_rank_1_and_3(mesh):
    cells = _cells(visualize(Layout([("batch", "model")], mesh), show=False))
    assert [_ids(row[0]) for row in cells] == [[i] for i in range(8)]
    cells3 = _cells(visualize(Layout([None, "batch", "model"], mesh), shape=(2, 4, 4), show=False))
    assert len(cells3) == 1 and len(cells3[0]) == 4
    assert _ids(cells3[0][1]) == [2, 3]
    assert "d2[0:2]" in cells3[0][1] and "d2[2:4]" in cells3[0][1]


def test_show_prints(mesh, capsys):
    Layout(["batch", "model"], mesh).visualize(show=True)
    out = capsys.readouterr().out
    assert "dev 5" in out and "shape=(4, 2)" in out and "Layout(" in out
    console = Console(record=True, width=120)
    console.print(visualize(Layout(["batch", None], mesh), show=False))
    assert "dev 6,7" in console.export_text()


def test_bad_shape(mesh):
    with pytest.raises(
        dtensor.LayoutError,
        match=r"dimension 0 has size 3, which does not divide into the 4 shards",
    ):
        visualize(Layout(["batch"], mesh), shape=(3,), show=False)
