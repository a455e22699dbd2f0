"""The iterator of a :class:`~dtensor.DTensorDataset`: prefetched global batches, and a position that resumes.

When the source iterator is checkpointable (``get_state()`` / ``set_state()``:
Grain's dataset and ``DataLoader`` iterators, or any iterator that has them),
so is this one. Its state is the source's state *after the last batch handed
out* (the prefetch thread reads ahead; the state recorded with each batch is
taken right after that batch was read), plus the number of global batches
handed out. Pass it as ``data=`` to :func:`dtensor.checkpoint.save` or to
``PreemptionCheckpointHandler`` and a resumed run reads exactly the batches
that the interrupted one had not.

Beyond the same number of processes: :meth:`ResumableIterator.resplit_state`
turns the positions saved by P processes into this process's position among
P' processes, for index-based pipelines whose state is Grain's
``{"next_index": n}``, where each process reads its share of every global
batch (``dataset[process_index::process_count]`` or ``InputContext.shard``).
After k global batches every process has read ``n = k`` batches (batched
before ``to_iter_dataset()``) or ``n = k * G / P`` examples (batched after);
the examples read are those of the first k global batches, whatever P, so the
position on P' processes is ``k`` or ``k * G / P'``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

__all__ = ["ResumableIterator", "checkpointable"]

_END = object()


def checkpointable(it: Any) -> bool:
    """Whether ``it`` has ``get_state()`` and ``set_state()``."""
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


class _Prefetcher:
    """Reads the source and places its batches on a background thread, keeping at most ``size``."""

    def __init__(self, next_item: Callable[[], Any], size: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(next_item,), daemon=True)
        self._thread.start()

    def _work(self, next_item: Callable[[], Any]) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = next_item()
                except StopIteration:
                    self._queue.put(_END)
                    return
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # surfaced in the consumer
            self._queue.put(e)

    def get(self) -> Any:
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # later calls end too
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop reading ahead and wait until the thread has let go of the source."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # unblock a put on a full queue
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)


class ResumableIterator:
    """Global batches from a source iterator, prefetched; checkpointable when the source is.

    Args:
        source: the iterator of host batches.
        place: turns a host batch into global arrays.
        prefetch: batches to keep ready (0: read on demand).
        process_local: each process reads its own share (else every process
            reads the same global batches).
        rows: the rows of a host batch (for re-splitting positions).
        pipelines: how many input pipelines read distinct shares (processes
            by default; see :func:`dtensor.data.dataset.input_pipelines`).

    Examples:
        >>> import dtensor, grain, numpy as np
        >>> mesh = dtensor.create_mesh([("batch", 8)])
        >>> ds = grain.MapDataset.range(32).map(lambda i: {"x": np.full((2,), i, np.float32)})
        >>> it = iter(dtensor.DTensorDataset(ds.batch(8), mesh))
        >>> _ = next(it)
        >>> it.get_state()["source"], it.get_state()["batches"]
        ({'next_index': 1}, 1)
        >>> it2 = iter(dtensor.DTensorDataset(ds.batch(8), mesh))
        >>> it2.set_state(it.get_state())
        >>> next(it2)["x"][:, 0].tolist() == next(it)["x"][:, 0].tolist()
        True
    """

    def __init__(
        self,
        source: Iterator[Any],
        place: Callable[[Any], Any],
        *,
        prefetch: int,
        process_local: bool,
        rows: Callable[[Any], int | None],
        pipelines: int | None = None,
    ) -> None:
        self._source: Any = source  # get_state/set_state where it has them
        self._place = place
        self._size = prefetch
        self._process_local = process_local
        self._rows_of = rows
        self._pipelines = jax.process_count() if pipelines is None else pipelines
        self._resumable = checkpointable(source)
        self._batches = 0
        self._rows: int | None = None
        self._state = self._source.get_state() if self._resumable else None
        self._pre: _Prefetcher | None = None

    def _read(self) -> tuple[Any, Any, int | None]:
        item = next(self._source)
        state = self._source.get_state() if self._resumable else None
        return self._place(item), state, self._rows_of(item)

    def __iter__(self) -> ResumableIterator:
        return self

    def __next__(self) -> Any:
        if self._size <= 0:
            placed, state, rows = self._read()
        else:
            if self._pre is None:
                self._pre = _Prefetcher(self._read, self._size)
            placed, state, rows = self._pre.get()
        self._batches += 1
        self._state, self._rows = state, rows
        return placed

    # --------------------------------------------------------------- state
    def _need_state(self) -> None:
        if not self._resumable:
            raise TypeError(
                f"the dataset's iterator ({type(self._source).__name__}) has no get_state()/"
                "set_state(), so its position cannot be saved. Feed a Grain dataset or DataLoader "
                "(or an iterator with get_state()/set_state()), or save without data=."
            )

    def get_state(self) -> dict[str, Any]:
        """The position after the last batch handed out (JSON-able when the source's is)."""
        self._need_state()
        return {
            "format": 1,
            "batches": self._batches,
            "source": self._state,
            "rows": self._rows,
            "process_local": self._process_local,
            "process_count": jax.process_count(),
            "pipelines": self._pipelines,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`get_state`): the next batch is the one after it."""
        self._need_state()
        if self._pre is not None:
            self._pre.stop()
            self._pre = None
        self._source.set_state(state["source"])
        self._batches = int(state.get("batches", 0))
        self._state, self._rows = state["source"], state.get("rows")

    def resplit_state(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """This process's position, from the positions saved by ``len(states)`` processes.

        Raises:
            ValueError: the positions cannot be re-split (not Grain's
                index-based ``{"next_index": n}``, processes at different
                batches, or a share that does not divide).
        """
        saved = int(states[0].get("pipelines", len(states)))
        now = self._pipelines
        batches = {int(s.get("batches", -1)) for s in states}
        if len(batches) != 1:
            raise ValueError(f"the processes stopped at different batches {sorted(batches)}")
        k = batches.pop()
        if not states[0].get("process_local", True):  # every process read the same global batches
            return dict(states[0], process_count=jax.process_count(), pipelines=now)
        sources = [s.get("source") for s in states]
        if not all(isinstance(s, dict) and set(s) == {"next_index"} for s in sources):
            raise ValueError(
                f"the source's state {sources[0]!r} is not an index-based Grain position "
                "({'next_index': n}); only those can be re-split. Build the pipeline as a Grain "
                "MapDataset sharded by process (dataset[index::count]) ending in to_iter_dataset()"
            )
        index = {int(s["next_index"]) for s in sources}  # type: ignore[index]
        rows = states[0].get("rows")
        if index == {k}:  # counts batches
            n = k
        elif rows and index == {k * int(rows)}:  # counts this process's examples
            global_rows = int(rows) * saved
            if global_rows % now:
                raise ValueError(
                    f"the global batch of {global_rows} rows does not divide over {now} input "
                    "pipelines"
                )
            n = k * global_rows // now
        else:
            raise ValueError(
                f"after {k} global batches the processes' next_index are {sorted(index)}, neither "
                f"{k} (batches) nor {k} x {rows} (examples of this process's share)"
            )
        return {
            "format": 1,
            "batches": k,
            "source": {"next_index": n},
            "rows": None if rows is None else int(rows) * saved // now,
            "process_local": True,
            "process_count": jax.process_count(),
            "pipelines": now,
        }

    def close(self) -> None:
        """Stop reading ahead."""
        if self._pre is not None:
            self._pre.stop()
            self._pre = None

    def __del__(self) -> None:
        pre = getattr(self, "_pre", None)
        if pre is not None:
            pre._stop.set()
