"""`Mesh`: named axes over devices, a value object that compiles to `jax.sharding.Mesh`.

Axis types. JAX offers two kinds of mesh axes. *Auto* axes let the compiler
propagate shardings (ordinary Flax/optax code runs unchanged; layouts are hints
the compiler honours at the boundaries). *Explicit* axes make the sharding part
of every array's type (some ops then need an ``out_sharding=``). dtensor's
default is **Auto**, because unannotated Flax models and optax losses break in
ordinary places under Explicit axes (``nnx.Embed`` lookups, integer-label
cross-entropy). Pass ``axis_types="explicit"`` for models whose layers carry
``out_sharding=`` annotations (Flax's Gemma, for example).
"""

from __future__ import annotations

import dataclasses
import math
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType

__all__ = ["Mesh", "MeshError", "arrange_devices", "create_mesh", "current_mesh", "mesh_of"]

AxisTypes = Literal["auto", "explicit"]

_local = threading.local()


class MeshError(ValueError):
    """A mesh that cannot be built from what was asked."""


def _stack() -> list[Mesh]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


@dataclasses.dataclass(frozen=True, slots=True, eq=True)
class Mesh:
    """A named, n-dimensional arrangement of devices.

    A thin immutable wrapper over :class:`jax.sharding.Mesh`; two meshes are
    equal when their devices, axis names and axis types are. Build one with
    :func:`create_mesh`. ``with mesh:`` makes it the default mesh (for dtensor
    and for JAX's own ``jax.set_mesh``).

    Examples:
        >>> import dtensor
        >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
        >>> mesh
        Mesh(batch=4, model=2)
        >>> mesh.shape, mesh.size
        ({'batch': 4, 'model': 2}, 8)
    """

    jax_mesh: jax.sharding.Mesh

    def __post_init__(self) -> None:
        if not isinstance(self.jax_mesh, jax.sharding.Mesh):
            raise TypeError(
                f"Mesh wraps a jax.sharding.Mesh, got {type(self.jax_mesh).__name__}. "
                "Build meshes with dtensor.create_mesh([('batch', 4), ...])."
            )
        types = tuple(self.jax_mesh.axis_types)
        if AxisType.Auto in types and AxisType.Explicit in types:
            axes = ", ".join(
                f"{n}={t.name}" for n, t in zip(self.jax_mesh.axis_names, types, strict=True)
            )
            raise MeshError(
                f"Mesh got a jax.sharding.Mesh whose axes mix Auto and Explicit types ({axes}); "
                "dtensor (like Flax's sharding rules) needs all axes of one type, because a "
                "layout's meaning depends on it. Build the jax mesh with one type for every axis "
                "(axis_types=(AxisType.Auto,) * ndim), or use dtensor.create_mesh(..., "
                "axis_types='auto' or 'explicit')."
            )

    # ------------------------------------------------------------------ views
    @property
    def dim_names(self) -> tuple[str, ...]:
        """The axis names, outermost first."""
        return tuple(self.jax_mesh.axis_names)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size, in axis order."""
        return dict(self.jax_mesh.shape)

    @property
    def size(self) -> int:
        """The number of devices."""
        return int(self.jax_mesh.devices.size)

    @property
    def devices(self) -> np.ndarray:
        """The devices as an array of the mesh's shape."""
        return self.jax_mesh.devices

    @property
    def device_list(self) -> list[Any]:
        """The devices in mesh order (row-major over the axes)."""
        return list(self.jax_mesh.devices.flat)

    @property
    def local_devices(self) -> list[Any]:
        """The devices of this process, in mesh order."""
        pid = jax.process_index()
        return [d for d in self.jax_mesh.devices.flat if d.process_index == pid]

    @property
    def axis_types(self) -> AxisTypes:
        """``"auto"`` or ``"explicit"`` (all axes of a dtensor mesh share one type)."""
        types = set(self.jax_mesh.axis_types)
        return "explicit" if AxisType.Explicit in types else "auto"

    @property
    def platform(self) -> str:
        """The device platform (``"cpu"``, ``"gpu"``, ``"tpu"``)."""
        return self.device_list[0].platform

    @property
    def is_multi_process(self) -> bool:
        """Whether the mesh spans devices of more than one process."""
        return len({d.process_index for d in self.device_list}) > 1

    def axis_size(self, axes: str | Sequence[str] | None) -> int:
        """The product of the sizes of ``axes`` (1 for none)."""
        if axes is None:
            return 1
        if isinstance(axes, str):
            axes = (axes,)
        for a in axes:
            self.check_axis(a)
        return math.prod(self.shape[a] for a in axes)

    def check_axis(self, axis: str, what: str = "axis") -> None:
        """Raise a :class:`MeshError` naming ``what`` unless ``axis`` is an axis of this mesh."""
        if axis not in self.dim_names:
            raise MeshError(
                f"{what} {axis!r} is not an axis of {self!r}; the mesh has axes "
                f"{self.dim_names}. Use one of those names."
            )

    def with_axis_types(self, axis_types: AxisTypes) -> Mesh:
        """The same devices and names with other axis types."""
        return Mesh(
            jax.sharding.Mesh(
                self.jax_mesh.devices,
                self.dim_names,
                axis_types=(_axis_type(axis_types),) * len(self.dim_names),
            )
        )

    # -------------------------------------------------------------- context
    def __enter__(self) -> Mesh:
        stack = _stack()
        cm = jax.set_mesh(self.jax_mesh)
        cm.__enter__()
        stack.append(self)
        _cms().append(cm)
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()
        _cms().pop().__exit__(*exc)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in self.shape.items())
        if self.axis_types == "explicit":
            dims += ", axis_types='explicit'"
        return f"Mesh({dims})"

    @classmethod
    def from_jax(cls, mesh: jax.sharding.Mesh) -> Mesh:
        """Wrap an existing ``jax.sharding.Mesh``."""
        return cls(mesh)


