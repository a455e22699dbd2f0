"""Which mesh axis spans the slices of a multi-slice TPU topology (``across_slices=``).

A multi-slice TPU job joins slices (each a full ICI torus) by the data-centre
network (DCN), some 50x slower per chip. :func:`slice_mesh` builds a preset's
mesh so that exactly one axis crosses DCN: ``"data"`` (the slices are
data-parallel replicas; only gradient all-reduces cross DCN, as MaxText's
default ``dcn_data_parallelism``) or ``"fsdp"`` (one fully-sharded group over
every chip; its all-gathers and reduce-scatters cross DCN in every layer). The
sizes given stay the mesh's sizes; the spanning axis is
``dtensor.create_distributed_mesh``'s DCN axis (slice-major along it, each
slice's devices arranged by the TPU topology).

Devices without distinct ``slice_index`` values (CPU, GPU, one TPU slice) have
one slice: the mesh is :func:`dtensor.create_mesh`'s, in the given order, and
``across_slices`` only has its name checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import dtensor
from dtensor import Mesh
from dtensor.core.mesh import resolve_sizes

__all__ = ["ACROSS_SLICES", "slice_count", "slice_mesh"]

ACROSS_SLICES = ("data", "fsdp", "stage")


def slice_count(devices: Sequence[Any]) -> int:
    """How many TPU slices ``devices`` span (1 where devices carry no ``slice_index``).

    Examples:
        >>> import jax
        >>> from strategies.placement.slices import slice_count
        >>> slice_count(jax.devices())  # CPU devices: no slices
        1
    """
    found = {getattr(d, "slice_index", None) for d in devices}
    return 1 if None in found else len(found)


def check_across_slices(across_slices: Any, *, preset: str = "HybridStrategy") -> str | None:
    """``across_slices`` checked: ``None``, ``"data"``, ``"fsdp"`` or ``"stage"``."""
    if across_slices is None or across_slices in ACROSS_SLICES:
        return across_slices
    raise ValueError(
        f"{preset}(across_slices={across_slices!r}) names no axis that can span slices; "
        "valid values are None (choose by the sizes), 'data', 'fsdp' and 'stage' "
        "(HybridStrategy(stage=S): pipeline stages on different slices). Pass one of those."
    )


def _default(sizes: dict[str, int], n: int) -> str | None:
    """``"data"`` when each replica (its fsdp x tensor devices) fits in one slice, else ``"fsdp"``."""
    for axis in ("data", "fsdp"):
        if sizes[axis] % n == 0:
            return axis
    return None


def slice_mesh(
    dims: Sequence[tuple[str, int]],
    devices: Sequence[Any],
    across_slices: str | None,
    *,
    preset: str = "HybridStrategy",
) -> tuple[Mesh, str | None]:
    """The preset's mesh over ``devices``, ``across_slices`` spanning their slices.

    Args:
        dims: ``[(name, size), ...]`` of the whole mesh (one size may be
            ``-1``); must include ``"data"`` and ``"fsdp"``.
        devices: the devices, slice by slice (as :func:`dtensor.tpu_topology`
            and ``jax.devices()`` give them).
        across_slices: ``"data"``, ``"fsdp"``, or ``None``: ``"data"`` when the
            data size is a multiple of the slice count (each replica's
            ``fsdp x tensor`` devices then lie within one slice), else
            ``"fsdp"`` when the fsdp size is.
        preset: the preset's name, for error messages.

    Returns:
        The mesh, and the axis that spans slices (``None`` on one slice).

    Raises:
        ValueError: an unknown ``across_slices``; a spanning axis whose size is
            not a multiple of the slice count.

    Examples:
        >>> import jax
        >>> from strategies.placement.slices import slice_mesh
        >>> slice_mesh([("data", -1), ("fsdp", 2), ("tensor", 1)], jax.devices(), "data")
        (Mesh(data=4, fsdp=2, tensor=1), None)
    """
    across = check_across_slices(across_slices, preset=preset)
    devices = list(devices)
    sizes = dict(resolve_sizes(list(dims), len(devices)))
    used = devices[: math.prod(sizes.values())]
    n = slice_count(used)
    if n == 1:
        return dtensor.create_mesh(list(dims), devices=devices), None
    per = len(used) // n
    where = f"the {len(used)} devices it uses ({n} slices of {per} {used[0].device_kind} devices)"
    asked = ", ".join(f"{k}={v}" for k, v in sizes.items())
    if across is None:
        across = _default(sizes, n)
        if across is None:
            raise ValueError(
                f"{preset}({asked}) over {where}: neither data ({sizes['data']}) nor fsdp "
                f"({sizes['fsdp']}) is a multiple of {n}, so no axis can span the slices. Make "
                f"data a multiple of {n} (each fsdp x tensor replica within a slice of {per}) "
                f"or fsdp a multiple of {n}."
            )
    if across not in sizes:
        raise ValueError(
            f"{preset}({asked}, across_slices={across!r}) over {where}: this mesh has no "
            f"{across!r} axis; across_slices='stage' needs HybridStrategy(stage=S) with S a "
            f"multiple of the {n} slices."
        )
    if sizes[across] % n:
        other = per // sizes["tensor"] if per % sizes["tensor"] == 0 else None
        fix = {
            "data": f"data=-1, fsdp={other}, tensor={sizes['tensor']} (each replica within one "
            f"slice of {per})"
            if other
            else f"a tensor size that divides {per} and data a multiple of {n}",
            "fsdp": f"fsdp a multiple of {n}, e.g. data=1, fsdp={len(used) // sizes['tensor']}, "
            f"tensor={sizes['tensor']}",
            "stage": f"stage a multiple of {n}",
        }[across]
        swap = "fsdp" if across == "data" else "data"
        raise ValueError(
            f"{preset}({asked}, across_slices={across!r}) over {where}: the {across!r} axis "
            f"(size {sizes[across]}) must be a multiple of the {n} slices to span them, one "
            f"block of {across} per slice. Pass {fix}, or across_slices={swap!r}."
        )
    ici = [(k, v // n if k == across else v) for k, v in sizes.items()]
    mesh = dtensor.create_distributed_mesh(ici, [(across, n)], devices=used)
    return mesh, across
