"""`Layout`: for each dimension of an array, the mesh axes that split it.

A layout is a value: the mesh plus one entry per array dimension, each either
``UNSHARDED`` (the dimension is whole on every device), a mesh axis name, or a
tuple of axis names (the dimension is split over their product, major first).
A layout may also be *partial* over some mesh axes: each device then holds a
per-device partial result (a sum, max or min) not yet combined across those
axes; relayouting it to a non-partial layout performs the reduction.

Layouts compile to :class:`jax.sharding.NamedSharding`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from dtensor.core.mesh import Mesh, create_mesh
from dtensor.core.picture import blocks_table
from dtensor.core.reduce_op import ReduceOp

__all__ = ["UNSHARDED", "Layout", "LayoutError", "DimSpec"]

UNSHARDED = "unsharded"
"""The sharding spec of a dimension that is not split (``None`` means the same)."""

DimSpec = str | tuple[str, ...] | None


class LayoutError(ValueError):
    """A layout that does not fit its mesh or its array."""


def _norm_dim(spec: Any, dim: int) -> str | tuple[str, ...]:
    if spec is None or spec == UNSHARDED:
        return UNSHARDED
    if isinstance(spec, str):
        return spec
    if isinstance(spec, tuple | list) and all(isinstance(a, str) for a in spec):
        axes = tuple(spec)
        if not axes:
            return UNSHARDED
        return axes[0] if len(axes) == 1 else axes
    raise LayoutError(
        f"Layout dimension {dim} has spec {spec!r}; a dimension's spec is a mesh axis name, "
        "a tuple of axis names, or UNSHARDED."
    )


def _axes_of(spec: str | tuple[str, ...]) -> tuple[str, ...]:
    if spec == UNSHARDED:
        return ()
    return (spec,) if isinstance(spec, str) else spec


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Layout:
    """How an array is laid out over a :class:`Mesh`.

    Args:
        sharding_specs: one entry per array dimension: a mesh axis name, a
            tuple of axis names, or ``UNSHARDED``/``None``.
        mesh: the mesh.
        partial_axes: mesh axes over which each device holds a partial value
            not yet reduced (see :meth:`Layout.partial`).
        reduce_op: how partial values combine (``SUM``, ``MAX``, ``MIN``).

    Examples:
        >>> import dtensor
        >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
        >>> layout = dtensor.Layout(["batch", None], mesh)
        >>> layout
        Layout(['batch', UNSHARDED], mesh=Mesh(batch=4, model=2))
        >>> layout.partition_spec
        P('batch', None)
        >>> layout.local_shape((8, 6))
        (2, 6)
    """

    sharding_specs: tuple[str | tuple[str, ...], ...]
    mesh: Mesh
    partial_axes: tuple[str, ...]
    reduce_op: ReduceOp

    def __init__(
        self,
        sharding_specs: Sequence[DimSpec],
        mesh: Mesh,
        *,
        partial_axes: Sequence[str] = (),
        reduce_op: ReduceOp | str = ReduceOp.SUM,
    ) -> None:
        if not isinstance(mesh, Mesh):
            raise TypeError(
                f"Layout needs a dtensor.Mesh, got {type(mesh).__name__}. Build one with "
                "dtensor.create_mesh(...) or wrap a jax mesh with dtensor.Mesh(jax_mesh)."
            )
        if isinstance(sharding_specs, str):
            raise TypeError(
                f"sharding_specs={sharding_specs!r} is a string; pass a list with one entry per "
                "dimension, e.g. ['batch', UNSHARDED], or use Layout.from_string."
            )
        specs = tuple(_norm_dim(s, i) for i, s in enumerate(sharding_specs))
        if isinstance(partial_axes, str):
            partial_axes = (partial_axes,)
        op = ReduceOp.parse(reduce_op)
        if not partial_axes:
            op = ReduceOp.SUM  # Only partial values combine; keeps equal layouts equal.
        object.__setattr__(self, "sharding_specs", specs)
        object.__setattr__(self, "mesh", mesh)
        object.__setattr__(self, "partial_axes", tuple(partial_axes))
        object.__setattr__(self, "reduce_op", op)
        self._validate()
        # Partial axes are a set: keep them once each, in mesh order.
        names = mesh.dim_names
        object.__setattr__(self, "partial_axes", tuple(a for a in names if a in self.partial_axes))

    def _validate(self) -> None:
        names = self.mesh.dim_names
        used: dict[str, int] = {}
        for dim, spec in enumerate(self.sharding_specs):
            for axis in _axes_of(spec):
                if axis not in names:
                    raise LayoutError(
                        f"Layout dimension {dim} names mesh axis {axis!r}, but the mesh has axes "
                        f"{names}. Use one of those, or UNSHARDED to replicate it."
                    )
                if axis in used:
                    raise LayoutError(
                        f"Layout uses mesh axis {axis!r} for dimensions {used[axis]} and {dim} "
                        f"(mesh {self.mesh!r}); a mesh axis can split only one dimension. Use "
                        "UNSHARDED for one of them, or another axis."
                    )
                used[axis] = dim
        for axis in self.partial_axes:
            if axis not in names:
                raise LayoutError(
                    f"partial axis {axis!r} is not an axis of {self.mesh!r} (axes {names}). "
                    "Use one of those names."
                )
            if axis in used:
                raise LayoutError(
                    f"mesh axis {axis!r} is both partial and splits dimension {used[axis]}; a "
                    "value is either partial over an axis or sharded on it. Drop one."
                )
        if self.partial_axes and self.reduce_op is ReduceOp.MEAN:
            raise LayoutError(
                "a partial layout's reduce_op is SUM, MAX or MIN; MEAN is SUM followed by a "
                "division, so use ReduceOp.SUM and divide by the axis size."
            )

    # ----------------------------------------------------------- constructors
    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> Layout:
        """Every dimension whole on every device.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("x", 8)])
            >>> dtensor.Layout.replicated(mesh, rank=2).is_fully_replicated()
            True
        """
        return cls([UNSHARDED] * rank, mesh)

    @classmethod
    def batch_sharded(
        cls, mesh: Mesh, batch_dim: str | tuple[str, ...], rank: int, axis: int = 0
    ) -> Layout:
        """Dimension ``axis`` split over mesh axis ``batch_dim``; the rest replicated.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("batch", 8)])
            >>> dtensor.Layout.batch_sharded(mesh, "batch", rank=3)
            Layout(['batch', UNSHARDED, UNSHARDED], mesh=Mesh(batch=8))
        """
        if not -rank <= axis < rank:
            raise LayoutError(f"axis={axis} is out of range for rank {rank}; use 0..{rank - 1}.")
        specs: list[DimSpec] = [UNSHARDED] * rank
        specs[axis] = batch_dim
        return cls(specs, mesh)

    @classmethod
    def inner_sharded(cls, mesh: Mesh, inner_dim: str | tuple[str, ...], rank: int) -> Layout:
        """The last dimension split over ``inner_dim``; the rest replicated.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("model", 8)])
            >>> dtensor.Layout.inner_sharded(mesh, "model", rank=2).to_string()
            'sharding_specs:unsharded,model, mesh:|model=8|0,1,2,3,4,5,6,7|auto'
        """
        return cls.batch_sharded(mesh, inner_dim, rank, axis=rank - 1)

    @classmethod
    def partial(
        cls,
        mesh: Mesh,
        axes: str | Sequence[str],
        *,
        rank: int | None = None,
        sharding_specs: Sequence[DimSpec] | None = None,
        op: ReduceOp | str = ReduceOp.SUM,
    ) -> Layout:
        """A layout whose devices hold partial results (not yet reduced) over ``axes``.

        Give either ``rank`` (all dimensions unsharded) or ``sharding_specs``.
        Relayout to a non-partial layout reduces: to replicated, an all-reduce;
        to a layout sharded on a partial axis, a reduce-scatter.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("x", 8)])
            >>> dtensor.Layout.partial(mesh, "x", rank=1)
            Layout([UNSHARDED], mesh=Mesh(x=8), partial=sum('x'))
        """
        if sharding_specs is None:
            if rank is None:
                raise LayoutError("Layout.partial needs rank= or sharding_specs=; give one.")
            sharding_specs = [UNSHARDED] * rank
        return cls(
            sharding_specs,
            mesh,
            partial_axes=tuple([axes] if isinstance(axes, str) else axes),
            reduce_op=op,
        )

    @classmethod
    def from_sharding(cls, sharding: jax.sharding.Sharding, rank: int | None = None) -> Layout:
        """The layout of a ``NamedSharding`` (or a single-device sharding).

        Args:
            sharding: the sharding.
            rank: the array's rank; needed when the spec is shorter than the
                array (trailing dimensions are unsharded) and for single-device
                shardings.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("x", 8)])
            >>> s = dtensor.Layout(["x", None], mesh).sharding
            >>> dtensor.Layout.from_sharding(s) == dtensor.Layout(["x", None], mesh)
            True
        """
        if isinstance(sharding, NamedSharding):
            if not isinstance(sharding.mesh, jax.sharding.Mesh):
                raise LayoutError(
                    "this NamedSharding is over an abstract mesh (inside a trace); fetch the "
                    "layout of a concrete array, or pass the Layout you gave."
                )
            spec = tuple(getattr(sharding.spec, "partitions", sharding.spec))  # unreduced-safe
            if rank is not None:
                if len(spec) > rank:
                    raise LayoutError(
                        f"sharding spec {sharding.spec} has {len(spec)} entries but rank is {rank}; "
                        "a spec has at most one entry per dimension. Pass the array's rank."
                    )
                spec = spec + (None,) * (rank - len(spec))
            unreduced = tuple(getattr(sharding.spec, "unreduced", ()) or ())
            return cls(list(spec), Mesh(sharding.mesh), partial_axes=unreduced)
        if isinstance(sharding, jax.sharding.SingleDeviceSharding):
            if rank is None:
                raise LayoutError("a single-device sharding needs rank= to give a layout.")
            (device,) = sharding.device_set
            return cls.replicated(create_mesh([("device", 1)], devices=[device]), rank)
        raise TypeError(
            f"cannot read a Layout from a {type(sharding).__name__}; dtensor layouts come from "
            "NamedSharding or SingleDeviceSharding. Relayout the array first."
        )

    # ------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        """The number of array dimensions."""
        return len(self.sharding_specs)

    @property
    def partition_spec(self) -> PartitionSpec:
        """The ``jax.sharding.PartitionSpec`` (partial axes are not part of it)."""
        return PartitionSpec(*(None if s == UNSHARDED else s for s in self.sharding_specs))

    @property
    def sharding(self) -> NamedSharding:
        """The ``jax.sharding.NamedSharding`` of this layout (its device placement)."""
        return NamedSharding(self.mesh.jax_mesh, self.partition_spec)

    @property
    def is_partial(self) -> bool:
        """Whether devices hold unreduced partial values."""
        return bool(self.partial_axes)

    def axes(self, dim: int) -> tuple[str, ...]:
        """The mesh axes that split dimension ``dim`` (empty when unsharded)."""
        return _axes_of(self.sharding_specs[dim])

    def num_shards(self, dim: int) -> int:
        """How many pieces dimension ``dim`` is split into.

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("data", 2), ("fsdp", 4)])
            >>> dtensor.Layout([("data", "fsdp"), None], mesh).num_shards(0)
            8
        """
        if not -self.rank <= dim < self.rank:
            raise LayoutError(f"dimension {dim} is out of range for a rank-{self.rank} layout.")
        return math.prod(self.mesh.shape[a] for a in self.axes(dim))

    def is_fully_replicated(self) -> bool:
        """Whether every device holds the whole (reduced) array."""
        return all(s == UNSHARDED for s in self.sharding_specs) and not self.partial_axes

    def check_shape(self, shape: Sequence[int], name: str = "array") -> None:
        """Raise a :class:`LayoutError` if ``shape`` cannot take this layout.

        ``name`` (a pytree path, say) appears in the message.
        """
        shape = tuple(shape)
        if len(shape) != self.rank:
            raise LayoutError(
                f"{name} has rank {len(shape)} (shape {shape}) but the layout {self!r} has rank "
                f"{self.rank}. Give a layout with one spec per dimension."
            )
        for dim, size in enumerate(shape):
            n = self.num_shards(dim)
            if size % n:
                raise LayoutError(
                    f"{name} dimension {dim} has size {size}, which does not divide into the "
                    f"{n} shards of mesh axes {self.axes(dim)} (layout {self!r}). Pad the array "
                    f"to a multiple of {n}, or leave that dimension UNSHARDED."
                )

    def local_shape(self, global_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of each device's block of an array of ``global_shape``."""
        self.check_shape(global_shape)
        return tuple(s // self.num_shards(d) for d, s in enumerate(global_shape))

    def global_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape whose blocks have ``local_shape``."""
        if len(local_shape) != self.rank:
            raise LayoutError(
                f"local shape {tuple(local_shape)} has rank {len(local_shape)} but the layout has "
                f"rank {self.rank}."
            )
        return tuple(s * self.num_shards(d) for d, s in enumerate(local_shape))

    def with_mesh(self, mesh: Mesh) -> Layout:
        """The same specs over another mesh with the axes they name."""
        return Layout(
            self.sharding_specs, mesh, partial_axes=self.partial_axes, reduce_op=self.reduce_op
        )

    def unreduced(self) -> Layout:
        """This layout without its partial axes (what a reduction produces)."""
        return Layout(self.sharding_specs, self.mesh)

    # ---------------------------------------------------------------- text
    def to_string(self) -> str:
        """A text form that :meth:`from_string` reads back (device ids included).

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
            >>> s = dtensor.Layout([("batch", "model"), None], mesh).to_string()
            >>> s
            'sharding_specs:batch+model,unsharded, mesh:|batch=4,model=2|0,1,2,3,4,5,6,7|auto'
            >>> dtensor.Layout.from_string(s) == dtensor.Layout([("batch", "model"), None], mesh)
            True
        """
        specs = ",".join(s if isinstance(s, str) else "+".join(s) for s in self.sharding_specs)
        dims = ",".join(f"{n}={s}" for n, s in self.mesh.shape.items())
        ids = ",".join(str(d.id) for d in self.mesh.device_list)
        text = f"sharding_specs:{specs}, mesh:|{dims}|{ids}|{self.mesh.axis_types}"
        if self.partial_axes:
            text += f", partial:{self.reduce_op.value}({'+'.join(self.partial_axes)})"
        return text

    @classmethod
    def from_string(
        cls, text: str, mesh: Mesh | None = None, *, devices: Sequence[Any] | None = None
    ) -> Layout:
        """Parse :meth:`to_string`'s form.

        Args:
            text: ``"sharding_specs:a,unsharded, mesh:|a=4,b=2|0,...,7|auto"``; the
                mesh part may be left out when ``mesh`` is given
                (``"sharding_specs:a,unsharded"``, or just ``"a,unsharded"``).
            mesh: the mesh to use instead of the one in the text.
            devices: where to look device ids up (default ``jax.devices()``).

        Examples:
            >>> import dtensor
            >>> mesh = dtensor.create_mesh([("x", 8)])
            >>> dtensor.Layout.from_string("x,unsharded", mesh)
            Layout(['x', UNSHARDED], mesh=Mesh(x=8))
        """
        m = _STRING_RE.fullmatch(text.strip()) if isinstance(text, str) else None
        if m is None or not m.group("specs"):
            raise LayoutError(
                f"layout string {text!r} is malformed; expected "
                "'sharding_specs:a,unsharded, mesh:|a=4,b=2|0,1,...|auto' (or just 'a,unsharded' "
                "with mesh=). Produce one with Layout.to_string()."
            )
        specs: list[DimSpec] = []
        for item in m.group("specs").split(","):
            item = item.strip()
            if not item:
                raise LayoutError(
                    f"layout string {text!r} has an empty dimension spec; write 'unsharded'."
                )
            specs.append(UNSHARDED if item == UNSHARDED else tuple(item.split("+")))
        if mesh is None:
            if m.group("dims") is None:
                raise LayoutError(
                    f"layout string {text!r} has no mesh part; pass mesh= or use the full form "
                    "from Layout.to_string()."
                )
            mesh = _mesh_from_text(text, m.group("dims"), m.group("ids"), m.group("types"), devices)
        partial: tuple[str, ...] = ()
        op = ReduceOp.SUM
        if m.group("pop"):
            op = ReduceOp.parse(m.group("pop"))
            partial = tuple(m.group("paxes").split("+"))
        return cls(specs, mesh, partial_axes=partial, reduce_op=op)

    # ---------------------------------------------------------------- misc
    def visualize(self, shape: Sequence[int] | None = None, *, show: bool = True) -> Any:
        """Print (and return) a picture of which device holds which block.

        See :func:`dtensor.visualize`.
        """
        shape = (
            tuple(shape)
            if shape is not None
            else tuple(self.num_shards(d) for d in range(self.rank))
        )
        self.check_shape(shape)
        index_map = self.sharding.devices_indices_map(shape)
        return blocks_table(f"{self!r}  shape={shape}", index_map, shape, show=show)

    def __repr__(self) -> str:
        items = ", ".join("UNSHARDED" if s == UNSHARDED else repr(s) for s in self.sharding_specs)
        text = f"Layout([{items}], mesh={self.mesh!r}"
        if self.partial_axes:
            axes = ", ".join(repr(a) for a in self.partial_axes)
            text += f", partial={self.reduce_op.value}({axes})"
        return text + ")"


_STRING_RE = re.compile(
    r"(?:sharding_specs:)?(?P<specs>[^|]*?)"
    r"(?:,\s*mesh:\|(?P<dims>[^|]*)\|(?P<ids>[^|]*)\|(?P<types>auto|explicit))?"
    r"(?:,\s*partial:(?P<pop>sum|max|min)\((?P<paxes>[^)]+)\))?"
)


def _mesh_from_text(
    text: str, dims: str, ids: str, types: str, devices: Sequence[Any] | None
) -> Mesh:
    try:
        pairs = [(n, int(s)) for n, s in (p.split("=") for p in dims.split(","))]
        id_list = [int(i) for i in ids.split(",")]
    except ValueError:
        raise LayoutError(
            f"layout string {text!r} has a malformed mesh part; expected '|a=4,b=2|0,1,...|auto'."
        ) from None
    by_id = {d.id: d for d in (devices if devices is not None else jax.devices())}
    missing = [i for i in id_list if i not in by_id]
    if missing:
        raise LayoutError(
            f"layout string {text!r} names devices {missing[:8]} that are not present "
            f"({len(by_id)} devices exist). Pass mesh= to use another mesh."
        )
    arr = np.empty(len(id_list), dtype=object)
    arr[:] = [by_id[i] for i in id_list]
    names = tuple(n for n, _ in pairs)
    shape = tuple(s for _, s in pairs)
    if math.prod(shape) != len(id_list):
        raise LayoutError(
            f"layout string {text!r}: mesh sizes {shape} do not match {len(id_list)} device ids."
        )
    axis_type = (
        jax.sharding.AxisType.Explicit if types == "explicit" else jax.sharding.AxisType.Auto
    )
    return Mesh(jax.sharding.Mesh(arr.reshape(shape), names, axis_types=(axis_type,) * len(names)))
