"""Partial values: per-device results (sum, max or min) not yet reduced.

A *partial* array over mesh axes ``A`` is one whose devices along ``A`` each
hold a different block, and whose value is those blocks combined (summed,
max'ed or min'ed). It is what a contraction over a sharded dimension produces
before its all-reduce (``x @ w`` with ``x`` split on its columns and ``w`` on
its rows), and what per-replica gradients are. PyTorch's DTensor calls it the
``Partial`` placement; JAX calls it *unreduced* axes.

Where partial-ness is recorded (two representations, chosen from the layout):

- **native** — a mesh with Explicit axes and ``ReduceOp.SUM``: a plain
  ``jax.Array`` whose sharding is ``PartitionSpec(..., unreduced={axes})``.
  JAX itself knows the value is partial; :func:`dtensor.fetch_layout` reads it
  from the sharding, and the all-reduce is JAX's own ``reshard``.
- **stacked** — every other case (JAX's unreduced axes exist only on Explicit
  axes, and only for sums): a :class:`PartialArray`, a pytree holding the
  blocks as one global array with a leading dimension of size ``|A|`` split
  over ``A`` (each device keeps exactly its block, nothing is copied), plus the
  partial :class:`Layout`. It passes through ``jax.jit`` like any pytree.

Reduction (``dtensor.relayout`` from a partial to a non-partial layout):

- to a layout that does not split any dimension over a partial axis: an
  all-reduce (``reshard`` for native sums; ``psum``/``pmax``/``pmin`` in a
  ``jax.shard_map`` otherwise);
- to a layout that splits dimension ``d`` over partial axes (appended, minor
  most, to what already splits ``d``): a reduce-scatter — ``psum_scatter`` for
  sums, an ``all_to_all`` followed by a local max/min for MAX/MIN;
- anything else is the reduction above followed by an ordinary relayout.

Create partial values with :func:`dtensor.pack` (one block per device) or
:func:`dtensor.call_with_layout` with a partial layout, which runs the
function once per device on the blocks of its arguments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dtensor.core.layout import UNSHARDED, Layout, LayoutError
from dtensor.core.mesh import Mesh
from dtensor.core.placement import array_layout, copy_to_mesh, is_traced, relayout_plain
from dtensor.core.reduce_op import ReduceOp

__all__ = [
    "PartialArray",
    "is_native",
    "partial_layout_of",
    "reduce_block",
    "relayout_partial",
    "scatter_block",
    "stacked_layout",
]


def is_native(layout: Layout) -> bool:
    """Whether JAX records this partial layout itself (Explicit axes and ``SUM``).

    Examples:
        >>> import dtensor
        >>> from dtensor.core.partial import is_native
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> is_native(dtensor.Layout.partial(mesh, "x", rank=1))
        False
        >>> is_native(dtensor.Layout.partial(mesh.with_axis_types("explicit"), "x", rank=1))
        True
    """
    return layout.mesh.axis_types == "explicit" and layout.reduce_op is ReduceOp.SUM


def _axes_spec(axes: Sequence[str]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else tuple(axes)


def stacked_layout(layout: Layout) -> Layout:
    """The layout of a :class:`PartialArray`'s blocks: a leading dimension over the partial axes."""
    return Layout([_axes_spec(layout.partial_axes), *layout.sharding_specs], layout.mesh)


