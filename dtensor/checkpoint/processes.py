"""Which processes write a checkpoint: all of the job's (the default), or this one alone.

A parameter-server job's ``ps`` task holds its variables by itself, in a JAX
job whose other processes do not take part in its saves. Inside
:func:`this_process_only` a save or restore runs as if this process were the
whole job: orbax synchronises only this process (its ``active_processes``),
and the checksum records name it process 0 of 1.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import jax

__all__ = ["orbax_options", "process_count", "process_index", "solo", "this_process_only"]

_solo = {"on": False}
_lock = threading.Lock()


@contextlib.contextmanager
def this_process_only() -> Iterator[None]:
    """Checkpoint as if this process were the whole job (one at a time per process).

    Examples:
        >>> from dtensor.checkpoint.processes import this_process_only, process_count
        >>> with this_process_only():
        ...     process_count()
        1
    """
    with _lock:
        _solo["on"] = True
        try:
            yield
        finally:
            _solo["on"] = False


def solo() -> bool:
    return _solo["on"]


def process_index() -> int:
    return 0 if _solo["on"] else jax.process_index()


def process_count() -> int:
    return 1 if _solo["on"] else jax.process_count()


def orbax_options(ocp: Any) -> dict[str, Any]:
    """Orbax's keyword options for a save by this process alone (``{}`` otherwise)."""
    if not solo():
        return {}
    me = jax.process_index()
    options = ocp.options.MultiprocessingOptions(
        primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"dtensor-solo-{me}"
    )
    return {"multiprocessing_options": options}