def _cms() -> list[Any]:
    if not hasattr(_local, "cms"):
        _local.cms = []
    return _local.cms


def current_mesh() -> Mesh | None:
    """The current mesh: the innermost ``with mesh:`` block or ``jax.set_mesh(...)``, or ``None``.

    A ``jax.sharding.Mesh`` the user set with ``jax.set_mesh`` (outside
    ``jax.jit``) counts as much as a dtensor ``with mesh:``; the innermost of
    the two wins. Inside ``jax.jit`` only dtensor's own blocks are seen (JAX
    exposes just the abstract mesh there).

    Raises:
        MeshError: the mesh set with ``jax.set_mesh`` mixes Auto and Explicit axes.

    Examples:
        >>> import dtensor, jax
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> with mesh:
        ...     dtensor.current_mesh() == mesh
        True
        >>> with jax.set_mesh(mesh.jax_mesh):
        ...     dtensor.current_mesh() == mesh
        True
    """
    stack = _stack()
    ours = stack[-1] if stack else None
    theirs = _jax_concrete_mesh()
    if theirs is None or (ours is not None and ours.jax_mesh == theirs):
        return ours
    return Mesh(theirs)


def _jax_concrete_mesh() -> jax.sharding.Mesh | None:
    """The mesh of ``jax.set_mesh`` (public ``jax.sharding.get_mesh``), outside a trace."""
    try:
        mesh = jax.sharding.get_mesh()
    except ValueError:  # inside jax.jit JAX offers only the abstract mesh
        return None
    if not isinstance(mesh, jax.sharding.Mesh) or mesh.empty:
        return None
    return mesh


def _axis_type(t: AxisTypes | AxisType) -> AxisType:
    if isinstance(t, AxisType):
        return t
    if t == "auto":
        return AxisType.Auto
    if t == "explicit":
        return AxisType.Explicit
    raise ValueError(f"axis_types={t!r} is not valid; use 'auto' (the default) or 'explicit'.")


