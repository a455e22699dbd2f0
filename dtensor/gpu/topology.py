"""NVIDIA GPU topologies without a GPU: real device objects for ahead-of-time compiles.

XLA's GPU compiler needs no GPU to compile. With JAX's CUDA plugin installed
(``pip install -e '.[gpu-aot]'`` in a checkout, i.e. ``jax[cuda12]``), the plugin
describes any number of hosts of any GPU model from a *target config*: an XLA
``GpuTargetConfig`` text proto naming the GPU's hardware (SM count, shared
memory, registers, clock, memory size and bandwidth, compute capability) and
the CUDA and cuDNN versions the program is built for. :func:`gpu_topology`
returns its devices; ``jax.jit(...).lower(abstract args).compile()`` over a
mesh of them runs the real XLA:GPU pipeline (fusion, NCCL collectives,
scheduling, memory assignment, PTX), as :func:`dtensor.tpu_topology` does for
TPUs.

The hardware half of each target config is a data file,
``dtensor/gpu/configs/<model>.txtpb`` (every number cited from the vendor's
public specifications); the software half (CUDA runtime and cuDNN versions) is
read from the installed CUDA wheels, so the program is compiled for the
libraries that would run it.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Iterator
from typing import Any

from dtensor.compat import backends_initialized
from dtensor.gpu.specs import GPUS

__all__ = ["GPU_MODELS", "GpuTopologyError", "gpu_topology", "parse_gpu_topology", "target_config"]

#: The GPU models there is a target config for.
GPU_MODELS = tuple(GPUS)

_SKIP = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
_INSTALL = (
    "pip install -e '.[gpu-aot]' in this project (or "
    "pip install 'jax[cuda12]==<your jax version>'; about 5.5 GB of CUDA wheels)"
)
# When the CUDA wheels' versions cannot be read (a system CUDA): what jax[cuda12] 0.10 ships.
_FALLBACK_CUDA = (12, 9)
_FALLBACK_CUDNN = (9, 8)


class GpuTopologyError(ValueError):
    """A GPU topology name or size that :func:`gpu_topology` cannot describe."""


def _has_gpu() -> bool:
    """Whether this machine has an NVIDIA GPU (its driver's device files)."""
    return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))


@contextlib.contextmanager
def _deviceless() -> Iterator[None]:
    """Let the CUDA plugin load without a GPU (else it stops at ``cuInit``).

    Only where no GPU is attached, and only while the plugin registers: on a
    machine with GPUs the plugin's own version checks stay on.
    """
    added = not _has_gpu() and _SKIP not in os.environ
    if added:
        os.environ[_SKIP] = "1"
    try:
        yield
    finally:
        if added:
            os.environ.pop(_SKIP, None)


def _version(package: str, default: tuple[int, int]) -> tuple[int, int, int]:
    try:
        parts = [int(p) for p in re.findall(r"\d+", importlib.metadata.version(package))[:3]]
    except importlib.metadata.PackageNotFoundError:
        parts = list(default)
    return (parts + [0, 0, 0])[0], (parts + [0, 0, 0])[1], (parts + [0, 0, 0])[2]


def target_config(model: str) -> str:
    """The XLA ``GpuTargetConfig`` text proto that :func:`gpu_topology` compiles for.

    The model's hardware file (``dtensor/gpu/configs/<model>.txtpb``) plus
    ``platform_name``, and the CUDA runtime and cuDNN versions of the
    installed CUDA wheels (``nvidia-cuda-runtime-cu12``,
    ``nvidia-cudnn-cu12``).

    Args:
        model: a name in :data:`GPU_MODELS` (``"h100"``, ``"h200"``,
            ``"a100-80gb"``, ``"b200"``).

    Returns:
        The text proto.

    Raises:
        GpuTopologyError: an unknown model.

    Examples:
        >>> from dtensor.gpu.topology import target_config
        >>> text = target_config("h100")
        >>> "core_count: 132" in text, 'platform_name: "CUDA"' in text
        (True, True)
    """
    if model not in GPUS:
        raise GpuTopologyError(
            f"GPU model {model!r} has no target config; known models: {', '.join(GPU_MODELS)}. "
            "To add one, put its <model>.txtpb in dtensor/gpu/configs/ and its figures in "
            "dtensor/gpu/specs.py (see the ahead-of-time guide)."
        )
    hardware = (importlib.resources.files("dtensor.gpu") / "configs" / f"{model}.txtpb").read_text()
    cuda = _version("nvidia-cuda-runtime-cu12", _FALLBACK_CUDA)
    cudnn = _version("nvidia-cudnn-cu12", _FALLBACK_CUDNN)
    return (
        f"{hardware}\n"
        'platform_name: "CUDA"\n'
        f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}\n"
        f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]} patch: {cudnn[2]} }}\n"
    )


