"""The safetensors file format, read by byte ranges and written as a stream, locally or in a bucket.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``)
and the tensors' bytes, row-major, back to back. A Hugging Face checkpoint is a
folder of such files plus ``model.safetensors.index.json`` (``weight_map``: tensor
name -> file). The format is small enough to read and write here directly: a
reader fetches exactly the byte runs of the slices it needs (``os.preadv`` on a
local file, ranged requests through fsspec in a bucket) and counts them
(:class:`ReadStats`); a writer streams one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from dtensor.checkpoint import storage
from dtensor.checkpoint.errors import CheckpointError

__all__ = [
    "DTYPES",
    "INDEX",
    "SINGLE",
    "Entry",
    "ReadStats",
    "Reader",
    "dtype_code",
    "header_bytes",
    "read_header",
    "torch_error",
]

#: safetensors' dtype codes.
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in DTYPES.items()}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_MAX_HEADER = 100 * 2**20  # safetensors' own limit


def dtype_code(dtype: Any, name: str) -> str:
    """safetensors' code for ``dtype`` (``float32`` -> ``"F32"``).

    Examples:
        >>> import jax.numpy as jnp
        >>> from dtensor.checkpoint.safetensors_format import dtype_code
        >>> dtype_code(jnp.bfloat16, "w"), dtype_code("int32", "n")
        ('BF16', 'I32')
    """
    code = _CODES.get(np.dtype(dtype))
    if code is None:
        raise CheckpointError(
            f"tensor {name!r} has dtype {np.dtype(dtype)}, which safetensors cannot store; valid: "
            f"{sorted(str(d) for d in DTYPES.values())}. Cast it (the mapping's astype)."
        )
    return code


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a checkpoint: its file, dtype, shape and absolute byte range in the file."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    stop: int


def header_bytes(
    tensors: Sequence[tuple[str, Any, Sequence[int]]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8-byte length and JSON header of a file holding ``(name, dtype, shape)`` in order.

    Examples:
        >>> from dtensor.checkpoint.safetensors_format import header_bytes
        >>> h = header_bytes([("a", "float32", (2,)), ("b", "int8", (3,))])
        >>> len(h) % 8, b'"b":{"dtype":"I8","shape":[3],"data_offsets":[8,11]}' in h
        (0, True)
    """
    head: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, dtype, shape in tensors:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        head[name] = {
            "dtype": dtype_code(dtype, name),
            "shape": [int(s) for s in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % 8)  # the data 8-byte aligned, as safetensors pads
    return struct.pack("<Q", len(text)) + text


def _bad(file: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"safetensors file {file!r} is not readable: {what}. Download or write it again (a "
        "partial download or copy leaves such a file)."
    )


def torch_error(file: str, what: str) -> CheckpointError:
    """The error for a PyTorch ``torch.save`` file (``pytorch_model.bin``) given as safetensors."""
    return CheckpointError(
        f"{file!r} is {what}: a PyTorch pickle checkpoint (torch.save, as pytorch_model.bin), "
        "not safetensors; it is not read here (unpickling runs code). Convert it to "
        "safetensors where torch is installed: `from safetensors.torch import save_file; "
        "save_file(torch.load(PATH, map_location='cpu'), 'model.safetensors')` (or "
        "transformers' from_pretrained(DIR).save_pretrained(OUT)), or download the "
        "repository's .safetensors files, and pass those."
    )


def _torch_kind(raw: bytes) -> str | None:
    """What kind of ``torch.save`` file starts with ``raw`` (None: not one)."""
    if raw[:4] == b"PK\x03\x04":
        return "a zip archive"
    if (
        len(raw) >= 2 and raw[0] == 0x80 and 2 <= raw[1] <= 5
    ):  # a pickle's PROTO opcode: torch's legacy format
        return "a Python pickle"
    return None


def _check_offsets(file: str, entries: list[tuple[str, int, int]], data: int) -> None:
    """The tensors' byte ranges tile the data exactly, as the ``safetensors`` library requires:
    in order, each starting where the one before ends, the last ending at the file's end."""
    at, prev = 0, None
    for name, begin, end in sorted(entries, key=lambda e: (e[1], e[2])):
        if begin != at:
            was = f"tensor {prev[0]!r} (bytes {prev[1]}-{prev[2]})" if prev else "the data's start"
            how = "overlap" if begin < at else f"leave {begin - at} bytes between them"
            raise CheckpointError(
                f"safetensors file {file!r} has an invalid offset: {was} and tensor {name!r} "
                f"(bytes {begin}-{end}) {how}; in a valid file each tensor starts where the one "
                "before it ends (the safetensors library refuses it too). The file was damaged or "
                "not written by a safetensors writer: download or write it again."
            )
        at, prev = end, (name, begin, end)
    if at != data:
        raise CheckpointError(
            f"safetensors file {file!r} has {data} bytes of data after its header, but its "
            f"tensors cover {at}; in a valid file they cover all of it (the safetensors library "
            "refuses it too). The file was damaged or appended to: download or write it again."
        )


def read_header(path: Any, file: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """The tensors of one file (checked against its size: a truncated file names the tensors
    it cuts; byte ranges that overlap or leave gaps are refused) and its ``__metadata__``."""
    with storage.store_errors(path):
        total = storage.size(path)
        with path.open("rb") as f:
            raw = f.read(8)
            kind = _torch_kind(raw)  # said only where the bytes are not a safetensors header
            if len(raw) < 8:
                raise _bad(file, f"it is {total} bytes long, shorter than its 8-byte header size")
            n = struct.unpack("<Q", raw)[0]
            if n > min(_MAX_HEADER, total - 8):
                if kind is not None:
                    raise torch_error(file, kind)
                raise _bad(file, f"its header claims {n} bytes, the file has {total}")
            text = f.read(n)
    try:
        head = json.loads(text)
    except ValueError as e:
        if kind is not None:
            raise torch_error(file, kind) from None
        raise _bad(file, f"its JSON header does not parse ({e})") from None
    if not isinstance(head, dict):
        raise _bad(file, "its header is not a JSON object")
    metadata = head.pop("__metadata__", None) or {}
    base = 8 + n
    entries = {}
    cut = []
    for name, spec in head.items():
        try:
            dtype = DTYPES[spec["dtype"]]
            shape = tuple(int(s) for s in spec["shape"])
            begin, end = (int(o) for o in spec["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise _bad(file, f"tensor {name!r} has a malformed entry {spec!r}") from None
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or begin < 0:
            raise _bad(
                file, f"tensor {name!r}: {end - begin} bytes for {spec['dtype']}{list(shape)}"
            )
        if base + end > total:
            cut.append(name)
        entries[name] = Entry(name, file, dtype, shape, base + begin, base + end)
    if cut:
        need = max(e.stop for e in entries.values())
        raise CheckpointError(
            f"safetensors file {file!r} is truncated: it is {total} bytes, its header needs {need}; "
            f"tensor(s) {', '.join(repr(c) for c in cut[:5])}{' and more' if len(cut) > 5 else ''} "
            "run past its end. Download or write the file again."
        )
    _check_offsets(
        file, [(e.name, e.start - base, e.stop - base) for e in entries.values()], total - base
    )
    return entries, {str(k): str(v) for k, v in metadata.items()}


# ------------------------------------------------------------------- reading
@dataclasses.dataclass
class ReadStats:
    """What a load read, counted by its reader: bytes, requests (runs), tensors, files."""

    bytes_read: int = 0
    reads: int = 0
    tensors: int = 0
    files: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def _runs(shape: tuple[int, ...], box: Sequence[tuple[int, int]]) -> tuple[np.ndarray, int]:
    """Element offsets of the contiguous runs of ``box`` in a row-major ``shape``, and their length."""
    nd = len(shape)
    k = nd  # dims k.. are whole in the box: each run spans box[k-1] x them
    while k > 0 and box[k - 1] == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        return np.zeros(1, np.int64), int(np.prod(shape, dtype=np.int64))
    inner = int(np.prod(shape[k:], dtype=np.int64))
    run = (box[k - 1][1] - box[k - 1][0]) * inner
    strides = np.cumprod((1,) + tuple(shape[::-1]), dtype=np.int64)[::-1][1:]  # elements per index
    offsets = np.zeros(1, np.int64)
    for d in range(k - 1):
        idx = np.arange(box[d][0], box[d][1], dtype=np.int64) * strides[d]
        offsets = (offsets[:, None] + idx[None, :]).reshape(-1)
    return offsets + box[k - 1][0] * strides[k - 1], run


def _pread_full(fd: int, view: np.ndarray, offset: int, entry: Entry) -> None:
    done = 0
    while done < view.size:  # one read returns at most ~2 GiB on Linux
        got = os.preadv(fd, [memoryview(view[done:])], offset + done)  # type: ignore[arg-type]
        if got <= 0:
            raise _bad(entry.file, f"tensor {entry.name!r} ends early (short read)")
        done += got


class Reader:
    """Byte-range reads of checkpoint files (local or ``gs://``), counted in :attr:`stats`.

    Remote runs closer than ``gap`` bytes are fetched as one request (a column
    slice of a row-major tensor is thousands of small runs); local runs are
    read exactly.
    """

    def __init__(self, root: Any, *, gap: int = 2**20) -> None:
        self.root = root
        self.remote = storage.is_url(root)
        self.gap = gap
        self.stats = ReadStats()
        self._fds: dict[str, int] = {}
        self._fs: Any = None

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(os.fspath(self.root / file), os.O_RDONLY)
            self.stats.files += 1
        return self._fds[file]

    def read(self, entry: Entry, box: Sequence[tuple[int, int]]) -> np.ndarray:
        """``entry``'s tensor at ``box`` (``(start, stop)`` per dimension), read from its file."""
        box = tuple((int(a), int(b)) for a, b in box)
        out = np.empty(tuple(b - a for a, b in box), entry.dtype)
        self.stats.tensors += 1
        if out.size == 0:
            return out
        offsets, run = _runs(entry.shape, box)
        item = entry.dtype.itemsize
        flat = out.reshape(len(offsets), run).view(np.uint8).reshape(len(offsets), run * item)
        starts = entry.start + offsets * item
        if self.remote:
            self._read_remote(entry, starts, run * item, flat)
        else:
            fd = self._fd(entry.file)
            for i, s in enumerate(starts.tolist()):
                _pread_full(fd, flat[i], s, entry)
            self.stats.reads += len(starts)
            self.stats.bytes_read += len(starts) * run * item
        return out

    def _read_remote(self, entry: Entry, starts: np.ndarray, size: int, flat: np.ndarray) -> None:
        if self._fs is None:
            import fsspec

            self._fs, _ = fsspec.core.url_to_fs(os.fspath(self.root))
        path = os.fspath(self.root / entry.file)
        groups: list[tuple[int, int, list[int]]] = []  # (begin, end, rows) per request
        for i, s in enumerate(starts.tolist()):
            if groups and s - groups[-1][1] < self.gap:
                groups[-1] = (groups[-1][0], s + size, groups[-1][2] + [i])
            else:
                groups.append((s, s + size, [i]))
        with storage.store_errors(path):
            blobs = self._fs.cat_ranges(
                [path] * len(groups), [g[0] for g in groups], [g[1] for g in groups]
            )
        for (begin, end, rows), blob in zip(groups, blobs, strict=True):
            if isinstance(blob, BaseException):
                raise storage.store_error(path, blob)
            if len(blob) != end - begin:
                raise _bad(entry.file, f"tensor {entry.name!r} ends early (short read)")
            buf = np.frombuffer(blob, np.uint8)
            for i in rows:
                at = int(starts[i]) - begin
                flat[i] = buf[at : at + size]
            self.stats.reads += 1
            self.stats.bytes_read += end - begin

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_chunks(array: np.ndarray, chunk: int = 64 * 2**20) -> Iterator[memoryview]:
    """The bytes of ``array`` (C order) in pieces of at most ``chunk`` bytes."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    for i in range(0, flat.size, chunk):
        yield memoryview(flat[i : i + chunk])  # type: ignore[arg-type]
