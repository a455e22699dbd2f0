"""Start N local processes wired into one multi-process JAX job.

    python -m dtensor.launch -n 2 --devices-per-process 2 -- python train.py --steps 10

Each process gets the environment of the launcher plus ``DTENSOR_COORDINATOR``
(``127.0.0.1:<free port>``), ``DTENSOR_NUM_PROCESSES``, ``DTENSOR_PROCESS_ID``
and, if asked, ``DTENSOR_DEVICES_PER_PROCESS``, which :func:`dtensor.initialize`
reads; ``JAX_PLATFORMS=cpu`` if unset where there are no TPU or GPU device files
(:func:`~dtensor.runtime.platform.default_platforms`). Their output is streamed with a
``[rank i]`` prefix on every line. The launcher's exit status is the
first non-zero one of its processes (``128 + signal`` for a process killed by
a signal, ``124`` on timeout), a cause preferred over the
:data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST` of a process that only
reported losing it.

When one process fails the others are stopped so that they can still say
why: the launcher writes each ended process's status into a directory named
by ``DTENSOR_LAUNCH_STATUS_DIR``; processes that joined the job with
:func:`dtensor.initialize` read it, print one line naming the lost process
("process 1 was killed by signal 9 (SIGKILL)") and exit with 75 by
themselves. Those get ``report_s`` seconds to do so; the rest, and any still
running then, get SIGTERM to their own pids, then SIGKILL after ``grace_s``.
(SIGTERM is left for real preemption notices: JAX's preemption notifier
catches it in a joined process.)

It is how multi-host code is tried on one machine, and how dtensor's own tests run it.
The launched processes' bookkeeping (statuses, output, stopping, parameter-server roles) is
:mod:`dtensor.runtime.local_job`; the command line's flags are :mod:`dtensor.runtime.launch_args`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from dtensor.runtime import launch_args
from dtensor.runtime.cluster import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_STATUS_DIR,
)
from dtensor.runtime.exit_codes import EXIT_TIMEOUT, describe
from dtensor.runtime.local_job import (
    Job,
    exit_status,
    note,
    pump,
    role_env,
    task_roles,
    write_atomic,
)
from dtensor.runtime.peers import LAUNCHER_FILE
from dtensor.runtime.platform import default_platforms

__all__ = ["LaunchResult", "free_port", "launch", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    """What a :func:`launch` run produced.

    Attributes:
        returncode: the first non-zero exit status among the processes, in
            the order they ended, other than 75 (a process that lost another)
            when there is one (``128 + signal`` for a signal, ``124`` if the
            launch timed out), else 0.
        returncodes: each rank's own exit status, same convention; processes
            the launcher stopped show the signal that stopped them.
        outputs: each rank's combined stdout and stderr, without prefixes.
        failed_rank: the rank whose failure decided ``returncode`` (``None``
            on success or timeout).
        timed_out: whether the overall timeout ended the run.
    """

    returncode: int
    returncodes: tuple[int, ...]
    outputs: tuple[str, ...]
    failed_rank: int | None = None
    timed_out: bool = False


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now.

    Examples:
        >>> from dtensor.runtime.launch import free_port
        >>> 0 < free_port() < 65536
        True
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _command(cmd: Sequence[str]) -> list[str]:
    """A script runs with this interpreter; so does a bare ``python``/``python3``
    (the launcher's own environment, as ``jupyter_client`` does for kernels).

    Examples:
        >>> import sys
        >>> from dtensor.runtime.launch import _command
        >>> _command(["python", "train.py"])[0] == sys.executable
        True
    """
    cmd = list(cmd)
    if cmd and cmd[0].endswith(".py"):
        cmd.insert(0, sys.executable)
    elif cmd and cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    return cmd


def _check(cmd: Sequence[str], num_processes: int, devices_per_process: int | None) -> None:
    if isinstance(cmd, str) or not cmd:
        raise ValueError(
            f"launch() needs the command as a non-empty list of arguments; got {cmd!r}. "
            "Write it as ['python', 'train.py', '--steps', '10']."
        )
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(
            f"num_processes={num_processes!r} is not valid; give a positive integer "
            "(the number of processes to start), e.g. 2."
        )
    if devices_per_process is not None and (
        not isinstance(devices_per_process, int) or devices_per_process < 1
    ):
        raise ValueError(
            f"devices_per_process={devices_per_process!r} is not valid; give a positive "
            "integer (CPU devices each process simulates), or None to leave JAX's default."
        )


def launch(
    cmd: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
    report_s: float = 10.0,
    stop_on_failure: bool = True,
    out: IO[str] | None = None,
    num_ps: int | None = None,
    restart_workers: int = 0,
    host: str = "127.0.0.1",
) -> LaunchResult:
    """Run ``cmd`` as ``num_processes`` local processes of one JAX job.

    Args:
        cmd: the command (a script path ending in ``.py`` runs with this
            Python).
        num_processes: how many processes to start.
        devices_per_process: CPU devices each process simulates (sets
            ``DTENSOR_DEVICES_PER_PROCESS``, read by :func:`dtensor.initialize`;
            ``None``: the script's own count, one unless it sets one).
        port: the coordinator's port on ``host`` (default: a free one; if
            another process takes it before the coordinator starts, the job
            starts once more on a new one).
        timeout_s: stop everything after this many seconds (exit status 124).
        env: extra environment variables for the processes (on top of this
            process's environment).
        grace_s: seconds between SIGTERM and SIGKILL when stopping processes.
        report_s: when one process failed (or the timeout passed), how long
            the processes that joined the job with :func:`dtensor.initialize`
            get to name the lost process and exit by themselves (they
            usually need about a second) before SIGTERM.
        stop_on_failure: stop the other processes when one fails (``False``
            lets each end by itself, e.g. to see how the others react).
        out: where to stream the prefixed output (default ``sys.stdout``).
        num_ps: start a parameter-server job: process 0 is the ``chief``, the
            next ``num_ps`` are ``ps`` tasks and the rest ``worker`` tasks
            (``DTENSOR_TASK_TYPE``/``DTENSOR_TASK_INDEX``/``DTENSOR_NUM_PS``/
            ``DTENSOR_NUM_WORKERS``, read by
            :func:`dtensor.runtime.join_cluster`). A worker that fails does not
            stop the job (the chief runs its closures elsewhere); the job's
            status is the chief's, or a ``ps`` task's failure.
        restart_workers: with ``num_ps``, how many times in all a failed
            worker is started again (it rejoins the job).
        host: the address of this machine the processes find the coordinator
            at. Loopback keeps the job on this machine; an address other
            hosts reach (this machine's interface) makes the job's traffic
            take the network path a multi-host job takes: the coordinator
            service and every transfer server bind and advertise it (see
            :func:`dtensor.runtime.rpc.transfer_host`).

    Returns:
        A :class:`LaunchResult`.

    Raises:
        ValueError: an empty command or a non-positive count.

    Examples:
        >>> import sys
        >>> from dtensor.runtime.launch import launch
        >>> r = launch([sys.executable, "-c", "import os; print(os.environ['DTENSOR_PROCESS_ID'])"],
        ...            2, timeout_s=60, out=open(os.devnull, "w"))
        >>> r.returncode, [o.strip() for o in r.outputs]
        (0, ['0', '1'])
    """
    # A port picked here can be taken by another process between the pick and the
    # coordinator's start: process 0 then stops before the job forms; start once more.
    once = functools.partial(
        _launch_once, cmd, num_processes, devices_per_process=devices_per_process,
        timeout_s=timeout_s, env=env, grace_s=grace_s, report_s=report_s,
        stop_on_failure=stop_on_failure, out=out, num_ps=num_ps,
        restart_workers=restart_workers, host=host,
    )  # fmt: skip
    first = once(port=port)
    if port is None and first.returncode and PORT_TAKEN in (first.outputs or ("",))[0]:
        print(
            "dtensor.launch: the coordinator's port was taken; starting again on a new one",
            file=sys.stdout if out is None else out,
            flush=True,
        )
        return once(port=None)
    return first


#: What process 0 prints when the coordinator's port was taken (``dtensor.runtime.process``).
PORT_TAKEN = "is already in use on this host"


def _launch_once(
    cmd: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
    report_s: float = 10.0,
    stop_on_failure: bool = True,
    out: IO[str] | None = None,
    num_ps: int | None = None,
    restart_workers: int = 0,
    host: str = "127.0.0.1",
) -> LaunchResult:
    """:func:`launch`, once."""
    _check(cmd, num_processes, devices_per_process)
    sink: IO[str] = sys.stdout if out is None else out
    port = free_port(host) if port is None else port
    base = dict(os.environ)
    base.update(env or {})
    if (platforms := default_platforms(base)) is not None:
        base["JAX_PLATFORMS"] = platforms
    base["PYTHONUNBUFFERED"] = "1"
    base[ENV_COORDINATOR] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    base[ENV_NUM_PROCESSES] = str(num_processes)
    if devices_per_process is not None:
        base[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    else:
        base.pop(ENV_DEVICES_PER_PROCESS, None)
    argv = _command(cmd)
    lock = threading.Lock()
    job = Job(Path(tempfile.mkdtemp(prefix="dtensor-launch-")))
    base[ENV_STATUS_DIR] = str(job.status_dir)
    sinks: list[list[str]] = [[] for _ in range(num_processes)]
    pumps: list[threading.Thread] = []
    roles = task_roles(num_processes, num_ps)
    if num_ps is not None:  # a parameter-server job: a worker's failure is not the job's
        job.tolerate = frozenset(r for r, (kind, _) in enumerate(roles) if kind == "worker")
    restarts = restart_workers
    failed = False
    timed_out = False
    before_timeout: tuple[int, int] | None = None
    try:

        def start(rank: int) -> subprocess.Popen[bytes]:
            proc_env = dict(base, **{ENV_PROCESS_ID: str(rank)})
            if num_ps is not None:
                proc_env.update(role_env(roles[rank], num_ps, num_processes - 1 - num_ps))
            p = subprocess.Popen(
                argv, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            assert p.stdout is not None
            t = threading.Thread(
                target=pump, args=(rank, p.stdout, sinks[rank], sink, lock), daemon=True
            )
            t.start()
            pumps.append(t)
            return p

        for rank in range(num_processes):
            job.procs.append(start(rank))
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while job.poll() or (num_ps is not None and job.procs[0].poll() is None):
            for rank, code in list(job.ended):
                if rank in job.tolerate and code != 0 and restarts > 0:
                    restarts -= 1
                    job.ended.remove((rank, code))
                    with contextlib.suppress(OSError):
                        (job.status_dir / f"{rank}.status").unlink()
                    note(
                        sink,
                        lock,
                        f"rank {rank} ({roles[rank][0]} {roles[rank][1]}) {describe(code)}; restarting it",
                    )
                    job.procs[rank] = start(rank)
            first = job.first_failure()
            if first is not None and not failed:
                failed = True
                if stop_on_failure:
                    note(
                        sink,
                        lock,
                        f"rank {first[0]} {describe(job.procs[first[0]].returncode or 0)}; "
                        "stopping the others",
                    )
                    job.stop(grace_s, report_s)
                    break
            if deadline is not None and time.monotonic() > deadline:
                timed_out, before_timeout = True, job.first_failure()
                running = [r for r, p in enumerate(job.procs) if p.poll() is None]
                note(sink, lock, f"timed out after {timeout_s:g} s; stopping ranks {running}")
                write_atomic(
                    job.status_dir / LAUNCHER_FILE,
                    f"the job timed out after {timeout_s:g} s (dtensor.launch --timeout)",
                )
                job.stop(grace_s, report_s)
                break
            time.sleep(0.05)
    finally:
        job.stop(grace_s)  # still running here only if the launcher itself was stopped
        for t in pumps:
            t.join(timeout=10)
        shutil.rmtree(job.status_dir, ignore_errors=True)
    codes = tuple(exit_status(p.returncode) for p in job.procs)
    first = before_timeout if timed_out else job.first_failure()
    if timed_out and first is None:  # the processes stopped at the timeout did not fail
        returncode, failed_rank = EXIT_TIMEOUT, None
    elif first is not None:
        returncode, failed_rank = first[1], first[0]
    else:
        returncode, failed_rank = 0, None
    return LaunchResult(
        returncode=returncode,
        returncodes=codes,
        outputs=tuple("".join(s) for s in sinks),
        failed_rank=failed_rank,
        timed_out=timed_out,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dtensor.launch``'s command line (its flags: :mod:`dtensor.runtime.launch_args`);
    returns the exit status."""
    args = launch_args.parse(argv)

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds launch(), which stops the processes

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        result = launch(list(args.cmd), args.num_processes, **args.options)
    except ValueError as e:
        launch_args.error(str(e))
    return result.returncode


# The launcher's pieces under the names tests/test_peers.py and tests/test_roles.py import.
_Job = Job
_roles = task_roles


if __name__ == "__main__":
    sys.exit(main())
