"""Layout-aware checkpoints over orbax-checkpoint: save, restore, reshard.

A checkpoint directory holds one sub-directory per step (orbax's
``CheckpointManager`` layout). Each step holds two items: ``state``, the
arrays (orbax's ``StandardSave``, each process writing its own shards), and
``manifest``, a small JSON file with the step, the mesh, each array's path,
shape, dtype and layout (:meth:`Layout.to_string`), and the library versions.
orbax writes a step into a temporary ``*.orbax-checkpoint-tmp*`` directory and
renames it once complete, so a process killed mid-write leaves the earlier
steps intact, and unfinished directories are never restored.

What can be saved, anywhere inside the tree: arrays (laid out or not), Flax
NNX modules and optimizers (their ``nnx.state``), NNX ``State``, Linen params
(boxed or not), optax states, typed PRNG keys, NumPy arrays, Python scalars.

What ``target`` means on restore (it decides the structure of the result and
where every array goes; values are bit-identical whatever the layouts):

* ``None``: the saved structure, as plain containers (dicts with string keys,
  lists). Each array in the layout it was saved in when all of that mesh's
  devices exist here; otherwise replicated on the current mesh (``with
  mesh:``), or on all devices when there is none.
* a :class:`Mesh`: the saved structure, every array replicated on that mesh.
* a :class:`LayoutMap`, a function ``(path, leaf) -> Layout | None``, or any
  object with a ``variable_layout(path, leaf)`` method (a strategy): the saved
  structure, each array in the layout it gives (``None``: replicated on the
  strategy's mesh, else the current mesh).
* a pytree like the saved one, whose leaves say where each array goes: a
  :class:`Layout`, a ``jax.Array`` (its sharding; a live model's current
  layout), a ``jax.ShapeDtypeStruct`` (its sharding), a NumPy array or scalar
  (restored on the host). NNX modules and optimizers in the tree are updated
  in place. A structure, shape or dtype that differs from the checkpoint
  raises a :class:`CheckpointError` naming the first differing paths.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dtensor.core.arrays import fetch_layout
from dtensor.core.layout import Layout
from dtensor.core.mesh import Mesh, create_mesh, current_mesh
from dtensor.core.rules import LayoutMap, resolve_layouts
from dtensor.core.tree import is_box, is_node, path_str

__all__ = ["Checkpointer", "CheckpointError", "save", "restore", "read_manifest"]

MANIFEST_FORMAT = 1
_STATE, _MANIFEST = "state", "manifest"
_TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unfinished, or does not match its target."""


def _ocp() -> Any:
    import orbax.checkpoint as ocp

    return ocp


# ------------------------------------------------------------ canonical form
def _is_state(x: Any) -> bool:
    from flax import nnx

    return isinstance(x, nnx.State)


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _is_container_leaf(x: Any) -> bool:
    """Nodes that the canonical form replaces by plain containers."""
    return is_node(x) or _is_state(x) or is_box(x)


def _canon(tree: Any) -> Any:
    """``tree`` with NNX objects as pure dicts of their state and Linen boxes unboxed."""

    def one(x: Any) -> Any:
        if is_node(x):
            from flax import nnx

            return _canon(nnx.state(x).to_pure_dict())
        if _is_state(x):
            return _canon(x.to_pure_dict())
        if is_box(x):
            return _canon(x.unbox())
        return x

    return jax.tree.map(one, tree, is_leaf=_is_container_leaf)


def _rebuild(target: Any, restored: Any) -> Any:
    """Put restored canonical values back into the shape of ``target``."""

    def one(t: Any, r: Any) -> Any:
        if is_node(t):
            from flax import nnx

            state = nnx.state(t)
            nnx.replace_by_pure_dict(state, _rebuild(state.to_pure_dict(), r))
            nnx.update(t, state)
            return t
        if _is_state(t):
            from flax import nnx

            state = jax.tree.map(lambda v: v, t)
            nnx.replace_by_pure_dict(state, _rebuild(t.to_pure_dict(), r))
            return state
        if is_box(t):
            return t.replace_boxed(_rebuild(t.unbox(), r))
        if _is_key(t) and not _is_key(r):
            return jax.random.wrap_key_data(r, impl=_key_impl(t))
        return r

    return jax.tree.map(one, target, restored, is_leaf=_is_container_leaf)


def _key_impl(x: Any) -> str | None:
    if isinstance(x, jax.ShapeDtypeStruct):  # no public accessor on an abstract key's dtype
        return getattr(getattr(x.dtype, "_impl", None), "name", None)
    return str(jax.random.key_impl(x))


