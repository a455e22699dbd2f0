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
"""

from __future__ import annotations

import argparse
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

from dtensor.runtime.cluster import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_STATUS_DIR,
)
from dtensor.runtime.exit_codes import EXIT_PEER_LOST, EXIT_TIMEOUT, describe
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


def _status(code: int) -> int:
    return 128 - code if code < 0 else code


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


def _pump(
    rank: int, stream: IO[bytes], sink: list[str], out: IO[str] | None, lock: threading.Lock
) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if out is not None:
            text = line if line.endswith("\n") else line + "\n"
            with lock:
                out.write(f"[rank {rank}] {text}")
                out.flush()
    stream.close()


class _Job:
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
                    _write(self.status_dir / f"{rank}.status", str(code))
        return running

    def first_failure(self) -> tuple[int, int] | None:
        """The first failure (rank, status), a cause preferred over a 75 (a lost peer's echo)."""
        failures = [(r, _status(c)) for r, c in self.ended if c != 0 and r not in self.tolerate]
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


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (readers never see half a file)."""
    with contextlib.suppress(OSError):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)


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
    job = _Job(Path(tempfile.mkdtemp(prefix="dtensor-launch-")))
    base[ENV_STATUS_DIR] = str(job.status_dir)
    sinks: list[list[str]] = [[] for _ in range(num_processes)]
    pumps: list[threading.Thread] = []
    roles = _roles(num_processes, num_ps)
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
                proc_env.update(_role_env(roles[rank], num_ps, num_processes - 1 - num_ps))
            p = subprocess.Popen(
                argv, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            assert p.stdout is not None
            t = threading.Thread(
                target=_pump, args=(rank, p.stdout, sinks[rank], sink, lock), daemon=True
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
                    _note(
                        sink,
                        lock,
                        f"rank {rank} ({roles[rank][0]} {roles[rank][1]}) {describe(code)}; restarting it",
                    )
                    job.procs[rank] = start(rank)
            first = job.first_failure()
            if first is not None and not failed:
                failed = True
                if stop_on_failure:
                    _note(
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
                _note(sink, lock, f"timed out after {timeout_s:g} s; stopping ranks {running}")
                _write(
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
    codes = tuple(_status(p.returncode) for p in job.procs)
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


def _roles(num_processes: int, num_ps: int | None) -> list[tuple[str, int]]:
    """Each rank's (task type, index): chief, then ps, then workers (``worker i`` without ps)."""
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


def _role_env(role: tuple[str, int], num_ps: int, num_workers: int) -> dict[str, str]:
    return {
        "DTENSOR_TASK_TYPE": role[0],
        "DTENSOR_TASK_INDEX": str(role[1]),
        "DTENSOR_NUM_PS": str(num_ps),
        "DTENSOR_NUM_WORKERS": str(num_workers),
    }


def _note(out: IO[str], lock: threading.Lock, message: str) -> None:
    with lock:
        out.write(f"[dtensor.launch] {message}\n")
        out.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtensor.launch",
        description="Start N local processes of one JAX job (coordinator on 127.0.0.1; "
        "JAX_PLATFORMS kept if set, else cpu where there are no TPU/GPU device files).",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="this machine's address the processes find the coordinator at (default: loopback)",
    )
    p.add_argument("-n", "--num-processes", type=int, default=None, help="processes to start")
    p.add_argument("--ps", type=int, default=None, help="parameter-server job: ps tasks")
    p.add_argument("--workers", type=int, default=None, help="parameter-server job: worker tasks")
    p.add_argument(
        "--restart-workers", type=int, default=0, help="times a failed worker is started again"
    )
    p.add_argument(
        "--devices-per-process", type=int, default=None, help="CPU devices each one simulates"
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument("--timeout", type=float, default=None, help="overall limit in seconds")
    p.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL")
    p.add_argument(
        "--report",
        type=float,
        default=10.0,
        help="seconds joined processes get to report a failed peer and exit before SIGTERM",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="do not stop the others when one process fails",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then the command to run")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("no command given; write it after '--', e.g. -- python train.py")

    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds launch(), which stops the processes

    signal.signal(signal.SIGTERM, on_sigterm)
    num_processes, num_ps = args.num_processes, args.ps
    if (args.ps is None) != (args.workers is None):
        parser.error("--ps and --workers go together (a chief is added): e.g. --ps 1 --workers 2")
    if args.ps is not None:
        num_processes = 1 + args.ps + args.workers
    if num_processes is None:
        parser.error("give -n N (processes), or --ps N --workers M (a parameter-server job)")
    try:
        result = launch(
            cmd,
            num_processes,
            num_ps=num_ps,
            restart_workers=args.restart_workers,
            devices_per_process=args.devices_per_process,
            port=args.port,
            host=args.host,
            timeout_s=args.timeout,
            grace_s=args.grace,
            report_s=args.report,
            stop_on_failure=not args.keep_going,
        )
    except ValueError as e:
        parser.error(str(e))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
