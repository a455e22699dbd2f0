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
import mmap
import os
import shutil
import threading
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import exchange

__all__ = ["Box", "Held", "LocalTier", "box_of", "pack"]

_log = logging.getLogger(__name__)
_STEP, _TMP = "step_", ".tmp"
Box = tuple[tuple[int, int], ...]


# ------------------------------------------------------------------ payloads
def box_of(index: Any, shape: tuple[int, ...]) -> Box:
    return tuple(
        (0 if s.start is None else int(s.start), n if s.stop is None else int(s.stop))
        for s, n in zip(index, shape, strict=True)
    )


def _shards(leaf: Any) -> list[tuple[Box, np.ndarray]]:
    """The unique blocks of ``leaf`` on this process (a host value: the whole of it)."""
    if isinstance(leaf, jax.Array):
        seen: dict[Box, np.ndarray] = {}
        for s in leaf.addressable_shards:
            box = box_of(s.index, leaf.shape)
            if box not in seen:
                seen[box] = np.asarray(s.data)
        return list(seen.items())
    a = np.asarray(leaf)
    return [(tuple((0, n) for n in a.shape), a)]


def pack(arrays: dict[str, Any], head: dict[str, Any]) -> bytearray:
    """``head`` (JSON) and every leaf's blocks as one byte string, each block checksummed.

    The blocks are copied once, straight into the result (they are the size of
    the process's share of the model).
    """
    blocks, index, offset = [], [], 0
    for path, leaf in arrays.items():
        for box, a in _shards(leaf):
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            index.append(
                {
                    "path": path,
                    "box": [list(b) for b in box],
                    "dtype": str(a.dtype),
                    "offset": offset,
                    "nbytes": flat.size,
                    "crc32": zlib.crc32(flat.data),
                }
            )
            blocks.append(flat)
            offset += flat.size
    text = json.dumps({**head, "blocks": index}).encode()
    out = bytearray(8 + len(text) + offset)
    out[:8] = len(text).to_bytes(8, "little")
    out[8 : 8 + len(text)] = text
    view, at = memoryview(out), 8 + len(text)
    for flat in blocks:
        view[at : at + flat.size] = flat
        at += flat.size
    return out


class Held:
    """One process's unpacked payload: its head and its blocks by ``(path, box)``."""

    def __init__(self, payload: Any, where: str) -> None:
        n = int.from_bytes(bytes(payload[:8]), "little")
        self.raw = payload
        self.head = json.loads(bytes(payload[8 : 8 + n]))
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
        final = self._step_dir(step)
        tmp = final.with_name(f"{final.name}{_TMP}{os.getpid()}")
        tmp.mkdir(parents=True)
        # Its own shards are written while the peer copy crosses the network.
        first = self._start(lambda: _write_file(tmp / "own.bin", own), f"own-{step}")
        count, shift = jax.process_count(), 0 if alone else exchange.peer_shift()
        received = None
        if shift:  # dispatched: the copy crosses while training goes on, read by the writer
            pairs = [(p, (p + shift) % count) for p in range(count)]
            received = exchange.send_bytes(own, pairs, wait=False)

        def finish() -> None:
            peer = None if received is None else received()
            first.join()
            if self._error is not None:
                return
            if peer is not None:
                _write_file(tmp / "peer.bin", peer)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # the step exists from here on, whole
            for old in self.steps()[: -self.max_to_keep]:
                shutil.rmtree(self._step_dir(old), ignore_errors=True)

        self._writer = self._start(finish, f"commit-{step}")

    def _start(self, fn: Any, name: str) -> threading.Thread:
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by the next wait()
                self._error = e

        thread = threading.Thread(target=run, name=f"dtensor-local-{name}")
        thread.start()
        return thread

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
            with open(path, "rb") as f:  # mapped: only the blocks a restore needs are read
                return Held(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), str(path))
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError):
            _log.warning("local checkpoint %s cannot be read; skipping it", path)
            return None


def _write_file(path: Path, blob: Any) -> None:
    # No fsync: a killed process's writes survive in the page cache; a lost host loses its
    # tier whatever was synced, and its shards live on in the peer's copy.
    with open(path, "wb") as f:
        f.write(blob)
