"""Peer loss with real processes: one line naming the lost process, exit status 75, no hang.

Each fault runs twice: as separate processes joined by address (as on separate
hosts, no launcher) and through dtensor.launch. Times are upper bounds only, a
guard against hangs (JAX's own timeouts are 30 s and more), not a speed test.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading
import time

import pytest

from dtensor.runtime.exit_codes import EXIT_PEER_LOST, EXIT_TIMEOUT
from dtensor.runtime.launch import free_port, launch

from .util import REPO, WORKERS

HEARTBEAT_S = "4"
HANG_GUARD_S = 45
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.xdist_group("multiprocess-peers"),
    pytest.mark.timeout(150),
]


@dataclasses.dataclass
class Run:
    codes: list[int]
    outputs: list[str]
    fault_at: float | None  # when the failing process said it was going away
    ended_at: list[float]  # when each process ended

    def report(self) -> str:
        parts = [f"codes={self.codes} since fault={self.since_fault()}"]
        parts += [f"----- process {i} -----\n{o}" for i, o in enumerate(self.outputs)]
        return "\n".join(parts)

    def since_fault(self) -> list[float] | None:
        if self.fault_at is None:
            return None
        return [round(t - self.fault_at, 1) for t in self.ended_at]


class _Clock:
    """Collects output lines and notes when the fault's marker line appears."""

    def __init__(self) -> None:
        self.fault_at: float | None = None
        self.lock = threading.Lock()

    def see(self, line: str) -> None:
        if "going away" in line:
            with self.lock:
                self.fault_at = self.fault_at or time.monotonic()

    def write(self, text: str) -> int:  # as dtensor.launch's output stream
        for line in text.splitlines():
            self.see(line)
        return len(text)

    def flush(self) -> None:
        pass


def run_separately(scenario: str, n: int = 2) -> Run:
    """``faults.py`` as ``n`` processes joined by address, without the launcher."""
    address = f"127.0.0.1:{free_port()}"
    env = {"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    import os

    env = {**os.environ, **env}
    env = {k: v for k, v in env.items() if not k.startswith("DTENSOR_")}
    clock = _Clock()
    procs, outputs, pumps = [], [[] for _ in range(n)], []
    for i in range(n):
        p = subprocess.Popen(
            [
                sys.executable,
                str(WORKERS / "faults.py"),
                scenario,
                HEARTBEAT_S,
                address,
                str(n),
                str(i),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        procs.append(p)

        def pump(p=p, sink=outputs[i]) -> None:
            for line in p.stdout:
                clock.see(line)
                sink.append(line)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        pumps.append(t)
    ended = [0.0] * n
    deadline = time.monotonic() + 120
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if p.poll() is not None and not ended[i]:
                    ended[i] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        for t in pumps:
            t.join(timeout=10)
    for i in range(n):
        ended[i] = ended[i] or time.monotonic()
    return Run([p.returncode for p in procs], ["".join(o) for o in outputs], clock.fault_at, ended)


def run_launched(scenario: str, n: int = 2) -> tuple[Run, object]:
    clock = _Clock()
    result = launch(
        [sys.executable, str(WORKERS / "faults.py"), scenario, HEARTBEAT_S],
        n,
        timeout_s=120,
        grace_s=1,
        env={"PYTHONPATH": str(REPO)},
        out=clock,  # type: ignore[arg-type]
    )
    end = time.monotonic()
    run = Run(list(result.returncodes), list(result.outputs), clock.fault_at, [end] * n)
    return run, result


def _within_guard(run: Run) -> None:
    assert run.fault_at is not None, run.report()
    assert max(run.since_fault()) < HANG_GUARD_S, run.report()


def _one_line(run: Run, process: int, text: str) -> None:
    lines = [ln for ln in run.outputs[process].splitlines() if ln.startswith("dtensor.runtime:")]
    assert any(text in ln for ln in lines), run.report()
    assert sum("lost process" in ln for ln in lines) == 1, run.report()


# ------------------------------------------------------------ sys.exit(3)
def test_exit_status_is_named_without_launcher():
    run = run_separately("exit3")
    assert run.codes == [EXIT_PEER_LOST, 3], run.report()
    _one_line(run, 0, "process 0 of 2 lost process 1: it exited with status 3.")
    _within_guard(run)


def test_exit_status_is_named_and_returned_by_launcher():
    run, result = run_launched("exit3")
    assert result.returncode == 3 and result.failed_rank == 1, run.report()
    assert run.codes == [EXIT_PEER_LOST, 3], run.report()
    _one_line(run, 0, "process 0 of 2 lost process 1: it exited with status 3.")
    _within_guard(run)


# ------------------------------------------------------------ SIGKILL of process 1
def test_killed_peer_is_named_without_launcher():
    run = run_separately("kill")
    assert run.codes == [EXIT_PEER_LOST, -9], run.report()
    _one_line(run, 0, "process 0 of 2 lost process 1: it stopped responding")
    _within_guard(run)


def test_killed_peer_is_named_by_launcher_status():
    run, result = run_launched("kill")
    assert result.returncode == 128 + 9 and result.failed_rank == 1, run.report()
    assert run.codes == [EXIT_PEER_LOST, 128 + 9], run.report()
    _one_line(run, 0, "process 0 of 2 lost process 1: it was killed by signal 9 (SIGKILL).")
    _within_guard(run)


# ------------------------------------------------------------ SIGKILL of the coordinator
def test_killed_coordinator_is_named_without_launcher():
    run = run_separately("kill_coordinator")
    assert run.codes == [-9, EXIT_PEER_LOST], run.report()
    _one_line(run, 1, "process 1 of 2 lost process 0 (the coordinator at 127.0.0.1:")
    _within_guard(run)


def test_killed_coordinator_is_named_under_launcher():
    run, result = run_launched("kill_coordinator")
    assert result.returncode == 128 + 9 and result.failed_rank == 0, run.report()
    assert run.codes == [128 + 9, EXIT_PEER_LOST], run.report()
    _one_line(run, 1, "process 1 of 2 lost process 0 (the coordinator at 127.0.0.1:")
    _within_guard(run)


# ------------------------------------------------------------ a clean end
def test_clean_end_at_different_times_is_zero_everywhere():
    run = run_separately("clean")
    assert run.codes == [0, 0], run.report()
    assert all(f"process {i} finished" in run.outputs[i] for i in range(2)), run.report()
    assert "lost process" not in "".join(run.outputs), run.report()


# ------------------------------------------------------------ the launcher's timeout
def test_launcher_timeout_stops_joined_processes_with_their_own_line():
    result = launch(
        [sys.executable, str(WORKERS / "faults.py"), "loop", HEARTBEAT_S],
        2,
        timeout_s=30,
        grace_s=1,
        env={"PYTHONPATH": str(REPO)},
        out=_Clock(),  # type: ignore[arg-type]
    )
    outputs = "\n".join(result.outputs)
    assert all("looping" in out for out in result.outputs), outputs  # joined before the timeout
    assert result.timed_out and result.returncode == EXIT_TIMEOUT, outputs
    assert result.returncodes == (EXIT_TIMEOUT, EXIT_TIMEOUT), outputs
    for rank in range(2):
        assert (
            f"dtensor.runtime: process {rank} of 2 stopped by dtensor.launch: the job timed out "
            "after 30 s (dtensor.launch --timeout)." in result.outputs[rank]
        ), outputs
