"""What one collective moves: :class:`Collective`, element sizes, and the ring model of bytes."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["KINDS", "Collective", "array_bytes", "dtype_bits", "ring_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Bits per element of XLA's primitive types (sub-byte types round up per array).
_BITS = dict(
    (t, int(b))
    for t, b in (
        e.split(":")
        for e in "pred:8 s2:2 u2:2 s4:4 u4:4 s8:8 u8:8 s16:16 u16:16 s32:32 u32:32 s64:64 "
        "u64:64 f16:16 bf16:16 f32:32 f64:64 c64:64 c128:128 token:0".split()
    )
)


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type (``f8e4m3fn`` and friends are 8)."""
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4") or dtype.startswith("f6"):
        return int(dtype[1])
    raise ValueError(f"unknown HLO element type {dtype!r}")


def array_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of an array of HLO type ``dtype`` and ``shape``."""
    return math.ceil(math.prod(shape) * dtype_bits(dtype) / 8)


def ring_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes each device sends for one collective under the ring model.

    ``nbytes`` is the size of the collective's *result* on one device (for a
    collective-permute, the buffer moved) and ``n`` the group size: all-reduce
    ``2(n-1)/n*S``; all-gather ``(n-1)/n*S_out``; reduce-scatter
    ``(n-1)/n*S_in = (n-1)*S_out``; all-to-all ``(n-1)/n*S``; collective-permute
    ``S``.

    Examples:
        >>> from dtensor.analysis.hlo import ring_bytes
        >>> ring_bytes("all-reduce", 800, 8), ring_bytes("reduce-scatter", 100, 8)
        (1400.0, 700.0)
    """
    if kind == "collective-permute":
        return float(nbytes)
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind == "reduce-scatter":
        return float((n - 1) * nbytes)
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * nbytes
    raise ValueError(f"unknown collective kind {kind!r}; kinds are {KINDS}.")


@dataclasses.dataclass(frozen=True, slots=True)
class Collective:
    """One operand of one collective in a compiled program.

    Attributes:
        kind: ``all-reduce``, ``all-gather``, ``reduce-scatter``,
            ``all-to-all`` or ``collective-permute``.
        mesh_axes: the mesh axes its groups span, major first (``()`` when
            the program's mesh is unknown).
        dtype: the HLO element type (``f32``, ``bf16``...).
        shape: the per-device *result* shape of this operand.
        group_size: devices per replica group (for a permute: devices along
            ``mesh_axes``).
        bytes_per_device: bytes each device sends per execution (ring model,
            see :func:`ring_bytes`).
        count: executions per call of the program (loop trip counts).
        name: the HLO instruction's name.
        op_name: its ``metadata={op_name=...}``: JAX's name stack (``jax.named_scope``),
            as ``.../context_attention/...`` for :func:`dtensor.context_attention`'s exchange.
        network: ``"ici"`` (within a TPU slice), ``"dcn"`` (across slices),
            ``"nvlink"`` (within a GPU host), ``"ib"`` (across GPU hosts:
            InfiniBand or RoCE), or ``""`` when unknown. For a DCN
            transfer ``shape`` is what each device sends.
    """

    kind: str
    mesh_axes: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    group_size: int
    bytes_per_device: float
    count: int = 1
    name: str = ""
    network: str = ""
    op_name: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def total_bytes_per_device(self) -> float:
        """``bytes_per_device * count``."""
        return self.bytes_per_device * self.count

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with sorted keys."""
        d = dataclasses.asdict(self)
        d["mesh_axes"] = list(self.mesh_axes)
        d["shape"] = list(self.shape)
        return dict(sorted(d.items()))
