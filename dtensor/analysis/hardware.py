"""Accelerator chips: peak compute, memory and network, from their public specifications.

One table (:data:`CHIPS`), keyed by the ``device_kind`` JAX reports, so that
other accelerators (GPUs) can join it. The figures feed the memory verdict
(:mod:`dtensor.analysis.memory`) and the step-time floor
(:mod:`dtensor.analysis.floor`).

Sources (Google Cloud TPU documentation, "System architecture" of each
generation, read 2026-12):

- v5e (https://cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16 per chip,
  16 GB HBM, 400 GB/s bidirectional ICI per chip (4 ports), 8 chips per host
  with 2 x 100 Gbps NICs (25 Gbit/s DCN per chip).
- v5p (https://cloud.google.com/tpu/docs/v5p): 459 TFLOP/s, 95 GiB HBM,
  1200 GB/s bidirectional ICI per chip, 50 Gbit/s DCN per chip.
- v6e (https://cloud.google.com/tpu/docs/v6e): 918 TFLOP/s, 32 GB HBM,
  800 GB/s bidirectional ICI per chip, 8 chips per host with 4 x 200 Gbps
  NICs (100 Gbit/s DCN per chip).
- v4 (https://cloud.google.com/tpu/docs/v4; Jouppi et al., "TPU v4", ISCA
  2023): 275 TFLOP/s, 32 GiB HBM, six ICI links of 50 GB/s; no DCN figure per
  chip is published.

- tpu7x, Ironwood (Google Cloud, "Ironwood: the first Google TPU for the age of
  inference", 2025-04, and Cloud TPU's Ironwood page): 4614 TFLOP/s fp8 and 2307
  bf16 per chip, 192 GB HBM at 7.37 TB/s, 1.2 TB/s bidirectional ICI per chip, 9216
  chips a pod; no DCN figure per chip. Its two TensorCores are two JAX devices
  (libtpu has no megacore for it), so its entry holds **per-device** figures, half a
  chip's (the usable HBM is libtpu 0.0.42's "available HBM" per device), and memory
  is reported per device.

HBM bandwidth per chip (the same pages): v4 1200 GB/s, v5e 819, v5p 2765,
v6e 1640. The link between a chip and its host (PCIe; Google publishes no
per-chip figure): 32 GB/s each way, the upper end of the 16-32 GB/s a TPU's
PCIe link carries by the JAX Scaling Book ("How to Scale Your Model", part 2,
"How to think about TPUs"), so that the host-link term of the floor errs low.

A collective's bytes per device (the ring model of
:mod:`dtensor.analysis.collective`) leave a chip over all its ICI links at
once at best, so the floor divides them by the chip's egress bandwidth, half
the bidirectional figure.

NVIDIA GPUs join through :func:`chip_of` from their own cited table
(:data:`dtensor.gpu.specs.GPUS`): dense bf16 peak, NVLink within a host in
the place of ICI, the GPU's NIC (InfiniBand/RoCE) between hosts in the place
of DCN, and what JAX's allocator lets one program use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dtensor.gpu.specs import gpu_spec, memory_fraction

__all__ = ["CHIPS", "GENERATIONS", "USABLE_HBM_GIB", "Chip", "chip_of"]

GB = 1e9


@dataclasses.dataclass(frozen=True, slots=True)
class Chip:
    """One accelerator chip's public figures.

    ``peak_flops`` is the dense bf16 peak per chip (FLOP/s);
    ``ici_bytes_per_s`` what one chip can send at once over its ICI links
    (half the bidirectional figure); ``dcn_bytes_per_s`` its share of the
    hosts' data-centre network (``None`` where none is published);
    ``usable_hbm_gib`` what the compiler lets one program use per chip;
    ``networks`` the names of the two networks (``("NVLink", "IB")`` for a
    GPU: within a host, between hosts); ``hbm_bytes_per_s`` its memory
    bandwidth and ``host_bytes_per_s`` its link to host memory, each way
    (``None``: no figure).
    """

    generation: str
    peak_flops: float
    hbm_gib: float
    usable_hbm_gib: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float | None
    networks: tuple[str, str] = ("ICI", "DCN")
    hbm_bytes_per_s: float | None = None
    host_bytes_per_s: float | None = None


_HOST = 32 * GB  # a TPU chip's PCIe link to its host, each way (upper end: see above)
_V4 = Chip(
    "v4", 275e12, 32, 30.75, 300 * GB, None, hbm_bytes_per_s=1200 * GB, host_bytes_per_s=_HOST
)
_V5E = Chip(
    "v5e", 197e12, 16, 15.75, 200 * GB, 25e9 / 8, hbm_bytes_per_s=819 * GB, host_bytes_per_s=_HOST
)
_V5P = Chip(
    "v5p", 459e12, 95, 95.74, 600 * GB, 50e9 / 8, hbm_bytes_per_s=2765 * GB, host_bytes_per_s=_HOST
)
_V6E = Chip(
    "v6e", 918e12, 32, 31.25, 400 * GB, 100e9 / 8, hbm_bytes_per_s=1640 * GB, host_bytes_per_s=_HOST
)
# per device (one TensorCore, half a chip): see above
_TPU7X = Chip(
    "tpu7x",
    2307e12 / 2,
    96,
    94.75,
    300 * GB,
    None,
    hbm_bytes_per_s=7370 * GB / 2,
    host_bytes_per_s=_HOST / 2,
)

#: ``device_kind`` -> :class:`Chip`. The usable HBM is the "available HBM" of the TPU
#: compiler's out-of-memory error (libtpu 0.0.42; the rest is reserved), per chip: one
#: device a chip as Cloud TPU VMs run v4 and v5p (megacore; :func:`dtensor.tpu_topology`).
CHIPS: dict[str, Chip] = {
    "TPU v4": _V4,
    "TPU v5 lite": _V5E,
    "TPU v5e": _V5E,
    "TPU v5": _V5P,
    "TPU v5p": _V5P,
    "TPU v6 lite": _V6E,
    "TPU v6e": _V6E,
    "TPU7x": _TPU7X,
}

#: ``device_kind`` -> TPU generation name.
GENERATIONS: dict[str, str] = {kind: chip.generation for kind, chip in CHIPS.items()}

#: HBM per device that the TPU compiler lets one program use, GiB, by generation.
USABLE_HBM_GIB: dict[str, float] = {c.generation: c.usable_hbm_gib for c in CHIPS.values()}


def chip_of(devices: Sequence[Any]) -> Chip | None:
    """The :class:`Chip` of ``devices`` (``None`` for a kind in neither :data:`CHIPS` nor
    :data:`dtensor.gpu.specs.GPUS`).

    Examples:
        >>> import dtensor
        >>> from dtensor.analysis.hardware import chip_of
        >>> chip = chip_of(dtensor.tpu_topology("v5e:2x2"))
        >>> chip.generation, chip.peak_flops / 1e12, chip.hbm_gib
        ('v5e', 197.0, 16)
        >>> chip_of(__import__("jax").devices()) is None
        True
    """
    if not devices:
        return None
    chip = CHIPS.get(getattr(devices[0], "device_kind", ""))
    if chip is not None:
        return chip
    spec = gpu_spec(devices)
    if spec is None:
        return None
    gib = float(1 << 30)
    return Chip(
        spec.name,
        spec.peak_bf16_flops,
        spec.hbm_bytes / gib,
        spec.hbm_bytes * memory_fraction() / gib,
        spec.nvlink_bytes_per_second,
        spec.network_bytes_per_second,
        networks=("NVLink", "IB"),
        hbm_bytes_per_s=spec.hbm_bytes_per_second,
    )