def unreduced_sharding(layout: Layout) -> NamedSharding:
    """The native ``NamedSharding`` (with ``unreduced=``) of a partial layout."""
    spec = [None if s == UNSHARDED else s for s in layout.sharding_specs]
    return NamedSharding(
        layout.mesh.jax_mesh, PartitionSpec(*spec, unreduced=frozenset(layout.partial_axes))
    )


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class PartialArray:
    """A partial value kept as its per-device blocks (the *stacked* form).

    ``blocks`` has shape ``(|partial axes|, *shape)`` and is split on
    dimension 0 over the partial axes, so each device holds only its own
    block. Use :func:`dtensor.relayout` to reduce it, :func:`dtensor.unpack`
    to see the blocks.

    Examples:
        >>> import dtensor, numpy as np
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> layout = dtensor.Layout.partial(mesh, "x", rank=1, op="max")
        >>> p = dtensor.pack([np.array([float(i)]) for i in range(8)], layout)
        >>> p
        PartialArray(shape=(1,), dtype=float32, layout=Layout([UNSHARDED], mesh=Mesh(x=8), partial=max('x')))
        >>> dtensor.relayout(p, layout.unreduced()).tolist()
        [7.0]
    """

    blocks: Any
    layout: Layout

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (reduced) global shape."""
        return tuple(self.blocks.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.blocks.dtype

    def reduce(self) -> Any:
        """The reduced value, in this layout without its partial axes."""
        return relayout_partial(self, self.layout.unreduced())

    def tree_flatten(self) -> tuple[tuple[Any], Layout]:
        return (self.blocks,), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: Sequence[Any]) -> PartialArray:
        return cls(children[0], layout)

    def __repr__(self) -> str:
        return f"PartialArray(shape={self.shape}, dtype={self.dtype}, layout={self.layout!r})"


def partial_layout_of(x: Any, mesh: Mesh | None = None) -> Layout | None:
    """The partial layout of ``x`` (either form), or ``None`` when ``x`` is not partial.

    ``mesh`` names the concrete mesh of a traced value's abstract one.
    """
    if isinstance(x, PartialArray):
        return x.layout
    if isinstance(x, jax.core.Tracer):
        sharding = getattr(jax.typeof(x), "sharding", None)
    elif isinstance(x, jax.Array):
        sharding = x.sharding
    else:
        return None
    if not isinstance(sharding, NamedSharding) or not getattr(sharding.spec, "unreduced", None):
        return None
    if mesh is not None and sharding.mesh in (mesh.jax_mesh, mesh.jax_mesh.abstract_mesh):
        sharding = NamedSharding(mesh.jax_mesh, sharding.spec)
        return Layout.from_sharding(sharding, rank=len(x.shape))
    return array_layout(x)


def assemble(shards: Sequence[Any], layout: Layout, global_shape: tuple[int, ...]) -> Any:
    """One partial value from one block per local device (mesh order); see :func:`dtensor.pack`."""
    devices = layout.mesh.local_devices
    if is_native(layout):
        arrays = [jax.device_put(s, d) for s, d in zip(shards, devices, strict=True)]
        return jax.make_array_from_single_device_arrays(
            global_shape, unreduced_sharding(layout), arrays
        )
    stacked = stacked_layout(layout)
    n = layout.mesh.axis_size(layout.partial_axes)
    arrays = [jax.device_put(np.expand_dims(s, 0), d) for s, d in zip(shards, devices, strict=True)]
    blocks = jax.make_array_from_single_device_arrays((n, *global_shape), stacked.sharding, arrays)
    return PartialArray(blocks, layout)


def blocks_of(x: Any) -> list[Any]:
    """Each local device's partial block, in mesh order."""
    layout = partial_layout_of(x)
    assert layout is not None
    arr = x.blocks if isinstance(x, PartialArray) else x
    by_device = {s.device: s.data for s in arr.addressable_shards}
    out = [by_device[d] for d in layout.mesh.local_devices]
    return [b[0] for b in out] if isinstance(x, PartialArray) else out


# ----------------------------------------------------------------- per block
def reduce_block(block: Any, axes: Sequence[str], op: ReduceOp) -> Any:
    """Inside ``shard_map``: every device along ``axes`` gets the combination of their blocks."""
    return op.across(block, axes)


