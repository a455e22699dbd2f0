"""Layout-aware checkpoints over orbax: save, restore into any mesh or layout, keep the last good step.

Every shard is checksummed as it is written; a restore checks what it read,
and :func:`verify` (or ``python -m dtensor.checkpoint verify DIR``) checks a
directory without restoring it. Every directory may be a local path or a bucket
URL (``gs://bucket/run``, resolved by ``etils.epath`` as orbax resolves it);
``data=`` saves and restores an input iterator's position with a step.

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
from dtensor.checkpoint.oneshot import latest_step as latest_step
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
    "latest_step",
    "read_manifest",
    "restore",
    "save",
    "verify",
]
