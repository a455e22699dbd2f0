"""Every exit status dtensor's runtime, launcher and strategies give a process, in one place.

A job that fails says why twice: one line on stderr, and its exit status, so a
scheduler (or :mod:`dtensor.launch`) can tell "restart me" from "a peer was
lost" from "my own error" without reading logs.

====  =============================  ===========================================
code  name                           meaning
====  =============================  ===========================================
0     (success)                      every process finished
1     (Python's own)                 an uncaught exception in this process
N     (the program's own)            ``sys.exit(N)``; other processes report it
                                     as "process i exited with status N"
75    :data:`EXIT_PEER_LOST`         this process was fine, but another process
                                     of the job was lost (exited non-zero, was
                                     killed, stopped responding, or never
                                     joined); its one line names that process
76    :data:`EXIT_STEP_TIMEOUT`      a step's collectives did not finish within
                                     ``CommunicationOptions.timeout_seconds``
124   :data:`EXIT_TIMEOUT`           :mod:`dtensor.launch` stopped the job at its
                                     ``--timeout``
134   (128 + SIGABRT)                JAX's own C++ abort, when dtensor could not
                                     attribute it to a lost process
128+N (signal N)                     :mod:`dtensor.launch`'s report of a process
                                     killed by signal N (137: SIGKILL)
143   :data:`EXIT_PREEMPTED`         ``PreemptionCheckpointHandler`` saved at a
                                     preemption notice (SIGTERM), or SIGTERM's
                                     grace period ran out
                                     (``DTENSOR_SIGTERM_GRACE_S``): restart me
====  =============================  ===========================================

75 is ``EX_TEMPFAIL`` from BSD's ``sysexits.h`` ("a temporary failure; retry"),
which is what a survivor of a lost peer is. The launcher returns the first
failing process's own status, preferring a cause over a 75 (a survivor that
reported first does not hide the process that failed).
"""

from __future__ import annotations

import signal

__all__ = [
    "EXIT_PEER_LOST",
    "EXIT_PREEMPTED",
    "EXIT_STEP_TIMEOUT",
    "EXIT_TIMEOUT",
    "describe",
]

EXIT_PEER_LOST = 75
"""Another process of the job was lost; this one stopped so the job fails instead of hanging."""

EXIT_STEP_TIMEOUT = 76
"""A step's collectives did not finish within ``CommunicationOptions.timeout_seconds``."""

EXIT_TIMEOUT = 124
""":mod:`dtensor.launch` stopped the job at its overall timeout (as coreutils' ``timeout``)."""

EXIT_PREEMPTED = 128 + signal.SIGTERM
"""A preemption save finished (128 + SIGTERM = 143): the job wants to be restarted."""


def describe(status: int) -> str:
    """What a process's exit status means, in words (negative: killed by that signal, as ``Popen``).

    Examples:
        >>> from dtensor.runtime.exit_codes import describe
        >>> describe(3)
        'exited with status 3'
        >>> describe(-9)
        'was killed by signal 9 (SIGKILL)'
        >>> describe(75)
        'exited with status 75 (it had lost another process)'
    """
    if status < 0:
        return f"was killed by signal {-status} ({_signal_name(-status)})"
    if status == EXIT_PEER_LOST:
        return f"exited with status {status} (it had lost another process)"
    if status == EXIT_STEP_TIMEOUT:
        return f"exited with status {status} (a step timed out)"
    if status == EXIT_PREEMPTED:
        return f"exited with status {status} (preempted: SIGTERM, or saved at a preemption notice)"
    if 128 < status < 128 + 65:
        return f"exited with status {status} (128 + {_signal_name(status - 128)})"
    return f"exited with status {status}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
