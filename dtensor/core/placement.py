"""Placing non-partial arrays: copy to a mesh, read a layout, move between layouts.

The layer under :mod:`dtensor.core.partial` and :mod:`dtensor.core.arrays`:
nothing here knows about partial values, so both can build on it without an
import cycle. Users call the public versions in :mod:`dtensor.core.arrays`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.core
import numpy as np

from dtensor.core.layout import Layout, LayoutError
from dtensor.core.mesh import Mesh, current_mesh

__all__ = ["array_layout", "copy_to_mesh", "is_traced", "mesh_of", "relayout_plain", "shape_of"]


def is_traced(x: Any) -> bool:
    """Whether ``x`` is an abstract value inside a JAX trace (``jax.jit`` etc.)."""
    return isinstance(x, jax.core.Tracer)


def shape_of(x: Any) -> tuple[int, ...]:
    """The shape of an array or of host data."""
    return tuple(np.shape(x))


def relayout_plain(x: Any, layout: Layout, *, name: str = "array") -> Any:
    """:func:`dtensor.relayout` between layouts that are not partial (no reduction involved)."""
    layout.check_shape(shape_of(x), name)
    if isinstance(x, jax.ShapeDtypeStruct):  # abstract (eval_shape): laid out, nothing allocated
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=layout.sharding, weak_type=x.weak_type
        )
    if is_traced(x):
        if layout.mesh.axis_types == "explicit":
            return jax.sharding.reshard(x, layout.sharding)
        return jax.lax.with_sharding_constraint(x, layout.sharding)
    if not isinstance(x, jax.Array):
        return copy_to_mesh(x, layout, name=name)
    if x.is_fully_addressable and layout.mesh.is_multi_process is False:
        return jax.device_put(x, layout.sharding)
    if x.sharding.is_equivalent_to(layout.sharding, x.ndim):
        return x
    if (
        x.is_fully_replicated
        and x.addressable_shards
        and x.sharding.device_set != layout.sharding.device_set
    ):
        # Onto other devices in a job of several processes (a jit cannot move between device
        # sets there): every process holds the whole value, so each places its own blocks.
        return copy_to_mesh(np.asarray(x.addressable_data(0)), layout, name=name)
    return _reshard_jit(layout.sharding)(x)


_RESHARD_CACHE: dict[Any, Callable[[Any], Any]] = {}


def _reshard_jit(sharding: jax.sharding.Sharding) -> Callable[[Any], Any]:
    fn = _RESHARD_CACHE.get(sharding)
    if fn is None:
        fn = _RESHARD_CACHE[sharding] = jax.jit(lambda a: a, out_shardings=sharding)
    return fn


def copy_to_mesh(x: Any, layout: Layout, *, name: str = "array") -> jax.Array:
    """Copy host or single-device data onto the mesh in ``layout``.

    In a multi-process run each process passes the same full value and only
    its own devices' blocks are transferred.

    Examples:
        >>> import dtensor, numpy as np
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> y = dtensor.copy_to_mesh(np.ones((8, 3)), dtensor.Layout(["x", None], mesh))
        >>> y.shape, len(y.addressable_shards), y.addressable_shards[0].data.shape
        ((8, 3), 8, (1, 3))
    """
    layout.check_shape(shape_of(x), name)
    if isinstance(x, jax.Array) and x.is_fully_addressable and not layout.mesh.is_multi_process:
        return jax.device_put(x, layout.sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, layout.sharding, lambda idx: host[idx])


def array_layout(x: Any) -> Layout:
    """The layout of a (non-partial-stacked) global array or traced value; see :func:`dtensor.fetch_layout`."""
    if is_traced(x):
        sharding = getattr(jax.typeof(x), "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            if isinstance(sharding.mesh, jax.sharding.Mesh):
                return Layout.from_sharding(sharding, rank=x.ndim)
            explicit = jax.sharding.AxisType.Explicit in tuple(sharding.mesh.axis_types)
            mesh = current_mesh()
            if explicit and mesh is not None and mesh.jax_mesh.abstract_mesh == sharding.mesh:
                concrete = jax.sharding.NamedSharding(mesh.jax_mesh, sharding.spec)
                return Layout.from_sharding(concrete, rank=x.ndim)
            if explicit:
                raise LayoutError(
                    f"fetch_layout got a traced value inside jax.jit whose type names the abstract "
                    f"mesh {sharding.mesh} (spec {sharding.spec}), but that mesh is not the current "
                    "one. Run the jitted function inside `with mesh:` for that dtensor.Mesh."
                )
        raise LayoutError(
            "fetch_layout got a traced value inside jax.jit; on Auto mesh axes its layout is "
            "decided by the compiler. Call fetch_layout on the jit's result, or use a mesh with "
            "axis_types='explicit' and run inside `with mesh:`."
        )
    if not isinstance(x, jax.Array):
        raise TypeError(
            f"fetch_layout needs a jax.Array, got {type(x).__name__}. Put host data on a mesh "
            "with dtensor.copy_to_mesh first."
        )
    return Layout.from_sharding(x.sharding, rank=x.ndim)


def mesh_of(x: Any) -> Mesh | None:
    """The mesh of a laid-out array, or ``None`` for other values."""
    if isinstance(x, jax.Array) and not is_traced(x):
        sharding = x.sharding
        if isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
            sharding.mesh, jax.sharding.Mesh
        ):
            return Mesh(sharding.mesh)
    return None
