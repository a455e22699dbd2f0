"""Layout-aware checkpoints over orbax: save, restore into any mesh or layout, keep the last good step.

Every shard is checksummed as it is written; a restore checks what it read,
and :func:`verify` (or ``python -m dtensor.checkpoint verify DIR``) checks a
directory without restoring it. Every directory may be a local path or a bucket
URL (``gs://bucket/run``, resolved by ``etils.epath`` as orbax resolves it);
``data=`` saves and restores an input iterator's position with a step.

Pretrained weights: :func:`load_safetensors` reads a Hugging Face safetensors
checkpoint (a file, or a folder with its index; local or ``gs://``) into any
layout, each process reading only its slices, and :func:`save_safetensors`
writes one back, tensor by tensor; a :class:`Mapping` pairs checkpoint names
with the tree's paths and the transforms between them (:func:`transpose`,
:func:`split_dim`, :func:`merge_dims`, :func:`permute`, :func:`rope_permute`,
:func:`astype`).

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
from dtensor.checkpoint.mapping import Mapping as Mapping
from dtensor.checkpoint.mapping import Rule as Rule
from dtensor.checkpoint.oneshot import latest_step as latest_step
from dtensor.checkpoint.oneshot import read_manifest as read_manifest
from dtensor.checkpoint.oneshot import restore as restore
from dtensor.checkpoint.oneshot import save as save
from dtensor.checkpoint.safetensors_load import load_safetensors as load_safetensors
from dtensor.checkpoint.safetensors_load import open_checkpoint as open_checkpoint
from dtensor.checkpoint.safetensors_save import save_safetensors as save_safetensors
from dtensor.checkpoint.transforms import astype as astype
from dtensor.checkpoint.transforms import merge_dims as merge_dims
from dtensor.checkpoint.transforms import permute as permute
from dtensor.checkpoint.transforms import rope_permute as rope_permute
from dtensor.checkpoint.transforms import split_dim as split_dim
from dtensor.checkpoint.transforms import transpose as transpose
from dtensor.checkpoint.verify import StepCheck as StepCheck
from dtensor.checkpoint.verify import verify as verify

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "DamagedCheckpointError",
    "Mapping",
    "Rule",
    "StepCheck",
    "astype",
    "latest_step",
    "load_safetensors",
    "merge_dims",
    "open_checkpoint",
    "permute",
    "read_manifest",
    "restore",
    "rope_permute",
    "save",
    "save_safetensors",
    "split_dim",
    "transpose",
    "verify",
]
