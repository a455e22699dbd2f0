"""One-call save, restore and manifest reading over a :class:`Checkpointer`."""

from __future__ import annotations

import os
from typing import Any

from dtensor.checkpoint import storage
from dtensor.checkpoint.checkpointer import Checkpointer
from dtensor.checkpoint.errors import CheckpointError

__all__ = ["existing", "latest_step", "read_manifest", "restore", "save"]


# ------------------------------------------------------------ one-shot helpers
def existing(directory: str | os.PathLike[str]) -> Checkpointer:
    """A :class:`Checkpointer` over a directory (or bucket URL) that must exist."""
    path = storage.resolve(directory)
    with storage.store_errors(path):
        missing = not path.is_dir()
    if missing:
        raise CheckpointError(
            f"checkpoint directory {str(directory)!r} does not exist. Check the path, or save a "
            "checkpoint there first."
        )
    return Checkpointer(directory, create=False, async_save=False)


def save(
    directory: str | os.PathLike[str], tree: Any, *, step: int | None = None, data: Any = None
) -> int:
    """Save ``tree`` into ``directory`` and wait until it is stored; returns the step.

    Args:
        directory: the checkpoint directory (created when missing): a local
            path or a URL such as ``gs://bucket/run``.
        tree: any pytree of arrays, NNX modules/optimizers, Linen params,
            optax states.
        step: the step number; default: one more than the latest (0 at first).
        data: an input iterator with ``get_state()``/``set_state()`` (a Grain
            iterator, or ``iter()`` of a strategy's distributed dataset): its
            position is saved with the step, one small JSON per process.

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
        ckpt.save(step, tree, force=True, data=data)
        ckpt.wait()
    return step


def restore(
    directory: str | os.PathLike[str],
    target: Any = None,
    *,
    step: int | None = None,
    verify: bool = True,
    data: Any = None,
) -> Any:
    """Restore a checkpoint from ``directory`` (default: its latest complete step).

    ``target`` is described in the module docstring: ``None``, a mesh, a
    layout policy (``LayoutMap``, function, strategy), or a pytree of
    layouts / live arrays / ``ShapeDtypeStruct`` s / NNX objects. Every array
    is checked against the checksums recorded when it was written (unless
    ``verify=False``); without ``step=`` a damaged step is skipped with a
    warning and the newest intact one restored. ``data``, an input iterator
    with ``set_state()``, is moved to the position saved with the restored
    step.

    Raises:
        CheckpointError: the directory is missing, holds no complete (or no
            intact) step, ``step`` is damaged, or ``target`` does not match.
    """
    with existing(directory) as ckpt:
        return ckpt.restore(step, target, verify=verify, data=data)


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest complete, intact step in ``directory`` (a path or a bucket URL), or ``None``.

    Unfinished steps (an interrupted write: no commit) are never counted; a
    damaged newest step is skipped with a warning, as a restore skips it.

    Examples:
        >>> import dtensor, jax.numpy as jnp, tempfile
        >>> d = tempfile.mkdtemp()
        >>> dtensor.checkpoint.latest_step(d) is None
        True
        >>> _ = dtensor.checkpoint.save(d, {"w": jnp.zeros(2)}, step=4)
        >>> dtensor.checkpoint.latest_step(d)
        4
    """
    path = storage.resolve(directory)
    with storage.store_errors(path):
        missing = not path.is_dir()
    if missing:
        return None
    with existing(directory) as ckpt:
        return ckpt.latest_step()


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
    with existing(directory) as ckpt:
        return ckpt.manifest(step)
