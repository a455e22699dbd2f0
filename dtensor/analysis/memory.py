"""Memory per chip: a compiled program's bytes against the TPU chip's or GPU's HBM.

:func:`memory_fit` sets a compiled program's per-device memory against the
chip's HBM (:data:`CHIP_HBM_GIB`; for NVIDIA GPUs :data:`dtensor.gpu.specs.GPUS`)
and gives the verdict; :func:`out_of_memory` turns the TPU compiler's
out-of-HBM error into a :class:`WillNotFitError`.

On GPU the limit is JAX's allocator pool, 75% of the GPU's memory by default
(``XLA_CLIENT_MEM_FRACTION``): a program's buffers come from it at run time.
XLA:GPU compiles a program of any size (it never refuses one for memory); its
own budget, which scheduling and rematerialisation aim at ahead of time, is
``0.95 * (0.8 * device memory - arguments and outputs)`` -- on an 80 GiB
H100, 59.85 GiB of temporaries beside 1 GiB of arguments (measured: "Can't
reduce memory use below 59.85GiB by rematerialization"), about the allocator's
75%.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from dtensor.analysis.hardware import CHIPS, GENERATIONS
from dtensor.analysis.hardware import USABLE_HBM_GIB as USABLE_HBM_GIB
from dtensor.core.text import human_bytes
from dtensor.gpu.specs import gpu_spec, memory_fraction

__all__ = [
    "CHIP_HBM_GIB",
    "USABLE_HBM_GIB",
    "DEFAULT_ADVICE",
    "MemoryFit",
    "WillNotFitError",
    "chip_generation",
    "memory_fit",
    "out_of_memory",
    "padded_bytes",
]

GIB = 1 << 30

#: HBM per chip, GiB, by TPU generation (from :data:`dtensor.analysis.hardware.CHIPS`).
CHIP_HBM_GIB: dict[str, float] = {c.generation: c.hbm_gib for c in CHIPS.values()}

# ``device_kind`` -> generation.
_KINDS = GENERATIONS

#: Generations whose :data:`dtensor.analysis.hardware.CHIPS` entry holds one device's
#: figures (a TensorCore), not a chip's: memory is checked per device there.
PER_DEVICE = {"tpu7x"}


class WillNotFitError(ValueError):
    """The TPU compiler refused a program: it needs more HBM per chip than the chip has.

    ``required`` and ``available`` are XLA's figures in bytes (``None`` when
    its message gives none); ``xla_message`` is its text.
    """

    def __init__(self, message: str, required: float | None, available: float | None, xla: str):
        super().__init__(message)
        self.required = required
        self.available = available
        self.xla_message = xla


_SIZE = r"([0-9.]+)\s*([KMGT]i?B?|B)?"


def _bytes(value: str, unit: str | None) -> float:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get((unit or "B")[0], 1)
    return float(value) * scale


#: What helps when nothing is known of the preset in use.
DEFAULT_ADVICE = (
    "Shard the variables (FullyShardedStrategy / HybridStrategy), shrink the batch, or use more "
    "chips."
)


def out_of_memory(error: BaseException, *, advice: str | None = None) -> WillNotFitError | None:
    """The :class:`WillNotFitError` for the TPU compiler's out-of-HBM error, else ``None``.

    ``advice`` is what would help given the preset in use (strategies pass
    their ``memory_advice()``); default :data:`DEFAULT_ADVICE`.

    Examples:
        >>> from dtensor.analysis.memory import out_of_memory
        >>> err = RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
        ...                    "required for HLO temporaries (16.00G) exceeds available HBM (15.75G).")
        >>> print(out_of_memory(err))  # doctest: +ELLIPSIS
        will not fit: the TPU compiler needs 16.0 GiB ... but 15.8 GiB of HBM is available per device...
        >>> out_of_memory(ValueError("something else")) is None
        True
    """
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text or "memory" not in text.lower():
        return None
    xla = text.split("\n", 1)[0].strip()
    req = re.search(r"required[^(]*\(" + _SIZE + r"\)", xla) or re.search(r"Used " + _SIZE, xla)
    avail = re.search(r"available HBM \(" + _SIZE + r"\)", xla) or re.search(
        r"Used [0-9.]+\s*\S* of " + _SIZE, xla
    )
    required = _bytes(req.group(1), req.group(2)) if req else None
    available = _bytes(avail.group(1), avail.group(2)) if avail else None
    need = (
        f"needs {human_bytes(required)} (for what it keeps live at once)"
        if required
        else "needs more"
    )
    have = (
        f"{human_bytes(available)} of HBM is available per device"
        if available
        else "the chip's HBM"
    )
    return WillNotFitError(
        f"will not fit: the TPU compiler {need}, but {have}. {advice or DEFAULT_ADVICE} "
        f"(XLA: {xla})",
        required,
        available,
        xla,
    )


def chip_generation(devices: Sequence[Any]) -> str | None:
    """``"v4"``, ``"v5e"``, ``"v5p"`` or ``"v6e"`` for TPU devices (``None`` otherwise).

    Examples:
        >>> import dtensor
        >>> from dtensor.analysis.memory import chip_generation
        >>> chip_generation(dtensor.tpu_topology("v4:2x2x2"))
        'v4'
    """
    if not devices or devices[0].platform != "tpu":
        return None
    return _KINDS.get(devices[0].device_kind)


def _devices_per_chip(devices: Sequence[Any]) -> int:
    """How many devices (TensorCores) share one chip (2 on v4, else 1)."""
    chips: dict[tuple[Any, ...], int] = {}
    for d in devices:
        key = (getattr(d, "slice_index", 0), tuple(getattr(d, "coords", (d.id,))))
        chips[key] = chips.get(key, 0) + 1
    return max(chips.values()) if chips else 1


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryFit:
    """A compiled program's memory per chip against the chip's HBM.

    The figures are XLA's (``memory_analysis()``), per device;
    ``bytes_per_chip`` adds the devices that share a chip (the two
    TensorCores of a v4 chip). A program needs ``arguments + outputs -
    aliased + temporaries + code`` at its peak (outputs that reuse donated
    arguments are counted once), against what the TPU compiler lets one
    program use of the chip's HBM (``usable_bytes_per_chip``, from
    :data:`USABLE_HBM_GIB`; the whole HBM when not given). ``advice`` is what
    would help if it does not fit, given the preset in use (default
    :data:`DEFAULT_ADVICE`).

    Examples:
        >>> from dtensor.analysis.memory import MemoryFit
        >>> fit = MemoryFit("v5e", 16 << 30, 1, 20 << 30, 1 << 30, 1 << 30, 2 << 30, 0)
        >>> fit.fits, round(fit.bytes_per_chip / 2**30, 1)
        (False, 22.0)
        >>> print(fit)
        will not fit: needs 22.0 GiB per v5e chip (arguments 20.0 GiB + outputs 1.0 GiB - aliased 1.0 GiB + temporaries 2.0 GiB + code 0 B) but a v5e chip has 16.0 GiB of HBM (138% of it). Shard the variables (FullyShardedStrategy / HybridStrategy), shrink the batch, or use more chips.
        >>> from dtensor.analysis.memory import USABLE_HBM_GIB
        >>> near = MemoryFit("v5e", 16 << 30, 1, 15 << 30, 0, 0, 900 << 20, 0,
        ...                  usable_bytes_per_chip=int(USABLE_HBM_GIB["v5e"] * 2**30))
        >>> near.fits, near.limit_bytes_per_chip / 2**30   # 15.9 GiB: within 16, over 15.75
        (False, 15.75)
    """

    chip: str
    hbm_bytes_per_chip: int
    devices_per_chip: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    code_bytes: int
    advice: str | None = None
    usable_bytes_per_chip: int | None = None
    unit: str = "chip"

    @property
    def limit_bytes_per_chip(self) -> int:
        """What a program may use of one chip: ``usable_bytes_per_chip``, else the whole HBM."""
        return self.usable_bytes_per_chip or self.hbm_bytes_per_chip

    @property
    def bytes_per_device(self) -> int:
        """Peak bytes of one device: arguments + outputs - aliased + temporaries + code."""
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
            + self.code_bytes
        )

    @property
    def bytes_per_chip(self) -> int:
        """``bytes_per_device`` times the devices on one chip."""
        return self.bytes_per_device * self.devices_per_chip

    @property
    def fits(self) -> bool:
        """Whether ``bytes_per_chip`` is within what a program may use of the chip's HBM."""
        return self.bytes_per_chip <= self.limit_bytes_per_chip

    @property
    def fraction(self) -> float:
        """``bytes_per_chip / limit_bytes_per_chip``."""
        return self.bytes_per_chip / self.limit_bytes_per_chip

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with sorted keys (the fields and the derived figures)."""
        d = dataclasses.asdict(self)
        d.update(
            bytes_per_device=self.bytes_per_device,
            bytes_per_chip=self.bytes_per_chip,
            fits=self.fits,
            fraction=self.fraction,
            limit_bytes_per_chip=self.limit_bytes_per_chip,
        )
        return dict(sorted(d.items()))

    def __str__(self) -> str:
        h = human_bytes
        parts = (
            f"arguments {h(self.argument_bytes)} + outputs {h(self.output_bytes)} - aliased "
            f"{h(self.alias_bytes)} + temporaries {h(self.temp_bytes)} + code {h(self.code_bytes)}"
        )
        if self.devices_per_chip > 1:
            parts += f", x{self.devices_per_chip} TensorCores per chip"
        need = f"{h(self.bytes_per_chip)} per {self.chip} {self.unit} ({parts})"
        usable = (
            f", {h(self.usable_bytes_per_chip)} usable by a program"
            if self.usable_bytes_per_chip
            else ""
        )
        hbm = f"{h(self.hbm_bytes_per_chip)} of HBM{usable} ({self.fraction:.0%} of it)"
        if self.fits:
            return f"fits: {need} of the {self.unit}'s {hbm}."
        return f"will not fit: needs {need} but a {self.chip} {self.unit} has {hbm}. " + (
            self.advice or DEFAULT_ADVICE
        )


def memory_fit(
    memory_analysis: Any, devices: Sequence[Any], *, advice: str | None = None
) -> MemoryFit | None:
    """The per-chip memory of a compiled program against the HBM of ``devices``' chip.

    Args:
        memory_analysis: ``compiled.memory_analysis()`` (per device figures).
        devices: the program's devices (TPU, e.g. from :func:`tpu_topology`,
            or NVIDIA GPU, e.g. from :func:`dtensor.gpu_topology`: the limit
            is then JAX's allocator pool, :func:`dtensor.gpu.specs.memory_fraction`
            of the GPU's memory).
        advice: what would help if it does not fit (see :class:`MemoryFit`).

    Returns:
        The :class:`MemoryFit`, or ``None`` for devices that are neither a
        TPU generation in :data:`CHIP_HBM_GIB` nor a GPU model in
        :data:`dtensor.gpu.specs.GPUS`, or without a memory analysis.
    """
    if memory_analysis is None:
        return None
    chip = chip_generation(list(devices))
    gpu = gpu_spec(list(devices))
    unit = "chip"
    if chip is not None:
        per_chip = _devices_per_chip(list(devices))
        hbm, usable = int(CHIP_HBM_GIB[chip] * GIB), int(USABLE_HBM_GIB[chip] * GIB)
        if chip in PER_DEVICE:  # figures per TensorCore (Ironwood: 2 devices a chip)
            per_chip, unit = 1, "TensorCore"
    elif gpu is not None:
        chip, per_chip = gpu.name, 1
        hbm, usable = gpu.hbm_bytes, int(gpu.hbm_bytes * memory_fraction())
    else:
        return None

    def get(field: str) -> int:
        return int(getattr(memory_analysis, field, 0) or 0)

    return MemoryFit(
        chip=chip,
        hbm_bytes_per_chip=hbm,
        usable_bytes_per_chip=usable,
        unit=unit if gpu is None else "GPU",
        devices_per_chip=per_chip,
        argument_bytes=get("argument_size_in_bytes"),
        output_bytes=get("output_size_in_bytes"),
        alias_bytes=get("alias_size_in_bytes"),
        temp_bytes=get("temp_size_in_bytes"),
        code_bytes=get("generated_code_size_in_bytes"),
        advice=advice,
    )


def padded_bytes(shape: Sequence[int], dtype: Any, layout: Any) -> int:
    """Bytes of an array of ``shape`` stored in a compiled TPU ``layout`` (tiles padded).

    TPU arrays are stored in tiles (``(8, 128)`` for float32 matrices), so a
    small or odd-sized array occupies more than ``size * itemsize``; this is
    what ``memory_analysis()`` counts. ``layout`` is a
    ``jax.experimental.layout.Layout`` (``compiled.input_formats[...]
    .layout``), with ``major_to_minor`` and ``tiling``; ``None`` or no tiling
    means dense.

    Examples:
        >>> import numpy as np
        >>> from types import SimpleNamespace as L
        >>> from dtensor.analysis.memory import padded_bytes
        >>> padded_bytes((32,), np.float32, L(major_to_minor=(0,), tiling=((128,),)))
        512
        >>> padded_bytes((64, 1000), np.float32, L(major_to_minor=(0, 1), tiling=((8, 128),)))
        262144
    """
    itemsize = np.dtype(dtype).itemsize
    dims = [int(d) for d in shape]
    order = tuple(getattr(layout, "major_to_minor", ()) or ())
    tiling: tuple[Any, ...] = tuple(getattr(layout, "tiling", ()) or ())
    if layout is None or not tiling:
        return math.prod(dims) * itemsize
    physical = [dims[i] for i in order] if len(order) == len(dims) else dims
    tile = tuple(int(t) for t in tiling[0])
    physical = [1] * max(0, len(tile) - len(physical)) + physical
    k = len(tile)
    head, minor = physical[: len(physical) - k], physical[len(physical) - k :]
    padded = [-(-d // t) * t for d, t in zip(minor, tile, strict=True)]
    return math.prod(head) * math.prod(padded) * itemsize
