"""ClusterCoordinator across processes: chief, ps and workers started by dtensor.launch --ps/--workers."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from dtensor.runtime.exit_codes import EXIT_PEER_LOST
from dtensor.runtime.launch import launch
from tests.multiprocess.util import REPO, WORKERS, _Discard, report

pytestmark = pytest.mark.timeout(150)


def interface_address() -> str | None:
    """This machine's address on its default route (not loopback), or None without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def run_ps(
    *args: str,
    restart_workers: int = 0,
    timeout_s: float = 120,
    num_ps: int = 1,
    host: str = "127.0.0.1",
):
    return launch(
        [sys.executable, str(WORKERS / "ps_train.py"), *args],
        3 + num_ps,
        num_ps=num_ps,
        restart_workers=restart_workers,
        timeout_s=timeout_s,
        host=host,
        grace_s=1.0,
        env={"PYTHONPATH": str(REPO)},
        out=_Discard(),  # type: ignore[arg-type]
    )


def chief_result(result) -> dict:
    lines = [ln for ln in result.outputs[0].splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, report(result)
    return json.loads(lines[0][len("RESULT ") :])


def single_process_result(steps: int, *args: str) -> dict:
    """The same script with the single-process coordinator: 1 (or 2) ps devices + 2 workers."""
    out = subprocess.run(
        [sys.executable, str(WORKERS / "ps_train.py"), "--local", "--steps", str(steps), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PYTHONPATH": str(REPO),
            "JAX_PLATFORMS": "cpu",
            "PATH": "/usr/bin:/bin",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={4 if '--partition' in args else 3}",
        },
        check=True,
    )
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@pytest.mark.slow
def test_tutorial_across_processes_reaches_the_single_process_loss(tmp_path) -> None:
    directory = str(tmp_path / "ckpt")
    result = run_ps("--steps", "40", "--max-staleness", "2", "--save", directory)
    assert result.returncode == 0 and result.returncodes == (0, 0, 0, 0), report(result)
    got = chief_result(result)
    assert got["completed"] == 40 and got["step"] == 40  # every closure committed once
    assert sum(got["per_worker"]) == 40 and all(n > 0 for n in got["per_worker"])
    assert len(got["staleness"]) == 40 and max(got["staleness"]) <= 2  # the bound, enforced
    assert got["bytes"] > 0
    local = single_process_result(40)
    assert local["step"] == 40
    # asynchronous updates from 2 workers, staleness <= 2: the same regression converges as far
    assert got["final"] < 1e-3 and local["final"] < 1e-3, (got["final"], local["final"])
    assert got["losses"][-1] < 0.01 * got["losses"][0]

    # the chief checkpointed the ps variables at the end; a new job resumes from them
    resumed = run_ps("--steps", "0", "--restore", directory)
    assert resumed.returncode == 0, report(resumed)
    back = chief_result(resumed)
    assert back["step"] == 40  # the optimizer state came back to the ps (and from it)
    assert back["final"] == pytest.approx(got["final"], rel=1e-5, abs=1e-12)


@pytest.mark.slow
def test_two_ps_tasks_split_the_variables_by_the_partitioner_over_the_network_path() -> None:
    # FixedShardsPartitioner(2): the kernel (4, 1) and its Adam moments are split by rows over
    # the two ps tasks, the bias and the step count are kept whole on both. The job finds its
    # coordinator at this machine's interface address, not loopback, as a job across hosts
    # does: every task's transfer server must bind and advertise that address (a loopback
    # one would be unreachable from another host).
    host = interface_address()
    if host is None:
        pytest.skip("this machine has no network interface besides loopback")
    args = ("--steps", "40", "--max-staleness", "2", "--partition", "--adam")
    result = run_ps(*args, num_ps=2, host=host)
    assert result.returncode == 0 and result.returncodes == (0,) * 5, report(result)
    tasks = ["chief 0", "ps 0", "ps 1", "worker 0", "worker 1"]
    for task, output in zip(tasks, result.outputs, strict=True):
        prefix = f"dtensor: {task}: transfers at "
        addresses = [ln[len(prefix) :] for ln in output.splitlines() if ln.startswith(prefix)]
        assert [a.rpartition(":")[0] for a in addresses] == [host], (task, report(result))
    got = chief_result(result)
    assert got["completed"] == 40 and got["step"] == 40, report(result)
    assert max(got["staleness"]) <= 2
    local = single_process_result(40, "--partition", "--adam")
    # the same schedule of 40 Adam steps, stale by <= 2: within 25% of the single-process loss
    assert got["final"] < 1.25 * local["final"] + 1e-4, (got["final"], local["final"])
    assert got["final"] < 0.01 * got["losses"][0]


@pytest.mark.slow
def test_a_killed_worker_loses_only_its_closure_and_a_restarted_one_rejoins(tmp_path) -> None:
    marker = str(tmp_path / "killed")
    result = run_ps(
        "--steps",
        "60",
        "--kill-worker",
        "3",
        "--marker",
        marker,
        "--sleep",
        "0.15",
        restart_workers=1,
    )
    assert result.returncode == 0, report(result)
    got = chief_result(result)
    assert got["completed"] == 60 and got["step"] == 60, report(result)  # all once, none twice
    assert got["retries"] >= 1  # the closure in flight on the killed worker ran again
    assert result.outputs[2].count("worker 0 serving") == 2, report(result)  # restarted, rejoined
    assert got["per_worker"][0] > 2, got["per_worker"]  # it ran closures after its restart


def test_ps_death_stops_the_job_naming_it() -> None:
    result = run_ps("--steps", "400", "--sleep", "0.05", "--die", "ps", timeout_s=60)
    assert not result.timed_out, report(result)
    assert result.returncodes[1] == 128 + 9, report(result)
    assert result.returncodes[0] == EXIT_PEER_LOST, report(result)
    lines = [ln for ln in result.outputs[0].splitlines() if "lost process 1 (ps 0)" in ln]
    assert len(lines) == 1, report(result)


@pytest.mark.slow
def test_chief_death_stops_every_task_naming_it() -> None:
    result = run_ps("--steps", "400", "--sleep", "0.05", "--die", "chief", timeout_s=60)
    assert not result.timed_out, report(result)
    assert result.returncodes[0] == 128 + 9, report(result)
    for rank in (1, 2, 3):  # the ps and both workers: one line each, naming the chief
        assert result.returncodes[rank] == EXIT_PEER_LOST, report(result)
        lines = [ln for ln in result.outputs[rank].splitlines() if "lost process 0 (chief" in ln]
        assert len(lines) == 1, report(result)
