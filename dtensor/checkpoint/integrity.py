"""Checksums recorded when a step is written, checked before and after it is read.

Two records live in the ``checksums`` item of each step, so orbax commits them
with the step (the step directory is renamed into place only once they are
written):

* ``process_<i>.json``, one per process: the CRC-32 of every shard that
  process wrote (its addressable shards with ``replica_id`` 0; host values on
  process 0), with the shard's index, computed from the very bytes handed to
  orbax. Each process hashes only its own shards, so the cost does not grow
  with the number of hosts.
* ``files.json``, written by the primary process once every process has
  finished its files and before the step is committed: the size of every file
  of the step, and the CRC-32 of each file the primary process wrote (the
  manifest, orbax's ``_METADATA``, its OCDBT index and data files). Other
  processes' data files are checked through their shard checksums
  (:func:`dtensor.checkpoint.diagnose.bad_shard`), so no host reads another's
  bytes at save time.

Files are read and written through :mod:`dtensor.checkpoint.storage`
(``etils.epath``), on disk or in a bucket alike.

:func:`check_files` compares the files with ``files.json`` (sizes and small
files always; every byte with ``full=True``); :func:`check_arrays` compares the
arrays a restore produced with the shard checksums, hashing the restored
shards that cover a recorded shard, so a restore reads the data once.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import processes, storage
from dtensor.checkpoint.errors import CheckpointError, DamagedCheckpointError
from dtensor.core.tree import path_str

__all__ = [
    "CHECKSUMS",
    "Records",
    "check_arrays",
    "check_files",
    "damaged",
    "load_records",
    "shard_checksums",
    "write_files_record",
]

CHECKSUMS = "checksums"
FILES = "files.json"
SMALL_FILE = 1 << 20  # files up to this size have every byte checked even without full=True
_CHUNK = 16 << 20
_SKIP = {"commit_success.txt", "_CHECKPOINT_METADATA"}  # orbax rewrites these after commit

Records = dict[str, list[dict[str, Any]]]


def _crc_bytes(a: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


def _parallel(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``map(fn, items)`` on threads (zlib releases the GIL on large buffers)."""
    workers = min(len(items), os.cpu_count() or 1, 8)
    if workers <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(s.indices(n)[:2]) for s, n in zip(index, shape, strict=True)]


def shard_checksums(tree: Any) -> Records:
    """Checksums of the shards this process writes: ``{path: [{index, crc32, nbytes}]}``."""
    tasks: list[tuple[str, list[list[int]], Any]] = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = path_str(path)
        if isinstance(leaf, jax.Array):
            tasks.extend(
                (p, _index(s.index, leaf.shape), s.data)
                for s in leaf.addressable_shards
                if s.replica_id == 0
            )
        elif processes.process_index() == 0:
            a = np.asarray(leaf)
            tasks.append((p, [[0, n] for n in a.shape], a))
    sums = _parallel(lambda t: _crc_bytes(np.asarray(t[2])), tasks)
    out: Records = {}
    for (p, index, data), crc in zip(tasks, sums, strict=True):
        out.setdefault(p, []).append({"index": index, "crc32": crc, "nbytes": int(data.nbytes)})
    return out


# ------------------------------------------------------------------- files
def _file_crc(path: Any) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _other_process(rel: str) -> bool:
    """Whether a file lies in another process's OCDBT shard (``ocdbt.process_<i>``, i > 0)."""
    return any(p.startswith("ocdbt.process_") and p != "ocdbt.process_0" for p in rel.split("/"))


def _step_files(step_dir: Any) -> list[str]:
    """Every file of a step (relative names), but the checksum records and orbax's commit markers."""
    out = []
    for rel_root, dirs, files in storage.iter_files(step_dir):
        if rel_root.split("/")[0] == CHECKSUMS:
            dirs.clear()
            continue
        out.extend(f"{rel_root}/{f}" if rel_root else f for f in files if f not in _SKIP)
    return sorted(out)


