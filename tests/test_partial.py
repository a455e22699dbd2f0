"""Partial (unreduced) layouts: creation, reduction to any layout, against a dense numpy reference."""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dtensor
from dtensor import UNSHARDED, Layout, LayoutError, ReduceOp
from dtensor.core.partial import PartialArray, is_native

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FACTORISATIONS = [
    s for k in (1, 2, 3) for s in itertools.product([1, 2, 4, 8], repeat=k) if math.prod(s) == 8
]
NUMPY = {ReduceOp.SUM: np.sum, ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}


def reference(blocks, layout, shape):
    """The dense value of a partial array: combine the blocks along the partial axes."""
    mesh = layout.mesh
    out = np.zeros(shape, np.float64)
    seen = np.zeros(shape, bool)
    base = layout.unreduced().sharding.devices_indices_map(shape)
    groups: dict = {}
    for d, b in zip(mesh.local_devices, blocks, strict=True):
        key = tuple(sl.indices(n)[:2] for sl, n in zip(base[d], shape, strict=True))
        groups.setdefault(key, {})[d.id] = (base[d], b)
    for members in groups.values():
        # one block per position along the partial axes (copies along other axes are equal)
        by_pos: dict = {}
        coords = {
            d.id: dict(zip(mesh.dim_names, np.argwhere(mesh.devices == d)[0], strict=True))
            for d in mesh.local_devices
        }
        for did, (idx, b) in members.items():
            pos = tuple(int(coords[did][a]) for a in layout.partial_axes)
            by_pos.setdefault(pos, (idx, b))
        idx = next(iter(by_pos.values()))[0]
        out[idx] = NUMPY[layout.reduce_op](
            np.stack([np.asarray(b, np.float64) for _, b in by_pos.values()]), axis=0
        )
        seen[idx] = True
    assert seen.all()
    return out


def random_blocks(layout, shape, seed):
    """One block per device: distinct along the partial axes, equal copies along the others."""
    rng = np.random.default_rng(seed)
    mesh = layout.mesh
    local = layout.unreduced().local_shape(shape)
    stacked = dtensor.core.partial.stacked_layout(layout)
    index = stacked.sharding.devices_indices_map((mesh.axis_size(layout.partial_axes), *shape))
    cache: dict = {}
    out = []
    for d in mesh.local_devices:
        key = tuple((sl.start, sl.stop) for sl in index[d])
        if key not in cache:
            cache[key] = rng.integers(-50, 50, size=local).astype(np.float32)
        out.append(cache[key])
    return out


@st.composite
def cases(draw):
    sizes = draw(st.sampled_from(FACTORISATIONS))
    names = draw(st.permutations(["a", "b", "c"]))[: len(sizes)]
    types = draw(st.sampled_from(["auto", "explicit"]))
    mesh = dtensor.create_mesh(list(zip(names, sizes, strict=True)), axis_types=types)
    op = draw(st.sampled_from([ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN]))
    partial = draw(st.lists(st.sampled_from(names), min_size=1, unique=True))
    free = [n for n in names if n not in partial]
    rank = draw(st.integers(1, 2))

    def specs(axes):
        out: list = [UNSHARDED] * rank
        for ax in axes:
            dim = draw(st.integers(-1, rank - 1))
            if dim >= 0:
                cur = out[dim]
                out[dim] = (
                    ax if cur == UNSHARDED else (*((cur,) if isinstance(cur, str) else cur), ax)
                )
        return out

    src = Layout.partial(mesh, partial, sharding_specs=specs(draw(st.permutations(free))), op=op)
    # Targets: often "source plus partial axes appended" (reduce-scatter), else anything.
    if draw(st.booleans()):
        tgt_specs = list(src.sharding_specs)
        for ax in draw(st.permutations(partial)):
            dim = draw(st.integers(-1, rank - 1))
            if dim >= 0:
                cur = tgt_specs[dim]
                tgt_specs[dim] = (
                    ax if cur == UNSHARDED else (*((cur,) if isinstance(cur, str) else cur), ax)
                )
    else:
        tgt_specs = specs(draw(st.permutations(names)))
    target = Layout(tgt_specs, mesh)
    dims = [math.lcm(src.unreduced().num_shards(d) * 8, target.num_shards(d)) for d in range(rank)]
    shape = tuple(draw(st.sampled_from([n, 2 * n])) if n <= 16 else n for n in dims)
    return src, target, shape, draw(st.integers(0, 2**16))


