"""Collectives of a compiled XLA program, read from its HLO text.

:func:`parse_collectives` reads ``compiled.as_text()`` and returns one
:class:`Collective` per operand of every all-reduce, all-gather,
reduce-scatter, all-to-all and collective-permute, with the mesh axes its
replica groups run over and its bytes per device under the ring model.

Replica groups appear in three syntaxes; all are read:

- explicit lists: ``replica_groups={{0,1,2,3},{4,5,6,7}}``;
- iota lists: ``replica_groups=[2,4]<=[4,2]T(1,0)`` (``iota(dims)``
  transposed by the permutation, reshaped to ``[groups, size]``);
- mesh axes: ``replica_groups=mesh['axis_0'=4,'axis_1'=2] {'axis_1'}``, where
  the names are XLA-internal (sub-axes print as ``'axis_0':(1)2``).

The ids in them are logical device ids: positions in the program's device
assignment, which for ``jax.jit`` over a ``NamedSharding`` is the mesh's
devices in row-major order. Each group is mapped back to mesh coordinates and
``mesh_axes`` names the axes along which the coordinates vary (major first).

Asynchronous pairs (``all-gather-start`` / ``all-gather-done``...) count once,
with the shape of the ``-done``. Collectives inside a ``while`` loop count as
many times as its ``known_trip_count`` (once when XLA does not know it); one
in a branch of a ``conditional`` whose name scope ends ``..._1_in_N_ticks``
(:func:`dtensor.pipeline`'s hand-off between stages, taken one tick in ``N``)
as ``1 / N`` of those.

libtpu overlaps a collective with the matmuls around it by an *async collective
fusion* chain: the fusion that starts it (an ``AsyncCollectiveStart`` custom
call), continuation fusions (``async_collective_fusion...``, often inside a
collective-matmul loop) and the fusion that ends it (``AsyncCollectiveDone``).
Every piece repeats the whole collective instruction, with the same
``channel_id``, and threads one output buffer and its progress counters through
the chain: it is one collective, counted once, where it starts
(``chained_copies=True`` counts every piece).

Multi-slice TPU programs (given ``slices=``, each device's slice index) are
compiled per slice: replica groups use slice-local ids, and what crosses
slices is a megascale host transfer (a ``send`` whose
``_xla_megascale_transfer_type`` is ``ALL_REDUCE``, ``ALL_GATHER``...). Those
are read as collectives with ``network="dcn"``; the others get ``"ici"``.
GPU programs (given ``hosts=``, each device's host) are one program over all
hosts: a collective whose groups stay within hosts gets ``"nvlink"``, one
whose groups span hosts ``"ib"``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from dtensor.analysis.collective import KINDS as KINDS
from dtensor.analysis.collective import Collective as Collective
from dtensor.analysis.collective import array_bytes as array_bytes
from dtensor.analysis.collective import dtype_bits as dtype_bits
from dtensor.analysis.collective import ring_bytes as ring_bytes
from dtensor.analysis.hlo_text import (
    Instr,
    attr,
    computations,
    groups_to_axes,
    ints,
    multipliers,
    parse_shapes,
    tuple_items,
)
from dtensor.analysis.hlo_text import parse_replica_groups as parse_replica_groups

__all__ = [
    "KINDS",
    "Collective",
    "array_bytes",
    "dtype_bits",
    "parse_collectives",
    "parse_replica_groups",
    "ring_bytes",
]

# XLA:GPU also emits reduce-scatter and all-to-all as start/done pairs.
_PAIRED = ("all-reduce", "all-gather", "collective-permute", "reduce-scatter", "all-to-all")
_ASYNC = {f"{k}-start": k for k in _PAIRED}
_DONE = {f"{k}-done" for k in _PAIRED}


def parse_collectives(
    text: str,
    mesh_shape: Sequence[tuple[str, int]] | None = None,
    num_devices: int | None = None,
    *,
    slices: Sequence[int] | None = None,
    hosts: Sequence[int] | None = None,
    chained_copies: bool = False,
) -> list[Collective]:
    """Every collective operand in optimised HLO text, in program order.

    Args:
        text: ``compiled.as_text()``.
        mesh_shape: ``[(axis name, size), ...]`` of the mesh whose row-major
            device order is the program's device assignment; ``None`` leaves
            ``mesh_axes`` empty.
        num_devices: devices in the program (default: the mesh's size), for
            replica groups written ``{}`` (all devices).
        slices: the TPU slice index of each device, in mesh order; given, each
            collective gets its ``network`` and a multi-slice program's
            slice-local ids are mapped to the mesh.
        hosts: the host (process) of each device, in mesh order, for GPU
            programs (one program over all hosts, global ids): a collective
            within one host gets ``network="nvlink"``, one that spans hosts
            ``"ib"`` (InfiniBand or RoCE).

    Returns:
        One :class:`Collective` per operand of each collective.
    """
    if num_devices is None:
        num_devices = math.prod(s for _, s in mesh_shape) if mesh_shape else 1
    net = (
        _Network.make(slices, num_devices)
        if hosts is None
        else _Network.make(hosts, num_devices, names=("nvlink", "ib"), per_slice=False)
    )
    if net is not None and net.local is not None:
        num_devices = len(net.local)
    comps, entry = computations(text)
    mults = multipliers(comps, entry)
    copies = set() if chained_copies else _chain_copies(comps)
    starts: dict[str, tuple[str, Instr, str]] = {}
    out: list[Collective] = []
    for comp, instrs in comps.items():
        for ins in instrs:
            if ins.name in copies:
                continue
            if ins.opcode in _ASYNC:
                starts[ins.name] = (_ASYNC[ins.opcode], ins, comp)
                continue
            if ins.opcode in _DONE:
                m = re.match(r"\(\s*%?([\w.\-]+)", ins.rest)
                if m and m.group(1) in starts:
                    kind, start, _ = starts.pop(m.group(1))
                    out.extend(
                        _collective(
                            kind, start, ins.shape, mults[comp], mesh_shape, num_devices, net
                        )
                    )
                continue
            if ins.opcode == "send" and net is not None and _MEGASCALE in ins.rest:
                out.extend(_dcn_transfer(ins, mults[comp], mesh_shape, net))
                continue
            if ins.opcode == "ragged-all-to-all-start":
                # Async (XLA:GPU; libtpu from 0.0.3x): ``((operands...), result, ...)`` with
                # trailing tokens or u32 scalars; the first operand is the input buffer.
                operands, result = tuple_items(ins.shape)[:2]
                sent = min(tuple_items(operands)[0], result, key=_shape_elements)
                out.extend(
                    _collective("all-to-all", ins, sent, mults[comp], mesh_shape, num_devices, net)
                )
                continue
            if ins.opcode == "ragged-all-to-all":
                # An MoE dispatch or its return: at most the smaller of its operand and result
                # leaves each device (the larger is the buffer sized for the dropless worst
                # case, ``n`` times the rows routed); counted as an all-to-all of that.
                sent = min(_operand_shape(instrs, ins), ins.shape, key=_shape_elements)
                out.extend(
                    _collective("all-to-all", ins, sent, mults[comp], mesh_shape, num_devices, net)
                )
                continue
            if ins.opcode in KINDS:
                kind, shape = _fused_reduce_scatter(comp, instrs, ins) or (ins.opcode, ins.shape)
                out.extend(_collective(kind, ins, shape, mults[comp], mesh_shape, num_devices, net))
    for kind, start, comp in starts.values():  # a start without its done: use its own shape
        shapes = parse_shapes(start.shape)
        half = {"all-gather": shapes[len(shapes) // 2 :], "collective-permute": shapes[:1]}.get(
            kind, shapes
        )
        fake = "(" + ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in half) + ")"
        out.extend(_collective(kind, start, fake, mults[comp], mesh_shape, num_devices, net))
    return out


def _chain_copies(comps: dict[str, list[Instr]]) -> set[str]:
    """Names of the collectives that continue or end an async collective fusion chain
    whose start (same ``channel_id``, outside the continuations and the end) is seen."""
    kinds = set(KINDS) | set(_ASYNC)
    repeats: dict[str, list[str]] = {}
    started: set[str] = set()
    for name, instrs in comps.items():
        repeat = name.startswith("async_collective_fusion") or any(
            i.opcode == "custom-call" and '"AsyncCollectiveDone"' in i.rest for i in instrs
        )
        for i in instrs:
            channel = attr(i.rest, "channel_id") if i.opcode in kinds else None
            if channel is None:
                continue
            if repeat:
                repeats.setdefault(channel, []).append(i.name)
            else:
                started.add(channel)
    return {n for channel, names in repeats.items() if channel in started for n in names}


def _shape_elements(shape: str) -> int:
    return sum(math.prod(d) for t, d in parse_shapes(shape) if t != "token")


def _operand_shape(instrs: list[Instr], ins: Instr) -> str:
    """The shape of ``ins``'s first operand (its own shape when the operand is not found)."""
    m = re.match(r"\(\s*(?:[\w\[\],{}:()]+\s+)?%?([\w.\-]+)", ins.rest)
    if m:
        for other in instrs:
            if other.name == m.group(1):
                return other.shape
    return ins.shape


def _fused_reduce_scatter(comp: str, instrs: list[Instr], ins: Instr) -> tuple[str, str] | None:
    """``("reduce-scatter", result shape)`` for the TPU compiler's fused reduce-scatter.

    libtpu emits a reduce-scatter as a fusion computation named
    ``all-reduce-scatter*`` holding an all-reduce of the (padded) input whose
    result is dynamic-sliced to this device's block; it runs as one
    reduce-scatter, so it is counted as one (``None`` for anything else).
    """
    if ins.opcode != "all-reduce" or not comp.startswith("all-reduce-scatter"):
        return None
    for other in instrs:
        if other.opcode == "dynamic-slice" and re.match(
            rf"\(\s*%?{re.escape(ins.name)}\b", other.rest
        ):
            return "reduce-scatter", other.shape
    return None


def _collective(
    kind: str,
    ins: Instr,
    shape: str,
    count: int,
    mesh_shape: Any,
    num_devices: int,
    net: _Network | None = None,
) -> list[Collective]:
    if kind == "collective-permute":
        pairs = [
            ints(p)
            for p in re.findall(r"\{(\d+\s*,\s*\d+)\}", attr(ins.rest, "source_target_pairs") or "")
        ]
        if net is not None:
            pairs = net.to_mesh(pairs)
        axes = groups_to_axes([list(p) for p in pairs], mesh_shape)
        sizes = dict(mesh_shape or ())
        n = math.prod(sizes[a] for a in axes) if axes else 1
        network = net.network(pairs) if net is not None else ""
    else:
        groups = parse_replica_groups(attr(ins.rest, "replica_groups"), num_devices)
        if net is not None:
            groups = net.to_mesh(groups)
        axes = groups_to_axes(groups, mesh_shape)
        n = len(groups[0]) if groups else num_devices
        network = net.network(groups) if net is not None else ""
    found = re.search(r'op_name="([^"]*)"', ins.rest)
    op_name = found.group(1) if found else ""
    return [
        Collective(
            kind=kind,
            mesh_axes=axes,
            dtype=dtype,
            shape=dims,
            group_size=n,
            bytes_per_device=ring_bytes(kind, array_bytes(dtype, dims), n),
            count=count,
            name=ins.name,
            network=network,
            op_name=op_name,
        )
        for dtype, dims in parse_shapes(shape)
        if dtype != "token"
    ]


# ------------------------------------------------------------- ICI and DCN
_MEGASCALE = "_xla_megascale_transfer_type"
_DCN_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}


