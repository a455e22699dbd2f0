"""Operations on laid-out arrays: relayout, pack/unpack, fetch/check, creation."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import numpy as np

from dtensor.core.layout import Layout, LayoutError
from dtensor.core.partial import (
    PartialArray,
    assemble,
    blocks_of,
    call_per_device,
    partial_layout_of,
    relayout_partial,
    stacked_layout,
)
from dtensor.core.placement import (
    array_layout,
    copy_to_mesh,
    is_traced,
    mesh_of,
    relayout_plain,
    shape_of,
)

__all__ = [
    "relayout",
    "pack",
    "unpack",
    "fetch_layout",
    "check_layout",
    "call_with_layout",
    "copy_to_mesh",
    "is_traced",
    "mesh_of",
]


def relayout(x: Any, layout: Layout, *, name: str = "array") -> Any:
    """Give ``x`` the layout ``layout``.

    Eagerly this moves data between devices (XLA picks the collectives);
    inside ``jax.jit`` it is a sharding constraint (``with_sharding_constraint``
    on Auto axes, ``jax.sharding.reshard`` on Explicit ones). A partial layout
    as the source reduces (see :mod:`dtensor.core.partial`).

    Args:
        x: a ``jax.Array`` (or host data, which is copied to the mesh).
        layout: the target layout.
        name: how ``x`` is named in error messages (a pytree path, say).

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
        >>> x = dtensor.copy_to_mesh(jnp.arange(16.0).reshape(8, 2), dtensor.Layout(["batch", None], mesh))
        >>> y = dtensor.relayout(x, dtensor.Layout([None, "model"], mesh))
        >>> dtensor.fetch_layout(y)
        Layout([UNSHARDED, 'model'], mesh=Mesh(batch=4, model=2))
        >>> bool((y == x).all())
        True
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"relayout of {name} needs a dtensor.Layout, got {type(layout).__name__}.")
    if layout.is_partial or partial_layout_of(x, layout.mesh) is not None:
        return relayout_partial(x, layout, name=name)
    return relayout_plain(x, layout, name=name)


def fetch_layout(x: Any) -> Layout:
    """The layout of a global array.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> y = dtensor.copy_to_mesh(jnp.zeros((16,)), dtensor.Layout(["x"], mesh))
        >>> dtensor.fetch_layout(y)
        Layout(['x'], mesh=Mesh(x=8))
    """
    if isinstance(x, PartialArray):
        return x.layout
    return array_layout(x)


def check_layout(x: Any, layout: Layout, *, name: str = "array") -> None:
    """Raise a :class:`LayoutError` unless ``x`` has (an equivalent of) ``layout``.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> y = dtensor.copy_to_mesh(jnp.zeros((8,)), dtensor.Layout(["x"], mesh))
        >>> dtensor.check_layout(y, dtensor.Layout(["x"], mesh))
    """
    layout.check_shape(shape_of(x), name)
    actual = fetch_layout(x)
    if actual == layout:
        return
    if actual.mesh == layout.mesh and x.sharding.is_equivalent_to(layout.sharding, x.ndim):
        return
    raise LayoutError(
        f"{name} has layout {actual!r} but {layout!r} was expected. Move it with "
        "dtensor.relayout(x, layout)."
    )