@SETTINGS
@given(cases())
def test_relayout_partial_matches_dense_reference(case):
    src, target, shape, seed = case
    blocks = random_blocks(src, shape, seed)
    x = dtensor.pack(blocks, src)
    assert dtensor.fetch_layout(x) == src
    assert isinstance(x, PartialArray) != is_native(src)
    want = reference(blocks, src, shape)
    got = dtensor.relayout(x, target)
    assert got.sharding.is_equivalent_to(target.sharding, len(shape))
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    # The same inside jax.jit.
    traced = jax.jit(lambda v: dtensor.relayout(v, target), out_shardings=target.sharding)(x)
    np.testing.assert_array_equal(np.asarray(traced, np.float64), want)


def _mesh(types="auto"):
    return dtensor.create_mesh([("x", 4), ("y", 2)], axis_types=types)


def _kinds(fn, *args):
    report = dtensor.explain(fn, *args)
    return sorted((c.kind, c.mesh_axes) for c in report.collectives)


@pytest.mark.parametrize("types", ["auto", "explicit"])
def test_reduction_compiles_to_all_reduce_or_reduce_scatter(types):
    mesh = _mesh(types)
    src = Layout.partial(mesh, "x", sharding_specs=[None, "y"])
    x = dtensor.pack([np.ones((8, 4), np.float32)] * 8, src)
    to_replicated = _kinds(lambda v: dtensor.relayout(v, Layout([None, "y"], mesh)), x)
    assert to_replicated == [("all-reduce", ("x",))]
    to_sharded = _kinds(lambda v: dtensor.relayout(v, Layout(["x", "y"], mesh)), x)
    assert to_sharded == [("reduce-scatter", ("x",))]