@dataclasses.dataclass(frozen=True, slots=True)
class _Network:
    """Slices of the mesh's devices: which network a group crosses, and id mapping."""

    slices: tuple[int, ...]  # slice (TPU) or host (GPU) index per mesh position
    local: tuple[int, ...] | None  # mesh positions of one slice (multi-slice programs)
    names: tuple[str, str] = ("ici", "dcn")  # the network within a group, and between groups

    @classmethod
    def make(
        cls,
        slices: Sequence[int] | None,
        num_devices: int,
        *,
        names: tuple[str, str] = ("ici", "dcn"),
        per_slice: bool = True,
    ) -> _Network | None:
        """``per_slice``: a multi-slice program is compiled per slice (TPU), with local ids."""
        if slices is None:
            return None
        slices = tuple(int(s) for s in slices)
        if len(slices) != num_devices:
            what = "slice index" if per_slice else "host index"
            raise ValueError(
                f"{'slices' if per_slice else 'hosts'}= has {len(slices)} entries but the program "
                f"has {num_devices} devices; give one {what} per device of the mesh, in mesh order."
            )
        multi = per_slice and len(set(slices)) > 1
        local = tuple(p for p, s in enumerate(slices) if s == slices[0]) if multi else None
        return cls(slices, local, names)

    def to_mesh(self, groups: list[list[int]]) -> list[list[int]]:
        """Slice-local ids (a multi-slice program) as mesh positions."""
        if self.local is None or any(i >= len(self.local) for g in groups for i in g):
            return groups
        return [[self.local[i] for i in g] for g in groups]

    def network(self, groups: list[list[int]]) -> str:
        n = len(self.slices)
        spans = any(len({self.slices[i] for i in g if 0 <= i < n}) > 1 for g in groups)
        return self.names[1] if spans else self.names[0]

    def slice_heads(self) -> list[int]:
        """The first mesh position of each slice, by slice index."""
        heads: dict[int, int] = {}
        for p, s in enumerate(self.slices):
            heads.setdefault(s, p)
        return [heads[s] for s in sorted(heads)]


