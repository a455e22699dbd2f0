"""Layout-aware checkpoints over orbax: save, restore into any mesh or layout, keep the last good step.

Every shard is checksummed as it is written; a restore checks what it read,
and :func:`verify` (or ``python -m dtensor.checkpoint verify DIR``) checks a
directory without restoring it.

Examples:
    >>> import tempfile, dtensor, jax.numpy as jnp
    >>> d = tempfile.mkdtemp()
    >>> dtensor.checkpoint.save(d, {"w": jnp.arange(4.0)}, step=1)
    1
    >>> dtensor.checkpoint.restore(d)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from dtensor.checkpoint.checkpointer import Checkpointer as Checkpointer
from dtensor.checkpoint.errors import CheckpointError as CheckpointError
from dtensor.checkpoint.errors import DamagedCheckpointError as DamagedCheckpointError
from dtensor.checkpoint.oneshot import read_manifest as read_manifest
from dtensor.checkpoint.oneshot import restore as restore
from dtensor.checkpoint.oneshot import save as save
from dtensor.checkpoint.verify import StepCheck as StepCheck
from dtensor.checkpoint.verify import verify as verify

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpointError",
    "StepCheck",
    "read_manifest",
    "restore",
    "save",
    "verify",
]
