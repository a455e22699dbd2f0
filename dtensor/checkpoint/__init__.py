"""Layout-aware checkpoints over orbax: save, restore into any mesh or layout, keep the last good step.

Examples:
    >>> import tempfile, dtensor, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> dtensor.checkpoint.save(d, {"w": jnp.arange(4.0)}, step=1)
    1
    >>> dtensor.checkpoint.restore(d)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from dtensor.checkpoint.checkpointer import Checkpointer as Checkpointer
from dtensor.checkpoint.checkpointer import CheckpointError as CheckpointError
from dtensor.checkpoint.checkpointer import read_manifest as read_manifest
from dtensor.checkpoint.checkpointer import restore as restore
from dtensor.checkpoint.checkpointer import save as save

__all__ = ["CheckpointError", "Checkpointer", "read_manifest", "restore", "save"]