def test_max_reduce_scatter_is_one_all_to_all():
    mesh = _mesh()
    src = Layout.partial(mesh, "x", rank=1, op="max")
    x = dtensor.pack([np.full((8,), i // 2, np.float32) for i in range(8)], src)
    report = dtensor.explain(lambda v: dtensor.relayout(v, Layout(["x"], mesh)), x)
    # One all-to-all instruction (XLA's CPU form has one operand per piece).
    assert {(c.kind, c.mesh_axes, c.name) for c in report.collectives} == {
        ("all-to-all", ("x",), report.collectives[0].name)
    }


def test_pack_checks_copies_off_the_partial_axes():
    mesh = _mesh()
    # Mesh order is (x, y): device i sits at y = i % 2. Partial over y, copies along x.
    ok = dtensor.pack(
        [np.full((2,), i % 2, np.float32) for i in range(8)], Layout.partial(mesh, "y", rank=1)
    )
    np.testing.assert_array_equal(ok.reduce(), [1.0, 1.0])
    with pytest.raises(LayoutError, match="different blocks 0 and 2"):
        dtensor.pack(
            [np.full((2,), i, np.float32) for i in range(8)], Layout.partial(mesh, "y", rank=1)
        )


def test_native_form_is_jax_unreduced_and_stacked_form_is_a_pytree():
    explicit = _mesh("explicit")
    native = dtensor.pack([np.ones((2,), np.float32)] * 8, Layout.partial(explicit, "x", rank=1))
    assert isinstance(native, jax.Array)
    assert native.sharding.spec.unreduced == frozenset({"x"})
    stacked = dtensor.pack([np.ones((2,), np.float32)] * 8, Layout.partial(_mesh(), "x", rank=1))
    assert isinstance(stacked, PartialArray)
    assert stacked.blocks.shape == (4, 2) and stacked.shape == (2,)
    assert jax.tree.leaves(stacked) == [stacked.blocks]
    np.testing.assert_array_equal(stacked.reduce(), [4.0, 4.0])
    assert [b.shape for b in dtensor.unpack(stacked)] == [(2,)] * 8
    assert [b.shape for b in dtensor.unpack(native)] == [(2,)] * 8


def test_call_with_layout_gives_partial_contraction():
    for types in ("auto", "explicit"):
        mesh = _mesh(types)
        a_host = np.arange(32.0, dtype=np.float32).reshape(4, 8)
        a = dtensor.copy_to_mesh(a_host, Layout([None, "x"], mesh))
        b = dtensor.copy_to_mesh(np.ones((8, 2), np.float32), Layout(["x", None], mesh))
        p = dtensor.call_with_layout(jnp.matmul, Layout.partial(mesh, "x", rank=2), a, b)
        assert dtensor.fetch_layout(p) == Layout.partial(mesh, "x", rank=2)
        np.testing.assert_allclose(
            dtensor.relayout(p, Layout([None, None], mesh)), a_host @ np.ones((8, 2))
        )
        # MAX of a replicated input over 'x' is the input itself.
        m = dtensor.call_with_layout(
            lambda v: v * 2, Layout.partial(mesh, "x", rank=2, op="max"), a_host
        )
        np.testing.assert_allclose(dtensor.relayout(m, Layout([None, "y"], mesh)), 2 * a_host)


@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_partial_to_partial_moves_blocks(op):
    mesh = _mesh()
    src = Layout.partial(mesh, "x", rank=2, op=op)
    rng = np.random.default_rng(0)
    per_x = [rng.normal(size=(4, 4)).astype(np.float32) for _ in range(4)]
    # mesh order: device i sits at x = i // 2, y = i % 2; copies along y are equal
    x = dtensor.pack([per_x[i // 2] for i in range(8)], src)
    target = Layout.partial(mesh, "x", sharding_specs=["y", None], op=op)
    moved = dtensor.relayout(x, target)
    assert dtensor.fetch_layout(moved) == target
    # each device keeps its own block, cut to its half along y (no reduction happened)
    for i, block in enumerate(dtensor.unpack(moved)):
        half = slice(2 * (i % 2), 2 * (i % 2) + 2)
        np.testing.assert_array_equal(np.asarray(block), per_x[i // 2][half])
    dense = NUMPY[ReduceOp(op)](np.stack(per_x), axis=0)
    np.testing.assert_allclose(
        np.asarray(dtensor.relayout(moved, Layout([None, None], mesh))), dense, rtol=1e-6
    )


def test_errors():
    mesh = _mesh()
    partial = Layout.partial(mesh, "x", rank=1)
    with pytest.raises(LayoutError, match=r"cannot relayout array \*to\* the partial layout"):
        dtensor.relayout(jnp.ones((4,)), partial)
    x = dtensor.pack([np.ones((4,), np.float32)] * 8, partial)
    with pytest.raises(LayoutError, match="only with the same partial axes and reduce op"):
        dtensor.relayout(x, Layout.partial(mesh, "y", rank=1))
    other = dtensor.create_mesh([("x", 8)])
    with pytest.raises(LayoutError, match="on another mesh"):
        dtensor.relayout(x, Layout([None], other))
    a = dtensor.copy_to_mesh(np.ones((8,)), Layout(["x"], other))
    with pytest.raises(LayoutError, match="must be a non-partial array on the same mesh"):
        dtensor.call_with_layout(lambda v: v, partial, a)
    with pytest.raises(LayoutError, match="needs f to return one array per device"):

        def f(v):
            return (v, v)

        dtensor.call_with_layout(f, partial, np.ones((4,), np.float32))
    assert re.search("partial=sum", repr(x))
