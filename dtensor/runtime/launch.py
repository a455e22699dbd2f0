"""Start N local processes wired into one multi-process JAX job.

    python -m dtensor.launch -n 2 --devices-per-process 2 -- python train.py --steps 10

Each process gets the environment of the launcher plus ``DTENSOR_COORDINATOR``
(``127.0.0.1:<free port>``), ``DTENSOR_NUM_PROCESSES``, ``DTENSOR_PROCESS_ID``
and, if asked, ``DTENSOR_DEVICES_PER_PROCESS``, which :func:`dtensor.initialize`
reads; ``JAX_PLATFORMS=cpu`` unless already set. Their output is streamed
with a ``[rank i]`` prefix on every line. The launcher's exit status is the
first non-zero one of its processes (``128 + signal`` for a process killed by
a signal, ``124`` on timeout); when one process fails the others are stopped
(SIGTERM to their own pids, then SIGKILL after a grace period).

It is how multi-host code is tried on one machine, and how dtensor's own
multi-process tests run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from dtensor.runtime.process import (
    ENV_COORDINATOR,
    ENV_DEVICES_PER_PROCESS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["LaunchResult", "free_port", "launch", "main"]

EXIT_TIMEOUT = 124


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchResult:
    """What a :func:`launch` run produced.

    Attributes:
        returncode: the first non-zero exit status among the processes, in
            the order they ended (``128 + signal`` for a signal, ``124`` if the
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
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


def _stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every process still running, then SIGKILL what is left after ``grace_s``."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
            p.wait()


def launch(
    cmd: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
    grace_s: float = 5.0,
    stop_on_failure: bool = True,
    out: IO[str] | None = None,
) -> LaunchResult:
    """Run ``cmd`` as ``num_processes`` local processes of one JAX job.

    Args:
        cmd: the command (a script path ending in ``.py`` runs with this
            Python).
        num_processes: how many processes to start.
        devices_per_process: CPU devices each process simulates (sets
            ``DTENSOR_DEVICES_PER_PROCESS``, read by :func:`dtensor.initialize`).
        port: the coordinator's port on 127.0.0.1 (default: a free one).
        timeout_s: stop everything after this many seconds (exit status 124).
        env: extra environment variables for the processes (on top of this
            process's environment).
        grace_s: seconds between SIGTERM and SIGKILL when stopping processes.
        stop_on_failure: stop the other processes when one fails (``False``
            lets each end by itself, e.g. to see how the others react).
        out: where to stream the prefixed output (default ``sys.stdout``).

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
    _check(cmd, num_processes, devices_per_process)
    sink: IO[str] = sys.stdout if out is None else out
    port = free_port() if port is None else port
    base = dict(os.environ)
    base.update(env or {})
    base.setdefault("JAX_PLATFORMS", "cpu")
    base["PYTHONUNBUFFERED"] = "1"
    base[ENV_COORDINATOR] = f"127.0.0.1:{port}"
    base[ENV_NUM_PROCESSES] = str(num_processes)
    if devices_per_process is not None:
        base[ENV_DEVICES_PER_PROCESS] = str(devices_per_process)
    else:
        base.pop(ENV_DEVICES_PER_PROCESS, None)
    argv = _command(cmd)
    lock = threading.Lock()
    procs: list[subprocess.Popen[bytes]] = []
    sinks: list[list[str]] = [[] for _ in range(num_processes)]
    pumps: list[threading.Thread] = []
    first: tuple[int, int] | None = None
    timed_out = False
    try:
        for rank in range(num_processes):
            proc_env = dict(base, **{ENV_PROCESS_ID: str(rank)})
            p = subprocess.Popen(
                argv, env=proc_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            procs.append(p)
            assert p.stdout is not None
            t = threading.Thread(
                target=_pump, args=(rank, p.stdout, sinks[rank], sink, lock), daemon=True
            )
            t.start()
            pumps.append(t)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while [p.poll() for p in procs].count(None):  # poll every one (no short-circuit)
            if first is None:
                for rank, p in enumerate(procs):
                    if p.returncode not in (None, 0):
                        first = (rank, _status(p.returncode))
                        break
                if first is not None and stop_on_failure:
                    _note(
                        sink,
                        lock,
                        f"rank {first[0]} exited with status {first[1]}; stopping the others",
                    )
                    _stop(procs, grace_s)
                    break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                running = [r for r, p in enumerate(procs) if p.poll() is None]
                _note(sink, lock, f"timed out after {timeout_s:g} s; stopping ranks {running}")
                _stop(procs, grace_s)
                break
            time.sleep(0.05)
    finally:
        _stop(procs, grace_s)
        for t in pumps:
            t.join(timeout=10)
    codes = tuple(_status(p.returncode) for p in procs)
    if first is None and not timed_out:
        for rank, code in enumerate(codes):
            if code != 0:
                first = (rank, code)
                break
    if timed_out and first is None:
        returncode, failed = EXIT_TIMEOUT, None
    elif first is not None:
        returncode, failed = first[1], first[0]
    else:
        returncode, failed = 0, None
    return LaunchResult(
        returncode=returncode,
        returncodes=codes,
        outputs=tuple("".join(s) for s in sinks),
        failed_rank=failed,
        timed_out=timed_out,
    )


def _note(out: IO[str], lock: threading.Lock, message: str) -> None:
    with lock:
        out.write(f"[dtensor.launch] {message}\n")
        out.flush()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dtensor.launch",
        description="Start N local processes of one JAX job (coordinator on 127.0.0.1).",
    )
    p.add_argument("-n", "--num-processes", type=int, required=True, help="processes to start")
    p.add_argument(
        "--devices-per-process", type=int, default=None, help="CPU devices each one simulates"
    )
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    p.add_argument("--timeout", type=float, default=None, help="overall limit in seconds")
    p.add_argument("--grace", type=float, default=5.0, help="seconds from SIGTERM to SIGKILL")
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
    try:
        result = launch(
            cmd,
            args.num_processes,
            devices_per_process=args.devices_per_process,
            port=args.port,
            timeout_s=args.timeout,
            grace_s=args.grace,
            stop_on_failure=not args.keep_going,
        )
    except ValueError as e:
        parser.error(str(e))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
