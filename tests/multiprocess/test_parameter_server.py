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


def interface_address() -> str:
    """A non-loopback IPv4 address of this machine: its default route's, else any interface's.

    The two-ps test runs its job over such an address, as a job across hosts does; a machine
    without one fails the test saying so (it never skips).
    """
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: picks the route, sends nothing
            address = s.getsockname()[0]
        if not address.startswith("127."):
            return address
    except OSError:
        pass  # no default route: look at the interfaces
    found = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "up"], capture_output=True, text=True, timeout=10
    ).stdout
    for line in found.splitlines():  # "2: eth0    inet 192.0.2.2/24 brd ..."
        fields = line.split()
        if "inet" in fields:
            address = fields[fields.index("inet") + 1].partition("/")[0]
            if not address.startswith("127."):
                return address
    pytest.fail(
        "this machine has no IPv4 address besides loopback (no default route, and `ip -4 addr` "
        f"lists none: {found.strip()!r}); the two-ps test needs one to run its job over an "
        "interface address as across hosts. Add one, e.g. `ip link add dt0 type dummy && "
        "ip addr add 192.0.2.10/24 dev dt0 && ip link set dt0 up`."
    )


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
    # against the loss at the initial variables: the job's closure 0 may be refused and re-run
    assert got["losses"][-1] < 0.01 * local["losses"][0]

    # the chief checkpointed the ps variables at the end; a new job resumes from them
    resumed = run_ps("--steps", "0", "--restore", directory)
    assert resumed.returncode == 0, report(resumed)
    back = chief_result(resumed)
    assert back["step"] == 40  # the optimizer state came back to the ps (and from it)
    assert back["final"] == pytest.approx(got["final"], rel=1e-5, abs=1e-12)


@pytest.mark.slow
def test_two_ps_tasks_split_the_variables_by_the_partitioner_over_the_network_path_and_restore_them(
    tmp_path,
) -> None:
    # FixedShardsPartitioner(2): the kernel (4, 1) and its Adam moments are split by rows over
    # the two ps tasks, the bias and the step count are kept whole on both. The job finds its
    # coordinator at this machine's interface address, not loopback, as a job across hosts
    # does: every task's transfer server must bind and advertise that address (a loopback
    # one would be unreachable from another host). --hold forces one stale read (worker 0
    # holds its first batch until 2 of worker 1's commits have landed): above
    # max_staleness=1, its commit is refused on both ps and the closure runs again.
    host = interface_address()
    args = ("--steps", "40", "--max-staleness", "1", "--partition", "--adam")
    ckpt = str(tmp_path / "ckpt")
    hold = ("--hold", str(tmp_path), "--shards", "--save", ckpt)
    result = run_ps(*args, *hold, num_ps=2, host=host)
    assert result.returncode == 0 and result.returncodes == (0,) * 5, report(result)
    tasks = ["chief 0", "ps 0", "ps 1", "worker 0", "worker 1"]
    for task, output in zip(tasks, result.outputs, strict=True):
        prefix = f"dtensor: {task}: transfers at "
        addresses = [ln[len(prefix) :] for ln in output.splitlines() if ln.startswith(prefix)]
        assert [a.rpartition(":")[0] for a in addresses] == [host], (task, report(result))
    got = chief_result(result)
    assert got["completed"] == 40 and got["step"] == 40, report(result)
    assert (tmp_path / "go").exists()  # the hold happened
    assert got["retries"] >= 1 and max(got["staleness"]) <= 1, got["staleness"]

    lines = [ln for ln in result.outputs[0].splitlines() if ln.startswith("SHARDS ")]
    assert len(lines) == 1, report(result)
    shards = json.loads(lines[0][len("SHARDS ") :])
    ps0, ps1 = shards["ps"]
    shapes = [{p: v["shape"] for p, v in ps["variables"].items()} for ps in (ps0, ps1)]
    assert shapes[0] == shapes[1]
    # The partitioner's split: 2 of the kernel's 4 rows on each ps, its Adam moments with it;
    # the bias, its moments and the step counts whole on each.
    split = {p for p in shapes[0] if p.endswith("dense/kernel")}
    assert len(split) == 3, sorted(shapes[0])  # the kernel, mu and nu
    for path, shape in shapes[0].items():
        assert shape == ([2, 1] if path in split else [1] if "bias" in path else []), path
    for path, v in ps0["variables"].items():
        if path not in split:  # kept whole: the same on both ps, commit for commit
            assert v["value"] == ps1["variables"][path]["value"], path
    steps = [v["value"] for p, v in ps0["variables"].items() if p.endswith("step")]
    assert steps and all(x == 40 for x in steps), sorted(ps0["variables"])
    # Both ps applied the same 40 closures in the same order, each once (the refused one
    # too, after its re-run); the chief's kernel is their rows joined.
    assert ps0["applied"] == ps1["applied"] and sorted(ps0["applied"]) == list(range(40))
    kernel = "0/dense/kernel"  # the builder's first node (the model), then the optimizer
    rows = ps0["variables"][kernel]["value"] + ps1["variables"][kernel]["value"]
    assert rows == shards["kernel"]

    # The chief saved them; a new job with 2 ps restores them: each ps gets its own rows and
    # the whole variables back (the optimizer state and step count with them), none applied.
    back = run_ps(
        "--steps", "0", "--partition", "--adam", "--restore", ckpt, "--shards", num_ps=2, host=host
    )
    assert back.returncode == 0, report(back)
    assert chief_result(back)["step"] == 40
    lines = [ln for ln in back.outputs[0].splitlines() if ln.startswith("SHARDS ")]
    assert len(lines) == 1, report(back)
    again = json.loads(lines[0][len("SHARDS ") :])
    for before, after in zip(shards["ps"], again["ps"], strict=True):
        assert after["variables"] == before["variables"] and after["applied"] == []
    assert again["kernel"] == shards["kernel"]

    local = single_process_result(40, "--partition", "--adam")
    # the same schedule of 40 Adam steps, stale by <= 1: within 25% of the single-process loss
    assert got["final"] < 1.25 * local["final"] + 1e-4, (got["final"], local["final"])
    # and far below the loss at the initial variables (the local run's first closure; the
    # job's closure 0 is the held one, refused and re-run on later variables)
    assert got["final"] < 0.01 * local["losses"][0], (got["final"], local["losses"][0])


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