def _dcn_transfer(ins: Instr, count: int, mesh_shape: Any, net: _Network) -> list[Collective]:
    """A megascale ``send``: one collective across slices, of what each device sends."""
    m = re.search(rf'{_MEGASCALE}="([A-Z_]+)"', ins.rest)
    kind = _DCN_KINDS.get(m.group(1) if m else "", "collective-permute")
    heads = net.slice_heads()
    target = re.search(r'_xla_megascale_target="\{([0-9,:\s]*)\}', ins.rest)
    members = _slice_set(target.group(1), len(heads)) if target else None
    group = [heads[s] for s in members] if members else heads
    axes = groups_to_axes([group], mesh_shape)
    n = len(group)
    shapes = [(t, d) for t, d in parse_shapes(ins.shape) if t not in ("token", "u32")][:1]
    out = []
    for dtype, dims in shapes:
        sent = array_bytes(dtype, dims)
        # ``sent`` is the whole buffer for all-reduce, reduce-scatter and all-to-all,
        # and this device's part for all-gather (whose result is n times larger).
        result = {"all-gather": sent * n, "reduce-scatter": sent / max(n, 1)}.get(kind, sent)
        out.append(
            Collective(
                kind=kind,
                mesh_axes=axes,
                dtype=dtype,
                shape=dims,
                group_size=n,
                bytes_per_device=ring_bytes(kind, result, n) if n > 1 else 0.0,
                count=count,
                name=ins.name,
                network="dcn",
            )
        )
    return out


def _slice_set(text: str, num_slices: int) -> list[int] | None:
    """``1,2`` or ``1:4`` (1-based slice numbers) as 0-based indices; ``None`` if odd."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition(":")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            return None
        out.extend(range(int(lo), int(hi or lo) + 1))
    idx = [i - 1 for i in out]
    return idx if idx and all(0 <= i < num_slices for i in idx) else None
