"""Keep orbax's and tensorstore's logging of a failed read off the user's terminal.

Failures are re-raised as one :class:`dtensor.checkpoint.CheckpointError`;
orbax logs the same failure at ERROR level through absl first, which would
print a library-internal traceback above ours.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

__all__ = ["quiet_orbax"]

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """Raise the absl logger to CRITICAL for the duration (re-entrant, thread-safe)."""
    global _depth
    log = logging.getLogger("absl")
    with _lock:
        if _depth == 0:
            quiet_orbax.saved = log.level  # type: ignore[attr-defined]
            log.setLevel(logging.CRITICAL)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                log.setLevel(quiet_orbax.saved)  # type: ignore[attr-defined]
