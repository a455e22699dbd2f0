"""Any laid-out tree written as a Hugging Face safetensors checkpoint, tensor by tensor.

The files are planned up front on every process alike (names through the mapping, shapes
and dtypes through its transforms undone, files cut at ``max_shard_size``). Then, leaf by
leaf, the leaf is brought whole to the host (one tensor at a time: all processes take part
in gathering a leaf split over them), and the process that writes its file (files are
dealt round the processes) streams its bytes out. No process ever holds more than one
leaf.

Nothing that looks complete is left by a failed save: an earlier index (or
``model.safetensors``) is removed first, local files are written under temporary names and
renamed once whole, and the index is written last (renamed into place on disk; in a
bucket, where an object appears only once its upload finishes, written after every file).
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import processes, storage
from dtensor.checkpoint.canonical import canon, is_key
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.mapping import as_mapping
from dtensor.checkpoint.safetensors_format import INDEX, SINGLE, header_bytes, iter_chunks
from dtensor.core.tree import path_str

__all__ = ["parse_size", "save_safetensors"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or Hugging Face's strings (``"5GB"`` = 5e9, ``"2GiB"``).

    Examples:
        >>> from dtensor.checkpoint.safetensors_save import parse_size
        >>> parse_size("5GB"), parse_size("100KiB"), parse_size(7)
        (5000000000, 102400, 7)
    """
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if m and m.group(2).upper() in _UNITS:
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    raise ValueError(
        f"max_shard_size={size!r} is not a size: pass bytes as an int or a string such as "
        "'5GB', '500MB' or '2GiB'."
    )


def _barrier(name: str) -> None:
    if processes.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"dtensor-safetensors-{name}")


