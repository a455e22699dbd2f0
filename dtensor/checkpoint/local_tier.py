"""The local tier: each process's shards of recent steps on its own fast storage, and a peer's.

A :class:`dtensor.checkpoint.Checkpointer` with ``local_directory=`` writes,
beside its persistent steps (a directory or a bucket), a *local* step on every
process: the unique shards its devices hold of every array, with the manifest
and its input position, in ``<local_directory>/process_<i>/step_<n>/own.*``.
Each process also keeps a copy of one peer's shards (``peer.*``), sent to it
over the job's own collectives (:mod:`dtensor.checkpoint.exchange`): process
``i``'s copy lives on process ``i + shift`` (the next process, or the same
position in the next TPU slice), so the loss of one host, or of one slice,
loses no shard.

A step is written into ``step_<n>.tmp`` and renamed once complete, so a process
killed mid-write leaves its earlier steps as they were; every shard carries a
CRC-32, checked when read back. On one machine the ``process_<i>`` folders play
the hosts' local disks: a process reads only its own folder, and what another
process holds reaches it over the network as it would between hosts.

Restore (:func:`restore`, called by the ``Checkpointer``) is collective: the
processes agree on the newest step that the local tier can serve, with each
process's devices finding every shard they need in what it holds, its own
shards, its peer copy, or (a replaced host, whose folder is empty) its own
shards sent back by the peer that kept them. Otherwise it says why, and the
persistent tier serves.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import exchange

__all__ = ["LocalTier", "Plan"]

_log = logging.getLogger(__name__)
_STEP, _TMP = "step_", ".tmp"
Box = tuple[tuple[int, int], ...]


# ------------------------------------------------------------------ payloads
def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    return tuple(
        (0 if s.start is None else int(s.start), n if s.stop is None else int(s.stop))
        for s, n in zip(index, shape, strict=True)
    )


def _shards(leaf: Any) -> list[tuple[Box, np.ndarray]]:
    """The unique blocks of ``leaf`` on this process (a host value: the whole of it)."""
    if isinstance(leaf, jax.Array):
        seen: dict[Box, np.ndarray] = {}
        for s in leaf.addressable_shards:
            box = _box(s.index, leaf.shape)
            if box not in seen:
                seen[box] = np.asarray(s.data)
        return list(seen.items())
    a = np.asarray(leaf)
    return [(tuple((0, n) for n in a.shape), a)]


def pack(arrays: dict[str, Any], head: dict[str, Any]) -> bytes:
    """``head`` (JSON) and every leaf's blocks as one byte string, each block checksummed."""
    blobs, index, offset = [], [], 0
    for path, leaf in arrays.items():
        for box, a in _shards(leaf):
            raw = np.ascontiguousarray(a).tobytes()
            index.append(
                {
                    "path": path,
                    "box": [list(b) for b in box],
                    "dtype": str(a.dtype),
                    "offset": offset,
                    "nbytes": len(raw),
                    "crc32": zlib.crc32(raw),
                }
            )
            blobs.append(raw)
            offset += len(raw)
    text = json.dumps({**head, "blocks": index}).encode()
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


class Held:
    """One process's unpacked payload: its head and its blocks by ``(path, box)``."""

    def __init__(self, payload: bytes, where: str) -> None:
        n = int.from_bytes(payload[:8], "little")
        self.raw = payload
        self.head = json.loads(payload[8 : 8 + n])
        self._body = memoryview(payload)[8 + n :]
        self.where = where
        self.blocks = {
            (b["path"], tuple(tuple(x) for x in b["box"])): b for b in self.head.pop("blocks")
        }

    def read(self, path: str, box: Box) -> np.ndarray:
        b = self.blocks[(path, box)]
        raw = self._body[b["offset"] : b["offset"] + b["nbytes"]]
        if zlib.crc32(raw) != b["crc32"]:
            raise ValueError(f"array {path!r} block {list(box)} in {self.where} fails its CRC-32")
        shape = tuple(hi - lo for lo, hi in box)
        return np.frombuffer(raw, dtype=jax.numpy.dtype(b["dtype"])).reshape(shape)


