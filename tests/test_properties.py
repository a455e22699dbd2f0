"""Property-based tests: random meshes over 8 devices, random layouts and shapes."""

from __future__ import annotations

import itertools
import math

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dtensor import (
    Layout,
    check_layout,
    copy_to_mesh,
    create_mesh,
    fetch_layout,
    pack,
    relayout,
    unpack,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Ordered factorisations of 8 into 1, 2 or 3 sizes (1s allowed).
FACTORISATIONS = [
    sizes
    for k in (1, 2, 3)
    for sizes in itertools.product([1, 2, 4, 8], repeat=k)
    if math.prod(sizes) == 8
]
NAMES = ["data", "model", "fsdp", "x"]


@st.composite
def meshes(draw):
    sizes = draw(st.sampled_from(FACTORISATIONS))
    names = draw(st.permutations(NAMES))[: len(sizes)]
    order = draw(st.permutations(range(8)))
    axis_types = draw(st.sampled_from(["auto", "explicit"]))
    devices = [jax.devices()[i] for i in order]
    return create_mesh(list(zip(names, sizes, strict=True)), devices=devices, axis_types=axis_types)


@st.composite
def layouts(draw, mesh, rank=None):
    rank = draw(st.integers(0, 3)) if rank is None else rank
    specs: list[list[str]] = [[] for _ in range(rank)]
    names = draw(st.permutations(mesh.dim_names))
    for axis in names:  # each mesh axis splits at most one dimension, in a random order
        dim = draw(st.integers(-1, rank - 1))
        if dim >= 0:
            specs[dim].append(axis)
    return Layout([tuple(s) if s else None for s in specs], mesh)


@st.composite
def shapes(draw, layout):
    return tuple(layout.num_shards(d) * draw(st.integers(1, 3)) for d in range(layout.rank))


@st.composite
def laid_out(draw):
    mesh = draw(meshes())
    layout = draw(layouts(mesh))
    shape = draw(shapes(layout))
    return layout, shape


def _host(shape):
    return np.arange(math.prod(shape), dtype=np.float32).reshape(shape)


@SETTINGS
@given(laid_out())
def test_pack_unpack_round_trip(case):
    layout, shape = case
    host = _host(shape)
    x = copy_to_mesh(host, layout)
    blocks = unpack(x)
    assert len(blocks) == layout.mesh.size
    index_map = layout.sharding.devices_indices_map(shape)
    for device, block in zip(layout.mesh.device_list, blocks, strict=True):
        assert list(block.devices()) == [device]
        np.testing.assert_array_equal(np.asarray(block), host[index_map[device]])
    y = pack(blocks, layout)
    assert fetch_layout(y) == layout
    np.testing.assert_array_equal(np.asarray(y), host)
    z = pack([np.asarray(b) for b in blocks], layout)  # host blocks too
    np.testing.assert_array_equal(np.asarray(z), host)


@st.composite
def relayout_cases(draw):
    mesh = draw(meshes())
    rank = draw(st.integers(1, 3))
    src = draw(layouts(mesh, rank))
    dst = draw(layouts(mesh, rank))
    shape = tuple(
        math.lcm(src.num_shards(d), dst.num_shards(d)) * draw(st.integers(1, 2))
        for d in range(rank)
    )
    return src, dst, shape, draw(st.booleans())


@SETTINGS
@given(relayout_cases())
def test_relayout_preserves_values(case):
    src, dst, shape, jit = case
    host = _host(shape)
    x = copy_to_mesh(host, src)
    if jit:
        y = jax.jit(lambda a: relayout(a + 0.0, dst))(x)
        check_layout(y, dst)  # the compiler may drop size-1 axes: an equivalent layout
    else:
        y = relayout(x, dst)
        assert fetch_layout(y) == dst
    np.testing.assert_array_equal(np.asarray(y), host)
    index_map = dst.sharding.devices_indices_map(shape)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), host[index_map[shard.device]])


@SETTINGS
@given(st.data())
def test_string_round_trip(data):
    mesh = data.draw(meshes())
    layout = data.draw(layouts(mesh, data.draw(st.integers(1, 4))))
    text = layout.to_string()
    back = Layout.from_string(text)
    assert back == layout
    assert back.mesh.device_list == mesh.device_list
    assert back.to_string() == text
    assert Layout.from_string(text.split(", mesh:")[0], mesh) == layout
    unused = [
        a
        for a in mesh.dim_names
        if a not in {x for d in range(layout.rank) for x in layout.axes(d)}
    ]
    if unused:
        partial = Layout(
            layout.sharding_specs,
            mesh,
            partial_axes=unused,
            reduce_op=data.draw(st.sampled_from(["sum", "max", "min"])),
        )
        assert Layout.from_string(partial.to_string()) == partial
