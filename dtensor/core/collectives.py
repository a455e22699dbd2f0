"""Collectives over named mesh axes on global arrays (`jax.shard_map` + `jax.lax`).

Each function looks at a global array the way DTensor does: every device holds
a *block* (its shard under the array's layout) and the collective combines the
blocks of the devices along ``axes``. The result is again a global array:

- ``all_reduce``: every device along ``axes`` ends with the combination of
  their blocks; the result is replicated over ``axes`` (a dimension that was
  split over ``axes`` keeps its block size).
- ``all_gather``: blocks along ``axes`` are concatenated; values unchanged,
  the dimension is no longer split over ``axes``.
- ``reduce_scatter``: blocks along ``axes`` are combined and the result split
  over ``axes`` along ``dim``.
- ``broadcast``: every device along ``axes`` gets the block of the device at
  position ``source`` along them.

They work eagerly and inside ``jax.jit`` (pass ``layout=``, the input's layout,
for traced values).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from dtensor.core.arrays import fetch_layout, is_traced, mesh_of
from dtensor.core.layout import UNSHARDED, Layout, LayoutError
from dtensor.core.reduce_op import ReduceOp

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast"]


_SIGNATURES = {
    "all_reduce": "dtensor.all_reduce(x, axes, op=ReduceOp.SUM, *, layout=None)",
    "all_gather": "dtensor.all_gather(x, axes, *, layout=None)",
    "reduce_scatter": "dtensor.reduce_scatter(x, axes, *, dim=0, op=ReduceOp.SUM, layout=None)",
    "broadcast": "dtensor.broadcast(x, axes, *, source=0, layout=None)",
}
_NO_OP = object()


def _is_op(v: Any) -> bool:
    """Whether ``v`` reads as a reduce op (a :class:`ReduceOp` or one's name)."""
    return isinstance(v, ReduceOp) or (
        isinstance(v, str) and v.lower() in {o.value for o in ReduceOp}
    )


def _is_axes(v: Any) -> bool:
    return isinstance(v, str) or (
        isinstance(v, Sequence) and bool(v) and all(isinstance(a, str) for a in v)
    )


def _axes(
    fn: str, x: Any, axes: Any, op: Any = _NO_OP, *, layout: Layout | None = None
) -> tuple[str, ...]:
    """``axes`` as a tuple, or a four-part error for arguments given in the wrong places.

    The usual slips: the reduce op where the mesh axes go (``all_reduce(x, "sum",
    "x")``, TF's ``reduce(op, value)`` order), the axes before the array, or
    an integer dimension where mesh axis names go.
    """
    sig = _SIGNATURES[fn]
    mesh = layout.mesh if layout is not None else mesh_of(x)
    example = repr(mesh.dim_names[0]) if mesh is not None else "'batch'"
    if _is_axes(x) and isinstance(axes, jax.Array | np.ndarray):
        raise TypeError(
            f"{fn}({x!r}, <array>): the array comes first and the mesh axes second; the signature "
            f"is {sig}. Call {fn}(x, {x!r}, ...)."
        )
    if _is_op(axes) and not (mesh is not None and axes in mesh.dim_names):
        name = axes.name if isinstance(axes, ReduceOp) else axes
        if op is not _NO_OP and _is_axes(op) and not _is_op(op):
            raise TypeError(
                f"{fn}(x, {axes!r}, {op!r}): the reduce op {name!r} is where the mesh axes go, "
                f"and the axes {op!r} where the op goes; the signature is {sig}. Swap them: "
                f"{fn}(x, {op!r}, {name.lower()!r})."
            )
        raise TypeError(
            f"{fn}(x, {axes!r}, ...): {name!r} is a reduce op, passed where the mesh axes go; "
            f"the signature is {sig}. Name the mesh axes first and the op after them: "
            f"{fn}(x, {example}, op={name.lower()!r})."
        )
    if not _is_axes(axes):
        hint = (
            " (an integer dimension? collectives act over mesh axis names; the dimension follows "
            "from the array's layout)"
            if isinstance(axes, int | np.integer)
            else ""
        )
        raise TypeError(
            f"{fn}(x, {axes!r}): axes must be a mesh axis name or a sequence of names, got "
            f"{axes!r} ({type(axes).__name__}){hint}; the signature is {sig}. Pass axis names: "
            f"{fn}(x, {example})."
        )
    named = mesh is not None and _is_axes(op) and set(_as_tuple(op)) <= set(mesh.dim_names)
    if op is not _NO_OP and not _is_op(op) and named:
        raise TypeError(
            f"{fn}(x, {axes!r}, {op!r}): {op!r} is not a reduce op (SUM, MEAN, MAX, MIN) but "
            f"mesh axes; the signature is {sig}. Give all the axes in one sequence: "
            f"{fn}(x, {(*_as_tuple(axes), *_as_tuple(op))!r})."
        )
    return _as_tuple(axes)


def _as_tuple(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _input_layout(x: Any, layout: Layout | None, fn: str) -> Layout:
    if layout is not None:
        layout.check_shape(x.shape, f"{fn} input")
        return layout
    if is_traced(x):
        raise LayoutError(
            f"{fn} inside jax.jit needs layout= (the input's Layout): a traced value's layout is "
            "not known until compilation."
        )
    return fetch_layout(x)


def _without(layout: Layout, axes: tuple[str, ...]) -> list[Any]:
    out: list[Any] = []
    for dim in range(layout.rank):
        kept = tuple(a for a in layout.axes(dim) if a not in axes)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return out


def _check_axes(layout: Layout, axes: tuple[str, ...], fn: str) -> None:
    for a in axes:
        if a not in layout.mesh.dim_names:
            raise LayoutError(
                f"{fn} over mesh axis {a!r}, but the array's mesh {layout.mesh!r} has axes "
                f"{layout.mesh.dim_names}. Use one of those."
            )


def _spec(specs: Sequence[Any]) -> PartitionSpec:
    return PartitionSpec(*(None if s == UNSHARDED else s for s in specs))


def _shard_map(
    fn: Any, layout: Layout, out_specs: Sequence[Any], x: Any, *, check_vma: bool = True
) -> Any:
    return jax.shard_map(
        fn,
        mesh=layout.mesh.jax_mesh,
        in_specs=(layout.partition_spec,),
        out_specs=_spec(out_specs),
        check_vma=check_vma,
    )(x)


def _varying(block: Any, layout: Layout, axes: tuple[str, ...]) -> Any:
    """Mark ``block`` as varying over the ``axes`` the layout replicates it on.

    Every device's block takes part in a collective, copies included; JAX's
    collectives refuse a mix of varying and replicated (invariant) axes.
    """
    split = {a for d in range(layout.rank) for a in layout.axes(d)}
    invariant = tuple(a for a in axes if a not in split)
    return jax.lax.pcast(block, invariant, to="varying") if invariant else block


def all_reduce(
    x: jax.Array,
    axes: str | Sequence[str],
    op: ReduceOp | str = ReduceOp.SUM,
    *,
    layout: Layout | None = None,
) -> jax.Array:
    """Combine the blocks of the devices along ``axes``.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], mesh))
        >>> dtensor.all_reduce(x, "x")          # the sum of the eight 1-element blocks
        Array([28.], dtype=float32)
        >>> dtensor.all_reduce(x, "x", dtensor.ReduceOp.MAX)
        Array([7.], dtype=float32)
    """
    axes = _axes("all_reduce", x, axes, op, layout=layout)
    op = ReduceOp.parse(op)
    layout = _input_layout(x, layout, "all_reduce")
    _check_axes(layout, axes, "all_reduce")
    return _shard_map(
        lambda b: op.across(_varying(b, layout, axes), axes), layout, _without(layout, axes), x
    )


def all_gather(
    x: jax.Array, axes: str | Sequence[str], *, layout: Layout | None = None
) -> jax.Array:
    """Concatenate the blocks along ``axes``: the dimension they split becomes whole.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], mesh))
        >>> y = dtensor.all_gather(x, "x")
        >>> dtensor.fetch_layout(y).is_fully_replicated(), bool((y == x).all())
        (True, True)
    """
    axes = _axes("all_gather", x, axes, layout=layout)
    layout = _input_layout(x, layout, "all_gather")
    _check_axes(layout, axes, "all_gather")
    dims = [d for d in range(layout.rank) if set(axes) & set(layout.axes(d))]
    if len(dims) != 1 or tuple(a for a in layout.axes(dims[0]) if a in axes) != axes:
        raise LayoutError(
            f"all_gather over {axes} needs one dimension split over exactly those axes (in that "
            f"order); the array's layout is {layout!r}. Relayout it first or name the right axes."
        )
    dim = dims[0]
    # Gather the minor-most axes of the dimension: they must be the trailing ones.
    dim_axes = layout.axes(dim)
    if dim_axes[len(dim_axes) - len(axes) :] != axes:
        raise LayoutError(
            f"all_gather over {axes}: dimension {dim} is split over {dim_axes}, and only its "
            "innermost (last) axes can be gathered while the others stay split."
        )
    return _shard_map(
        lambda b: jax.lax.all_gather(b, axes, axis=dim, tiled=True),
        layout,
        _without(layout, axes),
        x,
        check_vma=False,  # all_gather's result is the same on every device along `axes`.
    )


def reduce_scatter(
    x: jax.Array,
    axes: str | Sequence[str],
    *,
    dim: int = 0,
    op: ReduceOp | str = ReduceOp.SUM,
    layout: Layout | None = None,
) -> jax.Array:
    """Combine the blocks along ``axes`` and split the result over them along ``dim``.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = dtensor.copy_to_mesh(jnp.ones((8,)), dtensor.Layout.replicated(mesh, 1))
        >>> y = dtensor.reduce_scatter(x, "x")    # 8 replicas of ones, summed, then split
        >>> y, dtensor.fetch_layout(y)
        (Array([8., 8., 8., 8., 8., 8., 8., 8.], dtype=float32), Layout(['x'], mesh=Mesh(x=8)))
    """
    axes = _axes("reduce_scatter", x, axes, op, layout=layout)
    op = ReduceOp.parse(op)
    layout = _input_layout(x, layout, "reduce_scatter")
    _check_axes(layout, axes, "reduce_scatter")
    if not 0 <= dim < layout.rank:
        raise LayoutError(f"reduce_scatter dim={dim} is out of range for rank {layout.rank}.")
    n = layout.mesh.axis_size(axes)
    block = layout.local_shape(x.shape)
    if block[dim] % n:
        raise LayoutError(
            f"reduce_scatter over {axes} splits dimension {dim} of each block (size {block[dim]}) "
            f"into {n} pieces, which does not divide. Pad the dimension to a multiple of {n}."
        )
    out = _without(layout, axes)
    kept = out[dim]
    out[dim] = (*(() if kept is None else (kept,) if isinstance(kept, str) else kept), *axes)

    def fn(b: Any) -> Any:
        b = _varying(b, layout, axes)
        if op in (ReduceOp.SUM, ReduceOp.MEAN):
            r = jax.lax.psum_scatter(b, axes, scatter_dimension=dim, tiled=True)
            return r / n if op is ReduceOp.MEAN else r
        full = op.across(b, axes)
        size = block[dim] // n
        return jax.lax.dynamic_slice_in_dim(full, jax.lax.axis_index(axes) * size, size, axis=dim)

    return _shard_map(fn, layout, out, x)


def broadcast(
    x: jax.Array, axes: str | Sequence[str], *, source: int = 0, layout: Layout | None = None
) -> jax.Array:
    """Give every device along ``axes`` the block of the device at position ``source``.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> x = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], mesh))
        >>> dtensor.broadcast(x, "x", source=3)
        Array([3.], dtype=float32)
    """
    axes = _axes("broadcast", x, axes, layout=layout)
    layout = _input_layout(x, layout, "broadcast")
    _check_axes(layout, axes, "broadcast")
    n = layout.mesh.axis_size(axes)
    if not 0 <= source < n:
        raise LayoutError(
            f"broadcast source={source} is out of range; mesh axes {axes} have {n} positions."
        )

    def fn(b: Any) -> Any:
        b = _varying(b, layout, axes)
        mine = jax.lax.axis_index(axes) == source
        if b.dtype == jnp.bool_:
            return jax.lax.psum(jnp.where(mine, b, False).astype(jnp.int32), axes).astype(jnp.bool_)
        return jax.lax.psum(jnp.where(mine, b, jnp.zeros_like(b)), axes)

    return _shard_map(fn, layout, _without(layout, axes), x)
