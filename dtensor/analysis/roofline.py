"""The HBM roofline of a compiled step: each kernel's bytes at HBM bandwidth against its FLOPs.

A chip runs a step's kernels (XLA's fusions, copies, custom calls) one after another,
each at best as fast as the slower of

- its memory traffic: the bytes it must read and write, at the chip's HBM bandwidth;
- its arithmetic: its matmul FLOPs at the chip's peak.

The roofline term of the floor is the sum over kernels of the larger of the two, each
kernel counted as often as its computation runs (loop trip counts). It sees what the
compute term (matmul FLOPs over the whole step) cannot: elementwise work, normalisations
and a matmul too small to keep the MXU busy all wait for memory.

The bytes are counted low, so that the term stays a bound: a kernel's output once (an
in-place ``dynamic-update-slice`` only its update), each operand once, and of an operand
that the kernel only slices (one layer of a stacked weight in a scanned loop) only the
slices. Tiling padding, re-reads and spills are left out. The FLOPs of a
``convolution``/``dot`` are ``2 x output elements x contracted size``, the window of a
convolution left out (the TPU compiler writes batched matmuls as convolutions with
windows over padding), so they err low too. Asynchronous collectives and host copies run
beside the kernels and are priced by the network and host-link terms.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re

from dtensor.analysis.collective import array_bytes
from dtensor.analysis.hlo_text import Instr, operands, parse_shapes, program

__all__ = ["Roofline", "hbm_roofline"]

# Not kernels: structure, and what the other terms price (collectives, host copies).
_SKIP = {
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency",
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done", "all-gather",
    "all-reduce", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all",
    "collective-broadcast", "domain", "infeed", "outfeed", "token",
}  # fmt: skip
_SLICES = ("slice", "dynamic-slice", "gather")


@dataclasses.dataclass(frozen=True, slots=True)
class Roofline:
    """A step's kernels at the roofline, per device: ``seconds`` is the sum of each kernel's
    larger time; ``memory_seconds`` of the kernels where memory is the larger."""

    seconds: float
    memory_seconds: float
    bytes: int
    flops: int
    kernels: int


def hbm_roofline(text: str, hbm_bytes_per_s: float, peak_flops: float) -> Roofline:
    """The roofline of compiled HLO ``text`` (one device's program) on a chip.

    Examples:
        >>> from dtensor.analysis.roofline import hbm_roofline
        >>> hlo = '''HloModule m, entry_computation_layout={(f32[1024]{0})->f32[1024]{0}}
        ... %fused (p: f32[1024]) -> f32[1024] {
        ...   %p = f32[1024]{0} parameter(0)
        ...   ROOT %m = f32[1024]{0} multiply(%p, %p)
        ... }
        ... ENTRY %main (x: f32[1024]) -> f32[1024] {
        ...   %x = f32[1024]{0} parameter(0)
        ...   ROOT %f = f32[1024]{0} fusion(%x), kind=kLoop, calls=%fused
        ... }'''
        >>> r = hbm_roofline(hlo, 8192.0, 1e12)   # 8 KiB read and written at 8 KiB/s
        >>> r.bytes, r.seconds, r.kernels
        (8192, 1.0, 1)
    """
    comps, _, times = program(text)
    inner = _inner_computations(comps)
    total = memory = 0.0
    nbytes = flops = 0
    kernels = 0
    for name, instrs in comps.items():
        if name in inner:
            continue
        shapes = {ins.name: ins.shape for ins in instrs}
        for ins in instrs:
            if ins.opcode in _SKIP or ins.opcode.endswith(("-start", "-done", "-update")):
                continue
            b, f = _kernel(ins, shapes, comps)
            n = times.get(name, 1)
            t_mem, t_flops = b / hbm_bytes_per_s, f / peak_flops
            total += n * max(t_mem, t_flops)
            memory += n * t_mem if t_mem >= t_flops else 0.0
            nbytes += n * b
            flops += n * f
            kernels += 1
    return Roofline(total, memory, nbytes, flops, kernels)


def _inner_computations(comps: dict[str, list[Instr]]) -> set[str]:
    """Computations run inside a kernel: fusions' bodies and reducers (``to_apply``)."""
    inner: set[str] = set()
    for instrs in comps.values():
        for ins in instrs:
            for key in ("calls", "to_apply"):
                for m in re.finditer(rf"{key}=%?([\w.\-]+)", ins.rest):
                    if ins.opcode != "call" or key == "to_apply":
                        inner.add(m.group(1))
    return inner


def _kernel(ins: Instr, shapes: dict[str, str], comps: dict[str, list[Instr]]) -> tuple[int, int]:
    """``(bytes, flops)`` of one kernel, both counted low (see the module docs)."""
    names = operands(ins)
    sizes = [_nbytes(shapes.get(o, "")) for o in names]
    if ins.opcode == "fusion":
        m = re.search(r"calls=%?([\w.\-]+)", ins.rest)
        body = comps.get(m.group(1), []) if m else []
        return _fusion(ins, body, sizes, comps)
    if ins.opcode in _SLICES:
        return 2 * _nbytes(ins.shape), 0
    if ins.opcode == "dynamic-update-slice":
        return 2 * (sizes[1] if len(sizes) > 1 else 0), 0
    flops = _dot_flops(ins, [shapes.get(o, "") for o in names])
    return _nbytes(ins.shape) + sum(sizes), flops


def _fusion(
    ins: Instr, body: list[Instr], sizes: list[int], comps: dict[str, list[Instr]]
) -> tuple[int, int]:
    by_name = {i.name: i for i in body}
    root = body[-1] if body else None  # HLO text prints a computation's ROOT last
    out = _nbytes(ins.shape)
    if root is not None and root.opcode == "dynamic-update-slice":  # in place: the update
        update = by_name.get(operands(root)[1]) if len(operands(root)) > 1 else None
        out = _nbytes(update.shape) if update is not None else 0
    read = sum(_param_read(body, k, size, comps) for k, size in enumerate(sizes))
    return out + read, _body_flops(body, comps)


def _param_read(body: list[Instr], index: int, size: int, comps: dict[str, list[Instr]]) -> int:
    """The bytes a kernel's body reads of its parameter ``index`` (``size`` bytes): only the
    slices where it only slices it (through bitcasts and nested fusions), nothing where it
    only updates it in place, else all of it."""
    name = next(
        (
            i.name
            for i in body
            if i.opcode == "parameter" and re.match(rf"\(\s*{index}\s*\)", i.rest)
        ),
        None,
    )
    return size if name is None else _reads_of(body, name, size, comps, 0)


def _reads_of(
    body: list[Instr], name: str, size: int, comps: dict[str, list[Instr]], depth: int
) -> int:
    if body and body[-1].name == name:  # flows out of a nested kernel whole: read in full
        return size
    total = 0
    for user in body:
        ops = operands(user)
        if name not in ops:
            continue
        pos = ops.index(name)
        if user.opcode in _SLICES and pos == 0:
            total += _nbytes(user.shape)
        elif user.opcode == "dynamic-update-slice" and pos == 0:
            continue
        elif user.opcode == "bitcast" and depth < 8:
            total += _reads_of(body, user.name, size, comps, depth + 1)
        elif user.opcode == "fusion" and depth < 8:
            m = re.search(r"calls=%?([\w.\-]+)", user.rest)
            inner = comps.get(m.group(1), []) if m else []
            total += _param_read(inner, pos, size, comps) if inner else size
        else:
            return size
        if total >= size:
            return size
    return total


def _body_flops(body: list[Instr], comps: dict[str, list[Instr]], depth: int = 0) -> int:
    by_name = {i.name: i for i in body}
    flops = 0
    for i in body:
        if i.opcode == "fusion" and depth < 8:
            m = re.search(r"calls=%?([\w.\-]+)", i.rest)
            flops += _body_flops(comps.get(m.group(1), []) if m else [], comps, depth + 1)
        else:
            flops += _dot_flops(i, [by_name[o].shape for o in operands(i) if o in by_name])
    return flops


def _dot_flops(ins: Instr, operand_shapes: list[str]) -> int:
    """``2 x output elements x contracted size`` of a ``dot`` or ``convolution`` (0 else)."""
    if ins.opcode not in ("dot", "convolution") or not operand_shapes:
        return 0
    out = sum(math.prod(d) for _, d in parse_shapes(ins.shape))
    lhs = parse_shapes(operand_shapes[0])
    if not lhs:
        return 0
    dims = lhs[0][1]
    if ins.opcode == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
        idx = [int(x) for x in m.group(1).split(",") if x] if m else []
        return 2 * out * math.prod(dims[i] for i in idx if i < len(dims))
    m = re.search(r"dim_labels=([\w]+)_", ins.rest)
    labels = m.group(1) if m else ""
    feature = labels.find("f")
    size = dims[feature] if 0 <= feature < len(dims) else 1
    groups = re.search(r"feature_group_count=(\d+)", ins.rest)
    return 2 * out * size // (int(groups.group(1)) if groups else 1)


def _nbytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (tuples summed; an unknown type counts 0: low)."""
    total = 0
    for dtype, dims in parse_shapes(shape):
        with contextlib.suppress(ValueError):
            total += array_bytes(dtype, dims)
    return total
