"""`DTensorDataset`: host data to global arrays in given layouts, prefetched.

Two kinds of input:

- *global* elements (the default): every process iterates the same data and
  each element is the whole global batch; only this process's blocks are
  copied to its devices (``jax.make_array_from_callback``).
- *process-local* elements (``process_local=True``): each process yields only
  its own share (``global_batch_size / pipelines`` rows), stitched into
  global arrays with ``jax.make_array_from_process_local_data``. The
  pipelines are the processes that hold distinct rows (:func:`input_pipelines`):
  one a process on a data-parallel mesh, fewer where processes split another
  axis (pipeline stages across processes hold the same rows).

A background thread keeps a bounded buffer of batches already on the devices.
Grain datasets and loaders (and any iterable whose iterator has
``get_state()``/``set_state()``) give a checkpointable iterator whose position
is saved with a checkpoint (:mod:`dtensor.data.resumable`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import jax
import numpy as np

from dtensor.core.arrays import copy_to_mesh
from dtensor.core.layout import Layout, LayoutError
from dtensor.core.mesh import Mesh
from dtensor.core.text import sizes_text
from dtensor.data.resumable import ResumableIterator

__all__ = ["DTensorDataset", "input_pipelines", "lists_to_arrays", "pad_batch"]


def input_pipelines(mesh: Mesh, batch_dim: str | tuple[str, ...] | None) -> tuple[int, int]:
    """How many processes read distinct rows of a batch split over ``batch_dim``, and which is this.

    Processes whose devices hold the same rows (those that split the mesh over
    an axis other than the batch's: pipeline stages, tensor or context groups
    spanning processes) form one input pipeline and read the same share.

    Returns:
        ``(count, index)``: the number of input pipelines and this process's.

    Raises:
        LayoutError: processes hold overlapping but different sets of rows, so
            no process-local share exists.

    Examples:
        >>> import dtensor
        >>> from dtensor.data.dataset import input_pipelines
        >>> input_pipelines(dtensor.create_mesh([("batch", 4), ("model", 2)]), "batch")
        (1, 0)
    """
    axes = () if batch_dim is None else (batch_dim,) if isinstance(batch_dim, str) else batch_dim
    devices, names = mesh.devices, mesh.dim_names
    dims = [names.index(a) for a in axes]
    sizes = tuple(devices.shape[d] for d in dims)
    held: dict[int, set[int]] = {}
    for where in np.ndindex(devices.shape):
        block = int(np.ravel_multi_index(tuple(where[d] for d in dims), sizes)) if dims else 0
        device: Any = devices[where]
        held.setdefault(device.process_index, set()).add(block)
    groups = sorted({frozenset(b) for b in held.values()}, key=min)
    seen: set[int] = set()
    for g in groups:
        if g & seen:
            shares = {p: sorted(b) for p, b in sorted(held.items())}
            raise LayoutError(
                f"the processes hold overlapping row blocks of a batch split over {batch_dim!r} "
                f"({mesh!r}; blocks by process: {shares}), so no process can read a share of "
                "its own. Order the mesh so that each process's devices hold whole blocks "
                "(dtensor.create_mesh does), or feed global batches (process_local=False)."
            )
        seen |= g
    mine = frozenset(held.get(jax.process_index(), ()))
    if mine not in groups:  # this process holds no device of the mesh
        return len(groups), 0
    return len(groups), groups.index(mine)


def pad_batch(batch: Any, multiple: int) -> tuple[Any, np.ndarray]:
    """Pad every leaf's leading dimension up to a multiple of ``multiple``.

    Returns the padded batch and a float32 weight per row (1 real, 0 padding),
    so that weighted means over the padded batch equal the unpadded means.

    Examples:
        >>> import numpy as np
        >>> from dtensor.data.dataset import pad_batch
        >>> b, w = pad_batch({"x": np.ones((5, 2))}, 4)
        >>> b["x"].shape, w.tolist()
        ((8, 2), [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    """
    rows = _rows(batch)
    padded = -(-rows // multiple) * multiple

    def pad(x: Any) -> np.ndarray:
        x = np.asarray(x)
        return (
            np.concatenate([x, np.zeros((padded - rows, *x.shape[1:]), x.dtype)])
            if padded > rows
            else x
        )

    weights = np.zeros((padded,), np.float32)
    weights[:rows] = 1.0
    return jax.tree.map(pad, batch), weights


def _rows(batch: Any) -> int:
    named = [
        (f"batch{jax.tree_util.keystr(path)}", int(np.shape(x)[0]))
        for path, x in jax.tree_util.tree_leaves_with_path(batch)
        if np.ndim(x) > 0
    ]
    sizes = {n for _, n in named}
    if len(sizes) != 1:
        got = sizes_text(named) if named else "none (every leaf is a scalar)"
        raise LayoutError(
            f"the leaves of a batch have different leading sizes: {got}; every array in a batch "
            "needs the same number of rows (dimension 0). Give every array the batch's rows, or "
            "close over the odd one in the step instead of putting it in the batch."
        )
    return sizes.pop()


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | bool | complex | np.number)


def _is_data_list(v: Any) -> bool:
    """A (nested) Python list of numbers: one field's rows, not a list of fields."""
    return isinstance(v, list) and bool(v) and all(_is_number(e) or _is_data_list(e) for e in v)


def lists_to_arrays(batch: Any) -> Any:
    """Fields given as (nested) Python lists of numbers, as numpy arrays.

    A ragged list (rows of different lengths) raises one error naming the
    field and its distinct row lengths.

    Examples:
        >>> import numpy as np
        >>> from dtensor.data.dataset import lists_to_arrays
        >>> lists_to_arrays({"ids": [[1, 2], [3, 4]], "x": np.ones(2)})["ids"].shape
        (2, 2)
    """

    def convert(path: Any, v: Any) -> Any:
        if not _is_data_list(v):
            return v
        try:
            return np.asarray(v)
        except ValueError:  # numpy: "inhomogeneous shape"
            lengths = [(f"row {i}", len(r) if isinstance(r, list) else 1) for i, r in enumerate(v)]
            raise LayoutError(
                f"batch{jax.tree_util.keystr(path)} is a ragged list: its {len(v)} rows have "
                f"different lengths, {sizes_text(lengths, unit='items')}. Every row of a batch "
                "needs the same length; pad the rows to one length (and mask the padding), or "
                "bucket examples by length."
            ) from None

    return jax.tree_util.tree_map_with_path(convert, batch, is_leaf=_is_data_list)


class DTensorDataset:
    """An iterable of global arrays in given layouts, built from host data.

    Args:
        dataset: an iterable of batches (pytrees of host arrays: numpy, lists,
            ``tf.data``/Grain-style iterators' elements), or a pytree of numpy
            arrays that is cut into consecutive batches of ``global_batch_size``
            rows (the remainder dropped unless ``pad``).
        mesh: the mesh.
        layouts: a :class:`Layout` for every leaf, a pytree of layouts, or
            ``None``: dimension 0 split over ``batch_dim``, the rest replicated.
        global_batch_size: the rows of a global batch (checked against each
            element; required when ``dataset`` is an array pytree).
        batch_dim: the mesh axis (or axes) the batch is split over.
        process_local: elements hold only this process's share of the rows.
        prefetch: how many batches to keep ready on the devices (0: none).
        pad: pad a batch whose rows do not divide over the shards and yield
            ``(batch, weights)`` pairs (see :func:`pad_batch`).

    Examples:
        >>> import dtensor, numpy as np
        >>> mesh = dtensor.create_mesh([("batch", 8)])
        >>> data = {"x": np.arange(64.0).reshape(32, 2), "y": np.arange(32)}
        >>> ds = dtensor.DTensorDataset(data, mesh, global_batch_size=16, batch_dim="batch")
        >>> batches = list(ds)
        >>> len(batches), batches[0]["x"].shape, dtensor.fetch_layout(batches[0]["y"])
        (2, (16, 2), Layout(['batch'], mesh=Mesh(batch=8)))
    """

    def __init__(
        self,
        dataset: Iterable[Any] | Any,
        mesh: Mesh,
        layouts: Layout | Any = None,
        global_batch_size: int | None = None,
        *,
        batch_dim: str | tuple[str, ...] | None = None,
        process_local: bool = False,
        prefetch: int = 2,
        pad: bool = False,
    ) -> None:
        if batch_dim is None and layouts is None:
            batch_dim = mesh.dim_names[0]
        if batch_dim is not None:
            for a in (batch_dim,) if isinstance(batch_dim, str) else batch_dim:
                mesh.check_axis(a, "batch_dim")
        self.mesh = mesh
        self.layouts = layouts
        self.global_batch_size = global_batch_size
        self.batch_dim = batch_dim
        self.process_local = process_local
        self.prefetch = prefetch
        self.pad = pad
        self._source = dataset
        if _is_array_tree(dataset):
            if global_batch_size is None:
                raise LayoutError(
                    "DTensorDataset over arrays needs global_batch_size= to cut them into batches."
                )
            self._source = _ArrayBatches(dataset, global_batch_size, drop_remainder=not pad)
        self.num_shards = mesh.axis_size(batch_dim) if batch_dim is not None else 1
        self.pipelines = (
            input_pipelines(mesh, batch_dim)
            if process_local and batch_dim is not None
            else (jax.process_count(), jax.process_index())
            if process_local
            else (1, 0)
        )

    # ------------------------------------------------------------------ placing
    def _layout_tree(self, batch: Any) -> Any:
        if isinstance(self.layouts, Layout):
            return jax.tree.map(lambda _: self.layouts, batch)
        if self.layouts is not None:
            return self.layouts
        batch_dim = self.batch_dim if self.batch_dim is not None else self.mesh.dim_names[0]
        return jax.tree.map(
            lambda x: (
                Layout.batch_sharded(self.mesh, batch_dim, np.ndim(x))
                if np.ndim(x) > 0
                else Layout.replicated(self.mesh, 0)
            ),
            batch,
        )

    def place(self, batch: Any) -> Any:
        """Turn one host batch into global arrays (``(batch, weights)`` when padding)."""
        batch = lists_to_arrays(batch)
        rows = _rows(batch)
        procs = self.pipelines[0]
        global_rows = rows * procs
        # With pad, a short (last) batch is padded up to the full global batch: one shape, one compile.
        short = (
            self.pad and self.global_batch_size is not None and global_rows < self.global_batch_size
        )
        if (
            self.global_batch_size is not None
            and global_rows != self.global_batch_size
            and not short
        ):
            what = (
                f"{rows} rows per process x {procs} input pipeline{'s' * (procs != 1)}"
                if self.process_local
                else f"{rows} rows"
            )
            raise LayoutError(
                f"a batch has {what} but global_batch_size is {self.global_batch_size}. Make every "
                "element hold the global batch (or, with process_local=True, its share)."
            )
        target = (
            self.global_batch_size if short and self.global_batch_size is not None else global_rows
        )
        if target % self.num_shards:
            if not self.pad:
                raise LayoutError(
                    f"the global batch of {global_rows} rows does not divide over the "
                    f"{self.num_shards} shards of mesh axes {self.batch_dim!r} ({self.mesh!r}). "
                    f"Use a global batch that is a multiple of {self.num_shards}, or pass pad=True "
                    "to pad it and get per-row weights."
                )
            target = -(-target // self.num_shards) * self.num_shards
        weights = None
        if self.pad:  # every element a (batch, weights) pair, padded or not
            batch, weights = pad_batch(batch, target // procs)
        layouts = self._layout_tree(batch)
        leaves, treedef = jax.tree_util.tree_flatten_with_path(batch)
        lay = jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout))
        if len(lay) != len(leaves):
            raise LayoutError(
                f"the layouts tree has {len(lay)} leaves but a batch has {len(leaves)}; give one "
                "layout per array."
            )
        out = [
            self._place_leaf(x, layout, jax.tree_util.keystr(path))
            for (path, x), layout in zip(leaves, lay, strict=True)
        ]
        placed = treedef.unflatten(out)
        if weights is not None:
            wl = (
                Layout.batch_sharded(self.mesh, self.batch_dim, 1)
                if self.batch_dim
                else Layout.replicated(self.mesh, 1)
            )
            return placed, self._place_leaf(weights, wl, "weights")
        return placed

    def _place_leaf(self, x: Any, layout: Layout, name: str) -> jax.Array:
        if isinstance(x, jax.Array) and not self.process_local:
            return copy_to_mesh(x, layout, name=f"batch{name}")
        x = np.asarray(x)
        if not self.process_local:
            return copy_to_mesh(x, layout, name=f"batch{name}")
        global_shape = (x.shape[0] * self.pipelines[0], *x.shape[1:]) if x.ndim else x.shape
        layout.check_shape(global_shape, f"batch{name}")
        return jax.make_array_from_process_local_data(layout.sharding, x, global_shape)

    # ---------------------------------------------------------------- iterating
    def __iter__(self) -> ResumableIterator:
        """A new pass: global batches, prefetched; checkpointable when the source iterator is.

        With a Grain dataset or loader (or any source whose iterator has
        ``get_state()``/``set_state()``), the iterator returned has them too:
        pass it as ``data=`` to :func:`dtensor.checkpoint.save` or to
        ``PreemptionCheckpointHandler`` (see :mod:`dtensor.data.resumable`).
        """
        return ResumableIterator(
            iter(self._source),
            self.place,
            prefetch=self.prefetch,
            process_local=self.process_local,
            rows=_rows_or_none,
            pipelines=self.pipelines[0],
        )

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]


def _rows_or_none(batch: Any) -> int | None:
    try:
        return _rows(lists_to_arrays(batch))
    except (LayoutError, TypeError, ValueError):
        return None


def _is_array_tree(x: Any) -> bool:
    leaves = jax.tree.leaves(x)
    return (
        bool(leaves) and all(isinstance(v, np.ndarray) for v in leaves) and not isinstance(x, list)
    )


class _ArrayBatches:
    def __init__(self, arrays: Any, batch_size: int, *, drop_remainder: bool) -> None:
        self.arrays = arrays
        self.batch_size = batch_size
        rows = _rows(arrays)
        self.n = rows // batch_size if drop_remainder else -(-rows // batch_size)

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[Any]:
        for i in range(self.n):
            sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
            yield jax.tree.map(lambda a, sl=sl: a[sl], self.arrays)