def parse_gpu_topology(name: str, *, hosts: int = 1, slices: int = 1) -> tuple[str, int, int, int]:
    """``(model, slices, hosts per slice, GPUs per host)`` of a GPU topology name.

    ``"h100"`` (one host of 8), ``"h100:2x8"`` (hosts x GPUs per host),
    ``"h100:2x2x8"`` (slices x hosts per slice x GPUs per host). ``hosts`` and
    ``slices`` give the sizes for a bare model name.

    Examples:
        >>> from dtensor.gpu.topology import parse_gpu_topology
        >>> parse_gpu_topology("h100:2x8"), parse_gpu_topology("b200", hosts=4)
        (('h100', 1, 2, 8), ('b200', 1, 4, 8))
        >>> parse_gpu_topology("h100:2x2x8")
        ('h100', 2, 2, 8)
    """
    if not isinstance(name, str) or not name.strip():
        raise GpuTopologyError(
            f"gpu_topology(name={name!r}): the name must be a string such as 'h100', 'h100:2x8' "
            "(hosts x GPUs per host) or 'h100:2x2x8' (slices x hosts x GPUs per host)."
        )
    for what, value in (("hosts", hosts), ("slices", slices)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise GpuTopologyError(
                f"gpu_topology({name!r}, {what}={value!r}): {what} must be a positive integer."
            )
    model, _, grid = name.strip().lower().partition(":")
    if model not in GPUS:
        raise GpuTopologyError(
            f"gpu_topology({name!r}): no GPU model {model!r}; known models: "
            f"{', '.join(GPU_MODELS)} (e.g. 'h100:2x8' for 2 hosts of 8 H100s)."
        )
    per_host = GPUS[model].gpus_per_host
    if not grid:
        return model, slices, hosts, per_host
    sizes = grid.split("x")
    if len(sizes) not in (2, 3) or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise GpuTopologyError(
            f"gpu_topology({name!r}): the sizes after ':' must be HOSTSxGPUS ('h100:2x8') or "
            f"SLICESxHOSTSxGPUS ('h100:2x2x8'), positive integers; got {grid!r}."
        )
    if (hosts, slices) != (1, 1):
        raise GpuTopologyError(
            f"gpu_topology({name!r}, hosts={hosts}, slices={slices}): give the sizes either in "
            "the name or as hosts=/slices=, not both."
        )
    n = [int(s) for s in sizes]
    if n[-1] > per_host:
        raise GpuTopologyError(
            f"gpu_topology({name!r}): {n[-1]} GPUs per host, but a {model} host has at most "
            f"{per_host}; use more hosts."
        )
    return (model, 1, n[0], n[1]) if len(n) == 2 else (model, n[0], n[1], n[2])


@functools.lru_cache(maxsize=32)
def _topology(model: str, slices: int, hosts: int, per_host: int) -> tuple[Any, ...]:
    from jax.experimental import topologies

    grid = f"{slices}x{hosts}x{per_host}"
    plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    if not plugin:
        raise RuntimeError(
            f"gpu_topology({model!r}) needs JAX's CUDA plugin (XLA's GPU compiler), which is "
            f"not installed. Install it: {_INSTALL}. No GPU or driver is needed."
        )
    fresh = not backends_initialized()
    try:
        with _deviceless():
            desc = topologies.get_topology_desc(
                platform="cuda", target_config=target_config(model), topology=grid
            )
    except NotImplementedError:
        raise RuntimeError(
            f"gpu_topology({model!r}): the CUDA plugin is installed but did not register "
            + (
                "(see the log above)."
                if fresh
                else "(JAX's backends were set up before, and without a GPU the plugin then "
                f"stops at cuInit). Call dtensor.gpu_topology before the first jax.devices(), "
                f"or run with JAX_PLATFORMS=cpu (or {_SKIP}=1) on a machine without GPUs."
            )
        ) from None
    return tuple(desc.devices)


def gpu_topology(name: str, *, hosts: int = 1, slices: int = 1) -> list[Any]:
    """The devices of NVIDIA GPU hosts, from XLA's GPU compiler (no GPU needed).

    Use them as ``devices=`` anywhere (:func:`dtensor.create_mesh`,
    :func:`dtensor.create_distributed_mesh`, every preset) to compile for those
    hosts ahead of time; they cannot run anything. Each host is one process
    (``process_index``): collectives between devices of one host run over
    NVLink, the others over the network between hosts (InfiniBand or RoCE).
    Calls with the same arguments return the same device objects.

    Args:
        name: a GPU model (``"h100"``, ``"h200"``, ``"a100-80gb"``,
            ``"b200"``: 8 GPUs per host, as in HGX/DGX nodes), optionally
            with sizes: ``"h100:2x8"`` (hosts x GPUs per host) or
            ``"h100:2x2x8"`` (slices x hosts per slice x GPUs per host).
        hosts: hosts per slice, for a bare model name.
        slices: slices, for a bare model name. A slice is XLA's group of
            hosts (an NVLink domain on multi-node NVLink systems); between
            HGX hosts every byte crosses the network either way.

    Returns:
        The devices, slice by slice, host by host.

    Raises:
        GpuTopologyError: an unknown model or a malformed size.
        RuntimeError: the CUDA plugin is not installed.

    Examples:
        >>> import dtensor
        >>> devices = dtensor.gpu_topology("h100:2x8")
        >>> len(devices), devices[0].platform, devices[0].device_kind
        (16, 'gpu', 'NVIDIA H100 80GB HBM3')
        >>> sorted({d.process_index for d in devices})
        [0, 1]
        >>> dtensor.create_mesh([("data", 2), ("model", 8)], devices=devices)
        Mesh(data=2, model=8)
    """
    model, n_slices, n_hosts, per_host = parse_gpu_topology(name, hosts=hosts, slices=slices)
    return list(_topology(model, n_slices, n_hosts, per_host))
