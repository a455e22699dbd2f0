"""`dtensor.DTensorDataset`: host data to global arrays in given layouts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import dtensor
from dtensor import UNSHARDED as U
from dtensor import DTensorDataset, Layout, LayoutError
from dtensor.data.dataset import pad_batch


@pytest.fixture(scope="module")
def mesh():
    return dtensor.create_mesh([("batch", 4), ("model", 2)])


def test_arrays_are_cut_into_batches(mesh):
    data = {"x": np.arange(80.0).reshape(40, 2), "y": np.arange(40)}
    ds = DTensorDataset(data, mesh, global_batch_size=16, batch_dim="batch")
    assert len(ds) == 2  # 40 rows: two batches of 16, the remaining 8 dropped
    batches = list(ds)
    assert len(batches) == 2
    np.testing.assert_array_equal(batches[1]["y"], np.arange(16, 32))
    np.testing.assert_array_equal(batches[1]["x"], data["x"][16:32])
    assert dtensor.fetch_layout(batches[0]["x"]) == Layout(["batch", U], mesh)
    assert dtensor.fetch_layout(batches[0]["y"]) == Layout(["batch"], mesh)
    # Each batch-axis position holds its 4 rows; the model axis holds copies.
    x = batches[0]["x"]
    assert x.addressable_shards[0].data.shape == (4, 2)


def test_arrays_with_pad_keep_the_remainder(mesh):
    data = {"x": np.arange(40.0).reshape(20, 2)}
    ds = DTensorDataset(data, mesh, global_batch_size=16, batch_dim="batch", pad=True)
    assert len(ds) == 2
    (b0, w0), (b1, w1) = list(ds)
    assert b0["x"].shape == (16, 2) and float(w0.sum()) == 16.0
    assert b1["x"].shape == (16, 2)  # the last 4 rows, padded to the full batch: one shape
    np.testing.assert_array_equal(b1["x"][:4], data["x"][16:])
    np.testing.assert_array_equal(b1["x"][4:], 0)
    np.testing.assert_array_equal(w1, [1.0] * 4 + [0.0] * 12)
    assert dtensor.fetch_layout(w1) == Layout(["batch"], mesh)


def test_iterables_of_batches(mesh):
    def gen():
        for i in range(3):
            yield (np.full((8, 3), i, np.float32), [np.arange(8) * i])

    out = list(DTensorDataset(gen(), mesh, batch_dim="batch"))
    assert len(out) == 3
    x, (y,) = out[2]
    np.testing.assert_array_equal(x, np.full((8, 3), 2))
    np.testing.assert_array_equal(y, np.arange(8) * 2)
    assert dtensor.fetch_layout(y) == Layout(["batch"], mesh)


def test_batch_dim_defaults_to_the_first_axis_and_can_span_axes(mesh):
    (b,) = list(DTensorDataset([{"x": np.ones((8, 2))}], mesh))
    assert dtensor.fetch_layout(b["x"]) == Layout(["batch", U], mesh)
    (b,) = list(DTensorDataset([{"x": np.arange(8.0)}], mesh, batch_dim=("batch", "model")))
    assert dtensor.fetch_layout(b["x"]) == Layout([("batch", "model")], mesh)
    assert {sh.data.shape for sh in b["x"].addressable_shards} == {(1,)}


def test_scalars_are_replicated(mesh):
    (b,) = list(DTensorDataset([{"x": np.ones((8,)), "step": np.int32(3)}], mesh))
    assert dtensor.fetch_layout(b["step"]) == Layout.replicated(mesh, 0)
    assert int(b["step"]) == 3


def test_explicit_layouts_tree(mesh):
    layouts = {"x": Layout(["batch", "model"], mesh), "y": Layout.replicated(mesh, 1)}
    (b,) = list(
        DTensorDataset([{"x": np.arange(32.0).reshape(8, 4), "y": np.arange(8)}], mesh, layouts)
    )
    assert dtensor.fetch_layout(b["x"]) == layouts["x"]
    assert b["x"].addressable_shards[0].data.shape == (2, 2)
    assert dtensor.fetch_layout(b["y"]).is_fully_replicated()
    np.testing.assert_array_equal(b["x"], np.arange(32.0).reshape(8, 4))


def test_one_layout_for_every_leaf(mesh):
    layout = Layout([U, "model"], mesh)
    (b,) = list(
        DTensorDataset([{"a": np.ones((3, 4)), "b": np.ones((3, 2))}], mesh, layout, prefetch=0)
    )
    assert dtensor.fetch_layout(b["a"]) == layout
    assert dtensor.fetch_layout(b["b"]) == layout


def test_jax_arrays_as_input(mesh):
    (b,) = list(DTensorDataset([{"x": jax.numpy.arange(8.0)}], mesh, batch_dim="batch"))
    assert dtensor.fetch_layout(b["x"]) == Layout(["batch"], mesh)
    np.testing.assert_array_equal(b["x"], np.arange(8.0))


def test_process_local_single_process(mesh):
    (b,) = list(
        DTensorDataset(
            [{"x": np.arange(8.0)}],
            mesh,
            global_batch_size=8,
            batch_dim="batch",
            process_local=True,
        )
    )
    assert dtensor.fetch_layout(b["x"]) == Layout(["batch"], mesh)
    np.testing.assert_array_equal(b["x"], np.arange(8.0))


def test_pad_batch():
    b, w = pad_batch({"x": np.arange(10.0).reshape(5, 2), "y": np.arange(5)}, 4)
    assert b["x"].shape == (8, 2)
    np.testing.assert_array_equal(b["y"], [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(w, [1, 1, 1, 1, 1, 0, 0, 0])
    assert w.dtype == np.float32
    same, w = pad_batch({"x": np.ones((8, 2))}, 4)
    assert same["x"].shape == (8, 2) and float(w.sum()) == 8.0


# ------------------------------------------------------------------ errors
def test_arrays_without_a_batch_size(mesh):
    with pytest.raises(
        LayoutError,
        match=r"DTensorDataset over arrays needs global_batch_size= to cut them into batches",
    ):
        DTensorDataset({"x": np.ones((16, 2))}, mesh)


def test_leaves_with_different_row_counts(mesh):
    with pytest.raises(
        LayoutError,
        match=r"different leading sizes: 8 rows \(batch\[.x.\]\), 6 rows \(batch\[.y.\]\); every array "
        r"in a batch needs the same number of rows",
    ):
        list(DTensorDataset([{"x": np.ones((8, 2)), "y": np.ones((6,))}], mesh))


def test_element_of_the_wrong_global_batch_size(mesh):
    with pytest.raises(
        LayoutError,
        match=r"a batch has 12 rows but global_batch_size is 16\. Make every element hold the global batch",
    ):
        list(DTensorDataset([{"x": np.ones((12, 2))}], mesh, global_batch_size=16))
    with pytest.raises(
        LayoutError,
        match=r"a batch has 4 rows per process x 1 input pipeline but global_batch_size is 8",
    ):
        list(
            DTensorDataset([{"x": np.ones((4, 2))}], mesh, global_batch_size=8, process_local=True)
        )


def test_batch_that_does_not_divide(mesh):
    with pytest.raises(
        LayoutError,
        match=r"the global batch of 6 rows does not divide over the 4 shards of mesh axes 'batch' \(Mesh\(batch=4, model=2\)\)\. "
        r"Use a global batch that is a multiple of 4, or pass pad=True",
    ):
        list(DTensorDataset([{"x": np.ones((6, 2))}], mesh, batch_dim="batch"))


def test_layouts_tree_of_the_wrong_size(mesh):
    layouts = {"x": Layout(["batch", U], mesh)}
    with pytest.raises(
        LayoutError,
        match=r"the layouts tree has 1 leaves but a batch has 2; give one layout per array",
    ):
        list(DTensorDataset([{"x": np.ones((8, 2)), "y": np.ones((8,))}], mesh, layouts))


def test_layout_that_does_not_fit_the_batch(mesh):
    with pytest.raises(LayoutError, match=r"batch\['x'\]"):
        list(DTensorDataset([{"x": np.ones((8, 3))}], mesh, {"x": Layout([U, "model"], mesh)}))


def test_unknown_batch_dim(mesh):
    with pytest.raises(ValueError, match=r"batch_dim.*'data'"):
        DTensorDataset([], mesh, batch_dim="data")
