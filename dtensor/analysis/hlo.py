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
many times as its ``known_trip_count`` (once when XLA does not know it).

Multi-slice TPU programs (given ``slices=``, each device's slice index) are
compiled per slice: replica groups use slice-local ids, and what crosses
slices is a megascale host transfer (a ``send`` whose
``_xla_megascale_transfer_type`` is ``ALL_REDUCE``, ``ALL_GATHER``...). Those
are read as collectives with ``network="dcn"``; the others get ``"ici"``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Collective", "parse_collectives", "parse_replica_groups", "ring_bytes", "KINDS"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_ASYNC = {f"{k}-start": k for k in ("all-reduce", "all-gather", "collective-permute")}
_DONE = {f"{k}-done" for k in ("all-reduce", "all-gather", "collective-permute")}

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
        network: ``"ici"`` (within a TPU slice), ``"dcn"`` (across slices),
            or ``""`` when unknown (``slices=`` not given). For a DCN
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


# ------------------------------------------------------------------ text helpers
def _balanced(s: str, start: int) -> int:
    """Index just past the bracket group opening at ``s[start]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for i in range(start, len(s)):
        c = s[i]
        if c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
    raise ValueError(f"unbalanced brackets in HLO text: {s[start : start + 80]!r}")


_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def parse_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in an HLO shape (tuples flattened)."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


@dataclasses.dataclass(slots=True)
class _Instr:
    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes


def _parse_instr(line: str) -> _Instr | None:
    m = _INSTR.match(line)
    if not m:
        return None
    i = m.end()
    if i < len(line) and line[i] == "(":
        j = _balanced(line, i)
    else:
        j = line.find(" ", i)
        if j < 0:
            return None
    shape = line[i:j]
    m2 = re.match(r"\s*([a-z][a-z0-9\-]*)\(", line[j:])
    if not m2:
        return None
    return _Instr(m.group(1), shape, m2.group(1), line[j + m2.end() - 1 :])


def _attr(rest: str, key: str) -> str | None:
    """The raw text of attribute ``key=...`` (balanced brackets, or up to a comma)."""
    m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", rest)
    if not m:
        return None
    i = m.end()
    if rest.startswith("mesh[", i):
        j = _balanced(rest, i + 4)
        dev = re.match(r",\s*device_ids=\(", rest[j:])
        if dev:
            j = _balanced(rest, j + dev.end() - 1)
        brace = re.match(r"\s*\{", rest[j:])
        if brace:
            j = _balanced(rest, j + brace.end() - 1)
        return rest[i:j]
    if i < len(rest) and rest[i] in "{[(":
        j = _balanced(rest, i)
        if rest[i] == "[":  # iota: [g,n]<=[dims]T(perm)
            m2 = re.match(r"<=\[[0-9,]*\](?:T\([0-9,]*\))?", rest[j:])
            if m2:
                j += m2.end()
        return rest[i:j]
    m2 = re.match(r"[^,\s]*", rest[i:])
    return m2.group(0) if m2 else None


def _ints(s: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", s)]


def _iota(text: str) -> np.ndarray | None:
    """``[a,b]<=[dims]T(perm)`` as an array of shape ``[a,b]`` (the short form
    ``[dims]T(perm)``, as in mesh ``device_ids``, is flat); ``None`` if not iota."""
    short = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if short:
        dims = _ints(short.group(1))
        arr = np.arange(math.prod(dims)).reshape(dims)
        if short.group(2):
            arr = arr.transpose(_ints(short.group(2)))
        return arr.reshape(-1)
    m = re.fullmatch(r"\s*\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if not m:
        return None
    out_shape, dims = _ints(m.group(1)), _ints(m.group(2))
    arr = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        arr = arr.transpose(_ints(m.group(3)))
    return arr.reshape(out_shape)


def _mesh_groups(text: str) -> list[list[int]]:
    """Groups of ``mesh['a'=4,'b'=2][, device_ids=(...)] {'b', 'a':(1)2}``."""
    m = re.match(r"\s*maximal_mesh\[device_id=(\d+)\]", text)
    if m:
        return [[int(m.group(1))]]
    head_end = _balanced(text, text.index("["))
    axes = re.findall(r"'?([^'=,\s\[\]]+)'?\s*=\s*(\d+)", text[text.index("[") + 1 : head_end - 1])
    names = [a for a, _ in axes]
    sizes = [int(s) for _, s in axes]
    rest = text[head_end:]
    ids = np.arange(math.prod(sizes))
    dev = re.match(r",\s*device_ids=\(", rest)
    if dev:
        end = _balanced(rest, dev.end() - 1)
        inner = rest[dev.end() : end - 1]
        arr = _iota(inner)
        ids = arr.reshape(-1) if arr is not None else np.asarray(_ints(inner))
        rest = rest[end:]
    brace = rest[rest.index("{") + 1 : rest.rindex("}")]
    refs = []  # (mesh dim, pre_size, size)
    for name, pre, size in re.findall(r"'?([^':,\s{}]+)'?(?::\((\d+)\)(\d+))?", brace):
        d = names.index(name)
        refs.append((d, int(pre) if pre else 1, int(size) if size else sizes[d]))
    # Split each mesh dimension into the sub-axes the refs use (plus padding).
    reshape: list[int] = []
    grouped: list[int] = [0] * len(refs)
    for d, full in enumerate(sizes):
        mine = sorted((r[1], r[2], k) for k, r in enumerate(refs) if r[0] == d)
        if not mine:
            reshape.append(full)
            continue
        prefix = 1
        for pre, size, k in mine:
            if pre != prefix:
                reshape.append(pre // prefix)
                prefix = pre
            grouped[k] = len(reshape)
            reshape.append(size)
            prefix *= size
        if prefix != full:
            reshape.append(full // prefix)
    order = [i for i in range(len(reshape)) if i not in grouped] + grouped
    n = math.prod(reshape[g] for g in grouped) if refs else 1
    return ids.reshape(reshape).transpose(order).reshape(-1, n).tolist()


def parse_replica_groups(text: str | None, num_devices: int) -> list[list[int]]:
    """Logical device ids of each replica group, from any of the three syntaxes.

    Examples:
        >>> from dtensor.analysis.hlo import parse_replica_groups
        >>> parse_replica_groups("{{0,2},{1,3}}", 4)
        [[0, 2], [1, 3]]
        >>> parse_replica_groups("[2,2]<=[2,2]T(1,0)", 4)
        [[0, 2], [1, 3]]
        >>> parse_replica_groups("mesh['axis_0'=2,'axis_1'=2] {'axis_0'}", 4)
        [[0, 2], [1, 3]]
    """
    if text is None or re.fullmatch(r"\s*\{\s*\}\s*", text):
        return [list(range(num_devices))]
    text = text.strip()
    if text.startswith("mesh[") or text.startswith("maximal_mesh["):
        return _mesh_groups(text)
    arr = _iota(text)
    if arr is not None:
        return arr.tolist()
    groups = re.findall(r"\{([0-9,\s]*)\}", text[1:-1] if text.startswith("{{") else text)
    return [_ints(g) for g in groups]


# ------------------------------------------------------------------ mesh mapping
def groups_to_axes(
    groups: list[list[int]], mesh_shape: Sequence[tuple[str, int]] | None
) -> tuple[str, ...]:
    """The mesh axes along which the devices of each group differ, major first.

    ``mesh_shape`` is ``[(name, size), ...]``; logical id ``i`` sits at
    ``np.unravel_index(i, sizes)``. An axis that changes less often along a
    group is more major.
    """
    if not mesh_shape:
        return ()
    names = [n for n, _ in mesh_shape]
    sizes = [s for _, s in mesh_shape]
    total = math.prod(sizes)
    changes = dict.fromkeys(range(len(names)), 0)
    varies: set[int] = set()
    for group in groups:
        if any(not 0 <= i < total for i in group):
            return ()
        coords = np.array(np.unravel_index(group, sizes)).T if group else np.zeros((0, len(sizes)))
        for a in range(len(names)):
            col = coords[:, a]
            if len(set(col.tolist())) > 1:
                varies.add(a)
                changes[a] += int(np.count_nonzero(np.diff(col)))
    return tuple(names[a] for a in sorted(varies, key=lambda a: (changes[a], a)))


# ---------------------------------------------------------------------- parsing
def _computations(text: str) -> tuple[dict[str, list[_Instr]], str | None]:
    comps: dict[str, list[_Instr]] = {}
    entry = None
    current: list[_Instr] | None = None
    for line in text.splitlines():
        if not line.strip() or line.startswith("HloModule"):
            continue
        if not line[0].isspace():
            if line.rstrip().endswith("{"):
                is_entry = line.startswith("ENTRY")
                name = line.split()[1 if is_entry else 0].lstrip("%")
                current = comps.setdefault(name, [])
                if is_entry:
                    entry = name
            else:
                current = None
            continue
        if current is not None:
            instr = _parse_instr(line)
            if instr is not None:
                current.append(instr)
    return comps, entry


_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)


def _multipliers(comps: dict[str, list[_Instr]], entry: str | None) -> dict[str, int]:
    """Executions of each computation per program run (while trip counts)."""
    callers: dict[str, list[tuple[str, int]]] = {}
    for parent, instrs in comps.items():
        for ins in instrs:
            trip = 1
            if ins.opcode == "while":
                m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.rest)
                trip = int(m.group(1)) if m else 1
            for key, callee in _CALLS.findall(ins.rest):
                callers.setdefault(callee, []).append((parent, trip if key == "body" else 1))
            m = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
            for callee in re.findall(r"%?([\w.\-]+)", m.group(1)) if m else ():
                callers.setdefault(callee, []).append((parent, 1))
    memo: dict[str, int] = {}

    def mult(name: str, depth: int = 0) -> int:
        if name == entry or depth > 64:
            return 1
        if name not in memo:
            sites = callers.get(name)
            memo[name] = sum(mult(p, depth + 1) * f for p, f in sites) if sites else 1
        return memo[name]

    return {name: mult(name) for name in comps}


def parse_collectives(
    text: str,
    mesh_shape: Sequence[tuple[str, int]] | None = None,
    num_devices: int | None = None,
    *,
    slices: Sequence[int] | None = None,
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

    Returns:
        One :class:`Collective` per operand of each collective.
    """
    if num_devices is None:
        num_devices = math.prod(s for _, s in mesh_shape) if mesh_shape else 1
    net = _Network.make(slices, num_devices)
    if net is not None and net.local is not None:
        num_devices = len(net.local)
    comps, entry = _computations(text)
    mults = _multipliers(comps, entry)
    starts: dict[str, tuple[str, _Instr, str]] = {}
    out: list[Collective] = []
    for comp, instrs in comps.items():
        for ins in instrs:
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
            if ins.opcode in KINDS:
                out.extend(
                    _collective(
                        ins.opcode, ins, ins.shape, mults[comp], mesh_shape, num_devices, net
                    )
                )
    for kind, start, comp in starts.values():  # a start without its done: use its own shape
        shapes = parse_shapes(start.shape)
        half = {"all-gather": shapes[len(shapes) // 2 :], "collective-permute": shapes[:1]}.get(
            kind, shapes
        )
        fake = "(" + ", ".join(f"{t}[{','.join(map(str, d))}]" for t, d in half) + ")"
        out.extend(_collective(kind, start, fake, mults[comp], mesh_shape, num_devices, net))
    return out


def _collective(
    kind: str,
    ins: _Instr,
    shape: str,
    count: int,
    mesh_shape: Any,
    num_devices: int,
    net: _Network | None = None,
) -> list[Collective]:
    if kind == "collective-permute":
        pairs = [
            _ints(p)
            for p in re.findall(
                r"\{(\d+\s*,\s*\d+)\}", _attr(ins.rest, "source_target_pairs") or ""
            )
        ]
        if net is not None:
            pairs = net.to_mesh(pairs)
        axes = groups_to_axes([list(p) for p in pairs], mesh_shape)
        sizes = dict(mesh_shape or ())
        n = math.prod(sizes[a] for a in axes) if axes else 1
        network = net.network(pairs) if net is not None else ""
    else:
        groups = parse_replica_groups(_attr(ins.rest, "replica_groups"), num_devices)
        if net is not None:
            groups = net.to_mesh(groups)
        axes = groups_to_axes(groups, mesh_shape)
        n = len(groups[0]) if groups else num_devices
        network = net.network(groups) if net is not None else ""
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

    slices: tuple[int, ...]  # slice index per mesh position
    local: tuple[int, ...] | None  # mesh positions of one slice (multi-slice programs)

    @classmethod
    def make(cls, slices: Sequence[int] | None, num_devices: int) -> _Network | None:
        if slices is None:
            return None
        slices = tuple(int(s) for s in slices)
        if len(slices) != num_devices:
            raise ValueError(
                f"slices= has {len(slices)} entries but the program has {num_devices} devices; "
                "give one slice index per device of the mesh, in mesh order."
            )
        multi = len(set(slices)) > 1
        local = tuple(p for p, s in enumerate(slices) if s == slices[0]) if multi else None
        return cls(slices, local)

    def to_mesh(self, groups: list[list[int]]) -> list[list[int]]:
        """Slice-local ids (a multi-slice program) as mesh positions."""
        if self.local is None or any(i >= len(self.local) for g in groups for i in g):
            return groups
        return [[self.local[i] for i in g] for g in groups]

    def network(self, groups: list[list[int]]) -> str:
        n = len(self.slices)
        spans = any(len({self.slices[i] for i in g if 0 <= i < n}) > 1 for g in groups)
        return "dcn" if spans else "ici"

    def slice_heads(self) -> list[int]:
        """The first mesh position of each slice, by slice index."""
        heads: dict[int, int] = {}
        for p, s in enumerate(self.slices):
            heads.setdefault(s, p)
        return [heads[s] for s in sorted(heads)]


def _dcn_transfer(ins: _Instr, count: int, mesh_shape: Any, net: _Network) -> list[Collective]:
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
