"""dtensor.runtime.peers and exit_codes in-process: what a survivor names, and why.

The real processes are in tests/multiprocess/test_peers.py; here a fake
key-value store stands in for JAX's coordination service.
"""

from __future__ import annotations

import json
import time

import pytest

from dtensor.runtime import exit_codes, peers
from dtensor.runtime.exit_codes import EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_TIMEOUT
from dtensor.runtime.launch import _Job


class FakeStore:
    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.down = False

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        self.kv[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def monitor(me=0, n=3, timeout=5.0, status_dir=None) -> tuple[peers.PeerMonitor, FakeStore]:
    store = FakeStore()
    m = peers.PeerMonitor(store, me, n, "10.0.0.1:1234", timeout, status_dir=status_dir)
    m._seen = {i: (None, time.monotonic()) for i in range(n)}
    return m, store


def exit_record(store, i, status, **extra):
    store.kv[f"dtensor/exit/{i}"] = json.dumps({"status": status, **extra})


def test_nothing_lost():
    m, store = monitor()
    m._poll_store()
    assert m.diagnose() is None


def test_exit_record_names_process_and_status():
    m, store = monitor()
    exit_record(store, 2, 3, what="exited with status 3")
    m._poll_store()
    assert m.diagnose() == peers.Loss(2, "exited with status 3", 3)


def test_a_cause_wins_over_a_survivors_record():
    m, store = monitor(me=2)
    exit_record(store, 0, EXIT_PEER_LOST, what="lost process 1", root=1, root_what="was killed")
    m._poll_store()
    assert m.diagnose() == peers.Loss(1, "was killed", None)  # process 0 only echoed it


def test_preempted_peer_gets_time_to_stop_with_us():
    m, store = monitor(timeout=0.3)
    exit_record(store, 1, EXIT_PREEMPTED, what="exited with status 143")
    m._poll_store()
    assert m.diagnose() is None
    time.sleep(0.4)
    assert m.diagnose().process == 1


def test_launcher_status_names_a_killed_process(tmp_path):
    m, store = monitor(me=1, n=2, status_dir=str(tmp_path))
    (tmp_path / "0.status").write_text("-9")
    loss = m.diagnose()
    assert loss == peers.Loss(0, "was killed by signal 9 (SIGKILL)", -9, coordinator=True)
    assert peers.lost_message(1, 2, loss, m.address).startswith(
        "dtensor.runtime: process 1 of 2 lost process 0 (the coordinator at 10.0.0.1:1234): "
        "it was killed by signal 9 (SIGKILL). Stopping process 1 with exit status 75"
    )


def test_launcher_timeout_stops_with_124(tmp_path):
    m, _ = monitor(status_dir=str(tmp_path))
    (tmp_path / peers.LAUNCHER_FILE).write_text("the job timed out after 9 s")
    loss = m.diagnose()
    assert loss == peers.Loss(None, "the job timed out after 9 s", EXIT_TIMEOUT)
    assert peers.lost_message(0, 3, loss, None) == (
        "dtensor.runtime: process 0 of 3 stopped by dtensor.launch: the job timed out after 9 s."
    )


def test_silent_process_is_lost_after_the_timeout():
    m, store = monitor(timeout=0.2)
    store.kv["dtensor/alive/1"] = "done"  # finished: never counts as lost
    m._poll_store()
    time.sleep(0.3)
    assert m.diagnose() == peers.Loss(
        2, "stopped responding (no heartbeat for 0.2 s: killed, crashed or hung)", coordinator=False
    )


def test_unreachable_store_names_the_coordinator():
    m, store = monitor(me=1)
    store.down = True
    with pytest.raises(RuntimeError):
        m._poll_store()
    loss = m.diagnose(store_down="UNAVAILABLE: Failed to send RPC")
    assert loss.process == 0 and loss.coordinator
    assert "cannot be reached: UNAVAILABLE" in loss.what


def test_coordinator_reachable():
    assert peers.coordinator_reachable(None)
    port = __import__("dtensor.runtime.launch", fromlist=["free_port"]).free_port()
    assert not peers.coordinator_reachable(f"127.0.0.1:{port}", timeout=0.5)


@pytest.mark.parametrize(
    ("ended", "first"),
    [
        ([(0, EXIT_PEER_LOST), (1, 3)], (1, 3)),  # the cause, though it ended second
        ([(1, -9), (0, EXIT_PEER_LOST)], (1, 137)),
        ([(0, 0), (1, EXIT_PEER_LOST)], (1, EXIT_PEER_LOST)),
        ([(0, 0), (1, 0)], None),
    ],
)
def test_launcher_reports_the_cause(tmp_path, ended, first):
    job = _Job(tmp_path)
    job.ended = ended
    assert job.first_failure() == first


def test_every_code_is_documented():
    doc = exit_codes.__doc__
    for name in exit_codes.__all__:
        if name.startswith("EXIT_"):
            assert f":data:`{name}`" in doc and str(getattr(exit_codes, name)) in doc


ABORT_SCRIPT = """
import os, sys
from dtensor.runtime import peers
from tests.test_peers import FakeStore
status_dir, me = sys.argv[1], int(sys.argv[2])
m = peers.PeerMonitor(FakeStore(), me, 2, "10.0.0.1:1234", 30.0, status_dir=status_dir)
m._seen = {0: (None, 1e18), 1: (None, 1e18)}
peers.install_abort_hook(m)
os.abort()  # as JAX's C++ client does (LOG(FATAL)) when the job breaks
"""


@pytest.mark.parametrize("killed", [True, False])
def test_abort_is_named_when_the_loss_is_known(tmp_path, killed):
    import subprocess
    import sys

    from tests.multiprocess.util import REPO

    if killed:
        (tmp_path / "0.status").write_text("-9")
    proc = subprocess.run(
        [sys.executable, "-c", ABORT_SCRIPT, str(tmp_path), "1" if killed else "0"],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    if killed:  # a known loss: our line, status 75
        assert proc.returncode == EXIT_PEER_LOST, proc.stderr
        assert proc.stderr.strip().endswith("own output.")
        assert "process 1 of 2 lost process 0 (the coordinator at 10.0.0.1:1234): it was " in (
            proc.stderr
        )
    else:  # process 0, nothing known: not ours to explain, JAX's abort goes on
        assert proc.returncode == -6, proc.stderr
        assert "dtensor.runtime" not in proc.stderr
