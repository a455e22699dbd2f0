"""What a restore target means: the abstract tree orbax restores into, checked against the manifest."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dtensor.checkpoint.canonical import fmt, shape_dtype, to_kind
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.manifest import host_only
from dtensor.core.layout import Layout
from dtensor.core.mesh import Mesh, create_mesh, current_mesh
from dtensor.core.rules import LayoutMap, resolve_layouts
from dtensor.core.tree import is_node, path_str

__all__ = ["finish_saved", "is_policy", "saved_abstract", "target_abstract"]

Entries = dict[str, dict[str, Any]]


def _replicated(mesh: Mesh, rank: int) -> jax.sharding.Sharding:
    return Layout.replicated(mesh, rank).sharding


def _default_mesh(mesh: Mesh | None = None) -> Mesh:
    if mesh is not None:
        return mesh
    return current_mesh() or create_mesh([("replica", -1)])


def _layout_function(target: Any) -> tuple[Any, Mesh | None] | None:
    """``(layout source, mesh for None)`` when ``target`` is a layout policy."""
    if isinstance(target, LayoutMap):
        return target, target.mesh
    policy = getattr(target, "variable_layout", None)
    if callable(policy):
        return policy, getattr(target, "mesh", None)
    if callable(target) and not is_node(target) and not isinstance(target, Layout):
        return target, None
    return None


def is_policy(target: Any) -> bool:
    """Whether ``target`` is a layout policy (``LayoutMap``, function, strategy), not a pytree."""
    return not isinstance(target, Mesh) and _layout_function(target) is not None


def _as_saved_sharding(entry: dict[str, Any], fallback: Mesh) -> jax.sharding.Sharding:
    text = entry.get("layout")
    if text:
        try:
            return Layout.from_string(text).sharding
        except ValueError:
            pass  # its devices are not all here
    return _replicated(fallback, len(entry["shape"]))


def _on_host(entry: dict[str, Any], target: Any) -> bool:
    """Restored as NumPy: host values when ``target`` is None, and dtypes JAX cannot hold."""
    if target is None:
        return host_only(entry)
    dtype = np.dtype(entry["dtype"])
    return jax.dtypes.canonicalize_dtype(dtype) != dtype


def saved_abstract(metadata_tree: Any, target: Any, by_path: Entries) -> Any:
    """Restore arguments for ``target`` None, a :class:`Mesh` or a layout policy."""

    def one(m: Any) -> Any:
        return jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype))

    abstract = jax.tree.map(
        one, metadata_tree, is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype")
    )
    policy = None if isinstance(target, Mesh) else _layout_function(target)
    if policy is not None:
        source, mesh = policy
        layouts, _ = resolve_layouts(abstract, source, mesh=_default_mesh(mesh))
        shardings = jax.tree.map(lambda lay: lay.sharding, layouts)
    else:
        fallback = _default_mesh(target)
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, a: (
                _replicated(fallback, a.ndim)
                if target is not None
                else _as_saved_sharding(by_path.get(path_str(path), {"shape": a.shape}), fallback)
            ),
            abstract,
        )

    def place(path: Any, a: Any, sharding: Any) -> Any:
        entry = by_path.get(path_str(path))
        if entry is not None and _on_host(entry, target):
            return np.zeros(a.shape, a.dtype)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree_util.tree_map_with_path(place, abstract, shardings)


def finish_saved(tree: Any, by_path: Entries, target: Any) -> Any:
    """Typed keys wrapped again; host values (``target`` None) back in their saved type."""

    def one(path: Any, x: Any) -> Any:
        entry = by_path.get(path_str(path), {})
        impl = entry.get("key_impl")
        if impl:
            return jax.random.wrap_key_data(x, impl=impl)
        if target is None and entry.get("kind") is not None:
            return to_kind(x, entry["kind"], entry["dtype"])
        return x

    return jax.tree_util.tree_map_with_path(one, tree)


def target_abstract(canon: Any, by_path: Entries, where: str) -> Any:
    """Abstract restore arguments for a canonical target, after checking it matches."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(
        canon, is_leaf=lambda v: isinstance(v, Layout | jax.ShapeDtypeStruct)
    )
    diffs: list[str] = []
    seen = set()
    for path, leaf in leaves:
        p = path_str(path)
        seen.add(p)
        saved = by_path.get(p)
        if saved is None:
            desc = "a Layout" if isinstance(leaf, Layout) else fmt(*shape_dtype(leaf))
            diffs.append(f"{p!r}: not in the checkpoint (target has {desc})")
            continue
        if isinstance(leaf, Layout):
            continue
        shape, dtype = shape_dtype(leaf)
        if shape != tuple(saved["shape"]) or dtype != saved["dtype"]:
            diffs.append(
                f"{p!r}: saved {fmt(saved['shape'], saved['dtype'])} vs target {fmt(shape, dtype)}"
            )
    diffs.extend(
        f"{p!r}: in the checkpoint ({fmt(e['shape'], e['dtype'])}) but not in the target"
        for p, e in by_path.items()
        if p not in seen
    )
    if diffs:
        shown = "; ".join(diffs[:5]) + (f"; and {len(diffs) - 5} more" if len(diffs) > 5 else "")
        raise CheckpointError(
            f"the restore target does not match {where}: {len(diffs)} differing path(s): {shown}. "
            "Pass a target with the checkpoint's structure, shapes and dtypes (its paths are in "
            "dtensor.checkpoint.read_manifest(directory)), or target=None to restore the saved tree."
        )
    out = []
    for path, leaf in leaves:
        saved = by_path[path_str(path)]
        shape, dtype = tuple(saved["shape"]), np.dtype(saved["dtype"])
        if isinstance(leaf, Layout):
            leaf.check_shape(saved["shape"], path_str(path))
            out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=leaf.sharding))
        elif isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                sharding = _replicated(_default_mesh(), len(shape))
            out.append(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding))
        elif isinstance(leaf, np.ndarray | np.generic) or not hasattr(leaf, "shape"):
            out.append(np.zeros(shape, dtype))  # NumPy and Python values: restored on the host
        else:
            out.append(leaf)
    return treedef.unflatten(out)
