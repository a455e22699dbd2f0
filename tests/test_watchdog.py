"""dtensor.runtime.watchdog: exits that need no Python, the SIGTERM guard, the heartbeat settings.

The exits run in child processes (a process that ends itself cannot be
asserted on from inside); each is bounded by a subprocess timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import pytest

from dtensor import compat
from dtensor.runtime import watchdog
from dtensor.runtime.cluster import ClusterConfigError
from dtensor.runtime.launch import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(code: str, limit_s: float = 60, **env: str) -> tuple[int, str, float]:
    full = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu", **env}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=limit_s,
    )
    return done.returncode, done.stdout + done.stderr, time.monotonic() - started


def test_exit_after_ends_a_process_whose_main_thread_holds_the_gil():
    code, out, _ = run(
        """
        import ctypes, time
        from dtensor.runtime import watchdog
        print(watchdog.exit_after(0.5, 75), flush=True)
        ctypes.PyDLL(None).sleep(40)  # PyDLL keeps the interpreter lock: no Python thread runs
        print("not ended", flush=True)
        """
    )
    assert code == 75, out
    assert "kernel timer" in out and "not ended" not in out, out


def test_a_second_thread_that_wants_to_end_the_process_waits_for_the_first():
    """The first claim arms the end (status 75); a second claimant (status 3) never wins."""
    code, out, _ = run(
        """
        import threading, time
        from dtensor.runtime import peers
        peers._claim(75, 0.5)
        threading.Thread(target=peers.die, args=("second", 3), daemon=True).start()
        time.sleep(30)
        """
    )
    assert code == 75, out
    assert "second" not in out, out


def test_heartbeat_timeout_from_argument_env_or_default():
    assert watchdog.heartbeat_timeout(None, {}) == 15.0
    assert watchdog.heartbeat_timeout(None, {"DTENSOR_HEARTBEAT_TIMEOUT_S": "2.5"}) == 2.5
    assert watchdog.heartbeat_timeout(4, {"DTENSOR_HEARTBEAT_TIMEOUT_S": "2.5"}) == 4.0


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan", "off"])
def test_bad_heartbeat_variable_is_named(raw):
    with pytest.raises(ClusterConfigError, match=r"DTENSOR_HEARTBEAT_TIMEOUT_S=.* is not valid"):
        watchdog.heartbeat_timeout(None, {"DTENSOR_HEARTBEAT_TIMEOUT_S": raw})


def test_bad_heartbeat_argument_is_named():
    with pytest.raises(ClusterConfigError, match=r"heartbeat_timeout_s=0 is not valid"):
        watchdog.heartbeat_timeout(0)


def test_sigterm_grace_variable():
    assert watchdog.sigterm_grace({}) == 60.0
    assert watchdog.sigterm_grace({"DTENSOR_SIGTERM_GRACE_S": "off"}) is None
    with pytest.raises(
        ClusterConfigError, match=r"DTENSOR_SIGTERM_GRACE_S='x' is not valid.*'off'"
    ):
        watchdog.sigterm_grace({"DTENSOR_SIGTERM_GRACE_S": "x"})


@pytest.mark.parametrize("timeout", [0.5, 3, 15, 120])
def test_jax_decides_well_after_the_monitor(timeout):
    assert watchdog.jax_heartbeat_timeout(timeout) >= 2 * (timeout + 10)


def test_distributed_timeouts_passes_what_this_jax_takes():
    given = {"heartbeat_timeout_seconds": 56, "shutdown_timeout_seconds": 120}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compat.distributed_timeouts(**given) == given


def test_distributed_timeouts_leaves_out_what_this_jax_lacks(monkeypatch):
    def older_initialize(coordinator_address=None, num_processes=None, process_id=None):
        pass

    monkeypatch.setattr(jax.distributed, "initialize", older_initialize)
    with pytest.warns(UserWarning, match=r"takes no heartbeat_timeout_seconds; JAX's own default"):
        assert compat.distributed_timeouts(heartbeat_timeout_seconds=56) == {}


_JOB = """
    import os, signal, sys, threading, time
    import dtensor
    dtensor.initialize("127.0.0.1:{port}", 1, 0, summary=False)
    from jax.experimental import multihost_utils
    print("joined", flush=True)
    print(f"SIGTERM at {{time.time()}}", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    {after}
"""


@pytest.mark.multiprocess
def test_sigterm_still_reaches_jaxs_preemption_notice():
    """The guard chains JAX's handler: the preemption sync point still comes (the save path)."""
    after = """
    for step in range(600):
        if multihost_utils.reached_preemption_sync_point(step):
            print(f"sync point at step {step}", flush=True)
            os._exit(0)
        time.sleep(0.05)
    print("no sync point", flush=True)
    """
    code, out, _ = run(_JOB.format(port=free_port(), after=after), DTENSOR_SIGTERM_GRACE_S="30")
    assert code == 0 and "sync point at step" in out, out
    assert "process 0 of 1 got SIGTERM; it ends with exit status 143 within 30 s" in out, out


@pytest.mark.multiprocess
def test_sigterm_ends_a_stuck_process_with_143_after_the_grace():
    code, out, took = run(
        _JOB.format(port=free_port(), after="threading.Event().wait()"),
        DTENSOR_SIGTERM_GRACE_S="1",
    )
    ended = time.time()
    assert code == 143, out
    assert "got SIGTERM; it ends with exit status 143 within 1 s" in out, out
    # It waited out the grace (1 s from the signal), then ended by itself: far sooner than
    # the 60 s the subprocess is allowed (20 s leaves room for a loaded machine's exit).
    (sent,) = [
        float(line.split()[-1]) for line in out.splitlines() if line.startswith("SIGTERM at")
    ]
    assert 1.0 <= ended - sent < 20 and ended - sent <= took, (ended - sent, took, out)