def write_files_record(step_dir: Any) -> None:
    """Record every file's size, and the CRC-32 of the primary's, in ``checksums/files.json``.

    A file of another process holds ``[size, None]``: its bytes are checked
    through that process's shard checksums.
    """
    names = _step_files(step_dir)
    own = [n for n in names if not _other_process(n)]
    crcs = dict(zip(own, _parallel(lambda n: _file_crc(step_dir / n), own), strict=True))
    files = {n: [storage.size(step_dir / n), crcs.get(n)] for n in names}
    record = {"format": 1, "algorithm": "crc32", "files": files}
    storage.write_json(step_dir / CHECKSUMS / FILES, record)


# ------------------------------------------------------------------ checks
def damaged(step: int, where: str, what: str, *, array: str | None = None, file: str | None = None):
    """The one error for a damaged step: what is wrong, where, and what to do."""
    named = [f"array {array!r}"] if array is not None else []
    named += [f"file {file!r}"] if file is not None else []
    at = f" ({', '.join(named)})" if named else ""
    return DamagedCheckpointError(
        f"checkpoint step {step} in {where!r} is damaged: {what}{at}. Its files no "
        "longer match the checksums recorded when it was written. Restore an earlier step "
        "(restore without step= falls back to the newest intact one), or delete this step.",
        step=step,
        array=array,
        file=file,
        problem=what,
    )


def _read_json(step_dir: Any, rel: str, step: int, where: str) -> dict[str, Any]:
    path = step_dir / rel
    if not path.is_file():
        raise damaged(step, where, "its checksum record is missing", file=rel)
    try:
        out = storage.read_json(path)
    except (ValueError, OSError):
        raise damaged(step, where, "its checksum record is unreadable", file=rel) from None
    if not isinstance(out, dict):
        raise damaged(step, where, "its checksum record is unreadable", file=rel)
    return out


def load_records(step_dir: Any, step: int, where: str) -> tuple[Records, dict[str, list[int]]]:
    """Every process's shard checksums (``{path: records}``) and the primary's file record."""
    cdir = f"{CHECKSUMS}/"
    first = _read_json(step_dir, cdir + "process_0.json", step, where)
    records: Records = {}
    for i in range(int(first.get("process_count", 1))):
        rel = cdir + f"process_{i}.json"
        one = first if i == 0 else _read_json(step_dir, rel, step, where)
        for p, recs in one.get("arrays", {}).items():
            records.setdefault(p, []).extend(dict(r, process=i) for r in recs)
    files = _read_json(step_dir, cdir + FILES, step, where).get("files", {})
    return records, files


def _holder(step_dir: Any, rel: str, records: Records | None) -> str | None:
    """The array a damaged file of ``state/`` holds (found by reading the arrays), if any."""
    if records is None or not rel.startswith("state/") or rel == "state/_METADATA":
        return None
    from dtensor.checkpoint.diagnose import find_array

    return find_array(step_dir, records)


def check_files(
    step_dir: Any,
    step: int,
    where: str,
    files: dict[str, list[int]],
    *,
    full: bool,
    records: Records | None = None,
) -> int:
    """Raise :class:`DamagedCheckpointError` for the first missing, resized or changed file.

    Sizes are always compared, contents of small files always, contents of
    large ones with ``full``. With ``records``, the error also names the array
    the file held. Returns the bytes recorded.
    """
    try:
        return _check_files(step_dir, step, where, files, full=full)
    except DamagedCheckpointError as e:
        array = _holder(step_dir, e.file or "", records)
        if array is None:
            raise
        raise damaged(step, where, e.problem, array=array, file=e.file) from None


def _check_files(
    step_dir: Any, step: int, where: str, files: dict[str, list[int]], *, full: bool
) -> int:
    big = []
    for rel, (size, crc) in sorted(files.items()):
        path = step_dir / rel
        if not path.is_file():
            raise damaged(step, where, "a file it was written with is missing", file=rel)
        actual = storage.size(path)
        if actual != size:
            what = "truncated" if actual < size else "longer than written"
            raise damaged(step, where, f"a file is {what} ({actual} of {size} bytes)", file=rel)
        if crc is not None and (size <= SMALL_FILE or full):
            big.append((rel, crc))
    sums = _parallel(lambda item: _file_crc(step_dir / item[0]), big)
    for (rel, crc), got in zip(big, sums, strict=True):
        if got != crc:
            raise damaged(step, where, "a file does not match its checksum", file=rel)
    return sum(size for size, _ in files.values())


