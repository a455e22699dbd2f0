"""What a run's xdist workers share: a directory, and results made once for all of them.

A module-scoped fixture runs once per worker that runs one of the module's tests, and
pytest-xdist spreads a module's tests over both workers unless an ``xdist_group`` mark keeps
them together. For a fixture that takes tens of seconds (the Sphinx site, a plan search's
compiles), :func:`once` makes it on the first worker that asks and hands the others the
kept result, whichever way the tests were spread.
"""

from __future__ import annotations

import fcntl
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's directory every worker sees: the parent of a worker's base temp."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """``make(directory)``'s result, made once a run under a lock and read back by the rest.

    ``directory`` (``<shared>/name``) is the maker's to fill. A ``make`` that raises keeps
    nothing: the next worker that asks tries again (and fails the same way).
    """
    root = shared_dir(tmp_path_factory)
    kept = root / f"{name}.pickle"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if kept.exists():
            return pickle.loads(kept.read_bytes())
        work = root / name
        work.mkdir(exist_ok=True)
        result = make(work)
        kept.write_bytes(pickle.dumps(result))
        return result
