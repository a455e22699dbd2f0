"""Reading XLA's HLO text: instructions, attributes, replica groups, computations.

The syntax layer under :mod:`dtensor.analysis.hlo` (see its docstring for the
three replica-group syntaxes and how ids map to mesh coordinates).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Sequence

import numpy as np

__all__ = [
    "Instr",
    "attr",
    "computations",
    "groups_to_axes",
    "ints",
    "multipliers",
    "parse_instr",
    "parse_replica_groups",
    "operands",
    "parse_shapes",
    "program",
    "tuple_items",
]


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


def tuple_items(shape: str) -> list[str]:
    """The top-level items of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    items, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and i > 0):
            items.append(shape[start:i].strip())
            start = i + 1
        if depth == 0 and i > 0:
            break
    return [it for it in items if it]


@dataclasses.dataclass(slots=True)
class Instr:
    """One HLO instruction line: ``name = shape opcode(rest)``."""

    name: str
    shape: str
    opcode: str
    rest: str  # operands and attributes


def parse_instr(line: str) -> Instr | None:
    """The instruction on one line of HLO text, or ``None`` for other lines."""
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
    return Instr(m.group(1), shape, m2.group(1), line[j + m2.end() - 1 :])


def attr(rest: str, key: str) -> str | None:
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


def ints(s: str) -> list[int]:
    """Every integer in ``s``, in order."""
    return [int(x) for x in re.findall(r"-?\d+", s)]


def _iota(text: str) -> np.ndarray | None:
    """``[a,b]<=[dims]T(perm)`` as an array of shape ``[a,b]`` (the short form
    ``[dims]T(perm)``, as in mesh ``device_ids``, is flat); ``None`` if not iota."""
    short = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if short:
        dims = ints(short.group(1))
        arr = np.arange(math.prod(dims)).reshape(dims)
        if short.group(2):
            arr = arr.transpose(ints(short.group(2)))
        return arr.reshape(-1)
    m = re.fullmatch(r"\s*\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if not m:
        return None
    out_shape, dims = ints(m.group(1)), ints(m.group(2))
    arr = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        arr = arr.transpose(ints(m.group(3)))
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
        ids = arr.reshape(-1) if arr is not None else np.asarray(ints(inner))
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
    return [ints(g) for g in groups]


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
def _logical_lines(text: str) -> list[str]:
    """The lines of HLO text, an instruction that spans several joined into one.

    Inside a computation every instruction line is indented and only its closing ``}``
    is not; a line there that starts at column 0 continues the instruction before it
    (a custom call's ``backend_config`` can hold newlines: splash attention's
    ``xprof_metadata`` in libtpu 0.0.50 and later).
    """
    out: list[str] = []
    inside = False
    for line in text.splitlines():
        if inside and out and line and not line[0].isspace() and line.rstrip() != "}":
            out[-1] += " " + line
            continue
        out.append(line)
        if line and not line[0].isspace():
            inside = line.rstrip().endswith("{") and not line.startswith("HloModule")
    return out


def computations(text: str) -> tuple[dict[str, list[Instr]], str | None]:
    """The instructions of each computation of an HLO module, and the entry computation's name."""
    comps: dict[str, list[Instr]] = {}
    entry = None
    current: list[Instr] | None = None
    for line in _logical_lines(text):
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
            instr = parse_instr(line)
            if instr is not None:
                current.append(instr)
    return comps, entry


_CALLS = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
)


def _trip_from_condition(
    comps: dict[str, list[Instr]], ins: Instr, parent: list[Instr] | None = None
) -> int:
    """A while loop's trip count from its condition ``counter < constant(N)`` (else 1).

    The TPU compiler's optimised HLO drops ``known_trip_count``; a ``jax.lax``
    loop (``scan``, ``fori_loop``) still compares its counter, which starts at
    0, against the constant trip count; a loop whose first iteration the
    compiler peeled off (``loop_peel``) starts it at 1: where the counter's
    initial value is a constant in the loop's tuple (``parent``: the
    instructions of the computation running the loop), it is subtracted.
    """
    m = re.search(r"condition=%?([\w.\-]+)", ins.rest)
    cond = comps.get(m.group(1), []) if m else []
    consts = {}
    for c in cond:
        if c.opcode == "constant":
            k = re.match(r"\(\s*(-?\d+)\s*\)", c.rest)
            if k:
                consts[c.name] = int(k.group(1))
    for c in cond:
        if c.opcode != "compare":
            continue
        # Operand names: ``%a`` or ``s32[] %a``, and a tuple element written ``%param.98#0``
        # (newer libtpu); without ``%`` sigils, the bare names.
        head = c.rest.split(")", 1)[0]
        ops = re.findall(r"%([\w.\-]+)", head) or re.findall(r"([A-Za-z_][\w.\-]*)", head)
        if len(ops) < 2:
            continue
        if "direction=LT" in c.rest and ops[1] in consts:
            return max(consts[ops[1]] - _start(cond, ops[0], ins, parent), 1)
        if "direction=GT" in c.rest and ops[0] in consts:
            return max(consts[ops[0]] - _start(cond, ops[1], ins, parent), 1)
    return 1


