"""The input pipeline's position, saved with a step: one small JSON per process (``data/process_<i>.json``).

Any iterator with ``get_state()`` / ``set_state(state)`` (Grain's dataset
iterators and ``DataLoader`` iterators, the iterators of
:class:`dtensor.DTensorDataset` and of the strategies' distributed datasets)
can be saved. Its state is stored as JSON (``bytes`` states, such as a Grain
``DataLoader``'s, as base64). A step restored by as many processes as saved it
gives each process its own state back. A step restored by *another* number of
processes asks the iterator to re-split the saved positions
(``resplit_state(states)``, which the distributed datasets' iterators have for
index-based pipelines); an iterator without it gets a :class:`CheckpointError`
naming the two process counts and what to do.
"""

from __future__ import annotations

import base64
from typing import Any

import jax

from dtensor.checkpoint import storage
from dtensor.checkpoint.errors import CheckpointError

__all__ = ["DATA", "apply", "capture", "check_iterator", "load"]

DATA = "data"
_BYTES = "__bytes_base64__"


def check_iterator(data: Any, where: str) -> None:
    """Raise a ``TypeError`` unless ``data`` has ``get_state()`` and ``set_state()``."""
    if not (
        callable(getattr(data, "get_state", None)) and callable(getattr(data, "set_state", None))
    ):
        raise TypeError(
            f"{where}: data= must be an input iterator with get_state() and set_state() (a Grain "
            f"dataset iterator or DataLoader iterator, or iter() of a strategy's distributed "
            f"dataset), got {type(data).__name__}. Pass iter(dataset), not the dataset, or leave "
            "data=None to save the arrays only."
        )


def _encode(state: Any) -> Any:
    if isinstance(state, bytes | bytearray):
        return {_BYTES: base64.b64encode(bytes(state)).decode("ascii")}
    if isinstance(state, dict):
        return {str(k): _encode(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [_encode(v) for v in state]
    if hasattr(state, "item") and callable(state.item):  # numpy scalars
        return state.item()
    return state


def _decode(state: Any) -> Any:
    if isinstance(state, dict):
        if set(state) == {_BYTES}:
            return base64.b64decode(state[_BYTES])
        return {k: _decode(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_decode(v) for v in state]
    return state


def capture(data: Any) -> dict[str, Any]:
    """This process's record: the iterator's state and who saved it.

    Examples:
        >>> import grain
        >>> from dtensor.checkpoint.datastate import capture
        >>> it = iter(grain.MapDataset.range(4).to_iter_dataset())
        >>> _ = next(it)
        >>> r = capture(it)
        >>> r["state"], r["process_count"]
        ({'next_index': 1}, 1)
    """
    check_iterator(data, "saving the input position")
    return {
        "format": 1,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "iterator": type(data).__qualname__,
        "state": _encode(data.get_state()),
    }


def load(step_dir: Any, step: int, where: str) -> list[dict[str, Any]]:
    """Every process's record of ``step``, in process order."""
    item = step_dir / DATA
    first = item / "process_0.json"
    if not first.is_file():
        raise CheckpointError(
            f"checkpoint step {step} in {where!r} holds no input position (it was saved without "
            "data=). Restore it without data=, and start the input pipeline from where the step "
            "number says."
        )
    head = storage.read_json(first)
    records = [head] + [
        storage.read_json(item / f"process_{i}.json")
        for i in range(1, int(head.get("process_count", 1)))
    ]
    return records


def apply(data: Any, records: list[dict[str, Any]], step: int, where: str) -> None:
    """Set ``data`` to the position saved in ``records`` (re-split when the process count changed)."""
    check_iterator(data, "restoring the input position")
    saved, now = len(records), jax.process_count()
    states = [_decode(r["state"]) for r in records]
    if saved == now:
        data.set_state(states[jax.process_index()])
        return
    resplit = getattr(data, "resplit_state", None)
    if not callable(resplit):
        raise CheckpointError(
            f"checkpoint step {step} in {where!r} holds the input positions of {saved} processes, "
            f"but {now} processes restore it, and a {type(data).__name__} position cannot be "
            f"re-split over another number of processes. Resume on {saved} processes, or feed an "
            "index-based Grain pipeline through strategy.distribute_datasets_from_function / "
            "dtensor.DTensorDataset and pass iter() of that as data=."
        )
    try:
        state = resplit(states)
    except ValueError as e:
        raise CheckpointError(
            f"checkpoint step {step} in {where!r}: the input positions of {saved} processes cannot "
            f"be re-split over {now}: {e}"
        ) from None
    data.set_state(state)
