"""``python -m dtensor.launch``'s flags, read into the arguments of one
:func:`~dtensor.runtime.launch.launch` call (:func:`parse`).

    python -m dtensor.launch -n 2 --devices-per-process 2 -- python train.py --steps 10
    python -m dtensor.launch --ps 1 --workers 2 -- python train.py

A command line that asks for nothing runnable (no command, ``--ps`` without ``--workers``,
no process count) exits with status 2 and argparse's usage line, as :func:`error` does for
an argument :func:`~dtensor.runtime.launch.launch` refuses.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = ["LaunchArgs", "error", "parse"]


@dataclasses.dataclass(frozen=True, slots=True)
class LaunchArgs:
    """A command line's launch: ``launch(cmd, num_processes, **options)``."""

    cmd: tuple[str, ...]
    num_processes: int
    options: dict[str, Any]


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


def parse(argv: Sequence[str] | None = None) -> LaunchArgs:
    """The launch ``argv`` (default ``sys.argv[1:]``) asks for; exits 2 where it asks for none.

    Examples:
        >>> from dtensor.runtime.launch_args import parse
        >>> args = parse(["--ps", "1", "--workers", "2", "--", "python", "train.py"])
        >>> args.cmd, args.num_processes, args.options["num_ps"]
        (('python', 'train.py'), 4, 1)
    """
    parser = _parser()
    args = parser.parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("no command given; write it after '--', e.g. -- python train.py")
    num_processes = args.num_processes
    if (args.ps is None) != (args.workers is None):
        parser.error("--ps and --workers go together (a chief is added): e.g. --ps 1 --workers 2")
    if args.ps is not None:
        num_processes = 1 + args.ps + args.workers
    if num_processes is None:
        parser.error("give -n N (processes), or --ps N --workers M (a parameter-server job)")
    options = dict(
        num_ps=args.ps,
        restart_workers=args.restart_workers,
        devices_per_process=args.devices_per_process,
        port=args.port,
        host=args.host,
        timeout_s=args.timeout,
        grace_s=args.grace,
        report_s=args.report,
        stop_on_failure=not args.keep_going,
    )
    return LaunchArgs(cmd=tuple(cmd), num_processes=num_processes, options=options)


def error(message: str) -> NoReturn:
    """Exit with status 2, the usage line and ``message``, as for a flag argparse refused."""
    _parser().error(message)