def _contains(outer: list[list[int]], inner: list[list[int]]) -> bool:
    return all(o[0] <= i[0] and i[1] <= o[1] for o, i in zip(outer, inner, strict=True))


def _views(value: Any) -> list[tuple[list[list[int]], Any]]:
    """``(index, host-readable data)`` of the pieces of a restored value this process holds."""
    if isinstance(value, jax.Array):
        return [
            (_index(s.index, value.shape), s.data)
            for s in value.addressable_shards
            if s.replica_id == 0
        ]
    a = np.asarray(value)
    return [([[0, n] for n in a.shape], a)]


def check_arrays(tree: Any, records: Records) -> tuple[list[tuple[str, dict[str, Any]]], int]:
    """Recorded shards whose restored bytes differ, and the number this process checked.

    A recorded shard is checked when one restored piece on this process covers
    it (always when the layout is the saved one); otherwise from the whole
    array when it is fully addressable; otherwise by the process that holds it.
    """
    tasks: list[tuple[str, dict[str, Any], Any, list[list[int]], Any]] = []
    for path, value in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = path_str(path)
        views = _views(value)
        for rec in records.get(p, ()):
            piece = next((v for v in views if _contains(v[0], rec["index"])), None)
            if piece is None and isinstance(value, jax.Array) and value.is_fully_addressable:
                piece = ([[0, n] for n in value.shape], value)
            if piece is not None:
                tasks.append((p, rec, piece[1], piece[0], np.dtype(value.dtype)))

    def one(t: tuple[str, dict[str, Any], Any, list[list[int]], Any]) -> bool:
        _, rec, data, origin, _dtype = t
        local = tuple(
            slice(i[0] - o[0], i[1] - o[0]) for i, o in zip(rec["index"], origin, strict=True)
        )
        return _crc_bytes(np.asarray(data)[local]) == rec["crc32"]

    ok = _parallel(one, tasks)
    bad = [(t[0], t[1]) for t, good in zip(tasks, ok, strict=True) if not good]
    return bad, len(tasks)


def agree(count: int) -> int:
    """The largest ``count`` over all processes (every process sees the same verdict)."""
    if processes.process_count() == 1:
        return count
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(count, np.int32))))


def first_bad_file(
    step_dir: Any, step: int, where: str, files: dict[str, list[int]]
) -> DamagedCheckpointError | None:
    """The error for the first file whose bytes differ from its record (every byte read), or None."""
    try:
        _check_files(step_dir, step, where, files, full=True)
    except DamagedCheckpointError as e:
        return e
    return None


def read_failure(
    step_dir: Any,
    step: int,
    where: str,
    files: dict[str, list[int]],
    records: Records | None,
    error: BaseException,
) -> CheckpointError:
    """Our error for an orbax/tensorstore failure: the damaged file (and array) when there is one."""
    bad = first_bad_file(step_dir, step, where, files) if files else None
    if bad is not None:
        array = _holder(step_dir, bad.file or "", records)
        return damaged(step, where, bad.problem, array=array, file=bad.file)
    text = str(error).strip()
    first = text.splitlines()[0].split(" See full TensorStore details")[0][:300] if text else ""
    first = first.rstrip(".") or type(error).__name__
    return CheckpointError(
        f"orbax could not read checkpoint step {step} in {where!r}: {first}. Check the step with "
        "`python -m dtensor.checkpoint verify DIR`, or restore another step."
    )


def mismatch(
    step_dir: Any,
    step: int,
    where: str,
    files: dict[str, list[int]],
    bad: list[tuple[str, dict[str, Any]]],
) -> DamagedCheckpointError:
    """The error for restored shards that differ from their checksums (the file found by a full check)."""
    if not bad:
        return damaged(step, where, "another process found a shard that differs from its checksum")
    path, rec = bad[0]
    found = first_bad_file(step_dir, step, where, files) if files else None
    file = found.file if found is not None else f"state/ocdbt.process_{rec['process']}/d"
    index = ",".join(f"{a}:{b}" for a, b in rec["index"])
    more = f" ({len(bad)} damaged shards in all)" if len(bad) > 1 else ""
    return damaged(
        step, where, f"shard [{index}] does not match its checksum{more}", array=path, file=file
    )