def _shape_dtype(x: Any) -> tuple[tuple[int, ...], str]:
    if _is_key(x):
        out = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), x.dtype))
        return tuple(out.shape), str(out.dtype)
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return tuple(int(s) for s in np.shape(x)), str(np.dtype(dtype))


def _fmt(shape: Sequence[int], dtype: str) -> str:
    return f"{dtype}[{','.join(str(s) for s in shape)}]"


# ------------------------------------------------------------------ manifest
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


def _prepare_save(canon: Any, step: int) -> tuple[Any, dict[str, Any]]:
    """Typed keys as raw key data, and the manifest of the canonical tree."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(canon)
    out, entries, meshes = [], [], []
    for path, leaf in leaves:
        entry: dict[str, Any] = {"path": path_str(path)}
        shape, dtype = _shape_dtype(leaf)
        if _is_key(leaf):
            entry["key_impl"] = _key_impl(leaf)
            leaf = jax.random.key_data(leaf)
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
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "mesh": meshes[0] if meshes else None,
        "meshes": meshes,
        "leaves": entries,
        "versions": _versions(),
    }
    return treedef.unflatten(out), manifest


# ------------------------------------------------------------ restore targets
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


def _saved_abstract(metadata_tree: Any) -> Any:
    """The saved tree with ``ShapeDtypeStruct`` leaves (no shardings yet)."""

    def one(m: Any) -> Any:
        return jax.ShapeDtypeStruct(tuple(m.shape), np.dtype(m.dtype))

    return jax.tree.map(
        one, metadata_tree, is_leaf=lambda m: hasattr(m, "shape") and hasattr(m, "dtype")
    )


def _as_saved_sharding(entry: dict[str, Any], fallback: Mesh) -> jax.sharding.Sharding:
    text = entry.get("layout")
    if text:
        try:
            return Layout.from_string(text).sharding
        except ValueError:
            pass  # its devices are not all here
    return _replicated(fallback, len(entry["shape"]))


def _target_abstract(canon: Any, by_path: dict[str, dict[str, Any]], where: str) -> Any:
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
            desc = "a Layout" if isinstance(leaf, Layout) else _fmt(*_shape_dtype(leaf))
            diffs.append(f"{p!r}: not in the checkpoint (target has {desc})")
            continue
        if isinstance(leaf, Layout):
            continue
        shape, dtype = _shape_dtype(leaf)
        if shape != tuple(saved["shape"]) or dtype != saved["dtype"]:
            diffs.append(
                f"{p!r}: saved {_fmt(saved['shape'], saved['dtype'])} vs target {_fmt(shape, dtype)}"
            )
    diffs.extend(
        f"{p!r}: in the checkpoint ({_fmt(e['shape'], e['dtype'])}) but not in the target"
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
        p = path_str(path)
        saved = by_path[p]
        if isinstance(leaf, Layout):
            leaf.check_shape(saved["shape"], p)
            out.append(
                jax.ShapeDtypeStruct(
                    tuple(saved["shape"]), np.dtype(saved["dtype"]), sharding=leaf.sharding
                )
            )
        elif isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                sharding = _replicated(_default_mesh(), len(saved["shape"]))
            out.append(
                jax.ShapeDtypeStruct(
                    tuple(saved["shape"]), np.dtype(saved["dtype"]), sharding=sharding
                )
            )
        else:
            out.append(leaf)
    return treedef.unflatten(out)


def _wrap_keys(tree: Any, by_path: dict[str, dict[str, Any]]) -> Any:
    def one(path: Any, x: Any) -> Any:
        impl = by_path.get(path_str(path), {}).get("key_impl")
        return jax.random.wrap_key_data(x, impl=impl) if impl else x

    return jax.tree_util.tree_map_with_path(one, tree)


# --------------------------------------------------------------- Checkpointer
class Checkpointer:
    """Numbered, layout-aware checkpoints in one directory (over ``ocp.CheckpointManager``).

    Args:
        directory: where the steps live (created when missing, unless
            ``create=False``).
        max_to_keep: keep only the newest this many steps (``None``: all).
        save_interval_steps: :meth:`save` writes only steps that are a
            multiple of this (``force=True`` writes any step).
        async_save: return from :meth:`save` once the arrays are copied off
            the devices, and write the files in the background (training goes
            on); :meth:`wait` blocks until they are complete.
        create: create ``directory`` when it does not exist.

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> w = dtensor.copy_to_mesh(jnp.arange(16.0), dtensor.Layout(["x"], mesh))
        >>> with dtensor.checkpoint.Checkpointer(tempfile.mkdtemp(), max_to_keep=2) as ckpt:
        ...     for step in range(4):
        ...         _ = ckpt.save(step, {"w": w + step})
        ...     ckpt.wait()
        ...     ckpt.all_steps(), ckpt.latest_step()
        ...     float(ckpt.restore()["w"][1])
        ([2, 3], 3)
        4.0
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
        create: bool = True,
    ) -> None:
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise CheckpointError(
                f"checkpoint directory {str(self.directory)!r} does not exist. Check the path, or "
                "save a checkpoint there first."
            )
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(
                f"max_to_keep={max_to_keep!r} is not valid; use a positive int or None (keep all)."
            )
        if save_interval_steps < 1:
            raise ValueError(
                f"save_interval_steps={save_interval_steps!r} is not valid; use a positive int."
            )
        cm = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            create=create,
            enable_async_checkpointing=async_save,
            save_decision_policy=cm.FixedIntervalPolicy(save_interval_steps),
            preservation_policy=cm.LatestN(n=max_to_keep),
        )
        self.max_to_keep = max_to_keep
        self.save_interval_steps = save_interval_steps
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, save_args, restore_args in (
            (_STATE, ocp.args.StandardSave, ocp.args.StandardRestore),
            (_MANIFEST, ocp.args.JsonSave, ocp.args.JsonRestore),
        ):
            registry.add(item, save_args)
            registry.add(item, restore_args)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, handler_registry=registry
        )

    # -------------------------------------------------------------- steps
    def all_steps(self) -> list[int]:
        """The complete steps in the directory, oldest first (unfinished ones are ignored)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None`` when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def unfinished(self) -> list[str]:
        """Names of unfinished (temporary) step directories, left by an interrupted write."""
        if not self.directory.is_dir():
            return []
        return sorted(p.name for p in self.directory.iterdir() if _TMP_MARK in p.name)

    # --------------------------------------------------------------- save
    def save(self, step: int, tree: Any, *, force: bool = False) -> bool:
        """Save ``tree`` as ``step``; returns whether a checkpoint was started.

        Nothing is written when ``step`` is not a multiple of
        ``save_interval_steps`` or not newer than the latest step, unless
        ``force``. With ``async_save`` the files are written in the background.

        Raises:
            CheckpointError: ``step`` already exists.
        """
        if not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"step={step!r} is not valid; checkpoint steps are non-negative ints.")
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"step {step} already exists in {str(self.directory)!r}; steps are never "
                "overwritten. Save under a new step number."
            )
        ocp = _ocp()
        arrays, manifest = _prepare_save(_canon(tree), step)
        args = ocp.args.Composite(
            **{_STATE: ocp.args.StandardSave(arrays), _MANIFEST: ocp.args.JsonSave(manifest)}
        )
        return bool(self._manager.save(step, args=args, force=True))

    def wait(self) -> None:
        """Block until every started save is complete on disk."""
        self._manager.wait_until_finished()

    # ------------------------------------------------------------ restore
    def _check_step(self, step: int | None) -> int:
        steps = self.all_steps()
        if not steps:
            tmp = self.unfinished()
            extra = f" (only unfinished writes: {tmp[:3]})" if tmp else ""
            raise CheckpointError(
                f"no complete checkpoint in {str(self.directory)!r}{extra}. Save one first, or "
                "point at the directory that holds the step sub-directories."
            )
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"step {step} is not a complete checkpoint in {str(self.directory)!r}; the "
                f"complete steps are {steps}. Pass one of those, or step=None for the latest."
            )
        return step

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The JSON manifest of ``step`` (default: the latest complete step)."""
        step = self._check_step(step)
        ocp = _ocp()
        try:
            out = self._manager.restore(
                step, args=ocp.args.Composite(**{_MANIFEST: ocp.args.JsonRestore()})
            )
            manifest = out[_MANIFEST]
        except KeyError:  # orbax: the item is not in this step
            manifest = None
        if not isinstance(manifest, dict) or "leaves" not in manifest:
            raise CheckpointError(
                f"step {step} in {str(self.directory)!r} has no dtensor manifest; it was not written "
                "by dtensor.checkpoint. Restore it with orbax directly."
            )
        return manifest

    def restore(self, step: int | None = None, target: Any = None) -> Any:
        """Restore ``step`` (default: the latest complete one) as ``target`` says.

        See the module docstring for what ``target`` may be. NNX modules and
        optimizers in ``target`` are updated in place (and also returned).

        Raises:
            CheckpointError: no such complete step, or ``target`` does not match.
        """
        step = self._check_step(step)
        manifest = self.manifest(step)
        by_path = {e["path"]: e for e in manifest["leaves"]}
        where = f"checkpoint step {step} in {str(self.directory)!r}"
        ocp = _ocp()
        policy = None if isinstance(target, Mesh) else _layout_function(target)
        if target is None or isinstance(target, Mesh) or policy is not None:
            meta = self._manager.item_metadata(step)[_STATE]
            abstract = _saved_abstract(getattr(meta, "tree", meta))
            if policy is not None:
                source, mesh = policy
                layouts, _ = resolve_layouts(abstract, source, mesh=_default_mesh(mesh))
                abstract = jax.tree.map(
                    lambda a, lay: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=lay.sharding),
                    abstract,
                    layouts,
                )
            else:
                fallback = _default_mesh(target)

                def place(path: Any, a: Any) -> Any:
                    entry = by_path.get(path_str(path), {"shape": a.shape})
                    sharding = (
                        _replicated(fallback, a.ndim)
                        if target is not None
                        else _as_saved_sharding(entry, fallback)
                    )
                    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

                abstract = jax.tree_util.tree_map_with_path(place, abstract)
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
            )
            return _wrap_keys(restored[_STATE], by_path)
        canon = _canon(target)
        abstract = _target_abstract(canon, by_path, where)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(abstract)})
        )
        return _rebuild(target, restored[_STATE])

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for pending saves and release the manager."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({str(self.directory)!r}, max_to_keep={self.max_to_keep}, "
            f"save_interval_steps={self.save_interval_steps})"
        )


