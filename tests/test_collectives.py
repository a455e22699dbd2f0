"""Tests for dtensor.collectives, against numpy references over the per-device blocks."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtensor import (
    Layout,
    LayoutError,
    ReduceOp,
    all_gather,
    all_reduce,
    broadcast,
    copy_to_mesh,
    create_mesh,
    fetch_layout,
    reduce_scatter,
)

_NP = {ReduceOp.SUM: np.sum, ReduceOp.MEAN: np.mean, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}


def _mesh(axis_types):
    return create_mesh([("a", 2), ("b", 2), ("c", 2)], axis_types=axis_types)


# Each case runs on an Auto mesh eagerly and under jax.jit; a few also on an Explicit mesh.
MODES = [("auto", False), ("auto", True)]
MODES_ALL = [*MODES, ("explicit", False), ("explicit", True)]


def _cases(cases, first_modes=2):
    """``(mode, *case)`` tuples: every case in MODES, the first ``first_modes`` cases also on Explicit."""
    out = []
    for i, case in enumerate(cases):
        for types, jit in MODES_ALL if i < first_modes else MODES:
            out.append(
                pytest.param(types, jit, *case, id=f"{types}-{'jit' if jit else 'eager'}-{i}")
            )
    return out


def _host(shape, seed=0):
    # Small integers: sums and means are exact in float32.
    return np.random.default_rng(seed).integers(-8, 9, size=shape).astype(np.float32)


def _coords(mesh):
    return {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}


def _blocks(host, layout):
    return {d.id: host[idx] for d, idx in layout.sharding.devices_indices_map(host.shape).items()}


def _group(mesh, device_id, axes):
    """The devices that differ from ``device_id`` only along ``axes``, by position along them."""
    coords = _coords(mesh)
    names = mesh.dim_names
    fixed = [i for i, n in enumerate(names) if n not in axes]

    def pos(e):
        p = 0
        for a in axes:
            p = p * mesh.shape[a] + coords[e][names.index(a)]
        return p

    members = [e for e in coords if all(coords[e][i] == coords[device_id][i] for i in fixed)]
    return sorted(members, key=pos), pos


def _result_blocks(y):
    return {s.device.id: np.asarray(s.data) for s in y.addressable_shards}


def _run(fn, x, layout, jit):
    if jit:
        return jax.jit(lambda v: fn(v, layout=layout))(x)
    return fn(x)


ALL_REDUCE = [
    (["a", "b"], ("b", "c"), ReduceOp.SUM),  # split on b, replicated on c
    ([("a", "b"), None], "a", ReduceOp.MEAN),
    ([None, None], ("a", "b", "c"), ReduceOp.MAX),
    ([("c", "a"), "b"], ("a", "b"), ReduceOp.MIN),
    (["a", "b"], "c", ReduceOp.SUM),  # only replicated copies
    ([("c", "a"), "b"], ("c", "b"), ReduceOp.MEAN),
]


@pytest.mark.parametrize(("types", "jit", "specs", "axes", "op"), _cases(ALL_REDUCE))
def test_all_reduce(types, jit, specs, axes, op):
    mesh = _mesh(types)
    host = _host((8, 4))
    layout = Layout(specs, mesh)
    x = copy_to_mesh(host, layout)
    blocks = _blocks(host, layout)
    axes_t = (axes,) if isinstance(axes, str) else axes
    y = _run(lambda v, layout=None: all_reduce(v, axes, op, layout=layout), x, layout, jit)
    got = _result_blocks(y)
    for d in blocks:
        members, _ = _group(mesh, d, axes_t)
        want = _NP[op](np.stack([blocks[e] for e in members]), axis=0)
        np.testing.assert_allclose(got[d], want, rtol=1e-6, err_msg=f"device {d}")
    out_layout = fetch_layout(y)
    assert out_layout.mesh == mesh
    assert not set(axes_t) & {a for dim in range(out_layout.rank) for a in out_layout.axes(dim)}


def test_all_reduce_global_values():
    mesh = create_mesh([("x", 8)])
    x = copy_to_mesh(jnp.arange(8.0), Layout(["x"], mesh))
    np.testing.assert_array_equal(np.asarray(all_reduce(x, "x")), [28.0])
    np.testing.assert_array_equal(np.asarray(all_reduce(x, "x", "mean")), [3.5])
    np.testing.assert_array_equal(np.asarray(all_reduce(x, "x", ReduceOp.MIN)), [0.0])
    rep = copy_to_mesh(jnp.arange(3.0), Layout.replicated(mesh, 1))
    np.testing.assert_array_equal(np.asarray(all_reduce(rep, "x")), 8 * np.arange(3.0))


ALL_GATHER = [
    ([("a", "b"), None], "b", ["a", None]),
    (["a", "b"], "a", [None, "b"]),
    (["a", "b"], "b", ["a", None]),
    ([("a", "b"), None], ("a", "b"), [None, None]),
    ([("c", "a"), "b"], "a", ["c", "b"]),
]


@pytest.mark.parametrize(("types", "jit", "specs", "axes", "out_specs"), _cases(ALL_GATHER))
def test_all_gather(types, jit, specs, axes, out_specs):
    mesh = _mesh(types)
    host = _host((8, 4), seed=1)
    layout = Layout(specs, mesh)
    x = copy_to_mesh(host, layout)
    y = _run(lambda v, layout=None: all_gather(v, axes, layout=layout), x, layout, jit)
    target = Layout(out_specs, mesh)
    assert fetch_layout(y) == target
    np.testing.assert_array_equal(np.asarray(y), host)  # values unchanged
    got = _result_blocks(y)
    axes_t = (axes,) if isinstance(axes, str) else axes
    blocks = _blocks(host, layout)
    dim = next(d for d in range(layout.rank) if set(axes_t) & set(layout.axes(d)))
    for d, want in _blocks(host, target).items():
        np.testing.assert_array_equal(got[d], want)
        members, _ = _group(mesh, d, axes_t)
        np.testing.assert_array_equal(
            got[d], np.concatenate([blocks[e] for e in members], axis=dim)
        )


REDUCE_SCATTER = [
    (["a", None], ("b", "c"), 1, ReduceOp.SUM),
    ([None, "b"], "a", 1, ReduceOp.MAX),
    ([None, None], "a", 0, ReduceOp.MEAN),
    ([None, None], ("a", "b"), 1, ReduceOp.MIN),
    (["a", None], "b", 0, ReduceOp.SUM),
    ([None, "b"], ("c", "a"), 0, ReduceOp.MEAN),
]


@pytest.mark.parametrize(("types", "jit", "specs", "axes", "dim", "op"), _cases(REDUCE_SCATTER))
def test_reduce_scatter(types, jit, specs, axes, dim, op):
    mesh = _mesh(types)
    host = _host((8, 8), seed=2)
    layout = Layout(specs, mesh)
    x = copy_to_mesh(host, layout)
    y = _run(
        lambda v, layout=None: reduce_scatter(v, axes, dim=dim, op=op, layout=layout),
        x,
        layout,
        jit,
    )
    axes_t = (axes,) if isinstance(axes, str) else axes
    n = math.prod(mesh.shape[a] for a in axes_t)
    blocks = _blocks(host, layout)
    got = _result_blocks(y)
    for d in blocks:
        members, pos = _group(mesh, d, axes_t)
        reduced = _NP[op](np.stack([blocks[e] for e in members]), axis=0)
        want = np.split(reduced, n, axis=dim)[pos(d)]
        np.testing.assert_allclose(got[d], want, rtol=1e-6, err_msg=f"device {d}")
    out = fetch_layout(y)
    assert out.axes(dim)[-len(axes_t) :] == axes_t


def test_reduce_scatter_global_values():
    mesh = create_mesh([("x", 8)])
    x = copy_to_mesh(jnp.arange(8.0), Layout.replicated(mesh, 1))
    y = reduce_scatter(x, "x")
    assert fetch_layout(y) == Layout(["x"], mesh)
    np.testing.assert_array_equal(np.asarray(y), 8 * np.arange(8.0))
    np.testing.assert_array_equal(np.asarray(reduce_scatter(x, "x", op="max")), np.arange(8.0))


BROADCAST = [
    (["a", "b"], ("b", "c"), 3),
    (["a", "b"], "a", 1),
    ([("a", "b"), None], ("a", "b"), 2),
    (["a", "b"], "c", 0),
]


@pytest.mark.parametrize(("types", "jit", "specs", "axes", "source"), _cases(BROADCAST))
def test_broadcast(types, jit, specs, axes, source):
    mesh = _mesh(types)
    host = _host((8, 4), seed=3)
    layout = Layout(specs, mesh)
    x = copy_to_mesh(host, layout)
    y = _run(
        lambda v, layout=None: broadcast(v, axes, source=source, layout=layout), x, layout, jit
    )
    axes_t = (axes,) if isinstance(axes, str) else axes
    blocks = _blocks(host, layout)
    got = _result_blocks(y)
    for d in blocks:
        members, _ = _group(mesh, d, axes_t)
        np.testing.assert_array_equal(got[d], blocks[members[source]], err_msg=f"device {d}")


def test_broadcast_bool_and_int():
    mesh = create_mesh([("x", 8)])
    flags = copy_to_mesh(np.array([False, False, True, False] * 2), Layout(["x"], mesh))
    np.testing.assert_array_equal(np.asarray(broadcast(flags, "x", source=2)), [True])
    ints = copy_to_mesh(np.arange(8, dtype=np.int32) * 3, Layout(["x"], mesh))
    out = broadcast(ints, "x", source=5)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), [15])


# ------------------------------------------------------------------ bad input
def test_collective_bad_input():
    mesh = create_mesh([("a", 4), ("b", 2)])
    layout = Layout(["a", None], mesh)
    x = copy_to_mesh(np.zeros((8, 4), np.float32), layout)
    with pytest.raises(LayoutError, match=r"all_reduce over mesh axis 'z'.*\('a', 'b'\)"):
        all_reduce(x, "z")
    with pytest.raises(LayoutError, match=r"all_reduce inside jax.jit needs layout="):
        jax.jit(lambda v: all_reduce(v, "a"))(x)
    with pytest.raises(LayoutError, match=r"all_reduce input has rank 2 .* has rank 1"):
        all_reduce(x, "a", layout=Layout(["a"], mesh))
    with pytest.raises(ValueError, match=r"reduce op 'prod' is not one of"):
        all_reduce(x, "a", "prod")
    with pytest.raises(
        LayoutError, match=r"all_gather over \('b',\) needs one dimension split over exactly those"
    ):
        all_gather(x, "b")
    two = copy_to_mesh(np.zeros((8, 4), np.float32), Layout([("a", "b"), None], mesh))
    with pytest.raises(LayoutError, match=r"only its innermost \(last\) axes can be gathered"):
        all_gather(two, "a")
    with pytest.raises(LayoutError, match=r"reduce_scatter dim=2 is out of range for rank 2"):
        reduce_scatter(x, "b", dim=2)
    with pytest.raises(LayoutError, match=r"each block \(size 2\) into 4 pieces"):
        reduce_scatter(x, "a", dim=0)
    with pytest.raises(
        LayoutError,
        match=r"broadcast source=2 is out of range; mesh axes \('b',\) have 2 positions",
    ):
        broadcast(x, "b", source=2)


def test_collective_arguments_in_the_wrong_places():
    mesh = create_mesh([("a", 4), ("b", 2)])
    x = copy_to_mesh(np.zeros((8, 4), np.float32), Layout(["a", None], mesh))
    # The reduce op where the axes go (tf.distribute's reduce(op, value) habit), and back.
    with pytest.raises(
        TypeError,
        match=r"all_reduce\(x, 'sum', 'a'\): the reduce op 'sum' is where the mesh axes go, and "
        r"the axes 'a' where the op goes; the signature is dtensor\.all_reduce\(x, axes, "
        r"op=ReduceOp\.SUM, \*, layout=None\)\. Swap them: all_reduce\(x, 'a', 'sum'\)",
    ):
        all_reduce(x, "sum", "a")
    with pytest.raises(
        TypeError, match=r"the reduce op 'MAX' is where .* all_reduce\(x, 'a', 'max'\)"
    ):
        all_reduce(x, ReduceOp.MAX, "a")
    with pytest.raises(
        TypeError,
        match=r"all_reduce\(x, 'mean', \.\.\.\): 'mean' is a reduce op, passed where the mesh axes "
        r"go; .* all_reduce\(x, 'a', op='mean'\)",
    ):
        all_reduce(x, "mean")
    with pytest.raises(
        TypeError,
        match=r"all_reduce\(x, 'a', 'b'\): 'b' is not a reduce op .* mesh axes; .*"
        r"all_reduce\(x, \('a', 'b'\)\)",
    ):
        all_reduce(x, "a", "b")
    with pytest.raises(
        TypeError,
        match=r"reduce_scatter\(x, 'sum', \.\.\.\): 'sum' is a reduce op.*dtensor\.reduce_scatter\(x, "
        r"axes, \*, dim=0, op=ReduceOp\.SUM, layout=None\)\. .*reduce_scatter\(x, 'a', op='sum'\)",
    ):
        reduce_scatter(x, "sum")
    # The axes before the array.
    with pytest.raises(
        TypeError,
        match=r"all_gather\('a', <array>\): the array comes first and the mesh axes second; the "
        r"signature is dtensor\.all_gather\(x, axes, \*, layout=None\)",
    ):
        all_gather("a", x)
    # An integer dimension where mesh axis names go.
    with pytest.raises(
        TypeError,
        match=r"broadcast\(x, 0\): axes must be a mesh axis name or a sequence of names, got 0 "
        r"\(int\) \(an integer dimension\?.*dtensor\.broadcast\(x, axes, \*, source=0, "
        r"layout=None\)\. Pass axis names: broadcast\(x, 'a'\)",
    ):
        broadcast(x, 0)
    with pytest.raises(TypeError, match=r"all_gather\(x, 1\): axes must be a mesh axis name"):
        all_gather(x, 1)
    # A mesh axis that happens to be named like an op is an axis, not a slip.
    odd = create_mesh([("sum", 8)])
    y = copy_to_mesh(np.arange(8.0, dtype=np.float32), Layout(["sum"], odd))
    assert float(all_reduce(y, "sum", "max")[0]) == 7.0
