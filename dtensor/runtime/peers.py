"""Peer loss: every process of a job notices a lost peer, names it in one line, and exits.

The processes of a job watch each other through the coordination service's
key-value store (process 0 runs it):

- ``dtensor/alive/<i>``: a counter process ``i`` bumps every ``period``
  seconds (``done`` once it finished normally);
- ``dtensor/exit/<i>``: a JSON record ``{"status": N, "what": ...}`` a process
  writes just before it ends with a non-zero status (``sys.exit(N)``, an
  uncaught exception, or 75 after losing a peer, then with the ``root`` it lost).

Under :mod:`dtensor.launch` the launcher also writes each ended process's
status into ``DTENSOR_LAUNCH_STATUS_DIR`` (so "killed by SIGKILL" can be told
from "stopped responding"), and a ``launcher`` file when it stops the job.

A process that loses a peer prints one line naming it and what happened, and
exits with :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST` within
:attr:`PeerMonitor.bound_s` (the heartbeat timeout + 10 s) of the loss: the
exit is armed as a kernel timer (:func:`dtensor.runtime.watchdog.exit_after`)
before anything that could block, and JAX's own heartbeat verdict is set
later than the monitor's (:func:`~dtensor.runtime.watchdog.jax_heartbeat_timeout`). Process 0
lingers a moment first (its exit takes the store with it), so the others read
the record and name the real cause rather than "lost the coordinator". When
the coordinator itself dies, JAX's C++ client aborts the survivors
(``LOG(FATAL)``, SIGABRT) as soon as it notices; a SIGABRT handler turns that
into the same one line and status 75.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from dtensor.runtime import watchdog
from dtensor.runtime.cluster import ENV_STATUS_DIR
from dtensor.runtime.exit_codes import (
    EXIT_PEER_LOST,
    EXIT_PREEMPTED,
    EXIT_TIMEOUT,
    describe,
)

__all__ = ["Loss", "PeerMonitor", "die", "lost_message"]

_ALIVE = "dtensor/alive/"
_EXIT = "dtensor/exit/"
_DONE = "done"
LAUNCHER_FILE = "launcher"
"""The file in the launcher's status directory that says why it stopped the job."""

_dying = threading.Lock()
_FLUSH_S = 3.0
"""How long a process that decided to end may spend flushing its output before the forced exit."""


@dataclasses.dataclass(frozen=True, slots=True)
class Loss:
    """A lost process (``None``: the launcher stopped the job) and what happened to it."""

    process: int | None
    what: str
    status: int | None = None
    coordinator: bool = False


def _claim(code: int, within_s: float) -> None:
    """Become the one thread that ends this process, within ``within_s`` seconds with ``code``.

    The end is armed first, as a kernel timer (:func:`watchdog.exit_after`),
    so it comes even if this thread then blocks (an RPC to a store that is
    going away, a stream lock). Any other thread that tries to end the process
    too waits here for that end.
    """
    if not _dying.acquire(blocking=False):
        while True:
            time.sleep(60)
    watchdog.exit_after(within_s, code)


def die(
    message: str,
    code: int = EXIT_PEER_LOST,
    *,
    claimed: bool = False,
    then: Callable[[], object] | None = None,
) -> None:
    """Print ``message`` as one line on stderr and end this process now (no atexit, no barrier).

    ``then`` runs after the line is out and just before the exit (within the
    same forced-exit bound): e.g. telling the coordinator this process is done
    with the store, so that its exit, which aborts the others, comes only after
    this process's line and status are settled.
    """
    if not claimed:
        _claim(code, _FLUSH_S)
    try:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        watchdog.write_line(message)
        if then is not None:
            with contextlib.suppress(Exception):
                then()
    finally:
        os._exit(code)


def lost_message(
    me: int, n: int, loss: Loss, address: str | None, names: dict[int, str] | None = None
) -> str:
    """The one line a process prints when it stops because it lost ``loss.process``."""
    if loss.process is None:
        return f"dtensor.runtime: process {me} of {n} stopped by dtensor.launch: {loss.what}."
    who = f"process {loss.process}"
    role = (names or {}).get(loss.process)
    if loss.process == 0:
        who += f" ({role + ', ' if role else ''}the coordinator at {address})"
    elif role:
        who += f" ({role})"
    return (
        f"dtensor.runtime: process {me} of {n} lost {who}: it {loss.what}. Stopping process "
        f"{me} with exit status {EXIT_PEER_LOST} (a peer was lost) so the job fails instead of "
        f"hanging; look for the first error in process {loss.process}'s own output."
    )


def _parse_id(key: str) -> int | None:
    try:
        return int(key.rstrip("/").rsplit("/", 1)[-1])
    except ValueError:
        return None


