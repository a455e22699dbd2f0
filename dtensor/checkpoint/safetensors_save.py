"""Any laid-out tree written as a Hugging Face safetensors checkpoint, tensor by tensor.

The files are planned up front on every process alike (names through the mapping, shapes
and dtypes through its transforms undone, files cut at ``max_shard_size``). Then, leaf by
leaf, the leaf is brought whole to the host (one tensor at a time: all processes take part
in gathering a leaf split over them), and the process that writes its file (files are
dealt round the processes) streams its bytes out. No process ever holds more than one
leaf.

A save never writes into the checkpoint it replaces: its files go into a sibling folder,
which becomes the checkpoint only once every process has written its files (a rename on
disk; in a bucket, copies by the store, the index last: see
:mod:`dtensor.checkpoint.safetensors_commit`). A save that fails on any process (a full
disk, ``OSError: [Errno 27] File too large``) raises on every process, names the file and
the folder, and leaves the last checkpoint as it was.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import processes, storage
from dtensor.checkpoint.canonical import canon, is_key
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.mapping import as_mapping
from dtensor.checkpoint.safetensors_commit import Staging, write_error
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


def _agree(ok: bool) -> list[bool]:
    """Every process's ``ok``, in process order (a collective: all processes call it)."""
    if processes.process_count() == 1:
        return [ok]
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([int(ok)], np.int32), tiled=True)
    return [bool(f) for f in np.asarray(flags).reshape(-1)]


def _settle(error: BaseException | None, what: str, where: str, cleanup: Any = None) -> None:
    """Raise on every process when any failed ``what``: its own error on the process that
    failed, one naming that process elsewhere; ``cleanup`` runs on the first process first."""
    flags = _agree(error is None)
    if all(flags):
        return
    if cleanup is not None and processes.process_index() == 0:
        cleanup()
    if error is not None:
        raise error
    bad = [i for i, f in enumerate(flags) if not f]
    raise CheckpointError(
        f"save_safetensors({where!r}): process(es) {bad} failed {what} (their own error says "
        f"which file and why); the checkpoint at {where!r} is unchanged. Fix that and save again."
    )


def _needs_all(x: Any) -> bool:
    """Whether bringing ``x`` to the host is a collective (a leaf split over processes)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated


def _host_value(x: Any) -> np.ndarray:
    """A leaf whole on this host (all processes call this together for a leaf split over them)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if x.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


class _Writer:
    """One output file in the staging folder: header first, then tensors as they come."""

    def __init__(self, folder: Any, name: str, header: bytes) -> None:
        self.name = name
        self.path = folder / name
        self.f = self.path.open("wb")
        self.f.write(header)

    def write(self, array: np.ndarray) -> None:
        for chunk in iter_chunks(array):
            self.f.write(chunk)

    def commit(self) -> None:
        self.f.close()

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
    extra_files: dict[str, str | bytes] | None = None,
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
        extra_files: more files for the folder, name -> text or bytes (a ``config.json``):
            written with the weights, so they replace the folder's old ones together.

    A save over an existing checkpoint writes beside it and swaps it in only when whole
    (see :mod:`dtensor.checkpoint.safetensors_commit`): if any process fails, every process
    raises (the failing one naming its file and the folder) and the old checkpoint is left
    as it was; a save that succeeds leaves none of the old one's weight files, and keeps
    the folder's other files (a tokenizer). A file at ``path`` is refused.

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
    where = os.fspath(path)
    extra = dict(extra_files or {})
    for name in extra:
        if "/" in name or name in (*names, INDEX) or not name.strip("."):
            raise CheckpointError(
                f"save_safetensors: extra_files names {name!r}, which is not a file name of its "
                f"own in the folder (no '/', not one of the weight files {names[0]!r}... or "
                f"{INDEX!r}). Rename it."
            )
    stage = Staging(storage.resolve(path), where)
    stage.check_target()  # every process: an error here raises everywhere, before any barrier
    error: BaseException | None = None
    if processes.process_index() == 0:
        try:
            stage.prepare()
        except Exception as e:  # noqa: BLE001 - raised below, on every process
            error = e
    _settle(error, "to prepare the folder to write into", where)
    meta = {"format": "pt", **(metadata or {})}
    error = _write_files(plan, files, names, stage, meta)
    _settle(error, "to write their files", where, cleanup=stage.discard)
    if processes.process_index() == 0:
        current = ""
        try:
            if count > 1:
                total = sum(
                    int(np.prod(s, dtype=np.int64)) * d.itemsize for f in files for _, s, d in f
                )
                index = {
                    "metadata": {"total_size": total},
                    "weight_map": {n: names[file_of[n]] for n in sorted(file_of)},
                }
                current = INDEX
                with storage.store_errors(stage.root):
                    storage.write_json(stage.folder / INDEX, index)
            for current, content in extra.items():
                with storage.store_errors(stage.root):
                    data = content.encode() if isinstance(content, str) else bytes(content)
                    (stage.folder / current).write_bytes(data)
        except Exception as e:  # noqa: BLE001 - raised below, on every process
            error = e
            if isinstance(e, OSError):
                error = write_error(e, current, stage.folder, where)
                error.__cause__ = e
            stage.discard()
        else:
            try:
                stage.commit([*names, *extra, *([INDEX] if count > 1 else [])])
            except CheckpointError as e:  # the swap says what state it left
                error = e
    _settle(error, "to put the new checkpoint in place", where)
    return os.fspath(storage.resolve(path) / (INDEX if count > 1 else SINGLE))


def _write_files(
    plan: list[tuple[Any, list[tuple[str, tuple, np.dtype]], Any]],
    files: list[list[tuple[str, tuple, np.dtype]]],
    names: list[str],
    stage: Staging,
    meta: dict[str, str],
) -> BaseException | None:
    """This process's files, leaf by leaf, into the staging folder; the error that stopped
    them (after which it still takes part in every gather, so the others finish), or None."""
    me, nproc = processes.process_index(), processes.process_count()
    file_of = {t[0]: i for i, f in enumerate(files) for t in f}
    open_: dict[int, _Writer] = {}
    error: BaseException | None = None
    current = ""
    try:
        for leaf, tensors, src in plan:
            mine = any(file_of[t[0]] % nproc == me for t in tensors)
            if error is not None or not mine:
                if _needs_all(leaf):
                    _host_value(leaf)  # a leaf split over the processes: all gather it
                continue
            value = _host_value(leaf)
            try:  # a bucket's credentials were tried when the folder was prepared
                ns = len(src.stacked)
                value = value.reshape((-1,) + value.shape[ns:]) if ns else value[None]
                for k, (name, _, dtype) in enumerate(tensors):
                    i = file_of[name]
                    if i % nproc != me:
                        continue
                    current = names[i]
                    x = value[k]
                    for t in src.transforms[::-1]:
                        x = t.undo(x)
                    if i not in open_:
                        head = header_bytes([(n, d, s) for n, s, d in files[i]], meta)
                        open_[i] = _Writer(stage.folder, names[i], head)
                    open_[i].write(np.asarray(x, dtype))
                    if name == files[i][-1][0]:
                        open_.pop(i).commit()
            except Exception as e:  # noqa: BLE001 - every process learns of it
                error = e
                if isinstance(e, OSError):
                    error = write_error(e, current, stage.folder, stage.where)
                    error.__cause__ = e
                for w in open_.values():
                    w.abandon()
                open_.clear()
            del value
    except BaseException:  # interrupted: no agreement possible; the next save cleans up
        for w in open_.values():
            w.abandon()
        raise
    return error