def _host_value(x: Any) -> np.ndarray:
    """A leaf whole on this host (all processes call this together for a leaf split over them)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class _Writer:
    """One output file: header first, then tensors as they come; renamed into place when whole."""

    def __init__(self, root: Any, name: str, header: bytes) -> None:
        self.final = root / name
        self.remote = storage.is_url(root)
        self.path = self.final if self.remote else root / f"{name}.tmp-{uuid.uuid4().hex[:8]}"
        self.f = self.path.open("wb")
        self.f.write(header)

    def write(self, array: np.ndarray) -> None:
        for chunk in iter_chunks(array):
            self.f.write(chunk)

    def commit(self) -> None:
        self.f.close()
        if not self.remote:
            os.replace(os.fspath(self.path), os.fspath(self.final))

    def abandon(self) -> None:
        with contextlib.suppress(Exception):  # cleaning up after the error being raised
            self.f.close()
        with contextlib.suppress(OSError, FileNotFoundError):
            self.path.unlink()


def _plan(tree: Any, mapping: Any) -> list[tuple[Any, list[tuple[str, tuple, np.dtype]], Any]]:
    """``(leaf, [(name, shape, dtype)], source)`` for every leaf written, in tree order."""
    m = as_mapping(mapping)
    flat = jax.tree_util.tree_leaves_with_path(canon(tree))
    out, seen, unmapped = [], {}, []
    for p, leaf in flat:
        path = path_str(p)
        if is_key(leaf):
            continue
        shape = tuple(int(s) for s in np.shape(leaf))
        dtype = np.dtype(leaf.dtype if hasattr(leaf, "dtype") else np.asarray(leaf).dtype)
        src = m.source(path, saving=True, counts=shape)
        if src is None:
            unmapped.append(path)
            continue
        ns = len(src.stacked)
        if shape[:ns] != src.stacked:
            raise CheckpointError(
                f"{path!r} is {shape}; its rule {src.rule} stacks {ns} leading dimension(s) of "
                f"sizes {src.stacked}. Fix the rule's stack= values."
            )
        inner = shape[ns:]
        try:
            for t in src.transforms[::-1]:
                inner = tuple(int(s) for s in t.unshape(inner))
        except ValueError as e:
            raise CheckpointError(
                f"{path!r} ({shape}) does not fit its rule {src.rule}: {e} Fix the rule."
            ) from None
        saved = dtype if src.cast is None or src.cast.saved is None else src.cast.saved
        tensors = []
        for name in src.names:
            if name in seen:
                raise CheckpointError(
                    f"save_safetensors: {path!r} and {seen[name]!r} both map to tensor {name!r}. "
                    "Give one of their rules save=False (e.g. a head tied to the embedding)."
                )
            seen[name] = path
            tensors.append((name, inner, saved))
        out.append((leaf, tensors, src))
    if unmapped:
        raise CheckpointError(
            f"save_safetensors: no mapping rule names a checkpoint tensor for {unmapped[:5]}"
            f"{' and more' if len(unmapped) > 5 else ''}. Add rules for them (or "
            "Mapping(..., default=True) to save them under their paths)."
        )
    return out


def save_safetensors(
    path: str | os.PathLike[str],
    tree: Any,
    *,
    mapping: Any = None,
    max_shard_size: int | str = "5GB",
    metadata: dict[str, str] | None = None,
) -> str:
    """Write ``tree`` as a Hugging Face safetensors checkpoint; returns the index (or file) path.

    Args:
        path: the folder (created when missing; a local path or ``gs://...``).
        tree: an NNX model or any pytree of arrays, laid out in any way, over any number
            of processes (every process calls this).
        mapping: tree paths -> checkpoint names with transforms, as for
            :func:`load_safetensors` (undone here); ``None``: each path with ``/`` as ``.``.
        max_shard_size: files are cut before they pass this (``"5GB"``, ``"500MB"``, an
            int); one file (``model.safetensors``, no index) when all fits.
        metadata: extra ``__metadata__`` strings for every file (``format: pt`` is set, as
            ``transformers`` expects).

    Examples:
        >>> import tempfile, os, numpy as np, dtensor
        >>> d = tempfile.mkdtemp()
        >>> tree = {"a": np.zeros((64, 64), np.float32), "b": np.ones(8, np.float32)}
        >>> os.path.basename(dtensor.checkpoint.save_safetensors(d, tree, max_shard_size="16KB"))
        'model.safetensors.index.json'
        >>> sorted(os.listdir(d))
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors', 'model.safetensors.index.json']
    """
    limit = parse_size(max_shard_size)
    plan = _plan(tree, mapping)
    files: list[list[tuple[str, tuple, np.dtype]]] = [[]]
    size = 0
    for _, tensors, _ in plan:
        for name, shape, dtype in tensors:
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if files[-1] and size + n > limit:
                files.append([])
                size = 0
            files[-1].append((name, shape, dtype))
            size += n
    count = len(files)
    names = (
        [SINGLE]
        if count == 1
        else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    )
    file_of = {t[0]: i for i, f in enumerate(files) for t in f}
    me, nproc = processes.process_index(), processes.process_count()
    root = storage.resolve(path)
    meta = {"format": "pt", **(metadata or {})}
    with storage.store_errors(root):
        if me == 0:
            root.mkdir(parents=True, exist_ok=True)
            for stale in (INDEX, SINGLE):  # nothing complete-looking while this save runs
                if (root / stale).exists():
                    (root / stale).unlink()
        _barrier("start")
        open_: dict[int, _Writer] = {}
        try:
            for leaf, tensors, src in plan:
                mine = [t for t in tensors if file_of[t[0]] % nproc == me]
                value = _host_value(leaf)  # every process: a leaf split over them is gathered
                if not mine:
                    continue
                ns = len(src.stacked)
                value = value.reshape((-1,) + value.shape[ns:]) if ns else value[None]
                for k, (name, _, dtype) in enumerate(tensors):
                    i = file_of[name]
                    if i % nproc != me:
                        continue
                    x = value[k]
                    for t in src.transforms[::-1]:
                        x = t.undo(x)
                    if i not in open_:
                        head = header_bytes([(n, d, s) for n, s, d in files[i]], meta)
                        open_[i] = _Writer(root, names[i], head)
                    open_[i].write(np.asarray(x, dtype))
                    if name == files[i][-1][0]:
                        open_.pop(i).commit()
                del value
        except BaseException:
            for w in open_.values():
                w.abandon()
            raise
        _barrier("files")
        if count > 1 and me == 0:
            total = sum(
                int(np.prod(s, dtype=np.int64)) * d.itemsize for f in files for _, s, d in f
            )
            index = {
                "metadata": {"total_size": total},
                "weight_map": {n: names[file_of[n]] for n in sorted(file_of)},
            }
            final = root / INDEX
            tmp = final if storage.is_url(root) else root / f"{INDEX}.tmp-{uuid.uuid4().hex[:8]}"
            storage.write_json(tmp, index)
            if tmp != final:
                os.replace(os.fspath(tmp), os.fspath(final))
        _barrier("index")
    return os.fspath(root / (INDEX if count > 1 else SINGLE))
