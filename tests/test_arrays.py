"""Tests for dtensor.core.arrays: relayout, pack/unpack, fetch/check_layout, call_with_layout, copy_to_mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtensor import (
    Layout,
    LayoutError,
    call_with_layout,
    check_layout,
    copy_to_mesh,
    create_mesh,
    fetch_layout,
    pack,
    relayout,
    unpack,
)


@pytest.fixture(scope="module", params=["auto", "explicit"])
def mesh(request):
    return create_mesh([("batch", 4), ("model", 2)], axis_types=request.param)


def _host(shape, dtype=np.float32):
    return np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)


def _shards_by_id(x):
    return {s.device.id: np.asarray(s.data) for s in x.addressable_shards}


# ------------------------------------------------------------------ relayout
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (["batch", None], [None, "model"]),
        (["batch", None], [("batch", "model"), None]),
        ([None, None], ["model", "batch"]),
        (["model", "batch"], [None, None]),
    ],
)
def test_relayout_eager_moves_data(mesh, src, dst):
    host = _host((8, 4))
    x = copy_to_mesh(host, Layout(src, mesh))
    target = Layout(dst, mesh)
    y = relayout(x, target)
    assert fetch_layout(y) == target
    np.testing.assert_array_equal(np.asarray(y), host)
    # Each device holds exactly its block under the new layout.
    index_map = target.sharding.devices_indices_map(host.shape)
    for device_id, block in _shards_by_id(y).items():
        (device,) = [d for d in index_map if d.id == device_id]
        np.testing.assert_array_equal(block, host[index_map[device]])
        assert block.shape == target.local_shape(host.shape)


def test_relayout_host_data_copies_to_mesh(mesh):
    host = _host((8, 2))
    y = relayout(host, Layout(["batch", None], mesh))
    assert isinstance(y, jax.Array)
    assert fetch_layout(y) == Layout(["batch", None], mesh)
    np.testing.assert_array_equal(np.asarray(y), host)


def test_relayout_across_meshes():
    auto = create_mesh([("batch", 4), ("model", 2)])
    other = create_mesh([("x", 2)], devices=jax.devices()[6:])
    host = _host((4, 6))
    x = copy_to_mesh(host, Layout(["batch", "model"], auto))
    y = relayout(x, Layout([None, "x"], other))
    assert {s.device.id for s in y.addressable_shards} == {6, 7}
    np.testing.assert_array_equal(np.asarray(y), host)


def test_relayout_inside_jit_is_a_constraint(mesh):
    host = _host((8, 4))
    x = copy_to_mesh(host, Layout(["batch", None], mesh))
    target = Layout([None, "model"], mesh)

    def f(a):
        return relayout(a * 2.0, target)

    jitted = jax.jit(f)
    compiled = jitted.lower(x).compile()
    out_sharding = compiled.output_shardings
    assert Layout.from_sharding(out_sharding, rank=2) == target
    y = jitted(x)
    assert fetch_layout(y) == target
    np.testing.assert_array_equal(np.asarray(y), host * 2)
    # Without the constraint the compiler keeps the input's layout: the test can fail.
    plain = jax.jit(lambda a: a * 2.0).lower(x).compile().output_shardings
    assert Layout.from_sharding(plain, rank=2) != target


def test_relayout_inside_jit_uses_the_right_primitive(mesh):
    x = copy_to_mesh(_host((8, 4)), Layout(["batch", None], mesh))
    jaxpr = str(jax.make_jaxpr(lambda a: relayout(a, Layout([None, "model"], mesh)))(x))
    if mesh.axis_types == "explicit":
        assert "reshard" in jaxpr and "sharding_constraint" not in jaxpr
    else:
        assert "sharding_constraint" in jaxpr


def test_relayout_bad_input(mesh):
    x = copy_to_mesh(_host((8, 4)), Layout(["batch", None], mesh))
    with pytest.raises(
        LayoutError, match=r"params/w has rank 2 \(shape \(8, 4\)\) but the layout .* has rank 3"
    ):
        relayout(x, Layout([None, None, None], mesh), name="params/w")
    with pytest.raises(
        LayoutError, match=r"dimension 1 has size 4, which does not divide into the 8 shards"
    ):
        relayout(x, Layout([None, ("batch", "model")], mesh))
    with pytest.raises(TypeError, match=r"needs a dtensor.Layout, got NamedSharding"):
        relayout(x, Layout([None, None], mesh).sharding)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"cannot relayout array \*to\* the partial layout"):
        relayout(x, Layout.partial(mesh, "model", sharding_specs=["batch", None]))
    with pytest.raises(LayoutError, match=r"has rank 2 .* has rank 1"):
        jax.jit(lambda a: relayout(a, Layout(["batch"], mesh)))(x)


# ------------------------------------------------------------- pack / unpack
def test_pack_device_order_is_mesh_order(mesh):
    layout = Layout(["batch", "model"], mesh)
    blocks = [np.full((2, 3), i, np.float32) for i in range(8)]
    x = pack(blocks, layout)
    assert x.shape == (8, 6)
    assert fetch_layout(x) == layout
    by_id = _shards_by_id(x)
    for i, device in enumerate(mesh.device_list):
        np.testing.assert_array_equal(by_id[device.id], blocks[i])
    # Mesh position (b, m) holds rows 2b:2b+2 and columns 3m:3m+3.
    host = np.asarray(x)
    for b in range(4):
        for m in range(2):
            assert (host[2 * b : 2 * b + 2, 3 * m : 3 * m + 3] == 2 * b + m).all()


def test_pack_follows_a_permuted_mesh():
    devices = [jax.devices()[i] for i in (7, 6, 5, 4, 3, 2, 1, 0)]
    mesh = create_mesh([("x", 8)], devices=devices)
    x = pack([np.array([i], np.int32) for i in range(8)], Layout(["x"], mesh))
    np.testing.assert_array_equal(np.asarray(x), np.arange(8))
    assert _shards_by_id(x)[7].tolist() == [0]
    assert _shards_by_id(x)[0].tolist() == [7]
    assert [int(b[0]) for b in unpack(x)] == list(range(8))


def test_pack_replicated_copies(mesh):
    layout = Layout(["batch", None], mesh)  # "model" replicates each block twice
    blocks = [np.full((1, 2), i // 2, np.float32) for i in range(8)]
    x = pack(blocks, layout)
    np.testing.assert_array_equal(np.asarray(x)[:, 0], [0, 1, 2, 3])
    bad = [np.full((1, 2), i, np.float32) for i in range(8)]
    with pytest.raises(
        LayoutError,
        match=r"different blocks 0 and 1 for devices 0 and 1, which hold the same block",
    ):
        pack(bad, layout)
    # NaN copies are equal copies.
    nan = [np.full((1, 2), np.nan, np.float32)] * 8
    assert np.isnan(np.asarray(pack(nan, layout))).all()


def test_unpack_blocks_in_mesh_order(mesh):
    host = _host((8, 4))
    layout = Layout(["batch", "model"], mesh)
    x = copy_to_mesh(host, layout)
    blocks = unpack(x)
    assert len(blocks) == 8
    for i, block in enumerate(blocks):
        b, m = divmod(i, 2)
        np.testing.assert_array_equal(np.asarray(block), host[2 * b : 2 * b + 2, 2 * m : 2 * m + 2])
        assert list(block.devices()) == [mesh.device_list[i]]
    replicated = unpack(copy_to_mesh(host, Layout.replicated(mesh, 2)))
    for block in replicated:
        np.testing.assert_array_equal(np.asarray(block), host)


def test_pack_unpack_round_trip(mesh):
    host = _host((8, 8), np.int32)
    for specs in (["batch", "model"], [("batch", "model"), None], [None, "batch"], [None, None]):
        layout = Layout(specs, mesh)
        x = copy_to_mesh(host, layout)
        y = pack(unpack(x), layout)
        assert fetch_layout(y) == layout
        np.testing.assert_array_equal(np.asarray(y), host)


def test_pack_bad_input(mesh):
    layout = Layout(["batch", None], mesh)
    with pytest.raises(LayoutError, match=r"got 3 blocks, but .* has 8 devices"):
        pack([np.zeros((1, 2))] * 3, layout)
    with pytest.raises(LayoutError, match=r"blocks of different shapes \[\(1, 2\), \(1, 3\)\]"):
        pack([np.zeros((1, 2))] * 7 + [np.zeros((1, 3))], layout)
    with pytest.raises(
        LayoutError, match=r"local shape \(2,\) has rank 1 but the layout has rank 2"
    ):
        pack([np.zeros((2,))] * 8, layout)


# ----------------------------------------------------------- fetch / check
def test_fetch_layout(mesh):
    layout = Layout([None, ("batch", "model")], mesh)
    x = copy_to_mesh(_host((3, 16)), layout)
    assert fetch_layout(x) == layout
    single = jnp.arange(4.0)
    got = fetch_layout(single)
    assert got.mesh.device_list == list(single.devices())
    assert got.is_fully_replicated() and got.rank == 1
    with pytest.raises(TypeError, match=r"needs a jax.Array, got ndarray.*copy_to_mesh"):
        fetch_layout(np.zeros(3))


def test_fetch_layout_inside_jit(mesh):
    layout = Layout(["batch", None], mesh)
    x = copy_to_mesh(_host((8, 2)), layout)
    seen = []

    def f(a):
        seen.append(fetch_layout(a))
        return a

    if mesh.axis_types == "explicit":
        with mesh:
            jax.jit(f)(x)
        assert seen == [layout]
        with pytest.raises(LayoutError, match=r"not the current one.*`with mesh:`"):
            jax.jit(lambda a: fetch_layout(a))(x)
    else:
        with pytest.raises(
            LayoutError, match=r"on Auto mesh axes its layout is decided by the compiler"
        ):
            jax.jit(f)(x)


def test_check_layout_pass_and_fail(mesh):
    layout = Layout(["batch", None], mesh)
    x = copy_to_mesh(_host((8, 2)), layout)
    check_layout(x, layout)  # passes
    check_layout(
        x,
        Layout(
            ["batch", None], create_mesh([("batch", 4), ("model", 2)], axis_types=mesh.axis_types)
        ),
    )
    with pytest.raises(
        LayoutError,
        match=r"opt/mu has layout Layout\(\['batch', UNSHARDED\].*but Layout\(\[UNSHARDED, 'model'\]",
    ):
        check_layout(x, Layout([None, "model"], mesh), name="opt/mu")
    with pytest.raises(LayoutError, match=r"rank 2 .* rank 1"):
        check_layout(x, Layout(["batch"], mesh))


def test_check_layout_accepts_equivalent_sharding():
    mesh = create_mesh([("x", 8), ("one", 1)])
    x = copy_to_mesh(_host((8, 2)), Layout(["x", None], mesh))
    check_layout(x, Layout(["x", "one"], mesh))  # a size-1 axis splits nothing
    with pytest.raises(LayoutError, match=r"was expected"):
        check_layout(x, Layout([None, "one"], mesh))


# ---------------------------------------------------------- call_with_layout
def test_call_with_layout_result_layout_and_values(mesh):
    layout = Layout(["batch", "model"], mesh)
    w = call_with_layout(jax.random.normal, layout, jax.random.key(0), (64, 8))
    assert fetch_layout(w) == layout
    np.testing.assert_allclose(
        np.asarray(w), np.asarray(jax.random.normal(jax.random.key(0), (64, 8))), rtol=1e-6
    )


def test_call_with_layout_never_materialises_the_whole_array(monkeypatch):
    mesh = create_mesh([("batch", 4), ("model", 2)])
    layout = Layout(["batch", "model"], mesh)
    real_jit = jax.jit
    made = []

    def spy(fn, **kwargs):
        jitted = real_jit(fn, **kwargs)
        made.append(jitted)
        return jitted

    monkeypatch.setattr(jax, "jit", spy)
    key = jax.random.key(0)
    w = call_with_layout(jax.random.normal, layout, key, (1024, 512))
    monkeypatch.undo()
    assert w.shape == (1024, 512)
    assert len(made) == 1
    stats = made[0].lower(key).compile().memory_analysis()
    full = 1024 * 512 * 4
    # Per device: the output is one block and nothing close to the whole array is held.
    assert stats.output_size_in_bytes == full // 8
    assert stats.output_size_in_bytes + stats.temp_size_in_bytes < full


def test_call_with_layout_tree_of_layouts(mesh):
    def init(key):
        k1, k2 = jax.random.split(key)
        return {"w": jax.random.normal(k1, (8, 4)), "b": jnp.zeros((4,)), "step": 3}

    layouts = {
        "w": Layout(["batch", "model"], mesh),
        "b": Layout(["model"], mesh),
        "step": Layout([], mesh),
    }
    out = call_with_layout(init, layouts, jax.random.key(1))
    assert fetch_layout(out["w"]) == layouts["w"]
    assert fetch_layout(out["b"]) == layouts["b"]
    assert int(out["step"]) == 3
    np.testing.assert_array_equal(np.asarray(out["b"]), np.zeros(4))


def test_call_with_layout_kwargs_and_static_args(mesh):
    layout = Layout([None, "model"], mesh)
    out = call_with_layout(jnp.full, layout, (3, 4), fill_value=np.float32(2.5))
    assert fetch_layout(out) == layout
    np.testing.assert_array_equal(np.asarray(out), np.full((3, 4), 2.5, np.float32))


def test_call_with_layout_bad_input(mesh):
    layout = Layout(["batch", None], mesh)
    with pytest.raises(LayoutError, match=r"output 0 of zeros dimension 0 has size 6.*4 shards"):
        call_with_layout(jnp.zeros, layout, (6, 2))

    def two(key):
        return jnp.zeros((8, 2)), jnp.ones((8, 2))

    with pytest.raises(LayoutError, match=r"got 1 layouts for 2 outputs of two"):
        call_with_layout(two, [layout], jax.random.key(0))
    with pytest.raises(LayoutError, match=r"has rank 1 .* has rank 2"):
        call_with_layout(jnp.zeros, layout, (8,))


# ------------------------------------------------------------- copy_to_mesh
def test_copy_to_mesh_from_numpy(mesh):
    host = _host((8, 4))
    layout = Layout(["batch", "model"], mesh)
    x = copy_to_mesh(host, layout)
    assert fetch_layout(x) == layout
    np.testing.assert_array_equal(np.asarray(x), host)
    assert {s.data.shape for s in x.addressable_shards} == {(2, 2)}
    np.testing.assert_array_equal(_shards_by_id(x)[3], host[2:4, 2:4])


def test_copy_to_mesh_from_single_device_array(mesh):
    src = jax.device_put(jnp.asarray(_host((8, 4))), jax.devices()[5])
    layout = Layout([None, "model"], mesh)
    x = copy_to_mesh(src, layout)
    assert fetch_layout(x) == layout
    np.testing.assert_array_equal(np.asarray(x), _host((8, 4)))
    np.testing.assert_array_equal(_shards_by_id(x)[1], _host((8, 4))[:, 2:])


def test_copy_to_mesh_from_python_list_and_scalar(mesh):
    x = copy_to_mesh([[1.0, 2.0], [3.0, 4.0]], Layout(["model", None], mesh))
    np.testing.assert_array_equal(np.asarray(x), [[1.0, 2.0], [3.0, 4.0]])
    s = copy_to_mesh(np.float32(3.0), Layout([], mesh))
    assert s.shape == () and float(s) == 3.0


def test_copy_to_mesh_bad_input(mesh):
    with pytest.raises(
        LayoutError, match=r"batch dimension 0 has size 6, which does not divide into the 4 shards"
    ):
        copy_to_mesh(np.zeros((6, 2)), Layout(["batch", None], mesh), name="batch")
    with pytest.raises(LayoutError, match=r"has rank 1 \(shape \(8,\)\).*has rank 2"):
        copy_to_mesh(np.zeros(8), Layout(["batch", None], mesh))
