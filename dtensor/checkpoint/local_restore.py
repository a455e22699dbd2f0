"""A restore from the local tier: agree on a step, move the blocks each process lacks, build arrays.

Collective: every process calls :func:`restore` with the same target. The
processes agree on the newest local step any of them holds (at least as new as
the persistent tier's). Each process finds the blocks (``path``, index box) its
devices need in what it holds: its own shards and its peer copy. The blocks it
lacks (a replaced host with an empty folder; a process whose shards the job
now lays out on it after a restart on fewer or more processes) are sent by a
process that holds them, over the job's collectives, in rounds of one sender
and one receiver per process. A block that no process holds, or one that fails
its CRC-32, makes the local tier unable to serve: the caller falls back to the
persistent tier. The tier is ``"local"`` when every process read only its own
folder, ``"peer"`` when blocks crossed between processes.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import exchange
from dtensor.checkpoint.local_tier import Box, Held, LocalTier, box_of, pack

__all__ = ["Plan", "build", "fetch", "needed", "plan"]

Key = tuple[str, Box]


class Plan:
    """One local step: what this process holds of it, and where it came from."""

    def __init__(self, step: int, held: list[Held], manifest: dict[str, Any]) -> None:
        self.step, self.held, self.manifest = step, held, manifest
        self.tier = "local"

    def has(self, key: Key) -> bool:
        return any(key in h.blocks for h in self.held)

    def find(self, path: str, box: Box) -> np.ndarray | None:
        for h in self.held:
            if (path, box) in h.blocks:
                return h.read(path, box)
        return None

    def saved_processes(self) -> int:
        return int(self.manifest["process_count"])

    def data_records(self) -> list[dict[str, Any]]:
        """The input positions this process holds (every process's, saved with each step)."""
        return [r for h in self.held for r in h.head.get("data") or []]


def _gather_json(value: Any) -> list[Any]:
    return [json.loads(b) for b in exchange.allgather_bytes(json.dumps(value).encode())]


def plan(tier: LocalTier, at_least: int | None) -> Plan | None:
    """The newest local step ``>= at_least`` that some process holds (``None``: none). Collective."""
    mine = [s for s in tier.steps() if at_least is None or s >= at_least]
    candidates = sorted({s for steps in _gather_json(mine) for s in steps})
    if not candidates:
        return None
    step = candidates[-1]
    held = [h for name in ("own", "peer") if (h := tier.read(step, name)) is not None]
    if step not in mine:
        held = []
    # The manifest (and the saving job's size) from the first process holding the step.
    ours = (
        {"manifest": held[0].head["manifest"], "process_count": held[0].head["process_count"]}
        if held
        else None
    )
    heads = _gather_json(ours)
    first = next(h for h in heads if h is not None)
    return Plan(step, held, {**first["manifest"], "process_count": first["process_count"]})


def needed(abstract: Any) -> list[Key]:
    """The blocks this process's devices need to hold ``abstract`` (canonical, restore-ready)."""
    from dtensor.core.tree import path_str

    keys: list[Key] = []
    for keypath, a in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path, shape = path_str(keypath), tuple(a.shape)
        if not isinstance(a, jax.ShapeDtypeStruct):
            keys.append((path, tuple((0, n) for n in shape)))
            continue
        for index in a.sharding.addressable_devices_indices_map(shape).values():
            key = (path, box_of(index, shape))
            if key not in keys:
                keys.append(key)
    return keys


def _rounds(transfers: dict[tuple[int, int], list[Key]]) -> list[list[tuple[int, int]]]:
    """The (sender, receiver) pairs in rounds where each process sends once and receives once."""
    left, out = sorted(transfers), []
    while left:
        senders: set[int] = set()
        receivers: set[int] = set()
        now = []
        for src, dst in left:
            if src not in senders and dst not in receivers:
                now.append((src, dst))
                senders.add(src)
                receivers.add(dst)
        out.append(now)
        left = [p for p in left if p not in now]
    return out


def fetch(chosen: Plan, want: list[Key]) -> list[Key]:
    """Receive the blocks of ``want`` this process lacks from processes holding them. Collective.

    Returns the blocks no process holds (empty when the step is whole here).
    """
    me = jax.process_index()
    lacking = [k for k in want if not chosen.has(k)]
    asked = _gather_json([[p, [list(b) for b in box]] for p, box in lacking])
    union = sorted({(p, tuple(tuple(b) for b in box)) for req in asked for p, box in req})
    holds = [set(h) for h in _gather_json([i for i, k in enumerate(union) if chosen.has(k)])]
    position = {k: i for i, k in enumerate(union)}
    transfers: dict[tuple[int, int], list[Key]] = {}
    unheld: dict[int, list[Key]] = {}
    for dst, req in enumerate(asked):
        for p, box in req:
            key = (p, tuple(tuple(b) for b in box))
            i = position[key]
            src = next((q for q, have in enumerate(holds) if i in have), None)
            if src is None:
                unheld.setdefault(dst, []).append(key)
            else:
                transfers.setdefault((src, dst), []).append(key)
    for pairs in _rounds(transfers):
        mine = [keys for (src, _), keys in ((pr, transfers[pr]) for pr in pairs) if src == me]
        payload = b""
        if mine:
            blocks = {f"{p}\0{json.dumps(box)}": chosen.find(p, box) for p, box in mine[0]}
            payload = pack(blocks, {})
        got = exchange.send_bytes(payload, pairs)
        if got is not None:
            src = next(s for s, d in pairs if d == me)
            chosen.held.append(_relabel(Held(got, f"blocks sent by process {src}")))
    if transfers:
        chosen.tier = "peer"
    return unheld.get(me, [])


def _relabel(held: Held) -> Held:
    """Blocks sent as ``path\\0box`` entries, keyed again as ``(path, box)``."""
    blocks = {}
    for (name, _), entry in held.blocks.items():
        path, box = name.split("\0", 1)
        blocks[(path, tuple(tuple(b) for b in json.loads(box)))] = entry
    held.blocks = blocks
    return held


def build(chosen: Plan, abstract: Any) -> Any:
    """The canonical restored tree: ``abstract``'s layouts filled with the held blocks.

    Raises ``KeyError`` for a block this process does not hold and ``ValueError``
    for one that fails its CRC-32.
    """
    from dtensor.core.tree import path_str

    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for keypath, a in leaves:
        path, shape = path_str(keypath), tuple(a.shape)
        if not isinstance(a, jax.ShapeDtypeStruct):
            out.append(np.array(_need(chosen, path, tuple((0, n) for n in shape))))
            continue
        bufs = [
            jax.device_put(
                np.array(_need(chosen, path, box_of(index, shape)), dtype=a.dtype), device
            )
            for device, index in a.sharding.addressable_devices_indices_map(shape).items()
        ]
        out.append(jax.make_array_from_single_device_arrays(shape, a.sharding, bufs))
    return treedef.unflatten(out)


def _need(chosen: Plan, path: str, box: Box) -> np.ndarray:
    block = chosen.find(path, box)
    if block is None:
        raise KeyError(
            f"array {path!r} block {[list(b) for b in box]} of step {chosen.step} is held by no "
            "process (their own shards, their peer copies)"
        )
    return block


def all_data_records(chosen: Plan) -> list[dict[str, Any]]:
    """Every saving process's input position of the step, from whoever holds it. Collective.

    Each local step holds every process's position (they are small), so any
    surviving process can give them all.
    """
    found: dict[int, dict[str, Any]] = {}
    for records in _gather_json(chosen.data_records()):
        for record in records:
            found.setdefault(int(record["process_index"]), record)
    return [found[p] for p in sorted(found)]
