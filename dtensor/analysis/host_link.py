"""What a compiled step moves between device memory and host memory, read from its HLO.

Activations offloaded by a ``remat_policy`` (``"offload"``) and state kept in
``pinned_host`` memory cross the chip's link to its host. In the TPU
compiler's program a host buffer is an array whose layout names memory space
5 (``S(5)``); data reaches it and comes back through

- ``copy-start`` (an async copy: its shape is ``(destination, source, context)``),
- ``dynamic-update-slice-start`` into a host buffer (one layer's slice of a
  scanned stack of offloaded activations) and ``dynamic-slice-start`` out of one,
- and the synchronous ``copy``, ``dynamic-update-slice`` and ``dynamic-slice``.

Each transfer counts as often as its computation runs (loop trip counts, as
:mod:`dtensor.analysis.hlo` counts collectives).
"""

from __future__ import annotations

import dataclasses

from dtensor.analysis.collective import array_bytes
from dtensor.analysis.hlo_text import Instr, operands, parse_shapes, program, tuple_items

__all__ = ["HostTraffic", "Transfer", "host_transfers"]

HOST = "S(5)"
_SYNC = ("copy", "dynamic-update-slice", "dynamic-slice")
_ASYNC = ("copy-start", "dynamic-update-slice-start", "dynamic-slice-start")


@dataclasses.dataclass(frozen=True, slots=True)
class Transfer:
    """One array moved between device and host memory (``count`` times a step)."""

    direction: str  # "to host" | "from host"
    dtype: str
    shape: tuple[int, ...]
    count: int
    computation: str

    @property
    def bytes(self) -> int:
        """Bytes of all ``count`` transfers."""
        return array_bytes(self.dtype, self.shape) * self.count


@dataclasses.dataclass(frozen=True, slots=True)
class HostTraffic:
    """A step's transfers between device and host memory, per device."""

    transfers: tuple[Transfer, ...]

    @property
    def to_host_bytes(self) -> int:
        return sum(t.bytes for t in self.transfers if t.direction == "to host")

    @property
    def from_host_bytes(self) -> int:
        return sum(t.bytes for t in self.transfers if t.direction == "from host")


def host_transfers(text: str) -> HostTraffic:
    """The transfers between device and host memory in compiled HLO ``text`` (one device's).

    Examples:
        >>> from dtensor.analysis.host_link import host_transfers
        >>> hlo = '''HloModule m, entry_computation_layout={()->f32[8]{0}}
        ... ENTRY %main () -> f32[8] {
        ...   %p = f32[8]{0} parameter(0)
        ...   %s = (f32[8]{0:S(5)}, f32[8]{0}, u32[]) copy-start(%p)
        ...   %d = f32[8]{0:S(5)} copy-done(%s)
        ...   %b = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(%d)
        ...   ROOT %e = f32[8]{0} copy-done(%b)
        ... }'''
        >>> t = host_transfers(hlo)
        >>> t.to_host_bytes, t.from_host_bytes
        (32, 32)
    """
    comps, _, times = program(text)
    out: list[Transfer] = []
    for name, instrs in comps.items():
        shapes = {ins.name: ins.shape for ins in instrs}
        for ins in instrs:
            if HOST not in ins.shape and not (
                ins.opcode in _SYNC and any(HOST in shapes.get(o, "") for o in operands(ins))
            ):
                continue
            found = _transfer(ins, shapes)
            if found is not None:
                direction, array = found
                for dtype, dims in parse_shapes(array)[:1]:
                    out.append(Transfer(direction, dtype, dims, times.get(name, 1), name))
    return HostTraffic(tuple(out))


def _transfer(ins: Instr, shapes: dict[str, str]) -> tuple[str, str] | None:
    """``(direction, array shape)`` of one instruction that moves data to or from host memory."""
    if ins.opcode in _ASYNC:
        items = tuple_items(ins.shape)
        if ins.opcode == "copy-start" and len(items) >= 2:
            dst, src = items[0], items[1]
            if HOST in dst and HOST not in src:
                return "to host", dst
            if HOST in src and HOST not in dst:
                return "from host", dst
        if ins.opcode == "dynamic-update-slice-start" and items:
            inner = tuple_items(items[0])
            if len(inner) >= 2 and HOST in inner[0] and HOST not in inner[1]:
                return "to host", inner[1]
        if ins.opcode == "dynamic-slice-start" and len(items) >= 2:
            inner = tuple_items(items[0])
            if inner and HOST in inner[0] and HOST not in items[1]:
                return "from host", items[1]
        return None
    if ins.opcode not in _SYNC:
        return None
    given = [shapes.get(o, "") for o in operands(ins)]
    into_host = HOST in ins.shape
    from_host = bool(given) and HOST in given[0] and not into_host
    if ins.opcode == "dynamic-update-slice" and into_host and len(given) > 1:
        return ("to host", given[1]) if HOST not in given[1] else None
    if into_host and given and HOST not in given[0]:
        return "to host", ins.shape
    if from_host:
        return "from host", ins.shape
    return None
