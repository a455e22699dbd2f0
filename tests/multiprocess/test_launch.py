"""dtensor.launch: processes, environment, prefixes, exit codes, stopping, timeouts."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import pytest

from dtensor.runtime.launch import LaunchResult, launch, main

from .util import REPO, report

PY = sys.executable


def quiet() -> io.StringIO:
    return io.StringIO()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_environment_passed_through_and_launcher_variables(monkeypatch):
    monkeypatch.setenv("DTENSOR_TEST_MARK", "passed-through")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    code = (
        "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
        "['DTENSOR_COORDINATOR', 'DTENSOR_NUM_PROCESSES', 'DTENSOR_PROCESS_ID', "
        "'DTENSOR_DEVICES_PER_PROCESS', 'JAX_PLATFORMS', 'DTENSOR_TEST_MARK', 'EXTRA']}))"
    )
    result = launch(
        [PY, "-c", code],
        3,
        devices_per_process=2,
        port=23999,
        timeout_s=30,
        env={"EXTRA": "x"},
        out=quiet(),
    )
    assert result.returncode == 0, report(result)
    seen = [json.loads(out) for out in result.outputs]
    for rank, env in enumerate(seen):
        assert env == {
            "DTENSOR_COORDINATOR": "127.0.0.1:23999",
            "DTENSOR_NUM_PROCESSES": "3",
            "DTENSOR_PROCESS_ID": str(rank),
            "DTENSOR_DEVICES_PER_PROCESS": "2",
            "JAX_PLATFORMS": "cpu",
            "DTENSOR_TEST_MARK": "passed-through",
            "EXTRA": "x",
        }


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_free_port_by_default_and_platform_kept(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu,tpu")
    code = "import os; print(os.environ['DTENSOR_COORDINATOR'], os.environ['JAX_PLATFORMS'])"
    result = launch([PY, "-c", code], 2, timeout_s=30, out=quiet())
    addresses = {out.split()[0] for out in result.outputs}
    assert len(addresses) == 1
    host, port = addresses.pop().rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert all(out.split()[1] == "cpu,tpu" for out in result.outputs)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_picked_port_taken_before_the_coordinator_starts_is_picked_again(monkeypatch):
    """The port the launcher picks can be taken before process 0 starts the coordinator
    (another job on the machine: a CI flake once); the job then starts once more on a new
    port, and a port the caller named is never changed."""
    import socket

    import dtensor.runtime.launch as launcher

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picks = iter([busy])
    real = launcher.free_port
    monkeypatch.setattr(
        launcher, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host)
    )
    code = (
        "import dtensor; dtensor.initialize(); import jax, os; "
        "print('joined', jax.process_count(), os.environ['DTENSOR_COORDINATOR'])"
    )
    stream = io.StringIO()
    try:
        result = launch([PY, "-c", code], 2, devices_per_process=1, timeout_s=90, grace_s=1,
                        out=stream, env={"PYTHONPATH": str(REPO)})  # fmt: skip
        assert result.returncode == 0, report(result)
        assert all(out.split()[-3:-1] == ["joined", "2"] for out in result.outputs), report(result)
        assert f":{busy}" not in result.outputs[0].split()[-1]
        assert "starting again on a new one" in stream.getvalue()
        # A named port is the caller's: no second start.
        named = launch([PY, "-c", code], 2, devices_per_process=1, port=busy, timeout_s=90,
                       grace_s=1, out=quiet(), env={"PYTHONPATH": str(REPO)})  # fmt: skip
        assert named.returncode != 0 and launcher.PORT_TAKEN in named.outputs[0], report(named)
    finally:
        taken.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_rank_prefixes_on_every_line():
    stream = io.StringIO()
    code = "import os; r = os.environ['DTENSOR_PROCESS_ID']; print(f'a{r}'); print(f'b{r}', end='')"
    result = launch([PY, "-c", code], 2, timeout_s=30, out=stream)
    assert result.returncode == 0
    lines = stream.getvalue().splitlines()
    for rank in range(2):
        assert f"[rank {rank}] a{rank}" in lines and f"[rank {rank}] b{rank}" in lines
    assert len(lines) == 4
    assert result.outputs == ("a0\nb0", "a1\nb1")


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_first_failure_decides_and_the_others_are_stopped():
    code = (
        "import os, sys, time\n"
        "r = int(os.environ['DTENSOR_PROCESS_ID'])\n"
        "if r == 1: sys.exit(3)\n"
        "print('waiting', flush=True); time.sleep(120)\n"
    )
    result = launch([PY, "-c", code], 3, timeout_s=60, grace_s=1, out=quiet())
    assert result == LaunchResult(
        returncode=3,
        returncodes=(128 + 15, 3, 128 + 15),
        outputs=result.outputs,
        failed_rank=1,
        timed_out=False,
    ), report(result)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sigterm_ignored_gets_sigkill_after_grace():
    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.environ['DTENSOR_PROCESS_ID'] == '1': time.sleep(0.5); sys.exit(4)\n"
        "time.sleep(120)\n"
    )
    result = launch([PY, "-c", code], 2, timeout_s=60, grace_s=1, out=quiet())
    assert (result.returncode, result.returncodes) == (4, (128 + 9, 4)), report(result)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_overall_timeout():
    stream = io.StringIO()
    result = launch(
        [PY, "-c", "import time; time.sleep(120)"], 2, timeout_s=1, grace_s=1, out=stream
    )
    assert result.timed_out and result.returncode == 124 and result.failed_rank is None
    assert result.returncodes == (128 + 15, 128 + 15)
    assert "[dtensor.launch] timed out after 1 s; stopping ranks [0, 1]" in stream.getvalue()


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_keep_going_lets_the_others_finish():
    code = "import os, sys, time; r = os.environ['DTENSOR_PROCESS_ID']; time.sleep(0.5 * (r == '0')); sys.exit(2 if r == '1' else 0)"
    result = launch([PY, "-c", code], 2, timeout_s=30, stop_on_failure=False, out=quiet())
    assert (result.returncode, result.returncodes, result.failed_rank) == (2, (0, 2), 1)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_command_line(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys\nr = os.environ['DTENSOR_PROCESS_ID']\nprint('hello', r)\nsys.exit(5 if r == '1' else 0)\n"
    )
    proc = subprocess.run(
        [
            PY,
            "-m",
            "dtensor.launch",
            "-n",
            "2",
            "--timeout",
            "30",
            "--grace",
            "1",
            "--keep-going",
            "--",
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "[rank 0] hello 0" in proc.stdout and "[rank 1] hello 1" in proc.stdout


def test_command_line_needs_a_command(capsys):
    with pytest.raises(SystemExit) as info:
        main(["-n", "2", "--"])
    assert info.value.code == 2
    assert "no command given; write it after '--'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cmd", "n", "k", "match"),
    [
        (
            "python x.py",
            2,
            None,
            r"needs the command as a non-empty list of arguments; got 'python x.py'",
        ),
        ([], 2, None, r"needs the command as a non-empty list"),
        (["true"], 0, None, r"num_processes=0 is not valid; give a positive integer"),
        (["true"], 2, 0, r"devices_per_process=0 is not valid; give a positive integer"),
    ],
)
def test_argument_errors(cmd, n, k, match):
    with pytest.raises(ValueError, match=match):
        launch(cmd, n, devices_per_process=k)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_sigterm_to_the_launcher_stops_its_processes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n")
    launcher = subprocess.Popen(
        [PY, "-m", "dtensor.launch", "-n", "2", "--grace", "1", "--", str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert launcher.stdout is not None
    pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # gone (reaped by the launcher)