def coordinator_reachable(address: str | None, timeout: float = 1.0) -> bool:
    """Whether a TCP connection to the coordination service's ``host:port`` opens."""
    if not address or ":" not in address:
        return True  # unknown: do not claim it is gone
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


class PeerMonitor:
    """Watches the other processes of the job from a daemon thread (see the module docstring).

    Args:
        client: JAX's coordination-service client (key-value store).
        me: this process's id; n: the number of processes.
        address: the coordinator's ``host:port`` (for messages and reachability).
        timeout: seconds without a heartbeat after which a process counts as lost.
        status_dir: the launcher's status directory, if launched by :mod:`dtensor.launch`.
    """

    def __init__(
        self,
        client: Any,
        me: int,
        n: int,
        address: str | None,
        timeout: float,
        *,
        status_dir: str | None = None,
    ) -> None:
        self.client, self.me, self.n, self.address = client, me, n, address
        self.timeout = float(timeout)
        self.period = max(0.2, min(1.0, self.timeout / 5))
        self.status_dir = Path(status_dir) if status_dir else None
        self.stop = threading.Event()
        self.finished = False
        self.exits: dict[int, dict[str, Any]] = {}
        self.done: set[int] = set()
        self._seen: dict[int, tuple[str | None, float]] = {}
        self._first_seen_exit: dict[int, float] = {}
        self._first_seen_status: dict[int, float] = {}
        self.tolerate: frozenset[int] = frozenset()  # processes whose loss is not fatal
        self.names: dict[int, str] = {}  # how messages name processes ("ps 0")
        self.thread = threading.Thread(target=self._run, name="dtensor-peers", daemon=True)

    @classmethod
    def from_env(
        cls, client: Any, me: int, n: int, address: str | None, timeout: float
    ) -> PeerMonitor:
        return cls(client, me, n, address, timeout, status_dir=os.environ.get(ENV_STATUS_DIR))

    def start(self) -> None:
        now = time.monotonic()
        self._seen = {i: (None, now) for i in range(self.n)}
        if self.status_dir is not None:  # tell the launcher this process stops by itself
            with contextlib.suppress(OSError):
                (self.status_dir / f"{self.me}.watching").write_text(str(os.getpid()))
        self.thread.start()

    # ------------------------------------------------------------ reading
    def _launcher_statuses(self) -> tuple[dict[int, int], str | None]:
        statuses: dict[int, int] = {}
        reason = None
        if self.status_dir is None:
            return statuses, reason
        with contextlib.suppress(OSError):
            for path in self.status_dir.iterdir():
                if path.name == LAUNCHER_FILE:
                    reason = path.read_text().strip() or "the job was stopped"
                elif path.suffix == ".status" and path.stem.isdigit():
                    with contextlib.suppress(ValueError, OSError):
                        statuses[int(path.stem)] = int(path.read_text().strip())
        return statuses, reason

    def _poll_store(self) -> None:
        beat = _DONE if self.finished else str(time.monotonic())
        self.client.key_value_set(f"{_ALIVE}{self.me}", beat, allow_overwrite=True)
        alive = self.client.key_value_dir_get(_ALIVE)
        exits = self.client.key_value_dir_get(_EXIT)
        now = time.monotonic()
        for key, value in alive:
            i = _parse_id(key)
            if i is None:
                continue
            if value == _DONE:
                self.done.add(i)
            if self._seen.get(i, (None, 0.0))[0] != value:
                self._seen[i] = (value, now)
        for key, value in exits:
            i = _parse_id(key)
            if i is not None and i != self.me:
                with contextlib.suppress(ValueError, TypeError):
                    record = json.loads(value)
                    if isinstance(record, dict) and isinstance(record.get("status"), int):
                        self.exits[i] = record
                        self._first_seen_exit.setdefault(i, now)

    def diagnose(self, *, store_down: str | None = None) -> Loss | None:
        """The loss to report now, if any (best cause first), from what was last read."""
        now = time.monotonic()
        statuses, reason = self._launcher_statuses()
        if reason is not None:  # the launcher stopped the job: processes ending now are its doing
            return Loss(None, reason, EXIT_TIMEOUT)
        found: list[Loss] = []
        for i, record in sorted(self.exits.items()):
            status = int(record["status"])
            if status == EXIT_PREEMPTED and now - self._first_seen_exit.get(i, now) < self.timeout:
                continue  # preempted together: give this process time to save and stop too
            root = record.get("root")
            if status == EXIT_PEER_LOST and isinstance(root, int) and root != self.me:
                found.append(Loss(root, str(record.get("root_what", "was lost")), None))
            found.append(Loss(i, str(record.get("what") or describe(status)), status))
        for i, status in sorted(statuses.items()):
            if i == self.me or i in self.exits or status == 0:
                continue
            first = self._first_seen_status.setdefault(i, now)
            if status == EXIT_PREEMPTED and now - first < self.timeout:
                continue
            found.append(Loss(i, describe(status), status, coordinator=i == 0))
        found = [f for f in found if f.process not in self.tolerate]
        causes = [f for f in found if f.status != EXIT_PEER_LOST]
        if causes or found:
            return (causes or found)[0]
        if store_down is not None and self.me != 0:
            return Loss(
                0,
                "stopped responding (the coordination service cannot be reached: "
                f"{store_down.strip().splitlines()[0] if store_down.strip() else 'no answer'})",
                coordinator=True,
            )
        stale = sorted(self.stale() - self.tolerate)
        if stale:
            return Loss(
                stale[0],
                f"stopped responding (no heartbeat for {self.timeout:g} s: killed, crashed or hung)",
                coordinator=stale[0] == 0,
            )
        return None

    def _gone_tolerated(self) -> set[int]:
        """Tolerated processes (workers) that ended or went silent: nobody waits for them."""
        if not self.tolerate:
            return set()
        now = time.monotonic()
        silent = {i for i, (_, when) in self._seen.items() if now - when > 3 * self.period + 1}
        return silent & set(self.tolerate)

    # ------------------------------------------------------------ acting
    def _run(self) -> None:
        failing_since: float | None = None
        while not self.stop.is_set():
            store_down = None
            try:
                self._poll_store()
                failing_since = None
            except Exception as e:  # the store is process 0's: it may be gone
                if self.stop.is_set():
                    return
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= 3 * self.period:  # not a one-off RPC hiccup
                    store_down = str(e) or type(e).__name__
            loss = self.diagnose(store_down=store_down)
            if loss is not None and not self.stop.is_set():
                self.lose(loss, store_ok=store_down is None and failing_since is None)
                return
            self.stop.wait(self.period)

    def lose(self, loss: Loss, *, store_ok: bool = True) -> None:
        """Report ``loss`` in one line and end this process (75, or 124 if the launcher stopped it)."""
        code = EXIT_TIMEOUT if loss.process is None else EXIT_PEER_LOST
        _claim(code, self.linger_s + _FLUSH_S)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        watchdog.write_line(lost_message(self.me, self.n, loss, self.address, self.names))
        if store_ok:
            if loss.process is None:
                self.record(code, "was stopped by dtensor.launch")
            else:
                self.record(
                    code, f"lost process {loss.process}", root=loss.process, root_what=loss.what
                )
            self.linger(lost={loss.process} | self.stale())
        os._exit(code)

    def record(self, status: int, what: str, **extra: Any) -> None:
        """Write this process's exit record (best effort: the store may be gone)."""
        value = json.dumps({"status": int(status), "what": what, **extra})
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{_EXIT}{self.me}", value, allow_overwrite=True)

    @property
    def linger_s(self) -> float:
        """The longest :meth:`linger` waits."""
        return 3 * self.period + 2

    @property
    def bound_s(self) -> float:
        """The documented bound: a killed peer is named and this process ends within it."""
        return self.timeout + 10

    def stale(self) -> set[int]:
        """The processes silent for longer than the timeout (as last read)."""
        now = time.monotonic()
        return {
            i
            for i, (value, when) in self._seen.items()
            if i != self.me and value != _DONE and i not in self.done and now - when > self.timeout
        }

    def linger(self, limit: float | None = None, *, lost: set[int | None] | None = None) -> None:
        """Process 0 only: keep the store up until every other process ended or wrote its record.

        ``lost``: processes known gone (the lost peer itself): nobody waits for them.
        """
        if self.me != 0 or self.n < 2:
            return
        deadline = time.monotonic() + (self.linger_s if limit is None else limit)
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                self._poll_store()
            statuses, _ = self._launcher_statuses()
            gone = set(self.exits) | set(statuses) | self.done | {self.me} | self._gone_tolerated()
            gone |= {i for i in lost or () if i is not None}
            if len(gone) >= self.n:
                return
            time.sleep(min(0.2, self.period))

    def leave(self, status: int, what: str) -> None:
        """End this process with ``status`` now, telling the others why (skips JAX's shutdown barrier)."""
        _claim(status, self.linger_s + _FLUSH_S)
        self.stop.set()
        self.record(status, what)
        self.linger()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
            logging.shutdown()
        os._exit(status)

    def finish(self, wait_s: float) -> None:
        """A normal end: say so, then wait (still watching) until every process finished too.

        JAX's shutdown barrier, which runs next, then passes at once instead of
        hanging for its whole timeout on a process that failed meanwhile.
        """
        if self.stop.is_set():
            return
        self.finished = True
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{_ALIVE}{self.me}", _DONE, allow_overwrite=True)
        deadline = time.monotonic() + wait_s
        while self.thread.is_alive() and time.monotonic() < deadline:
            if len(self.done | {self.me} | self._gone_tolerated()) >= self.n:
                break
            time.sleep(min(0.2, self.period))
        self.stop.set()
        self.thread.join(timeout=5)
        if self.status_dir is not None:  # no longer stops by itself: the launcher need not wait
            with contextlib.suppress(OSError):
                (self.status_dir / f"{self.me}.watching").unlink()


