"""The manifest of a step: mesh, each array's path, shape, dtype, layout, kind, and versions.

Format 2 adds each leaf's ``kind`` (how a host value was given: ``numpy``,
``numpy_scalar``, ``int``, ...; absent for device arrays) and promises a
``checksums`` item beside it (see :mod:`dtensor.checkpoint.integrity`).
"""

from __future__ import annotations

import importlib.metadata
import platform
import time
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import processes
from dtensor.checkpoint.canonical import as_host, host_kind, is_key, key_impl, shape_dtype
from dtensor.core.arrays import fetch_layout
from dtensor.core.layout import Layout
from dtensor.core.tree import path_str

__all__ = ["MANIFEST_FORMAT", "host_only", "prepare_save"]

MANIFEST_FORMAT = 2


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in ("jax-dtensor", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _layout_of(x: Any) -> Layout | None:
    if not isinstance(x, jax.Array):
        return None
    try:
        return fetch_layout(x)
    except (TypeError, ValueError):
        return None


def host_only(entry: dict[str, Any]) -> bool:
    """Whether a manifest entry is restored on the host by default.

    Host values (NumPy arrays and scalars, Python scalars), and arrays whose
    dtype JAX cannot hold under the current config (``int64`` while
    ``jax_enable_x64`` is off): these keep their exact dtype as NumPy values.
    """
    if entry.get("kind") is not None:
        return True
    dtype = np.dtype(entry["dtype"])
    return jax.dtypes.canonicalize_dtype(dtype) != dtype


def prepare_save(canon: Any, step: int) -> tuple[Any, dict[str, Any]]:
    """The tree orbax writes (typed keys as key data, host scalars as 0-d arrays) and its manifest."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(canon)
    out, entries, meshes = [], [], []
    for path, leaf in leaves:
        entry: dict[str, Any] = {"path": path_str(path)}
        shape, dtype = shape_dtype(leaf)
        if is_key(leaf):
            entry["key_impl"] = key_impl(leaf)
            leaf = jax.random.key_data(leaf)
        kind = host_kind(leaf)
        if kind is not None:
            entry["kind"] = kind
            leaf = as_host(leaf)
        layout = _layout_of(leaf)
        entry.update(
            shape=list(shape), dtype=dtype, layout=None if layout is None else layout.to_string()
        )
        if layout is not None:
            desc = {"axes": layout.mesh.shape, "axis_types": layout.mesh.axis_types}
            if desc not in meshes:
                meshes.append(desc)
        entries.append(entry)
        out.append(leaf)
    manifest = {
        "format": MANIFEST_FORMAT,
        "step": step,
        "time": time.time(),
        "process_count": processes.process_count(),
        "device_count": jax.device_count(),
        "mesh": meshes[0] if meshes else None,
        "meshes": meshes,
        "leaves": entries,
        "versions": _versions(),
    }
    return treedef.unflatten(out), manifest
