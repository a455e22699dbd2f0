"""Keep orbax's and TensorStore's noise about a failed read off the user's terminal.

Failures are re-raised as one :class:`dtensor.checkpoint.CheckpointError`.
Around them orbax logs the same failure at ERROR level through absl, and
leaves the reads it abandoned as coroutines that Python reports ("Exception
ignored in: <coroutine ...>", with a library traceback) whenever they are
garbage collected, or that TensorStore completes later into orbax's closed
event loop ("Event loop is closed"). :func:`quiet_orbax` lowers absl's logging
for its duration and installs, once, a narrow filter on ``sys.unraisablehook``
for those two reports (every other report passes on to the previous hook);
:func:`collect_abandoned_reads`, called once orbax's exception is released,
collects the coroutines at once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
import traceback
from collections.abc import Iterator
from typing import Any

__all__ = ["collect_abandoned_reads", "quiet_orbax"]

_lock = threading.Lock()
_state = {"depth": 0, "level": logging.NOTSET}
_LIBRARIES = ("orbax", "tensorstore")


def _from_library(unraisable: Any) -> bool:
    """An abandoned orbax read, or TensorStore completing one into orbax's closed event loop."""
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        return unraisable.object is None  # reported from TensorStore's own thread
    tb = unraisable.exc_traceback
    text = repr(unraisable.object) + ("".join(traceback.format_tb(tb)) if tb else "")
    return any(name in text for name in _LIBRARIES)


def _filter_late_reports() -> None:
    """From now on, drop those reports when they arrive late (chained to the previous hook, once)."""
    previous = sys.unraisablehook
    if getattr(previous, "_dtensor_checkpoint_filter", False):
        return

    def hook(unraisable: Any) -> None:
        if not _from_library(unraisable):
            previous(unraisable)

    hook._dtensor_checkpoint_filter = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def collect_abandoned_reads() -> None:
    """Collect garbage now, dropping the reports of orbax/TensorStore reads abandoned by a failure.

    Call it once orbax's exception is no longer referenced (outside its
    ``except`` block): its traceback keeps the abandoned reads alive. Reads
    that TensorStore completes later, into orbax's closed event loop ("Event
    loop is closed"), are dropped by the filter :func:`quiet_orbax` installs
    on ``sys.unraisablehook`` (it passes every other report on).
    """
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if not _from_library(unraisable):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        gc.collect()
    finally:
        sys.unraisablehook = previous


@contextlib.contextmanager
def quiet_orbax() -> Iterator[None]:
    """absl's logger at CRITICAL for the duration (re-entrant, thread-safe).

    Also installs (once) the filter for late reports of abandoned reads: they
    can arrive from TensorStore's threads before orbax's exception reaches us.
    """
    _filter_late_reports()
    log = logging.getLogger("absl")
    with _lock:
        if _state["depth"] == 0:
            _state["level"] = log.level
            log.setLevel(logging.CRITICAL)
        _state["depth"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["depth"] -= 1
            if _state["depth"] == 0:
                log.setLevel(_state["level"])