def _parse_dims(mesh_dims: Sequence[tuple[str, int]] | dict[str, int]) -> list[tuple[str, int]]:
    items = list(mesh_dims.items()) if isinstance(mesh_dims, dict) else list(mesh_dims)
    if not items:
        raise MeshError("mesh_dims is empty; give at least one named axis, e.g. [('batch', 8)].")
    dims: list[tuple[str, int]] = []
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)):
            raise MeshError(
                f"mesh_dims entry {item!r} is not a (name, size) pair; write mesh_dims as "
                "[('batch', 4), ('model', 2)]."
            )
        name, size = item
        if not isinstance(size, int | np.integer) or (size < 1 and size != -1):
            raise MeshError(
                f"mesh axis {name!r} has size {size!r}; sizes are positive integers, "
                "or -1 for one axis whose size is inferred from the device count."
            )
        dims.append((name, int(size)))
    names = [n for n, _ in dims]
    if len(set(names)) != len(names):
        raise MeshError(
            f"mesh axis names {tuple(names)} repeat a name; give each axis its own name."
        )
    return dims


def resolve_sizes(dims: list[tuple[str, int]], num_devices: int) -> list[tuple[str, int]]:
    """Infer a ``-1`` size from the device count and check the total."""
    inferred = [n for n, s in dims if s == -1]
    if len(inferred) > 1:
        raise MeshError(
            f"mesh axes {tuple(inferred)} all have size -1; at most one size can be inferred."
        )
    known = math.prod(s for _, s in dims if s != -1)
    if inferred:
        if num_devices % known:
            raise MeshError(
                f"cannot infer the size of mesh axis {inferred[0]!r}: {num_devices} devices do "
                f"not divide by the other axes' product {known}. Give every size explicitly."
            )
        dims = [(n, num_devices // known if s == -1 else s) for n, s in dims]
    return dims


def create_mesh(
    mesh_dims: Sequence[tuple[str, int]] | dict[str, int],
    devices: Sequence[Any] | np.ndarray | None = None,
    *,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """Create a :class:`Mesh` from ``[(name, size), ...]``.

    Args:
        mesh_dims: axis names and sizes, outermost first; one size may be ``-1``
            (inferred from the number of devices).
        devices: the devices to use; defaults to all devices
            (``jax.devices()``). Devices that fill the mesh are arranged
            topology-aware on TPU, as ``mesh_utils.create_device_mesh``
            arranges them on a real VM, given or not (so a mesh over
            :func:`dtensor.tpu_topology` devices compiles the program a real
            slice compiles); on other platforms, and when the mesh is smaller
            than ``devices`` (the first ones are used, with a warning on TPU),
            the given order is mesh order.
        axis_types: ``"auto"`` (default; ordinary Flax/optax code works) or
            ``"explicit"`` (sharding in types; for models with ``out_sharding=``
            annotations).

    Returns:
        The mesh.

    Raises:
        MeshError: malformed dims, or more devices asked for than exist.

    Examples:
        >>> import dtensor
        >>> dtensor.create_mesh([("data", -1), ("model", 2)])
        Mesh(data=4, model=2)
        >>> dtensor.create_mesh({"x": 2}, axis_types="explicit")
        Mesh(x=2, axis_types='explicit')
    """
    dims = _parse_dims(mesh_dims)
    explicit_devices = devices is not None
    if devices is None:
        devices = jax.devices()
    device_list = list(np.asarray(devices, dtype=object).flat)
    if not device_list:
        raise MeshError("devices is empty; pass at least one device or leave devices=None.")
    dims = resolve_sizes(dims, len(device_list))
    shape = tuple(s for _, s in dims)
    need = math.prod(shape)
    if need > len(device_list):
        where = "were given" if explicit_devices else "exist"
        raise MeshError(
            f"mesh {dict(dims)} needs {need} devices but only {len(device_list)} {where}. "
            "Make the axes smaller, use -1 for one size, or (on CPU) simulate more devices "
            "with jax.config.update('jax_num_cpu_devices', N) before JAX starts."
        )
    # Devices that fill the mesh (all of jax.devices(), or all those given) are
    # arranged as a real VM arranges them (topology-aware on TPU, whether given or
    # not: tpu_topology's devices come in host order, not ring order). A mesh over
    # the first of more devices keeps their order.
    full = len(device_list) == need
    if not full and explicit_devices and getattr(device_list[0], "platform", None) == "tpu":
        warnings.warn(
            f"create_mesh: mesh {dict(dims)} uses the first {need} of the {len(device_list)} "
            "TPU devices given, in the order given (not arranged as on a real VM, where "
            "mesh neighbours are neighbouring chips). Pass exactly the mesh's devices to have "
            "them arranged, or all of a slice's.",
            UserWarning,
            stacklevel=2,
        )
    device_list = device_list[:need]
    arr = arrange_devices(shape, device_list, topology_aware=full)
    return mesh_of(arr, tuple(n for n, _ in dims), axis_types=axis_types)


def mesh_of(arr: np.ndarray, names: tuple[str, ...], *, axis_types: AxisTypes = "auto") -> Mesh:
    """A :class:`Mesh` over an already arranged device array, in exactly that order."""
    types = (_axis_type(axis_types),) * len(names)
    return Mesh(jax.sharding.Mesh(arr, names, axis_types=types))


def arrange_devices(
    shape: tuple[int, ...],
    devices: Sequence[Any],
    *,
    topology_aware: bool = True,
    caller: str = "create_mesh",
) -> np.ndarray:
    """``devices`` as an array of ``shape``: topology-aware on TPU, in the given order elsewhere.

    On TPU, JAX's ``mesh_utils.create_device_mesh`` places neighbouring mesh
    positions on neighbouring chips, as on a real VM; devices of several slices
    go through ``create_hybrid_device_mesh``, the outermost axis that divides by
    the slice count spanning the slices (use
    :func:`dtensor.create_distributed_mesh` to choose the axis). When it cannot lay ``shape`` over these
    devices, a ``UserWarning`` names the reason and the order used instead (the
    given one). Other platforms have no topology: the given order, silently.

    Examples:
        >>> import jax
        >>> from dtensor.core.mesh import arrange_devices
        >>> arrange_devices((2, 4), jax.devices()).shape
        (2, 4)
    """
    arr = np.empty(len(devices), dtype=object)
    arr[:] = list(devices)
    if not (topology_aware and devices and getattr(devices[0], "platform", None) == "tpu"):
        return arr.reshape(shape)
    from jax.experimental import mesh_utils

    def arrange(split: bool) -> np.ndarray:
        slices = len({getattr(d, "slice_index", 0) for d in devices})
        if slices == 1:
            return mesh_utils.create_device_mesh(
                shape, list(devices), allow_split_physical_axes=split
            )
        # Several slices: the outermost axis that divides by the slice count spans them
        # (slice-major, as the given order has it), each slice arranged within.
        axis = next((i for i, n in enumerate(shape) if n % slices == 0), None)
        if axis is None:
            raise ValueError(f"no mesh axis is a multiple of the {slices} slices")
        ici = tuple(n // slices if i == axis else n for i, n in enumerate(shape))
        dcn = tuple(slices if i == axis else 1 for i in range(len(shape)))
        return mesh_utils.create_hybrid_device_mesh(
            ici, dcn, list(devices), allow_split_physical_axes=split
        )

    try:
        try:
            return arrange(split=False)
        except NotImplementedError:
            # An axis that is no product of whole chip-grid sides (8 over a 4x4 grid):
            # split a side, as jax.make_mesh does on v5e.
            return arrange(split=True)
    except Exception as e:  # noqa: BLE001 - any failure of the arrangement is reported below
        warnings.warn(
            f"{caller}: JAX's topology-aware arrangement (mesh_utils.create_device_mesh) cannot "
            f"lay mesh shape {shape} over these {len(devices)} TPU devices "
            f"({type(e).__name__}: {e}). Using the devices in the order given "
            f"(ids {[getattr(d, 'id', d) for d in list(devices)[:8]]}...), where mesh neighbours "
            "may be distant chips. Pass devices= in the order you want, or a mesh shape that "
            "fits the chip grid, to choose it yourself.",
            UserWarning,
            stacklevel=3,
        )
        return arr.reshape(shape)
