"""Tests for dtensor.core.mesh: create_mesh, Mesh views, the mesh context, axis types."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.sharding import AxisType

import dtensor
from dtensor import Mesh, MeshError, create_mesh, current_mesh
from dtensor.core.mesh import arrange_devices


def test_create_mesh_shape_names_size_devices():
    mesh = create_mesh([("batch", 4), ("model", 2)])
    assert mesh.dim_names == ("batch", "model")
    assert mesh.shape == {"batch": 4, "model": 2}
    assert list(mesh.shape) == ["batch", "model"]  # axis order kept
    assert mesh.size == 8
    assert mesh.devices.shape == (4, 2)
    # Row-major over the axes: mesh order is jax.devices() order.
    assert [d.id for d in mesh.device_list] == [d.id for d in jax.devices()]
    assert [d.id for d in mesh.devices[1]] == [2, 3]
    assert mesh.local_devices == mesh.device_list
    assert isinstance(mesh.jax_mesh, jax.sharding.Mesh)
    assert mesh.jax_mesh.axis_names == ("batch", "model")
    assert mesh.platform == "cpu"
    assert mesh.is_multi_process is False
    assert mesh.axis_size("batch") == 4
    assert mesh.axis_size(("batch", "model")) == 8
    assert mesh.axis_size(None) == 1


@pytest.mark.parametrize(
    ("dims", "expected"),
    [
        ([("data", -1), ("model", 2)], {"data": 4, "model": 2}),
        ([("data", 2), ("model", -1)], {"data": 2, "model": 4}),
        ([("x", -1)], {"x": 8}),
        ([("a", 2), ("b", -1), ("c", 2)], {"a": 2, "b": 2, "c": 2}),
    ],
)
def test_minus_one_is_inferred(dims, expected):
    assert create_mesh(dims).shape == expected


def test_dict_form_equals_list_form():
    assert create_mesh({"data": 2, "model": -1}) == create_mesh([("data", 2), ("model", 4)])
    assert create_mesh({"data": 2, "model": 4}).dim_names == ("data", "model")


def test_smaller_mesh_uses_first_devices_and_explicit_devices_keep_order():
    assert [d.id for d in create_mesh([("x", 3)]).device_list] == [0, 1, 2]
    devices = [jax.devices()[i] for i in (7, 5, 3, 1)]
    mesh = create_mesh([("a", 2), ("b", 2)], devices=devices)
    assert [[d.id for d in row] for row in mesh.devices] == [[7, 5], [3, 1]]
    # -1 inferred from the given devices, not from all devices.
    assert create_mesh([("x", -1)], devices=devices).shape == {"x": 4}


def test_with_mesh_sets_current_and_jax_mesh():
    mesh = create_mesh([("batch", 4), ("model", 2)])
    assert current_mesh() is None
    with mesh as entered:
        assert entered is mesh
        assert current_mesh() == mesh
        abstract = jax.sharding.get_abstract_mesh()
        assert abstract.axis_names == ("batch", "model")
        assert dict(abstract.shape) == {"batch": 4, "model": 2}
        assert tuple(abstract.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert current_mesh() is None
    assert jax.sharding.get_abstract_mesh().axis_names == ()


def test_nested_mesh_contexts_restore_outer_even_on_error():
    outer = create_mesh([("x", 8)])
    inner = create_mesh([("y", 2)], axis_types="explicit")
    with outer:
        with pytest.raises(RuntimeError, match="boom"), inner:
            assert current_mesh() == inner
            assert jax.sharding.get_abstract_mesh().axis_names == ("y",)
            assert tuple(jax.sharding.get_abstract_mesh().axis_types) == (AxisType.Explicit,)
            raise RuntimeError("boom")
        assert current_mesh() == outer
        assert jax.sharding.get_abstract_mesh().axis_names == ("x",)
    assert current_mesh() is None


def test_mesh_context_is_per_thread():
    import threading

    mesh = create_mesh([("x", 8)])
    seen = []
    with mesh:
        t = threading.Thread(target=lambda: seen.append(current_mesh()))
        t.start()
        t.join()
    assert seen == [None]


def test_auto_and_explicit_axis_types():
    auto = create_mesh([("a", 4), ("b", 2)])
    explicit = create_mesh([("a", 4), ("b", 2)], axis_types="explicit")
    assert auto.axis_types == "auto"
    assert explicit.axis_types == "explicit"
    assert tuple(auto.jax_mesh.axis_types) == (AxisType.Auto, AxisType.Auto)
    assert tuple(explicit.jax_mesh.axis_types) == (AxisType.Explicit, AxisType.Explicit)
    assert auto != explicit
    assert repr(auto) == "Mesh(a=4, b=2)"
    assert repr(explicit) == "Mesh(a=4, b=2, axis_types='explicit')"
    assert auto.with_axis_types("explicit") == explicit
    assert explicit.with_axis_types("auto") == auto


def test_mesh_is_hashable_value():
    a = create_mesh([("a", 4), ("b", 2)])
    b = create_mesh({"a": 4, "b": 2})
    c = create_mesh([("a", 2), ("b", 4)])
    d = create_mesh([("a", 4), ("b", 2)], axis_types="explicit")
    assert a == b and hash(a) == hash(b)
    assert len({a, b, c, d}) == 3
    assert {a: 1}[b] == 1
    with pytest.raises(AttributeError):
        a.jax_mesh = c.jax_mesh  # type: ignore[misc]
    # Usable as a jit static argument.
    f = jax.jit(lambda x, mesh: x * mesh.size, static_argnums=1)
    assert float(f(1.0, a)) == 8.0


def test_from_jax_wraps_existing_mesh():
    jm = jax.sharding.Mesh(
        np.array(jax.devices()).reshape(2, 4), ("p", "q"), axis_types=(AxisType.Auto,) * 2
    )
    mesh = Mesh.from_jax(jm)
    assert mesh == Mesh(jm)
    assert mesh.shape == {"p": 2, "q": 4}
    assert mesh == create_mesh([("p", 2), ("q", 4)])


# ----------------------------------------------------------------- bad input
def test_mesh_larger_than_devices_names_both_counts():
    with pytest.raises(MeshError, match=r"needs 16 devices but only 8 exist"):
        create_mesh([("batch", 8), ("model", 2)])
    with pytest.raises(MeshError, match=r"needs 4 devices but only 2 were given"):
        create_mesh([("x", 4)], devices=jax.devices()[:2])
    assert issubclass(MeshError, ValueError)


def test_minus_one_that_does_not_divide():
    with pytest.raises(MeshError, match=r"'a'.*8 devices.*product 3"):
        create_mesh([("a", -1), ("b", 3)])


def test_two_minus_ones():
    with pytest.raises(MeshError, match=r"\('a', 'b'\) all have size -1"):
        create_mesh([("a", -1), ("b", -1)])


@pytest.mark.parametrize(
    ("dims", "match"),
    [
        ([], r"mesh_dims is empty"),
        ({}, r"mesh_dims is empty"),
        ([("a", 0)], r"mesh axis 'a' has size 0"),
        ([("a", -2)], r"mesh axis 'a' has size -2"),
        ([("a", 2.0)], r"mesh axis 'a' has size 2.0"),
        (["a"], r"entry 'a' is not a \(name, size\) pair"),
        ([(1, 2)], r"entry \(1, 2\) is not a \(name, size\) pair"),
        ([("a", 2), ("a", 4)], r"\('a', 'a'\) repeat a name"),
    ],
)
def test_malformed_mesh_dims(dims, match):
    with pytest.raises(MeshError, match=match):
        create_mesh(dims)


def test_empty_devices():
    with pytest.raises(MeshError, match=r"devices is empty"):
        create_mesh([("x", 1)], devices=[])


def test_bad_axis_types():
    with pytest.raises(ValueError, match=r"axis_types='manual' is not valid.*'auto'.*'explicit'"):
        create_mesh([("x", 8)], axis_types="manual")  # type: ignore[arg-type]


def test_mesh_wraps_only_jax_meshes():
    with pytest.raises(TypeError, match=r"got list.*create_mesh"):
        Mesh([1, 2])  # type: ignore[arg-type]


def test_axis_size_unknown_axis_names_it():
    mesh = create_mesh([("batch", 8)])
    with pytest.raises(MeshError, match=r"'batc' is not an axis of Mesh\(batch=8\).*\('batch',\)"):
        mesh.axis_size("batc")


def test_public_names_exported():
    for name in ("Mesh", "create_mesh", "current_mesh", "MeshError"):
        assert name in dtensor.__all__


# ------------------------------------------------- mixed axis types, jax.set_mesh, arrangement
def test_mixed_auto_and_explicit_axes_are_rejected_naming_each_axis():
    devices = np.asarray(jax.devices()).reshape(4, 2)
    mixed = jax.sharding.Mesh(
        devices, ("batch", "model"), axis_types=(AxisType.Auto, AxisType.Explicit)
    )
    with pytest.raises(MeshError, match=r"mix Auto and Explicit.*batch=Auto, model=Explicit"):
        Mesh.from_jax(mixed)


def test_current_mesh_honours_jax_set_mesh():
    mesh = create_mesh([("x", 4), ("y", 2)])
    other = create_mesh([("z", 8)])
    assert current_mesh() is None
    with jax.set_mesh(mesh.jax_mesh):
        assert current_mesh() == mesh
        with other:  # the innermost wins
            assert current_mesh() == other
        assert current_mesh() == mesh
    with other, jax.set_mesh(mesh.jax_mesh):
        assert current_mesh() == mesh
    assert current_mesh() is None


def test_current_mesh_rejects_a_jax_mesh_with_mixed_axis_types():
    devices = np.asarray(jax.devices()).reshape(4, 2)
    mixed = jax.sharding.Mesh(devices, ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with jax.set_mesh(mixed), pytest.raises(MeshError, match="mix Auto and Explicit"):
        current_mesh()


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """A TPU chip as mesh_utils sees it (as JAX's own mesh_utils tests mock them)."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int = 0
    process_index: int = 0
    slice_index: int = 0
    platform: str = "tpu"
    device_kind: str = "TPU v4"


def _v4_cube() -> list[FakeTpu]:
    """A 2x2x2 v4 slice, listed in an order unrelated to the chip grid."""
    coords = [(x, y, z) for z in range(2) for y in range(2) for x in range(2)]
    return [FakeTpu(id=i, coords=c) for i, c in enumerate(reversed(coords))]


def test_tpu_devices_are_arranged_by_topology_without_warning(recwarn):
    devices = _v4_cube()
    arr = arrange_devices((2, 4), devices)
    expected = mesh_utils.create_device_mesh((2, 4), devices)
    assert [d.id for d in arr.flat] == [d.id for d in expected.flat]
    assert not [w for w in recwarn if issubclass(w.category, UserWarning)]


def test_tpu_arrangement_failure_warns_with_the_order_used_instead():
    broken = [dataclasses.replace(d, device_kind="TPU v99") for d in _v4_cube()][:6]
    with pytest.warns(UserWarning, match=r"cannot lay mesh shape \(2, 3\).*order given"):
        arr = arrange_devices((2, 3), broken)
    assert [d.id for d in arr.flat] == [d.id for d in broken]


def test_cpu_devices_keep_their_order_without_warning(recwarn):
    devices = list(reversed(jax.devices()))
    arr = arrange_devices((4, 2), devices)
    assert [d.id for d in arr.flat] == [d.id for d in devices]
    assert not recwarn.list


def test_current_mesh_inside_jit_is_the_dtensor_block_only():
    mesh = create_mesh([("x", 8)])
    seen = []

    @jax.jit
    def f(x):
        seen.append(current_mesh())
        return x + 1

    with mesh:
        f(np.zeros(8, np.float32))
    with jax.set_mesh(mesh.jax_mesh):  # JAX shows only the abstract mesh inside a trace
        f(np.zeros(4, np.float32))
    assert seen == [mesh, None]
