"""A watchdog that turns a step hung in its collectives into an error and an exit code."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dtensor.runtime.exit_codes import EXIT_STEP_TIMEOUT

__all__ = ["StepWatchdog"]


class StepWatchdog:
    """Aborts the process when a step's results are not ready ``timeout`` seconds after it could start.

    A collective whose peer is lost never returns and XLA cannot cancel it;
    this turns the hang into an error message and exit code
    :data:`EXIT_TIMEOUT` (``dtensor.runtime.exit_codes.EXIT_STEP_TIMEOUT``, 76:
    its own status, not the 75 of a peer loss the runtime names; ``on_timeout``
    replaces the exit, for tests).
    """

    EXIT_TIMEOUT = EXIT_STEP_TIMEOUT

    def __init__(
        self, timeout: float, *, what: str, on_timeout: Callable[[str], None] | None = None
    ) -> None:
        self.timeout = float(timeout)
        self.what = what
        self.on_timeout = on_timeout or _abort
        self._cond = threading.Condition()
        self._pending: list[tuple[int, Any]] = []
        self._started: float | None = None
        self._step = 0
        self._fired = False
        threading.Thread(target=self._wait, name="dtensor-step-wait", daemon=True).start()
        threading.Thread(target=self._watch, name="dtensor-step-watch", daemon=True).start()

    def watch(self, leaf: Any) -> None:
        """Track one step by one of its output arrays."""
        with self._cond:
            self._step += 1
            self._pending.append((self._step, leaf))
            self._cond.notify_all()

    def _wait(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                step, leaf = self._pending[0]
                if self._started is None:
                    self._started = time.monotonic()
            try:
                leaf.block_until_ready()
            except Exception:  # noqa: BLE001, S110 - a failed step has finished too: its caller
                pass  # sees the error when it reads the step's results; this thread only times it
            with self._cond:
                self._pending.pop(0)
                self._started = time.monotonic() if self._pending else None

    def _watch(self) -> None:
        period = max(0.05, min(1.0, self.timeout / 4))
        while not self._fired:
            time.sleep(period)
            with self._cond:
                started, pending = self._started, list(self._pending)
            if started is not None and pending and time.monotonic() - started > self.timeout:
                self._fired = True
                self.on_timeout(
                    f"{self.what}: step {pending[0][0]} did not finish within timeout_seconds="
                    f"{self.timeout:g} (CommunicationOptions): its collectives are waiting for a "
                    "process that is lost, stuck or on another code path. Check the other "
                    "processes' logs; raise timeout_seconds if steps are legitimately this slow."
                )


def _abort(message: str) -> None:
    print(f"[dtensor] {message}", file=sys.stderr, flush=True)
    os._exit(StepWatchdog.EXIT_TIMEOUT)