# ---------------------------------------------------------------- JAX's aborts
_abort_state: dict[str, Any] = {}


def install_abort_hook(monitor: PeerMonitor) -> None:
    """On SIGABRT (JAX's C++ client aborting when the job breaks), name the lost process.

    JAX's coordination client ends the process with ``LOG(FATAL)`` as soon as
    it learns the coordinator (or, from it, another process) is gone. A C-level
    handler, installed with ``ctypes``, runs after that message: when the loss
    can be named (the coordinator refuses connections, or a peer's exit record,
    launcher status or silence is known) it prints our line and exits with
    :data:`EXIT_PEER_LOST`; otherwise it returns and the abort proceeds (134).
    """
    _abort_state["monitor"] = monitor
    if "handler" in _abort_state:
        return
    try:
        libc = ctypes.CDLL(None)
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        handler = handler_type(_on_abort)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, handler_type]
        libc.signal(signal.SIGABRT, handler)
    except (OSError, AttributeError, TypeError):  # no libc signal() here: keep JAX's abort
        return
    _abort_state["handler"] = handler  # keep the C callback alive


def uninstall_abort_hook() -> None:
    _abort_state.pop("monitor", None)


def _on_abort(signum: int) -> None:
    monitor: PeerMonitor | None = _abort_state.get("monitor")
    if monitor is None:
        return
    try:
        down = None
        if monitor.me != 0:
            # JAX aborts as the coordinator goes: its port may still accept for a moment
            # while it shuts down (seen under load), so look again for up to 2 s.
            for _ in range(10):
                if not coordinator_reachable(monitor.address, timeout=0.2):
                    down = "the connection was refused or timed out"
                    break
                time.sleep(0.2)
        loss = monitor.diagnose(store_down=down)
        if loss is None:
            return
        die(lost_message(monitor.me, monitor.n, loss, monitor.address, monitor.names))
    except Exception:  # never raise inside a signal handler; let the abort go on
        return


