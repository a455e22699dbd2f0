"""Which JAX platform the entry points select when ``JAX_PLATFORMS`` is unset.

``python -m dtensor.launch`` and ``examples/train.py`` select the CPU platform
only on a machine with no accelerator device files: a TPU VM exposes
``/dev/accel<n>`` (v2-v4) or ``/dev/vfio/<n>`` (v5e, v5p, v6e), an NVIDIA
host ``/dev/nvidia<n>``. There they leave the choice to JAX, so a job on a TPU
VM never trains on CPU by accident; elsewhere ``cpu`` keeps libtpu (installed
for ahead-of-time compiles) from probing for a TPU and printing its errors.
A ``JAX_PLATFORMS`` the user set is always kept.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["accelerator_device_files", "default_platforms"]

_PATTERNS = ("accel[0-9]*", "vfio/[0-9]*", "nvidia[0-9]*")


def accelerator_device_files(dev: str | Path = "/dev") -> list[str]:
    """The TPU and NVIDIA GPU device files under ``dev``, sorted (empty: none).

    Examples:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> accelerator_device_files(d)
        []
        >>> (d / "accel0").touch()
        >>> [pathlib.Path(f).name for f in accelerator_device_files(d)]
        ['accel0']
    """
    root = Path(dev)
    return sorted(str(f) for pattern in _PATTERNS for f in root.glob(pattern))


def default_platforms(
    environ: Mapping[str, str] | None = None, *, dev: str | Path = "/dev"
) -> str | None:
    """The ``JAX_PLATFORMS`` value to run with: the user's, else ``"cpu"`` without accelerators.

    Returns ``None`` (let JAX choose) on a machine with TPU or GPU device files
    and no ``JAX_PLATFORMS`` set.

    Examples:
        >>> import tempfile
        >>> default_platforms({"JAX_PLATFORMS": "tpu"})
        'tpu'
        >>> default_platforms({}, dev=tempfile.mkdtemp())
        'cpu'
    """
    env = os.environ if environ is None else environ
    if env.get("JAX_PLATFORMS"):
        return env["JAX_PLATFORMS"]
    return None if accelerator_device_files(dev) else "cpu"
