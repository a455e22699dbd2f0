"""Tests for dtensor.core.layout: constructors, views, equality, text form, bad input."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from dtensor import UNSHARDED, Layout, LayoutError, ReduceOp, create_mesh


@pytest.fixture(scope="module")
def mesh():
    return create_mesh([("batch", 4), ("model", 2)])


@pytest.fixture(scope="module")
def mesh3():
    return create_mesh([("data", 2), ("fsdp", 2), ("tensor", 2)])


# ------------------------------------------------------------- constructors
def test_plain_constructor_normalises_specs(mesh):
    layout = Layout(["batch", None], mesh)
    assert layout.sharding_specs == ("batch", UNSHARDED)
    assert layout.mesh == mesh
    assert layout.rank == 2
    assert layout.partial_axes == ()
    # None, UNSHARDED, () and a one-axis tuple are spellings of the same thing.
    assert Layout([("batch",), ()], mesh) == layout
    assert Layout(("batch", UNSHARDED), mesh) == layout


def test_replicated(mesh):
    layout = Layout.replicated(mesh, 3)
    assert layout.sharding_specs == (UNSHARDED,) * 3
    assert layout.is_fully_replicated()
    assert layout.partition_spec == P(None, None, None)
    assert [layout.num_shards(d) for d in range(3)] == [1, 1, 1]
    assert layout.local_shape((5, 6, 7)) == (5, 6, 7)
    assert Layout.replicated(mesh, 0).sharding_specs == ()


def test_batch_sharded(mesh):
    layout = Layout.batch_sharded(mesh, "batch", 3)
    assert layout.sharding_specs == ("batch", UNSHARDED, UNSHARDED)
    assert Layout.batch_sharded(mesh, "batch", 3, axis=1).sharding_specs == (
        UNSHARDED,
        "batch",
        UNSHARDED,
    )
    assert Layout.batch_sharded(mesh, "batch", 3, axis=-1).sharding_specs == (
        UNSHARDED,
        UNSHARDED,
        "batch",
    )
    two = Layout.batch_sharded(mesh, ("batch", "model"), 2)
    assert two.sharding_specs == (("batch", "model"), UNSHARDED)
    assert two.num_shards(0) == 8
    assert not layout.is_fully_replicated()


def test_inner_sharded(mesh):
    layout = Layout.inner_sharded(mesh, "model", 3)
    assert layout.sharding_specs == (UNSHARDED, UNSHARDED, "model")
    assert layout.partition_spec == P(None, None, "model")
    assert layout.local_shape((4, 4, 6)) == (4, 4, 3)
    assert Layout.inner_sharded(mesh, "batch", 1) == Layout(["batch"], mesh)


def test_partial(mesh):
    layout = Layout.partial(mesh, "model", rank=2)
    assert layout.is_partial
    assert layout.partial_axes == ("model",)
    assert layout.reduce_op is ReduceOp.SUM
    assert not layout.is_fully_replicated()  # each device holds only a part of the sum
    assert layout.partition_spec == P(None, None)
    assert (
        repr(layout)
        == "Layout([UNSHARDED, UNSHARDED], mesh=Mesh(batch=4, model=2), partial=sum('model'))"
    )
    sharded = Layout.partial(mesh, ["model"], sharding_specs=["batch", None], op="max")
    assert sharded.sharding_specs == ("batch", UNSHARDED)
    assert sharded.reduce_op is ReduceOp.MAX
    assert sharded.unreduced() == Layout(["batch", None], mesh)
    assert sharded != Layout(["batch", None], mesh)
    assert sharded != Layout.partial(mesh, "model", sharding_specs=["batch", None], op="min")
    # Partial axes form a set, kept in mesh order.
    assert Layout.partial(mesh, ["model", "batch"], rank=1) == Layout.partial(
        mesh, ["batch", "model"], rank=1
    )
    assert Layout.partial(mesh, ["model", "batch"], rank=1).partial_axes == ("batch", "model")


def test_reduce_op_is_ignored_without_partial_axes(mesh):
    assert Layout(["batch"], mesh, reduce_op="max") == Layout(["batch"], mesh)
    assert hash(Layout(["batch"], mesh, reduce_op="min")) == hash(Layout(["batch"], mesh))


def test_from_sharding_named(mesh):
    layout = Layout(["batch", "model"], mesh)
    assert Layout.from_sharding(layout.sharding) == layout
    assert Layout.from_sharding(NamedSharding(mesh.jax_mesh, P(("batch", "model")))) == Layout(
        [("batch", "model")], mesh
    )


def test_from_sharding_shorter_spec_needs_rank(mesh):
    s = NamedSharding(mesh.jax_mesh, P("batch"))
    assert Layout.from_sharding(s).sharding_specs == ("batch",)
    assert Layout.from_sharding(s, rank=3) == Layout(["batch", None, None], mesh)
    assert Layout.from_sharding(NamedSharding(mesh.jax_mesh, P()), rank=2) == Layout.replicated(
        mesh, 2
    )


def test_from_sharding_of_array(mesh):
    x = jax.device_put(jax.numpy.zeros((8, 4)), NamedSharding(mesh.jax_mesh, P(None, "model")))
    assert Layout.from_sharding(x.sharding, rank=x.ndim) == Layout([None, "model"], mesh)


def test_from_sharding_single_device():
    device = jax.devices()[3]
    layout = Layout.from_sharding(SingleDeviceSharding(device), rank=2)
    assert layout.mesh.shape == {"device": 1}
    assert layout.mesh.device_list == [device]
    assert layout.is_fully_replicated()
    assert layout.rank == 2
    with pytest.raises(LayoutError, match=r"single-device sharding needs rank="):
        Layout.from_sharding(SingleDeviceSharding(device))


def test_from_sharding_bad_input(mesh):
    with pytest.raises(LayoutError, match=r"has 3 entries but rank is 2"):
        Layout.from_sharding(NamedSharding(mesh.jax_mesh, P("batch", None, None)), rank=2)
    with pytest.raises(TypeError, match=r"cannot read a Layout from a P;.*NamedSharding"):
        Layout.from_sharding(P("batch"))  # type: ignore[arg-type]
    with mesh:
        abstract = NamedSharding(jax.sharding.get_abstract_mesh(), P("batch"))
    with pytest.raises(LayoutError, match=r"over an abstract mesh"):
        Layout.from_sharding(abstract)


# ------------------------------------------------------------------ views
def test_partition_spec_and_sharding(mesh):
    layout = Layout([("batch", "model"), None], mesh)
    assert layout.partition_spec == P(("batch", "model"), None)
    s = layout.sharding
    assert isinstance(s, NamedSharding)
    assert s.mesh == mesh.jax_mesh
    assert s.spec == P(("batch", "model"), None)
    # The sharding really splits dimension 0 in 8, batch-major.
    indices = s.devices_indices_map((16, 3))
    starts = {d.id: idx[0].start for d, idx in indices.items()}
    assert starts == {i: 2 * i for i in range(8)}


def test_multi_axis_dim(mesh3):
    layout = Layout([("data", "fsdp"), "tensor"], mesh3)
    assert layout.sharding_specs == (("data", "fsdp"), "tensor")
    assert layout.axes(0) == ("data", "fsdp")
    assert layout.axes(1) == ("tensor",)
    assert layout.num_shards(0) == 4
    assert layout.num_shards(-1) == 2
    assert layout.local_shape((8, 6)) == (2, 3)
    assert layout.global_shape((2, 3)) == (8, 6)
    # Order matters: ("fsdp", "data") splits the same dimension in another device order.
    other = Layout([("fsdp", "data"), "tensor"], mesh3)
    assert other != layout
    assert (
        repr(layout) == "Layout([('data', 'fsdp'), 'tensor'], mesh=Mesh(data=2, fsdp=2, tensor=2))"
    )


def test_num_shards_local_shape(mesh):
    layout = Layout(["batch", None, "model"], mesh)
    assert [layout.num_shards(d) for d in range(3)] == [4, 1, 2]
    assert layout.local_shape((8, 5, 6)) == (2, 5, 3)
    assert layout.global_shape((2, 5, 3)) == (8, 5, 6)
    with pytest.raises(LayoutError, match=r"dimension 3 is out of range for a rank-3 layout"):
        layout.num_shards(3)


def test_is_fully_replicated(mesh):
    assert Layout([None, None], mesh).is_fully_replicated()
    assert not Layout([None, "model"], mesh).is_fully_replicated()
    assert not Layout.partial(mesh, "batch", rank=2).is_fully_replicated()


def test_hashable_and_equality(mesh):
    a = Layout(["batch", None], mesh)
    b = Layout(["batch", UNSHARDED], create_mesh([("batch", 4), ("model", 2)]))
    c = Layout([None, "batch"], mesh)
    d = Layout(["batch", None], mesh.with_axis_types("explicit"))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a != d  # Auto and Explicit meshes differ, so do their layouts.
    assert len({a, b, c, d}) == 3
    with pytest.raises(AttributeError):
        a.mesh = mesh  # type: ignore[misc]
    f = jax.jit(lambda x, layout: x * layout.num_shards(0), static_argnums=1)
    assert float(f(1.0, a)) == 4.0


def test_repr(mesh):
    assert (
        repr(Layout(["batch", None], mesh))
        == "Layout(['batch', UNSHARDED], mesh=Mesh(batch=4, model=2))"
    )
    explicit = mesh.with_axis_types("explicit")
    assert (
        repr(Layout([None], explicit))
        == "Layout([UNSHARDED], mesh=Mesh(batch=4, model=2, axis_types='explicit'))"
    )


def test_with_mesh(mesh):
    other = create_mesh([("batch", 2), ("model", 4)])
    assert Layout(["batch", "model"], mesh).with_mesh(other) == Layout(["batch", "model"], other)


# --------------------------------------------------------------- text form
def test_to_string_exact(mesh):
    text = Layout(["batch", None], mesh).to_string()
    assert text == "sharding_specs:batch,unsharded, mesh:|batch=4,model=2|0,1,2,3,4,5,6,7|auto"


@pytest.mark.parametrize(
    "specs",
    [
        ["batch", None],
        [None, "model"],
        [("batch", "model"), None],
        [None, None, None],
        [],
        [("model", "batch")],
    ],
)
@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_string_round_trip(specs, axis_types):
    devices = [jax.devices()[i] for i in (3, 1, 2, 0, 7, 6, 5, 4)]
    mesh = create_mesh([("batch", 4), ("model", 2)], devices=devices, axis_types=axis_types)
    if not specs:
        with pytest.raises(LayoutError, match=r"malformed"):
            Layout.from_string(Layout(specs, mesh).to_string())
        return
    layout = Layout(specs, mesh)
    text = layout.to_string()
    assert "|3,1,2,0,7,6,5,4|" in text
    assert Layout.from_string(text) == layout
    assert Layout.from_string(text).mesh.device_list == devices


def test_string_round_trip_partial(mesh):
    layout = Layout.partial(mesh, "model", sharding_specs=["batch", None], op="max")
    text = layout.to_string()
    assert text.endswith(", partial:max(model)")
    assert Layout.from_string(text) == layout


def test_from_string_short_forms(mesh):
    assert Layout.from_string("batch,unsharded", mesh) == Layout(["batch", None], mesh)
    assert Layout.from_string("sharding_specs:unsharded,batch+model", mesh) == Layout(
        [None, ("batch", "model")], mesh
    )
    assert Layout.from_string("  batch , unsharded ", mesh) == Layout(["batch", None], mesh)


def test_from_string_with_devices():
    devices = jax.devices()[4:]
    mesh = create_mesh([("x", 4)], devices=devices)
    text = Layout(["x"], mesh).to_string()
    assert Layout.from_string(text, devices=devices) == Layout(["x"], mesh)
    with pytest.raises(
        LayoutError, match=r"names devices \[4, 5, 6, 7\] that are not present \(2 devices exist\)"
    ):
        Layout.from_string(text, devices=jax.devices()[:2])


# ------------------------------------------------------------------ bad input
def test_axis_not_in_mesh_names_it(mesh):
    with pytest.raises(
        LayoutError, match=r"dimension 1 names mesh axis 'modle'.*\('batch', 'model'\).*UNSHARDED"
    ):
        Layout([None, "modle"], mesh)
    with pytest.raises(LayoutError, match=r"mesh axis 'fsdp'"):
        Layout([("batch", "fsdp")], mesh)
    assert issubclass(LayoutError, ValueError)


def test_one_mesh_axis_for_two_dims(mesh):
    with pytest.raises(LayoutError, match=r"mesh axis 'batch' for dimensions 0 and 2"):
        Layout(["batch", None, "batch"], mesh)
    with pytest.raises(LayoutError, match=r"mesh axis 'model' for dimensions 0 and 1"):
        Layout([("batch", "model"), "model"], mesh)
    with pytest.raises(LayoutError, match=r"mesh axis 'batch' for dimensions 0 and 0"):
        Layout([("batch", "batch")], mesh)


def test_non_divisible_dim_names_both_sizes(mesh):
    layout = Layout(["batch", "model"], mesh)
    with pytest.raises(
        LayoutError, match=r"dimension 0 has size 6, which does not divide into the 4 shards"
    ):
        layout.local_shape((6, 4))
    with pytest.raises(
        LayoutError, match=r"params/w dimension 1 has size 3.*2 shards.*multiple of 2"
    ):
        layout.check_shape((8, 3), "params/w")


def test_rank_mismatch_names_both_ranks(mesh):
    layout = Layout(["batch", None], mesh)
    with pytest.raises(
        LayoutError, match=r"has rank 3 \(shape \(8, 2, 2\)\) but the layout .* has rank 2"
    ):
        layout.check_shape((8, 2, 2))
    with pytest.raises(LayoutError, match=r"rank 1 but the layout has rank 2"):
        layout.global_shape((8,))


def test_bad_spec_values(mesh):
    with pytest.raises(TypeError, match=r"sharding_specs='batch' is a string"):
        Layout("batch", mesh)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"dimension 1 has spec 3"):
        Layout(["batch", 3], mesh)  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"needs a dtensor.Mesh, got Mesh"):
        Layout(["batch"], mesh.jax_mesh)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"axis=2 is out of range for rank 2"):
        Layout.batch_sharded(mesh, "batch", 2, axis=2)


def test_bad_partial(mesh):
    with pytest.raises(LayoutError, match=r"partial axis 'x' is not an axis"):
        Layout.partial(mesh, "x", rank=1)
    with pytest.raises(LayoutError, match=r"'batch' is both partial and splits dimension 0"):
        Layout.partial(mesh, "batch", sharding_specs=["batch"])
    with pytest.raises(LayoutError, match=r"reduce_op is SUM, MAX or MIN"):
        Layout.partial(mesh, "batch", rank=1, op=ReduceOp.MEAN)
    with pytest.raises(LayoutError, match=r"needs rank= or sharding_specs="):
        Layout.partial(mesh, "batch")
    with pytest.raises(ValueError, match=r"reduce op 'avg' is not one of SUM, MEAN, MAX, MIN"):
        Layout.partial(mesh, "batch", rank=1, op="avg")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   ",
        "sharding_specs:",
        "batch|model",
        "sharding_specs:batch, mesh:|batch=4|0,1,2,3|manual",
    ],
)
def test_empty_or_malformed_string(mesh, text):
    with pytest.raises(
        LayoutError, match=r"layout string .* is malformed; expected 'sharding_specs:"
    ):
        Layout.from_string(text)
    with pytest.raises(LayoutError, match=r"is malformed"):
        Layout.from_string(text, mesh)


def test_malformed_string_parts(mesh):
    with pytest.raises(LayoutError, match=r"'batch,,model' has an empty dimension spec"):
        Layout.from_string("batch,,model", mesh)
    with pytest.raises(LayoutError, match=r"has no mesh part; pass mesh="):
        Layout.from_string("batch,unsharded")
    with pytest.raises(LayoutError, match=r"malformed mesh part"):
        Layout.from_string("sharding_specs:batch, mesh:|batch=four|0,1,2,3|auto")
    with pytest.raises(LayoutError, match=r"mesh sizes \(4,\) do not match 3 device ids"):
        Layout.from_string("sharding_specs:batch, mesh:|batch=4|0,1,2|auto")
    with pytest.raises(LayoutError, match=r"names mesh axis 'fsdp'"):
        Layout.from_string("fsdp,unsharded", mesh)
    with pytest.raises(LayoutError, match=r"is malformed"):
        Layout.from_string(None)  # type: ignore[arg-type]
