"""NVIDIA GPU models dtensor compiles for ahead of time: the vendor's figures per GPU.

One :class:`GpuSpec` per model in :data:`GPUS`, keyed by the name
:func:`dtensor.gpu_topology` takes. The compiler's view of each model (SM
count, shared memory, clocks...) is its target config,
``dtensor/gpu/configs/<name>.txtpb``; this table holds the figures a step-time
or fit estimate needs beside it: memory, peak dense bf16 FLOP/s, and the
bandwidth each GPU has on the network inside its host (NVLink) and between
hosts (InfiniBand or RoCE, one NIC per GPU in NVIDIA's reference nodes).
Bandwidths are per direction, bytes per second (the datasheets' NVLink
figures count both directions: 900 GB/s there is 450 GB/s here).

This module imports nothing from dtensor: the analysis layer reads it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["GPUS", "DEFAULT_MEMORY_FRACTION", "GpuSpec", "gpu_spec", "memory_fraction"]

GB = 10**9
TB = 10**12
GIB = 1 << 30

#: The share of a GPU's memory JAX's allocator takes for itself (and so the most one program
#: may use): XLA's ``GpuAllocatorConfig.memory_fraction`` default, which
#: ``XLA_CLIENT_MEM_FRACTION`` (formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``) overrides.
DEFAULT_MEMORY_FRACTION = 0.75


@dataclasses.dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's figures (per GPU; bandwidths per direction).

    Attributes:
        name: the model's name in :func:`dtensor.gpu_topology` (``"h100"``).
        device_kind: the name CUDA reports (``jax.Device.device_kind``).
        hbm_bytes: memory per GPU (the target config's ``device_memory_size``).
        hbm_bytes_per_second: memory bandwidth.
        peak_bf16_flops: dense bf16 tensor-core FLOP/s (the datasheets'
            "with sparsity" figure halved).
        nvlink_bytes_per_second: NVLink bandwidth of one GPU to the others of
            its host, one direction.
        network_bytes_per_second: scale-out bandwidth of one GPU (its NIC:
            InfiniBand or RoCE) to other hosts, one direction.
        gpus_per_host: GPUs on one board of the model's reference node
            (HGX/DGX).
        source: where the figures come from.
    """

    name: str
    device_kind: str
    hbm_bytes: int
    hbm_bytes_per_second: float
    peak_bf16_flops: float
    nvlink_bytes_per_second: float
    network_bytes_per_second: float
    gpus_per_host: int
    source: str


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="h100",
        device_kind="NVIDIA H100 80GB HBM3",
        hbm_bytes=80 * GIB,  # datasheet: 80 GB HBM3
        hbm_bytes_per_second=3.35 * TB,  # datasheet: 3.35 TB/s
        peak_bf16_flops=989e12,  # datasheet: 1,979 TFLOPS bf16 with sparsity
        nvlink_bytes_per_second=450 * GB,  # datasheet: NVLink 900 GB/s (both directions)
        network_bytes_per_second=50 * GB,  # DGX H100: 8x ConnectX-7, 400 Gb/s each
        gpus_per_host=8,
        source="NVIDIA H100 datasheet (SXM5); DGX H100 datasheet",
    ),
    "h200": GpuSpec(
        name="h200",
        device_kind="NVIDIA H200",
        hbm_bytes=141 * GIB,  # datasheet: 141 GB HBM3e
        hbm_bytes_per_second=4.8 * TB,  # datasheet: 4.8 TB/s
        peak_bf16_flops=989e12,  # datasheet: 1,979 TFLOPS bf16 with sparsity
        nvlink_bytes_per_second=450 * GB,  # datasheet: NVLink 900 GB/s (both directions)
        network_bytes_per_second=50 * GB,  # DGX H200: 8x ConnectX-7, 400 Gb/s each
        gpus_per_host=8,
        source="NVIDIA H200 datasheet (SXM); DGX H200 datasheet",
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        device_kind="NVIDIA A100-SXM4-80GB",
        hbm_bytes=80 * GIB,  # datasheet: 80 GB HBM2e
        hbm_bytes_per_second=2.039 * TB,  # datasheet: 2,039 GB/s
        peak_bf16_flops=312e12,  # datasheet: 312 TFLOPS bf16 (624 with sparsity)
        nvlink_bytes_per_second=300 * GB,  # datasheet: NVLink 600 GB/s (both directions)
        network_bytes_per_second=25 * GB,  # DGX A100: 8x ConnectX-6, 200 Gb/s HDR each
        gpus_per_host=8,
        source="NVIDIA A100 datasheet (80GB SXM); DGX A100 datasheet",
    ),
    "b200": GpuSpec(
        name="b200",
        device_kind="NVIDIA B200",
        hbm_bytes=180 * GIB,  # DGX B200: 1,440 GB HBM3e over 8 GPUs
        hbm_bytes_per_second=8 * TB,  # DGX B200: 64 TB/s over 8 GPUs
        peak_bf16_flops=2.25e15,  # HGX B200: 36 PFLOPS bf16 with sparsity over 8 GPUs
        nvlink_bytes_per_second=900 * GB,  # NVLink 5: 1.8 TB/s per GPU (both directions)
        network_bytes_per_second=50 * GB,  # DGX B200: 8x ConnectX-7, 400 Gb/s each
        gpus_per_host=8,
        source="NVIDIA DGX B200 and HGX B200 datasheets",
    ),
}

_BY_KIND = {s.device_kind: s for s in GPUS.values()}


def gpu_spec(devices: Sequence[Any]) -> GpuSpec | None:
    """The :class:`GpuSpec` of ``devices``' model (by ``device_kind``), else ``None``.

    Examples:
        >>> import jax
        >>> from dtensor.gpu.specs import GPUS, gpu_spec
        >>> gpu_spec(jax.devices()) is None
        True
        >>> GPUS["h100"].peak_bf16_flops / 1e12, GPUS["h100"].gpus_per_host
        (989.0, 8)
    """
    if not devices or devices[0].platform != "gpu":
        return None
    return _BY_KIND.get(devices[0].device_kind)


def memory_fraction() -> float:
    """The share of a GPU's memory one JAX process may use: the environment's, else 0.75.

    Reads ``XLA_CLIENT_MEM_FRACTION`` (or the older
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``), as JAX's GPU client does.

    Examples:
        >>> from dtensor.gpu.specs import memory_fraction
        >>> 0 < memory_fraction() <= 1
        True
    """
    text = os.environ.get("XLA_CLIENT_MEM_FRACTION") or os.environ.get(
        "XLA_PYTHON_CLIENT_MEM_FRACTION", ""
    )
    try:
        value = float(text)
    except ValueError:
        return DEFAULT_MEMORY_FRACTION
    return value if 0 < value <= 1 else DEFAULT_MEMORY_FRACTION