# ------------------------------------------------------------ uncaught errors
def looks_like_peer_failure(exc_type: Any, exc: Any) -> bool:
    """Whether an uncaught exception looks like a collective failing for a lost peer."""
    import re

    pattern = (
        r"^(UNKNOWN|UNAVAILABLE|INTERNAL|ABORTED|DEADLINE_EXCEEDED|CANCELLED|"
        r"FAILED_PRECONDITION): |gloo|nccl|connection (closed|reset|refused)"
    )
    return issubclass(exc_type, jax.errors.JaxRuntimeError) or bool(
        re.search(pattern, str(exc), re.IGNORECASE)
    )


def await_loss(monitor: PeerMonitor | None, exc_type: Any, exc: Any) -> None:
    """Before reporting an uncaught exception: if it looks like a lost peer's, name that peer.

    An XLA runtime error is often a collective failing because a peer died
    (gloo's "Connection reset by peer"). The monitor usually names the peer
    within a second or two, and then this process ends with its one line and
    status 75 (not the collective's traceback); otherwise it gets up to one
    heartbeat timeout, and the exception is reported as this process's own.
    """
    if monitor is None or not looks_like_peer_failure(exc_type, exc):
        return
    monitor.thread.join(2 * monitor.period + 1)
    if monitor.thread.is_alive():
        sys.stderr.write(
            f"dtensor.runtime: process {monitor.me} of {monitor.n} got an XLA runtime error; "
            f"checking for up to {monitor.timeout:g} s whether another process was lost.\n"
        )
        sys.stderr.flush()
        monitor.thread.join(monitor.timeout + 3 * monitor.period + 1)
    loss = monitor.diagnose()
    if loss is not None:
        monitor.lose(loss)


def report_uncaught(monitor: PeerMonitor | None, exc_type: Any) -> None:
    """After the traceback of an uncaught exception: record status 1 and leave now."""
    if monitor is None:
        return
    sys.stderr.write(
        f"dtensor.runtime: process {monitor.me} of {monitor.n} stopped by an uncaught "
        f"{exc_type.__name__} (exit status 1); the other processes will stop too.\n"
    )
    monitor.leave(1, f"raised an uncaught {exc_type.__name__} (exit status 1)")
