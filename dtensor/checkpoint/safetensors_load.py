"""Hugging Face safetensors checkpoints into any layout, each process reading only its slices.

``load_safetensors(path, target, mapping=...)`` opens a ``.safetensors`` file, or a
folder (local or ``gs://``) with ``model.safetensors.index.json`` or ``model.safetensors``,
matches every leaf of ``target`` to a checkpoint tensor through the mapping
(:mod:`dtensor.checkpoint.mapping`), checks names, shapes and dtypes up front, and then,
leaf by leaf, reads for each distinct slice this process's devices hold only the bytes of
that slice (through the transforms), places it on those devices and drops the buffer. A
process's peak host memory is its own shards plus one slice being read.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from dtensor.checkpoint import storage
from dtensor.checkpoint.canonical import canon, fmt, is_key, rebuild
from dtensor.checkpoint.errors import CheckpointError
from dtensor.checkpoint.mapping import Mapping, Source, as_mapping
from dtensor.checkpoint.safetensors_commit import aside_of
from dtensor.checkpoint.safetensors_format import (
    INDEX,
    SINGLE,
    Entry,
    Reader,
    read_header,
    torch_error,
)
from dtensor.checkpoint.transforms import is_lossless_cast
from dtensor.core.layout import Layout
from dtensor.core.mesh import create_mesh, current_mesh
from dtensor.core.tree import path_str

__all__ = ["load_safetensors", "open_checkpoint"]


def _files_error(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where!r} {what}. Pass a .safetensors file or a folder holding {SINGLE} or {INDEX} "
        "with the files it names (a Hugging Face model folder)."
    )


def open_checkpoint(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Entry]]:
    """The folder of a checkpoint and every tensor it holds (from the files' headers).

    Examples:
        >>> import tempfile, numpy as np, dtensor
        >>> d = tempfile.mkdtemp()
        >>> _ = dtensor.checkpoint.save_safetensors(d, {"w": np.ones((2, 3), np.float32)})
        >>> _, entries = dtensor.checkpoint.open_checkpoint(d)
        >>> entries["w"].shape, str(entries["w"].dtype), entries["w"].file
        ((2, 3), 'float32', 'model.safetensors')
    """
    where = os.fspath(path)
    p = storage.resolve(path)
    with storage.store_errors(p):
        is_dir, is_file = p.is_dir(), p.is_file()
        if is_file and p.name.endswith(".json"):
            index_path, root = p, p.parent
        elif is_file:
            root = p.parent
            entries, _ = read_header(p, p.name)
            return root, entries
        elif is_dir:
            root = p
            index_path = p / INDEX
            if not index_path.exists():
                if (p / SINGLE).exists():
                    return root, read_header(p / SINGLE, SINGLE)[0]
                names = sorted(f.name for f in p.iterdir())
                files = [n for n in names if n.endswith(".safetensors")]
                torch = [n for n in names if n.endswith((".bin", ".pt", ".pth"))]
                if not files and torch:
                    raise torch_error(os.fspath(p / torch[0]), f"the weights in {where!r}")
                if not files:
                    raise _files_error(where, "holds no .safetensors file")
                if len(files) > 1:
                    raise CheckpointError(
                        f"{where!r} holds {len(files)} .safetensors files ({files[0]!r}, ...) but "
                        f"no {INDEX}: an unfinished save or a partial download. Save or "
                        "download the checkpoint again, or pass one file's path."
                    )
                return root, read_header(p / files[0], files[0])[0]
        else:
            aside = aside_of(p)
            if aside.exists():
                raise _files_error(
                    where,
                    f"does not exist: a save there was stopped while swapping it in, and the "
                    f"checkpoint that was there is whole in {os.fspath(aside)!r} (the next save "
                    "puts it back; or rename it)",
                )
            raise _files_error(where, "does not exist")
        text = index_path.read_text()
    try:
        index = json.loads(text)
    except ValueError as e:
        raise CheckpointError(
            f"index {os.fspath(index_path)!r} is not valid JSON ({e}): a partial download or a "
            "damaged file. Download it again (or save the checkpoint again)."
        ) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise CheckpointError(
            f"index {os.fspath(index_path)!r} has no 'weight_map' of tensor name -> file name. "
            "Download it again, or pass a folder without an index."
        )
    torch = sorted({f for f in weight_map.values() if not f.endswith(".safetensors")})
    if torch:
        raise torch_error(os.fspath(index_path), f"an index naming {torch[0]!r}")
    by_file: dict[str, list[str]] = {}
    for name, f in weight_map.items():
        by_file.setdefault(f, []).append(name)
    entries = {}
    for f, names in sorted(by_file.items()):
        with storage.store_errors(root):
            there = (root / f).exists()
        if not there:
            raise CheckpointError(
                f"index {os.fspath(index_path)!r} puts tensor {names[0]!r}"
                f"{f' and {len(names) - 1} more' if len(names) > 1 else ''} in {f!r}, which is not "
                f"in {os.fspath(root)!r}. Download that file too (all the index names), or fix the "
                "index."
            )
        header = read_header(root / f, f)[0]
        for name in names:
            if name not in header:
                raise CheckpointError(
                    f"index {os.fspath(index_path)!r} puts tensor {name!r} in {f!r}, but that file "
                    f"does not hold it. Download {f!r} and the index again (they are from "
                    "different versions)."
                )
            entries[name] = header[name]
    return root, entries


# ------------------------------------------------------------------- planning
def _target_leaf(leaf: Any) -> tuple[Any, tuple[int, ...] | None, Any, bool]:
    """``(sharding, shape, dtype, on_host)`` of a target leaf (shape/dtype None: the checkpoint's)."""
    if isinstance(leaf, Layout):
        return leaf.sharding, None, None, False
    if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            mesh = current_mesh() or create_mesh([("replica", -1)])
            sharding = Layout.replicated(mesh, len(leaf.shape)).sharding
        return sharding, tuple(leaf.shape), np.dtype(leaf.dtype), False
    arr = np.asarray(leaf)
    return None, tuple(arr.shape), arr.dtype, True


def _chain(src: Source, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    shapes = [shape]
    for t in src.transforms:
        shapes.append(tuple(int(s) for s in t.shape(shapes[-1])))
    return shapes


class _Plan:
    """One leaf's source, its shapes through the transforms, and the shape/dtype it loads as."""

    def __init__(self, src: Source, entries: dict[str, Entry], want: tuple[Any, Any]) -> None:
        first = entries[src.names[0]]
        self.src, self.entries, self.first = src, entries, first
        for name in src.names[1:]:
            e = entries[name]
            if (e.shape, e.dtype) != (first.shape, first.dtype):
                raise CheckpointError(
                    f"tensors {first.name!r} ({fmt(first.shape, str(first.dtype))}, in "
                    f"{first.file!r}) and {name!r} ({fmt(e.shape, str(e.dtype))}, in {e.file!r}) "
                    f"are stacked into {src.path!r} but differ. Map them to separate paths."
                )
        try:
            self.shapes = _chain(src, first.shape)
        except ValueError as e:
            raise CheckpointError(
                f"tensor {first.name!r} ({fmt(first.shape, str(first.dtype))}, in {first.file!r}) "
                f"does not fit the mapping rule {src.rule} for {src.path!r}: {e} Fix the rule's "
                "transforms, or build the model from the checkpoint's config."
            ) from None
        self.shape = tuple(src.stacked) + self.shapes[-1]
        cast = src.cast
        self.dtype = first.dtype if cast is None else (cast.dtype or want[1] or first.dtype)

    def read(self, reader: Reader, box: Sequence[tuple[int, int]]) -> np.ndarray:
        """The leaf's values at ``box`` (its ``(start, stop)`` per dimension)."""
        ns = len(self.src.stacked)
        lead, inner = tuple(box[:ns]), tuple(box[ns:])
        finishes = []
        for t, shape in zip(self.src.transforms[::-1], self.shapes[-2::-1], strict=True):
            inner, fin = t.source_box(inner, shape)
            finishes.append(fin)
        out: np.ndarray | None = None
        for at in itertools.product(*(range(a, b) for a, b in lead)):
            name = self.src.names[int(np.ravel_multi_index(at, self.src.stacked)) if ns else 0]
            x = reader.read(self.entries[name], inner)
            for fin in finishes[::-1]:
                x = fin(x)
            x = x.astype(self.dtype, copy=False)
            if not ns:
                return x
            if out is None:
                out = np.empty(tuple(b - a for a, b in lead) + x.shape, self.dtype)
            out[tuple(i - a for i, (a, _) in zip(at, lead, strict=True))] = x
        assert out is not None
        return out


def _file_of(src: Source, entries: dict[str, Entry]) -> str:
    files = sorted({entries[n].file for n in src.names if n in entries})
    return ", ".join(repr(f) for f in files[:3]) or "no file"


def _plans(
    leaves: list[tuple[str, Any]], mapping: Mapping, entries: dict[str, Entry], where: str
) -> list[_Plan | None]:
    problems: list[str] = []
    plans: list[_Plan | None] = []
    used: set[str] = set()
    for path, leaf in leaves:
        if is_key(leaf):  # an RNG stream's key: not a weight
            plans.append(None)
            continue
        src = mapping.source(path, entries)
        if src is None:
            problems.append(
                f"no mapping rule names a checkpoint tensor for {path!r}: add a rule for it "
                "(checkpoint name template -> this path)"
            )
            plans.append(None)
            continue
        missing = [n for n in src.names if n not in entries]
        if missing or not src.names:
            name = missing[0] if missing else src.rule
            problems.append(
                f"tensor {name!r} (for {path!r}, by rule {src.rule}) is not in the checkpoint: "
                "check the rule's name, or that this checkpoint is of the model's architecture"
            )
            plans.append(None)
            continue
        used.update(src.names)
        _, shape, dtype, _ = _target_leaf(leaf)
        plan = _Plan(src, entries, (shape, dtype))
        file = _file_of(src, entries)
        first = plan.first
        if shape is not None and plan.shape != shape:
            problems.append(
                f"tensor {first.name!r} in {file} is {fmt(first.shape, str(first.dtype))}, after "
                f"the rule's transforms ({src.describe()}) {fmt(plan.shape, str(plan.dtype))}, but "
                f"{path!r} is {fmt(shape, str(dtype))}: build the model with the checkpoint's "
                "config (its config.json), or fix the rule's transforms"
            )
        elif dtype is not None and plan.dtype != dtype:
            how = "astype()" if is_lossless_cast(plan.dtype, dtype) else f"astype({dtype.name!r})"
            problems.append(
                f"tensor {first.name!r} in {file} is {first.dtype}, but {path!r} is {dtype}: add "
                f"{how} to the rule (casts to the model's dtype), or build the model in "
                f"{plan.dtype}"
            )
        elif (
            dtype is not None
            and src.cast is not None
            and src.cast.dtype is None
            and not is_lossless_cast(first.dtype, dtype)
        ):
            problems.append(
                f"tensor {first.name!r} in {file} is stored as {first.dtype}, but {path!r} is "
                f"{dtype}: {first.dtype} -> {dtype} is not a lossless float widening (only those, "
                "e.g. bfloat16 -> float32, load without being asked), so it is not cast "
                "silently; if the checkpoint is right, ask for the cast with an explicit dtype "
                f"in the rule: astype({dtype.name!r}) (examples/decoder.py: "
                f"hf_mapping(cfg, load_dtype={dtype.name!r}))"
            )
        plans.append(plan)
    extra = sorted(n for n in entries if n not in used and not mapping.ignored(n))
    problems.extend(
        f"tensor {n!r} in {entries[n].file!r} is read by no leaf of the target: map it to a path, "
        f"or leave it out with Mapping(..., ignore=[{n.replace('.', chr(92) + '.')!r}])"
        for n in extra
    )
    if problems:
        shown = "; ".join(problems[:5])
        more = f"; and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"load_safetensors({where!r}): the checkpoint does not match the target "
            f"({len(problems)} problem(s)): {shown}{more}."
        )
    return plans


# ---------------------------------------------------------------------- load
def _box(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


def _place(plan: _Plan, reader: Reader, sharding: Any) -> jax.Array:
    shape = plan.shape
    by_box: dict[tuple[tuple[int, int], ...], list[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        by_box.setdefault(_box(index, shape), []).append(device)
    arrays = []
    for box, devices in by_box.items():
        piece = plan.read(reader, box)
        arrays.extend(jax.device_put(piece, d) for d in devices)
        del piece
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def load_safetensors(
    path: str | os.PathLike[str],
    target: Any,
    *,
    mapping: Any = None,
    stats: dict[str, Any] | None = None,
) -> Any:
    """Load a Hugging Face safetensors checkpoint into ``target``'s layouts.

    Args:
        path: a ``.safetensors`` file, or a folder (a local path or ``gs://...``) with
            ``model.safetensors.index.json`` and the files it names, or ``model.safetensors``.
        target: where every tensor goes: an NNX model (built under a preset's ``scope()``
            or by its ``create``; filled in place and returned), or a pytree whose leaves
            are ``jax.Array`` s (their shardings), ``jax.ShapeDtypeStruct`` s (their
            shardings; none: replicated), :class:`~dtensor.Layout` s (shape and dtype from
            the checkpoint) or NumPy arrays (read whole, on the host).
        mapping: checkpoint names <-> the target's paths with per-tensor transforms (a
            :class:`~dtensor.checkpoint.Mapping`, a dict or a list of rules); ``None``: the
            names are the paths with ``/`` as ``.``.
        stats: a dict to receive the reader's counters: ``bytes_read``, ``reads``,
            ``tensors`` (slices read), ``files``, ``seconds``.

    Each process reads only the bytes of the slices its devices hold; every name,
    shape and dtype is checked before any tensor is read.

    Raises:
        CheckpointError: a file or tensor is missing, extra, truncated, or of another
            shape or dtype than the target (each named, with its file and the fix).

    Examples:
        >>> import tempfile, numpy as np, dtensor
        >>> d = tempfile.mkdtemp()
        >>> _ = dtensor.checkpoint.save_safetensors(d, {"w": np.arange(8.0, dtype=np.float32)})
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> out = dtensor.checkpoint.load_safetensors(d, {"w": dtensor.Layout(["x"], mesh)})
        >>> out["w"].sharding.num_devices, out["w"].tolist()[:3]
        (8, [0.0, 1.0, 2.0])
    """
    t0 = time.perf_counter()
    m = as_mapping(mapping)
    root, entries = open_checkpoint(path)
    canon_t = canon(target)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        canon_t, is_leaf=lambda v: isinstance(v, Layout | jax.ShapeDtypeStruct)
    )
    leaves = [(path_str(p), leaf) for p, leaf in flat]
    plans = _plans(leaves, m, entries, os.fspath(path))
    out = []
    with Reader(root) as reader, storage.store_errors(root):
        for (_, leaf), plan in zip(leaves, plans, strict=True):
            if plan is None:
                out.append(leaf)
                continue
            sharding, _, _, host = _target_leaf(leaf)
            if host:
                out.append(plan.read(reader, tuple((0, n) for n in plan.shape)))
            else:
                out.append(_place(plan, reader, sharding))
    if stats is not None:
        stats.update(reader.stats.as_dict(), seconds=time.perf_counter() - t0)
    return rebuild(target, jax.tree_util.tree_unflatten(treedef, out))