# -------------------------------------------------------------------- the tier
class LocalTier:
    """This process's folder of local steps (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int = 2) -> None:
        if max_to_keep < 1:
            raise ValueError(f"local max_to_keep={max_to_keep!r} is not valid; use a positive int.")
        root = Path(os.fspath(directory))
        if "://" in str(directory):
            raise ValueError(
                f"local_directory={str(directory)!r} is a URL; the local tier is each host's own "
                "fast storage (a RAM disk or local SSD path). Give the bucket as the Checkpointer's "
                "directory (the persistent tier) and a local path here."
            )
        self.root = root
        self.max_to_keep = max_to_keep
        self.folder = root / f"process_{jax.process_index()}"
        self.folder.mkdir(parents=True, exist_ok=True)
        for stale in self.folder.glob(f"{_STEP}*{_TMP}*"):  # a write killed midway
            shutil.rmtree(stale, ignore_errors=True)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_save_seconds: float | None = None

    # ---------------------------------------------------------------- steps
    def steps(self) -> list[int]:
        """This process's complete local steps, oldest first."""
        out = []
        for p in self.folder.glob(f"{_STEP}*"):
            tail = p.name[len(_STEP) :]
            if tail.isdigit() and (p / "own.bin").is_file():
                out.append(int(tail))
        return sorted(out)

    def _step_dir(self, step: int) -> Path:
        return self.folder / f"{_STEP}{step}"

    # ----------------------------------------------------------------- save
    def save(
        self, step: int, arrays: dict[str, Any], head: dict[str, Any], *, alone: bool = False
    ) -> None:
        """Write ``step`` (every process calls this: the peer copy is a collective).

        ``alone``: this process saves by itself (a parameter-server task): no peer copy.
        """
        self.wait()
        own = pack(arrays, {**head, "step": step, "process_index": jax.process_index()})
        count, shift = jax.process_count(), 0 if alone else exchange.peer_shift()
        peer = None
        if shift:
            pairs = [(p, (p + shift) % count) for p in range(count)]
            peer = exchange.send_bytes(own, pairs)

        def write() -> None:
            try:
                self._write(step, own, peer)
            except BaseException as e:  # noqa: BLE001 - reported by the next wait()
                self._error = e

        self._writer = threading.Thread(target=write, name=f"dtensor-local-save-{step}")
        self._writer.start()

    def _write(self, step: int, own: bytes, peer: bytes | None) -> None:
        final = self._step_dir(step)
        tmp = final.with_name(f"{final.name}{_TMP}{os.getpid()}")
        tmp.mkdir(parents=True)
        for name, blob in (("own.bin", own), ("peer.bin", peer)):
            if blob is None:
                continue
            with open(tmp / name, "wb") as f:
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.steps()[: -self.max_to_keep]:
            shutil.rmtree(self._step_dir(old), ignore_errors=True)

    def wait(self) -> None:
        """Block until the step being written is on disk; raise what its write raised."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise OSError(f"the local checkpoint tier in {self.folder} failed: {error}") from error

    # ----------------------------------------------------------------- read
    def read(self, step: int, name: str) -> Held | None:
        """This process's ``own`` or ``peer`` payload of ``step`` (``None`` when absent)."""
        path = self._step_dir(step) / f"{name}.bin"
        if not path.is_file():
            return None
        try:
            return Held(path.read_bytes(), str(path))
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError):
            _log.warning("local checkpoint %s cannot be read; skipping it", path)
            return None


class Plan:
    """Where a local restore of one step gets each process's blocks (agreed by every process)."""

    def __init__(self, step: int, tier: str, held: list[Held]) -> None:
        self.step, self.tier, self.held = step, tier, held

    def head(self) -> dict[str, Any] | None:
        return self.held[0].head if self.held else None

    def data_records(self) -> list[dict[str, Any]]:
        """The input positions this process holds (its own, its peer's), by the saver's index."""
        return [r for h in self.held for r in h.head.get("data") or []]

    def saved_processes(self) -> int:
        head = self.head()
        return -1 if head is None else int(head["process_count"])

    def find(self, path: str, box: Box) -> np.ndarray | None:
        for h in self.held:
            if (path, box) in h.blocks:
                return h.read(path, box)
        return None