def pack(shards: Sequence[Any], layout: Layout, *, name: str = "array") -> jax.Array:
    """Assemble one global array from per-device blocks.

    ``shards`` has one block per device of this process, in mesh order
    (``layout.mesh.local_devices``); devices that hold copies of the same block
    (replicated mesh axes) each get their own entry, which must be equal.

    Examples:
        >>> import dtensor, numpy as np
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = dtensor.pack([np.full((1, 2), i) for i in range(8)], dtensor.Layout(["x", None], mesh))
        >>> x.shape, int(x[5, 0])
        ((8, 2), 5)
    """
    devices = layout.mesh.local_devices
    if len(shards) != len(devices):
        raise LayoutError(
            f"pack of {name} got {len(shards)} blocks, but {layout!r} has {len(devices)} devices "
            "in this process. Give one block per local device, in mesh order."
        )
    shapes = {shape_of(s) for s in shards}
    if len(shapes) != 1:
        raise LayoutError(
            f"pack of {name} got blocks of different shapes {sorted(shapes)}; every device's "
            "block has the same local shape."
        )
    (local,) = shapes
    global_shape = layout.global_shape(local)
    if layout.is_partial:  # blocks differ along the partial axes (see dtensor.partial)
        n = layout.mesh.axis_size(layout.partial_axes)
        stacked = [np.expand_dims(np.asarray(s), 0) for s in shards]
        _check_copies_equal(stacked, devices, stacked_layout(layout), (n, *global_shape), name)
        return assemble(shards, layout, global_shape)
    _check_copies_equal(shards, devices, layout, global_shape, name)
    arrays = [jax.device_put(s, d) for s, d in zip(shards, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(global_shape, layout.sharding, arrays)


def _check_copies_equal(
    shards: Sequence[Any],
    devices: Sequence[Any],
    layout: Layout,
    global_shape: tuple[int, ...],
    name: str,
) -> None:
    """Devices that hold the same block (replicated mesh axes) must be given equal copies."""
    index_map = layout.sharding.devices_indices_map(global_shape)
    first: dict[tuple[tuple[int, int], ...], tuple[int, np.ndarray]] = {}
    for i, (shard, device) in enumerate(zip(shards, devices, strict=True)):
        key = tuple(
            sl.indices(n)[:2] for sl, n in zip(index_map[device], global_shape, strict=True)
        )
        value = np.asarray(shard)
        if key not in first:
            first[key] = (i, value)
            continue
        j, ref = first[key]
        nan = np.issubdtype(value.dtype, np.inexact) and np.issubdtype(ref.dtype, np.inexact)
        if not np.array_equal(ref, value, equal_nan=bool(nan)):
            raise LayoutError(
                f"pack of {name} got different blocks {j} and {i} for devices {devices[j].id} and "
                f"{device.id}, which hold the same block under {layout!r} (a mesh axis the layout "
                "does not split replicates it). Give every copy of a block the same value."
            )


def unpack(x: jax.Array) -> list[jax.Array]:
    """The per-device blocks of ``x``, one per local device in mesh order.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 4), ("y", 2)])
        >>> x = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], mesh))
        >>> [float(b[0]) for b in dtensor.unpack(x)]
        [0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
    """
    if partial_layout_of(x) is not None:
        return blocks_of(x)
    layout = fetch_layout(x)
    by_device = {s.device: s.data for s in x.addressable_shards}
    return [by_device[d] for d in layout.mesh.local_devices]


def call_with_layout(
    fn: Callable[..., Any], layout: Layout | Any, *args: Any, **kwargs: Any
) -> Any:
    """Call ``fn`` under ``jax.jit`` so its result is created directly in ``layout``.

    Each device computes only its own block: the whole array is never
    materialised on one device. ``layout`` may be a pytree of layouts that
    matches ``fn``'s output.

    Examples:
        >>> import dtensor, jax
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> layout = dtensor.Layout(["x", None], mesh)
        >>> w = dtensor.call_with_layout(jax.random.normal, layout, jax.random.key(0), (64, 4))
        >>> dtensor.fetch_layout(w) == layout
        True
    """
    if isinstance(layout, Layout) and layout.is_partial:
        return call_per_device(fn, layout, args, kwargs)
    flat, argdef = jax.tree.flatten((args, kwargs))
    dyn = [i for i, v in enumerate(flat) if isinstance(v, jax.Array | np.ndarray)]

    def bound(*arrays: Any) -> Any:
        values = list(flat)
        for i, a in zip(dyn, arrays, strict=True):
            values[i] = a
        a, kw = jax.tree.unflatten(argdef, values)
        return fn(*a, **kw)

    arrays = [flat[i] for i in dyn]
    name = getattr(fn, "__name__", "fn")
    out = jax.eval_shape(bound, *arrays)
    out_leaves, treedef = jax.tree.flatten(out)
    if isinstance(layout, Layout):
        layouts = [layout] * len(out_leaves)
    else:
        layouts = jax.tree.leaves(layout, is_leaf=lambda v: isinstance(v, Layout))
        if len(layouts) != len(out_leaves):
            raise LayoutError(
                f"call_with_layout got {len(layouts)} layouts for {len(out_leaves)} outputs of "
                f"{name}; give one layout per output (or a single Layout)."
            )
    for i, (leaf, lay) in enumerate(zip(out_leaves, layouts, strict=True)):
        lay.check_shape(leaf.shape, f"output {i} of {name}")
    shardings = jax.tree.unflatten(treedef, [lay.sharding for lay in layouts])
    return jax.jit(bound, out_shardings=shardings)(*arrays)