# ------------------------------------------------------------ one-shot helpers
def _existing(directory: str | os.PathLike[str]) -> Checkpointer:
    if not Path(directory).is_dir():
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} does not exist. Check the path, or save a "
            "checkpoint there first."
        )
    return Checkpointer(directory, create=False, async_save=False)


def save(directory: str | os.PathLike[str], tree: Any, *, step: int | None = None) -> int:
    """Save ``tree`` into ``directory`` and wait until it is on disk; returns the step.

    Args:
        directory: the checkpoint directory (created when missing).
        tree: any pytree of arrays, NNX modules/optimizers, Linen params,
            optax states.
        step: the step number; default: one more than the latest (0 at first).

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> d = tempfile.mkdtemp()
        >>> w = dtensor.copy_to_mesh(jnp.arange(8.0), dtensor.Layout(["x"], mesh))
        >>> dtensor.checkpoint.save(d, {"w": w})
        0
        >>> one = dtensor.create_mesh([("x", 1)])
        >>> out = dtensor.checkpoint.restore(d, {"w": dtensor.Layout(["x"], one)})
        >>> out["w"].sharding.num_devices, float(out["w"].sum())
        (1, 28.0)
    """
    with Checkpointer(directory, async_save=False) as ckpt:
        if step is None:
            latest = ckpt.latest_step()
            step = 0 if latest is None else latest + 1
        ckpt.save(step, tree, force=True)
        ckpt.wait()
    return step


def restore(
    directory: str | os.PathLike[str], target: Any = None, *, step: int | None = None
) -> Any:
    """Restore a checkpoint from ``directory`` (default: its latest complete step).

    ``target`` is described in the module docstring: ``None``, a mesh, a
    layout policy (``LayoutMap``, function, strategy), or a pytree of
    layouts / live arrays / ``ShapeDtypeStruct`` s / NNX objects.

    Raises:
        CheckpointError: the directory is missing, holds no complete step, or
            ``target`` does not match the checkpoint.
    """
    with _existing(directory) as ckpt:
        return ckpt.restore(step, target)


def read_manifest(directory: str | os.PathLike[str], *, step: int | None = None) -> dict[str, Any]:
    """The JSON manifest of a step: mesh, per-array path/shape/dtype/layout, versions.

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> d = tempfile.mkdtemp()
        >>> _ = dtensor.checkpoint.save(d, {"w": jnp.zeros((2, 3))}, step=5)
        >>> m = dtensor.checkpoint.read_manifest(d)
        >>> m["step"], [(e["path"], e["shape"], e["dtype"]) for e in m["leaves"]]
        (5, [('w', [2, 3], 'float32')])
    """
    with _existing(directory) as ckpt:
        return ckpt.manifest(step)