def _start(cond: list[Instr], counter: str, loop: Instr, parent: list[Instr] | None) -> int:
    """The initial value of a loop's ``counter`` (a tuple element of its state) where the
    loop's initial tuple holds it as a constant; 0 otherwise."""
    if not parent:
        return 0
    by_name = {i.name: i for i in parent}
    gte = next((c for c in cond if c.name == counter and c.opcode == "get-tuple-element"), None)
    index = re.search(r"index=(\d+)", gte.rest) if gte is not None else None
    init = re.match(r"\(\s*(?:[^%)]*\s)?%?([\w.\-]+)", loop.rest)
    state = by_name.get(init.group(1)) if init else None
    if index is None or state is None or state.opcode != "tuple":
        return 0
    items = re.findall(r"%([\w.\-]+)", state.rest.split(")", 1)[0])
    k = int(index.group(1))
    first = by_name.get(items[k]) if k < len(items) else None
    for _ in range(8):  # through copies of the constant
        if first is None or first.opcode not in ("copy", "bitcast"):
            break
        source = re.findall(r"%([\w.\-]+)", first.rest.split(")", 1)[0])
        first = by_name.get(source[0]) if source else None
    if first is None or first.opcode != "constant":
        return 0
    value = re.match(r"\(\s*(-?\d+)\s*\)", first.rest)
    return int(value.group(1)) if value else 0


def multipliers(comps: dict[str, list[Instr]], entry: str | None) -> dict[str, int]:
    """Executions of each computation per program run (while trip counts)."""
    callers: dict[str, list[tuple[str, float]]] = {}
    for parent, instrs in comps.items():
        for ins in instrs:
            trip = 1
            if ins.opcode == "while":
                m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)', ins.rest)
                trip = int(m.group(1)) if m else _trip_from_condition(comps, ins, instrs)
            # A conditional taken one run in N (dtensor.pipeline's hand-off, its name
            # scope ``..._1_in_N_ticks``): each branch runs 1/N as often as its caller.
            taken = ins.opcode == "conditional" and re.search(
                r'op_name="[^"]*_1_in_(\d+)_ticks', ins.rest
            )
            share = 1 / int(taken.group(1)) if taken else 1
            for key, callee in _CALLS.findall(ins.rest):
                f = trip if key == "body" else share if key.endswith("_computation") else 1
                callers.setdefault(callee, []).append((parent, f))
            m = re.search(r"branch_computations=\{([^}]*)\}", ins.rest)
            for callee in re.findall(r"%?([\w.\-]+)", m.group(1)) if m else ():
                callers.setdefault(callee, []).append((parent, share))
    memo: dict[str, float] = {}

    def mult(name: str, depth: int = 0) -> float:
        if name == entry or depth > 64:
            return 1
        if name not in memo:
            sites = callers.get(name)
            memo[name] = sum(mult(p, depth + 1) * f for p, f in sites) if sites else 1
        return memo[name]

    return {name: max(1, round(mult(name))) for name in comps}


def operands(ins: Instr) -> list[str]:
    """The names of ``ins``'s operands (those inside its leading parentheses)."""
    depth, end = 0, len(ins.rest)
    for i, ch in enumerate(ins.rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", ins.rest[:end])


@functools.lru_cache(maxsize=4)
def program(text: str) -> tuple[dict[str, list[Instr]], str | None, dict[str, int]]:
    """``(computations, entry, executions of each computation)`` of HLO ``text``, parsed once
    for the readers of one compiled program (host transfers, the roofline). Do not mutate."""
    comps, entry = computations(text)
    return comps, entry, multipliers(comps, entry)
