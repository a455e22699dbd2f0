"""The processes one :func:`dtensor.runtime.launch.launch` started: roles, output, statuses, stop.

A :class:`Job` holds the launched processes and the status directory they share
(``DTENSOR_LAUNCH_STATUS_DIR``): each ended process's status is written there for the
others (:mod:`dtensor.runtime.peers` reads it), and :meth:`Job.stop` lets the processes that
joined the job report a lost peer before it sends SIGTERM, then SIGKILL. :func:`pump`
streams one process's output with its ``[rank i]`` prefix; :func:`task_roles` numbers a
parameter-server job's tasks (chief, then ``ps``, then workers).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import IO

from dtensor.runtime.exit_codes import EXIT_PEER_LOST

__all__ = ["Job", "exit_status", "note", "pump", "role_env", "task_roles", "write_atomic"]


def exit_status(code: int) -> int:
    """A ``Popen.returncode`` as a shell reports it: ``128 + signal`` for a signal.

    Examples:
        >>> from dtensor.runtime.local_job import exit_status
        >>> exit_status(-9), exit_status(3)
        (137, 3)
    """
    return 128 - code if code < 0 else code


def pump(
    rank: int, stream: IO[bytes], sink: list[str], out: IO[str] | None, lock: threading.Lock
) -> None:
    """Read ``stream`` to its end into ``sink``, each line also to ``out`` as ``[rank i] line``."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if out is not None:
            text = line if line.endswith("\n") else line + "\n"
            with lock:
                out.write(f"[rank {rank}] {text}")
                out.flush()
    stream.close()


def note(out: IO[str], lock: threading.Lock, message: str) -> None:
    """One ``[dtensor.launch] message`` line of the launcher's own."""
    with lock:
        out.write(f"[dtensor.launch] {message}\n")
        out.flush()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (readers never see half a file)."""
    with contextlib.suppress(OSError):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


class Job:
    """The launched processes, the order they ended in, and the status directory."""

    def __init__(self, status_dir: Path) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.status_dir = status_dir
        self.ended: list[tuple[int, int]] = []  # (rank, status) in the order seen
        self.tolerate: frozenset[int] = frozenset()  # ranks whose failure is not the job's

    def poll(self) -> bool:
        """Note processes that ended (writing their status for the others); whether any run."""
        running = False
        for rank, p in enumerate(self.procs):
            code = p.poll()
            if code is None:
                running = True
            elif rank not in {r for r, _ in self.ended}:
                self.ended.append((rank, code))
                if code != 0:
                    write_atomic(self.status_dir / f"{rank}.status", str(code))
        return running

    def first_failure(self) -> tuple[int, int] | None:
        """The first failure (rank, status), a cause preferred over a 75 (a lost peer's echo)."""
        failures = [(r, exit_status(c)) for r, c in self.ended if c != 0 and r not in self.tolerate]
        causes = [f for f in failures if f[1] != EXIT_PEER_LOST]
        return (causes or failures or [None])[0]

    def stop(self, grace_s: float, report_s: float = 0.0) -> None:
        """Let joined processes report and stop (``report_s``), then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + report_s
        while self.poll() and time.monotonic() < deadline:
            watching = [
                p
                for rank, p in enumerate(self.procs)
                if p.poll() is None and (self.status_dir / f"{rank}.watching").exists()
            ]
            if not watching:
                break
            time.sleep(0.05)
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.poll() and time.monotonic() < deadline:
            time.sleep(0.05)
        for p in alive:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.wait()
        self.poll()


def task_roles(num_processes: int, num_ps: int | None) -> list[tuple[str, int]]:
    """Each rank's (task type, index): chief, then ps, then workers (``worker i`` without ps).

    Examples:
        >>> from dtensor.runtime.local_job import task_roles
        >>> task_roles(4, 1)
        [('chief', 0), ('ps', 0), ('worker', 0), ('worker', 1)]
    """
    if num_ps is None:
        return [("worker", r) for r in range(num_processes)]
    if num_ps < 1 or num_processes - 1 - num_ps < 1:
        raise ValueError(
            f"a parameter-server job needs at least one ps and one worker besides the chief; "
            f"got num_ps={num_ps} of {num_processes} processes. Use e.g. --ps 1 --workers 2."
        )
    return (
        [("chief", 0)]
        + [("ps", i) for i in range(num_ps)]
        + [("worker", i) for i in range(num_processes - 1 - num_ps)]
    )


def role_env(role: tuple[str, int], num_ps: int, num_workers: int) -> dict[str, str]:
    """The variables :func:`dtensor.runtime.join_cluster` reads a task's role from."""
    return {
        "DTENSOR_TASK_TYPE": role[0],
        "DTENSOR_TASK_INDEX": str(role[1]),
        "DTENSOR_NUM_PS": str(num_ps),
        "DTENSOR_NUM_WORKERS": str(num_workers),
    }