def scatter_block(block: Any, axes: Sequence[str], op: ReduceOp, dim: int) -> Any:
    """Inside ``shard_map``: combine the blocks along ``axes`` and keep this device's piece of ``dim``.

    Sums use ``psum_scatter`` (a reduce-scatter); MAX/MIN exchange pieces with
    one ``all_to_all`` and combine them locally (the same bytes moved).
    """
    axes = tuple(axes)
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        out = jax.lax.psum_scatter(block, axes, scatter_dimension=dim, tiled=True)
        return out / jax.lax.axis_size(axes) if op is ReduceOp.MEAN else out
    n = jax.lax.axis_size(axes)
    shape = block.shape
    pieces = block.reshape(*shape[:dim], n, shape[dim] // n, *shape[dim + 1 :])
    pieces = jnp.moveaxis(pieces, dim, 0)
    received = jax.lax.all_to_all(pieces, axes, 0, 0, tiled=True)
    return (jnp.max if op is ReduceOp.MAX else jnp.min)(received, axis=0)


# ------------------------------------------------------------------ relayout
def _plan(src: Layout, target: Layout, shape: tuple[int, ...]) -> dict[int, tuple[str, ...]]:
    """For each dimension, the partial axes a reduce-scatter puts onto it."""
    plan: dict[int, tuple[str, ...]] = {}
    partial = set(src.partial_axes)
    local = src.unreduced().local_shape(shape)
    for dim in range(target.rank):
        have, want = src.axes(dim), target.axes(dim)
        extra = want[len(have) :]
        if want[: len(have)] != have or not extra or not set(extra) <= partial:
            continue
        if local[dim] % src.mesh.axis_size(extra):
            continue
        plan[dim] = extra
    return plan


def relayout_partial(x: Any, target: Layout, *, name: str = "array") -> Any:
    """Relayout where the source or the target is partial (called by :func:`dtensor.relayout`)."""
    src = partial_layout_of(x, target.mesh)
    if src is None:
        raise LayoutError(
            f"cannot relayout {name} *to* the partial layout {target!r}: partial values come "
            "from computations (dtensor.pack or dtensor.call_with_layout with a partial layout), "
            "not from moving data. Relayout to a non-partial layout."
        )
    shape = tuple(x.shape)
    target.check_shape(shape, name)
    if target.mesh != src.mesh:
        raise LayoutError(
            f"{name} is partial over {src.mesh!r} but the target layout {target!r} is on another "
            "mesh. Reduce it on its own mesh first (relayout to a non-partial layout there)."
        )
    if target.is_partial:
        if (target.partial_axes, target.reduce_op) != (src.partial_axes, src.reduce_op):
            raise LayoutError(
                f"cannot relayout {name} from {src!r} to {target!r}: a partial value can move to "
                "another partial layout only with the same partial axes and reduce op. Reduce it "
                "first (relayout to a non-partial layout)."
            )
        if isinstance(x, PartialArray):
            return PartialArray(relayout_plain(x.blocks, stacked_layout(target), name=name), target)
        return _reshard(x, unreduced_sharding(target))
    plan = _plan(src, target, shape)
    scattered = [a for axes in plan.values() for a in axes]
    reduced = tuple(a for a in src.partial_axes if a not in scattered)
    specs: list[Any] = list(src.sharding_specs)
    for dim, axes in plan.items():
        specs[dim] = (*src.axes(dim), *axes)
    middle = Layout(specs, src.mesh)
    op = src.reduce_op
    native = not isinstance(x, PartialArray)
    if native and not plan:
        out = _reshard(x, middle.sharding)  # JAX's own unreduced -> reduced (an all-reduce)
    else:

        def body(block: Any) -> Any:
            if not native:
                block = block[0]
            for dim, axes in plan.items():
                block = scatter_block(block, axes, op, dim)
            return reduce_block(block, reduced, op)

        in_spec = unreduced_sharding(src).spec if native else stacked_layout(src).partition_spec
        fn = jax.shard_map(
            body, mesh=src.mesh.jax_mesh, in_specs=(in_spec,), out_specs=middle.partition_spec
        )
        arg = x if native else x.blocks
        out = fn(arg) if is_traced(arg) else _jit(fn)(arg)
    if middle == target:
        return out
    return relayout_plain(out, target, name=name)


_JITS: dict[Any, Callable[..., Any]] = {}


def _jit(fn: Callable[..., Any]) -> Callable[..., Any]:
    return jax.jit(fn)


def _reshard(x: Any, sharding: NamedSharding) -> Any:
    if isinstance(x, jax.core.Tracer):
        return jax.sharding.reshard(x, sharding)
    fn = _JITS.get(sharding)
    if fn is None:
        fn = _JITS[sharding] = jax.jit(lambda a: jax.sharding.reshard(a, sharding))
    return fn(x)


# ------------------------------------------------------------------ creation
def call_per_device(
    fn: Callable[..., Any], layout: Layout, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``fn`` once per device on the blocks of its array arguments; its result is that device's partial block.

    Array arguments keep their own layouts (they must be on ``layout.mesh``);
    host arrays are replicated. See :func:`dtensor.call_with_layout`.
    """
    name = getattr(fn, "__name__", "fn")
    flat, treedef = jax.tree.flatten((args, kwargs))
    dyn = [i for i, v in enumerate(flat) if isinstance(v, jax.Array | np.ndarray)]
    arrays, specs = [], []
    for i in dyn:
        v = flat[i]
        if isinstance(v, jax.Array) and not isinstance(v, jax.core.Tracer):
            lay = array_layout(v)
            if lay.mesh != layout.mesh or lay.is_partial:
                raise LayoutError(
                    f"call_with_layout({name}, {layout!r}): argument leaf {i} has layout {lay!r}; "
                    "with a partial layout every array argument must be a non-partial array on "
                    "the same mesh. Relayout it to that mesh first."
                )
        else:
            lay = Layout.replicated(layout.mesh, np.ndim(v))
            v = copy_to_mesh(np.asarray(v), lay)
        arrays.append(v)
        specs.append(lay.partition_spec)

    def body(*blocks: Any) -> Any:
        values = list(flat)
        for i, b in zip(dyn, blocks, strict=True):
            values[i] = b
        a, kw = jax.tree.unflatten(treedef, values)
        out = fn(*a, **kw)
        if not isinstance(out, jax.Array):
            raise LayoutError(
                f"call_with_layout({name}, {layout!r}) needs {name} to return one array per "
                f"device (its partial block); it returned {type(out).__name__}. Return a single "
                "array, or use separate calls."
            )
        layout.check_shape(layout.unreduced().global_shape(out.shape), f"output of {name}")
        # Every device's block takes part: make the block vary over the partial axes.
        varying = getattr(getattr(jax.typeof(out), "mat", None), "varying", frozenset())
        missing = tuple(a for a in layout.partial_axes if a not in varying)
        if missing:
            out = jax.lax.pcast(out, missing, to="varying")
        if not is_native(layout):
            return out[None]
        # Typed unreduced over the partial axes, as the out_specs say (jax >= 0.12 checks it).
        return jax.lax.pcast(out, tuple(layout.partial_axes), to="unreduced")

    out_spec = (
        unreduced_sharding(layout).spec
        if is_native(layout)
        else stacked_layout(layout).partition_spec
    )
    mapped = jax.shard_map(
        body, mesh=layout.mesh.jax_mesh, in_specs=tuple(specs), out_specs=out_spec
    )
    out = jax.jit(mapped)(*arrays)
    return out if is_native(layout) else PartialArray(out, layout)