def plan(tier: LocalTier, at_least: int | None) -> Plan | None:
    """The newest local step ``>= at_least`` held somewhere, with what this process holds of it.

    Collective. A replaced process (its folder lacks the step while the job has
    as many processes as saved it) gets its own blocks back from the peer that
    keeps them. Whether every process's devices find their blocks is for the
    caller to check (it knows the target's layouts); ``None``: no such step.
    """
    me, count = jax.process_index(), jax.process_count()
    mine = [s for s in tier.steps() if at_least is None or s >= at_least]
    listed = [json.loads(b) for b in exchange.allgather_bytes(json.dumps(mine).encode())]
    candidates = sorted({s for steps in listed for s in steps})
    if not candidates:
        return None
    step = candidates[-1]
    own = tier.read(step, "own") if step in mine else None
    peer = tier.read(step, "peer") if step in mine else None
    saved = [
        json.loads(b)
        for b in exchange.allgather_bytes(
            json.dumps(None if own is None else own.head["process_count"]).encode()
        )
    ]
    shift, tier_name = exchange.peer_shift(), "local"
    if shift and {c for c in saved if c is not None} == {count} and None in saved:
        pairs = [((p + shift) % count, p) for p, c in enumerate(saved) if c is None]
        pairs = [(src, dst) for src, dst in pairs if saved[src] is not None]
        got = exchange.send_bytes(b"" if peer is None else peer.raw, pairs)
        if got:
            own = Held(got, f"process {(me + shift) % count}'s copy of step {step}")
        tier_name = "peer" if pairs else tier_name
    return Plan(step, tier_name, [h for h in (own, peer) if h is not None])


def _indices(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Any, Any]:
    return dict(sharding.addressable_devices_indices_map(shape))


def build(chosen: Plan, canon_target: Any, where: str) -> Any:
    """The canonical restored tree of ``chosen``'s step in ``canon_target``'s layouts.

    Raises ``KeyError`` when this process's devices need a block it does not
    hold, ``ValueError`` when a block fails its checksum, and the
    ``CheckpointError`` of a target that does not match the step.
    """
    from dtensor.checkpoint.targets import target_abstract

    head = chosen.head()
    if head is None:
        raise KeyError(f"this process holds none of step {chosen.step}")
    by_path = {e["path"]: e for e in head["manifest"]["leaves"]}
    abstract = target_abstract(canon_target, by_path, f"step {chosen.step} in {where}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for keypath, a in leaves:
        path = _path(keypath)
        shape = tuple(a.shape)
        if not isinstance(a, jax.ShapeDtypeStruct):
            out.append(np.array(_need(chosen, path, tuple((0, n) for n in shape))))
            continue
        bufs = []
        for device, index in _indices(a.sharding, shape).items():
            block = _need(chosen, path, _box(index, shape))
            bufs.append(jax.device_put(np.array(block, dtype=a.dtype), device))
        out.append(jax.make_array_from_single_device_arrays(shape, a.sharding, bufs))
    return treedef.unflatten(out)


def _path(keypath: Any) -> str:
    from dtensor.core.tree import path_str

    return path_str(keypath)


def _need(chosen: Plan, path: str, box: Box) -> np.ndarray:
    block = chosen.find(path, box)
    if block is None:
        raise KeyError(
            f"array {path!r} block {[list(b) for b in box]} of step {chosen.step} is not held by "
            "this process (its own shards, its peer copy)"
        )
    return block


def all_data_records(chosen: Plan) -> list[dict[str, Any]]:
    """Every saving process's input position of the step, gathered from whoever holds it (collective).

    Each local step holds every process's position (they are small), so any
    surviving process can give them all; fewer than the saving processes: some
    were saved without one.
    """
    mine = json.dumps(chosen.data_records()).encode()
    found: dict[int, dict[str, Any]] = {}
    for blob in exchange.allgather_bytes(mine):
        for record in json.loads(blob):
            found.setdefault(int(record["process_index"]), record)
    return [found[p] for p in sorted(found)]
