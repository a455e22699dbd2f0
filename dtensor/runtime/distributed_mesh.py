"""`create_distributed_mesh`: one mesh over the devices of many hosts or slices.

Two networks join the devices of a large job: the fast one inside a slice or
host (ICI on TPU, NVLink on GPU) and the slow one between them (DCN). Each
mesh axis gets a size within one group (``mesh_dims``) and a number of groups
(``dcn_mesh_dims``); its full size is their product, **group-major**: along an
axis of size ``dcn * ici``, positions ``[g * ici, (g + 1) * ici)`` are group
``g``'s devices. This is ``jax.experimental.mesh_utils.create_hybrid_device_mesh``
(and MaxText's ``ici_*`` / ``dcn_*`` settings). Groups are TPU slices where
devices carry a ``slice_index``, otherwise processes (``process_index``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtensor.core.mesh import (
    AxisTypes,
    Mesh,
    MeshError,
    arrange_devices,
    create_mesh,
    mesh_of,
    resolve_sizes,
)

__all__ = ["create_distributed_mesh", "device_groups"]


def _pairs(dims: Any, arg: str) -> list[tuple[str, int]]:
    """``[(name, size), ...]`` from a list or dict, checked for shape (not for devices)."""
    items = list(dims.items()) if isinstance(dims, dict) else list(dims)
    out: list[tuple[str, int]] = []
    for item in items:
        ok = isinstance(item, tuple | list) and len(item) == 2 and isinstance(item[0], str)
        size = item[1] if ok else None
        if not ok or not isinstance(size, int | np.integer) or (size < 1 and size != -1):
            raise MeshError(
                f"{arg} entry {item!r} is not a (name, size) pair with a positive size (or -1); "
                f"write {arg} as [('data', 2), ('model', 1)]."
            )
        out.append((item[0], int(size)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise MeshError(f"{arg} names {tuple(names)} repeat a name; give each axis once.")
    return out


def device_groups(devices: Sequence[Any]) -> tuple[str, list[list[Any]]]:
    """Split devices into slices, or else processes, in index order.

    TPU devices group by ``slice_index``. Other platforms group by
    ``slice_index`` only where it tells groups apart (multi-process CPU/GPU
    devices report slice 0 everywhere), else by ``process_index``.

    Args:
        devices: the devices.

    Returns:
        The attribute grouped by (``"slice_index"`` or ``"process_index"``)
        and the groups, each in the given device order.

    Examples:
        >>> import jax
        >>> from dtensor.runtime.distributed_mesh import device_groups
        >>> by, groups = device_groups(jax.devices())
        >>> by, [len(g) for g in groups]
        ('process_index', [8])
    """
    slices = {getattr(d, "slice_index", None) for d in devices}
    tpu = devices[0].platform == "tpu"
    # On TPU every host of one slice shares the ICI network: a device without a
    # slice_index (a one-slice topology) belongs to slice 0.
    if tpu or (None not in slices and len(slices) > 1):
        by = "slice_index"
    else:
        by = "process_index"
    groups: dict[int, list[Any]] = {}
    for d in devices:
        key = getattr(d, by, None)
        groups.setdefault(int(key) if key is not None else 0, []).append(d)
    return by, [groups[k] for k in sorted(groups)]


def _inner_mesh(shape: tuple[int, ...], group: list[Any]) -> np.ndarray:
    ordered = sorted(group, key=lambda d: d.id)
    return arrange_devices(shape, ordered, caller="create_distributed_mesh")


def create_distributed_mesh(
    mesh_dims: Sequence[tuple[str, int]] | dict[str, int],
    dcn_mesh_dims: Sequence[tuple[str, int]] | dict[str, int] | None = None,
    devices: Sequence[Any] | np.ndarray | None = None,
    *,
    axis_types: AxisTypes = "auto",
) -> Mesh:
    """A mesh over the devices of all processes, aware of slices and hosts.

    Args:
        mesh_dims: ``[(name, size), ...]`` within one slice or host group
            (ICI); one size may be ``-1``. Without ``dcn_mesh_dims`` these are
            the sizes of the whole mesh, exactly as :func:`dtensor.create_mesh`.
        dcn_mesh_dims: ``[(name, count), ...]``: how many groups lie along
            each named axis (DCN); every name must be in ``mesh_dims`` (give
            it size 1 there for an axis that only spans groups). Unnamed axes
            have count 1; one count may be ``-1``.
        devices: the devices (default: all devices of all processes).
        axis_types: ``"auto"`` (default) or ``"explicit"``.

    Returns:
        The mesh; an axis's size is its ICI size times its DCN count, with
        each group's devices contiguous along it.

    Raises:
        MeshError: names or sizes that do not match the devices: a DCN axis
            not in ``mesh_dims``, a group count different from the product of
            the DCN counts, groups of unequal size, or a group size different
            from the product of ``mesh_dims``.

    Examples:
        >>> import dtensor
        >>> dtensor.create_distributed_mesh([("data", -1), ("model", 2)])
        Mesh(data=4, model=2)
        >>> dtensor.create_distributed_mesh([("data", 8)], [("data", 1)])
        Mesh(data=8)
    """
    if dcn_mesh_dims is None:
        return create_mesh(mesh_dims, devices, axis_types=axis_types)
    ici = _pairs(mesh_dims, "mesh_dims")
    if not ici:
        raise MeshError("mesh_dims is empty; give at least one named axis, e.g. [('data', 8)].")
    names = [n for n, _ in ici]
    dcn_given = _pairs(dcn_mesh_dims, "dcn_mesh_dims")
    unknown = [n for n, _ in dcn_given if n not in names]
    if unknown:
        raise MeshError(
            f"dcn_mesh_dims names axes {tuple(unknown)} that are not in mesh_dims "
            f"{tuple(names)}; every DCN axis must also be a mesh axis. Add it to mesh_dims "
            f"(with size 1 if it only spans slices/hosts), e.g. [({unknown[0]!r}, 1), ...]."
        )
    dcn_map = dict(dcn_given)
    dcn = [(n, dcn_map.get(n, 1)) for n in names]

    device_list = list(np.asarray(jax.devices() if devices is None else devices, dtype=object).flat)
    if not device_list:
        raise MeshError("devices is empty; pass at least one device or leave devices=None.")
    by, groups = device_groups(device_list)
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        detail = ", ".join(f"{i}: {len(g)}" for i, g in enumerate(groups))
        raise MeshError(
            f"the devices form groups (by {by}) of unequal sizes ({detail}); a distributed "
            "mesh needs the same number of devices in every slice/host. Pass devices= with "
            "an equal share from each group."
        )
    dcn = _resolve(dcn, len(groups), "dcn_mesh_dims", f"{len(groups)} groups (by {by})")
    ici = _resolve(ici, sizes[0], "mesh_dims", f"{sizes[0]} devices in each group (by {by})")
    ici_shape = tuple(s for _, s in ici)
    dcn_shape = tuple(s for _, s in dcn)
    inner = [_inner_mesh(ici_shape, g) for g in groups]
    blocks = np.empty(dcn_shape, dtype=object)
    for i, idx in enumerate(np.ndindex(*dcn_shape)):
        blocks[idx] = inner[i]
    arr = np.block(blocks.tolist())  # group-major along every axis, as mesh_utils does
    return mesh_of(np.asarray(arr, dtype=object), tuple(names), axis_types=axis_types)


def _resolve(dims: list[tuple[str, int]], have: int, arg: str, what: str) -> list[tuple[str, int]]:
    dims = resolve_sizes(dims, have)
    need = math.prod(s for _, s in dims)
    if need != have:
        raise MeshError(
            f"{arg} {dict(dims)} multiply to {need}, but the devices have {what}. Make the "
            f"product of {arg} equal {have} (or use -1 for one size)."
        )
    return dims
