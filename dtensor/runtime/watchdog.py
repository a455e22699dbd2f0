"""Exits that do not wait for Python: a kernel timer that ends the process, and a SIGTERM guard.

A process that decided to stop (it lost a peer, or got SIGTERM) must end even
when its other threads are stuck: in a collective waiting for the lost peer,
in JAX's own fatal path (``LOG(FATAL)`` holding the thread that completes the
coordination service's RPCs), or holding Python's interpreter lock. So the
end does not rely on them:

- :func:`exit_after` arms a POSIX timer (``timer_create`` with
  ``SIGEV_THREAD``, through ``ctypes``) whose expiry makes glibc start a fresh
  thread that calls ``_exit(code)`` directly: no Python, no lock, no signal
  handler. The one line that names the cause is written before it with
  :func:`write_line` (a plain ``write(2)`` on file descriptor 2).
- :func:`guard_sigterm` chains a handler in front of the SIGTERM handler JAX's
  preemption notifier installs: it arms :func:`exit_after` for
  ``DTENSOR_SIGTERM_GRACE_S`` seconds (default 60) with status 143, prints one
  line saying so, and calls JAX's handler, so the preemption save
  (``PreemptionCheckpointHandler``, status 143) still happens; a process stuck
  waiting on a lost peer ends with 143 when the grace period is over. The
  handler itself needs Python's lock for a moment; a thread that holds that
  lock forever (native code that never releases it) is the one case where only
  SIGKILL ends the process.

Where ``timer_create`` is missing (not glibc), :func:`exit_after` falls back to
a Python daemon thread (``os._exit``), which needs the interpreter lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

from dtensor.runtime.cluster import ClusterConfigError
from dtensor.runtime.exit_codes import EXIT_PREEMPTED

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_SIGTERM_GRACE_S",
    "ENV_HEARTBEAT_TIMEOUT",
    "ENV_SIGTERM_GRACE",
    "exit_after",
    "guard_sigterm",
    "heartbeat_timeout",
    "jax_heartbeat_timeout",
    "sigterm_grace",
    "write_line",
]

ENV_HEARTBEAT_TIMEOUT = "DTENSOR_HEARTBEAT_TIMEOUT_S"
"""Overrides ``initialize(heartbeat_timeout_s=...)``'s default (15 s) for every process of a job."""
ENV_SIGTERM_GRACE = "DTENSOR_SIGTERM_GRACE_S"
"""Seconds a process of a job may take to end after SIGTERM (default 60; ``off``: no limit)."""
DEFAULT_HEARTBEAT_TIMEOUT_S = 15.0
DEFAULT_SIGTERM_GRACE_S = 60.0

_CLOCK_MONOTONIC = 1
_SIGEV_THREAD = 2
_SIG_DFL, _SIG_IGN = 0, 1
_SA_SIGINFO = 0x4


# ------------------------------------------------------------ configuration
def _seconds(environ: Mapping[str, str], name: str, default: float, *, off: bool) -> float | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    if off and raw.lower() == "off":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        allowed = "a positive number of seconds" + (" or 'off'" if off else "")
        raise ClusterConfigError(
            f"{name}={raw!r} is not valid; give {allowed} (default {default:g}), e.g. "
            f"{name}=10, or unset it."
        )
    return value


def heartbeat_timeout(given: float | None, environ: Mapping[str, str] | None = None) -> float:
    """The peer monitor's heartbeat timeout: ``given``, else ``$DTENSOR_HEARTBEAT_TIMEOUT_S``, else 15.

    Examples:
        >>> from dtensor.runtime.watchdog import heartbeat_timeout
        >>> heartbeat_timeout(None, {}), heartbeat_timeout(None, {"DTENSOR_HEARTBEAT_TIMEOUT_S": "3"})
        (15.0, 3.0)
        >>> heartbeat_timeout(8, {"DTENSOR_HEARTBEAT_TIMEOUT_S": "3"})  # an argument wins
        8.0
    """
    if given is not None:
        if not isinstance(given, int | float) or isinstance(given, bool) or not given > 0:
            raise ClusterConfigError(
                f"heartbeat_timeout_s={given!r} is not valid; give a positive number of seconds "
                f"(default {DEFAULT_HEARTBEAT_TIMEOUT_S:g}, or ${ENV_HEARTBEAT_TIMEOUT})."
            )
        return float(given)
    env = os.environ if environ is None else environ
    value = _seconds(env, ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT_S, off=False)
    assert value is not None
    return value


def jax_heartbeat_timeout(monitor_timeout_s: float) -> int:
    """The heartbeat timeout handed to JAX's coordination service: well after the monitor's.

    JAX's own verdict on a silent process is a ``LOG(FATAL)`` that names
    nobody (and, racing the monitor, could leave the process stuck); the
    monitor must always decide first. It decides within
    ``monitor_timeout_s + 10`` s; JAX is given twice that plus 30 s.

    Examples:
        >>> from dtensor.runtime.watchdog import jax_heartbeat_timeout
        >>> jax_heartbeat_timeout(15), jax_heartbeat_timeout(3)
        (80, 56)
    """
    return int(math.ceil(2 * (monitor_timeout_s + 10) + 30))


def sigterm_grace(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds from SIGTERM to a forced exit 143 (``$DTENSOR_SIGTERM_GRACE_S``; ``None``: no limit).

    Examples:
        >>> from dtensor.runtime.watchdog import sigterm_grace
        >>> sigterm_grace({}), sigterm_grace({"DTENSOR_SIGTERM_GRACE_S": "off"})
        (60.0, None)
    """
    env = os.environ if environ is None else environ
    return _seconds(env, ENV_SIGTERM_GRACE, DEFAULT_SIGTERM_GRACE_S, off=True)


# ------------------------------------------------------------ the exit itself
def write_line(text: str) -> None:
    """Write ``text`` as one line to file descriptor 2 (no Python stream, no lock)."""
    data = (" ".join(text.split()) + "\n").encode(errors="replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


class _SigEvent(ctypes.Structure):
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),  # union sigval: the int handed to _exit
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("sigev_notify_function", ctypes.c_void_p),
        ("sigev_notify_attributes", ctypes.c_void_p),
        ("_pad", ctypes.c_int * 8),
    ]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("it_interval", _TimeSpec), ("it_value", _TimeSpec)]


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.timer_create.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        libc.timer_settime.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _libc()
_timers: list[Any] = []  # armed timers stay referenced


def _kernel_timer(seconds: float, code: int) -> bool:
    if _LIBC is None:
        return False
    exit_fn = ctypes.cast(_LIBC._exit, ctypes.c_void_p).value
    event = _SigEvent(sigev_value=code, sigev_notify=_SIGEV_THREAD, sigev_notify_function=exit_fn)
    timer = ctypes.c_void_p()
    if _LIBC.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        return False
    whole = int(seconds)
    spec = _ITimerSpec(it_value=_TimeSpec(whole, max(1, int((seconds - whole) * 1e9))))
    if _LIBC.timer_settime(timer, 0, ctypes.byref(spec), None) != 0:
        return False
    _timers.append((timer, event))
    return True


def exit_after(seconds: float, code: int) -> str:
    """End this process with ``code`` in ``seconds`` whatever its threads are doing.

    Returns how: ``"kernel timer"`` (glibc's ``timer_create``; needs no
    Python) or ``"python thread"`` (the fallback).
    """
    seconds = max(0.001, float(seconds))
    if _kernel_timer(seconds, code):
        return "kernel timer"

    def fire() -> None:
        time.sleep(seconds)
        os._exit(code)

    threading.Thread(target=fire, name="dtensor-exit-after", daemon=True).start()
    return "python thread"


# ------------------------------------------------------------ SIGTERM
class _SigAction(ctypes.Structure):
    _fields_ = [
        ("sa_handler", ctypes.c_void_p),
        ("sa_mask", ctypes.c_ulong * 16),
        ("sa_flags", ctypes.c_int),
        ("sa_restorer", ctypes.c_void_p),
    ]


_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_sigterm: dict[str, Any] = {}


def _on_sigterm(signum: int) -> None:
    state = _sigterm
    if not state.get("armed"):
        state["armed"] = True
        how = exit_after(state["grace"], EXIT_PREEMPTED)
        write_line(
            f"dtensor.runtime: {state['who']} got SIGTERM; it ends with exit status "
            f"{EXIT_PREEMPTED} within {state['grace']:g} s (${ENV_SIGTERM_GRACE}, "
            f"{how}) if it has not ended by then (a preemption save that finishes first "
            "ends it earlier)."
        )
    previous = state.get("previous")
    if previous is not None:
        previous(signum)


def guard_sigterm(who: str, grace_s: float | None = None) -> bool:
    """Install the SIGTERM guard (see the module docstring) in front of the current handler.

    Installed only over a native handler (JAX's preemption notifier): under
    the default action SIGTERM already ends the process, an ignored SIGTERM
    stays ignored, and a Python handler (``signal.signal``) is the program's
    own. Returns whether the guard is now installed.

    Args:
        who: how the line names this process ("process 1 of 2").
        grace_s: seconds until the forced exit (default ``$DTENSOR_SIGTERM_GRACE_S`` or 60).
    """
    grace = sigterm_grace() if grace_s is None else grace_s
    _sigterm.update(who=who, armed=False)
    if grace is None or _LIBC is None:
        return False
    _sigterm["grace"] = float(grace)
    if "handler" in _sigterm:
        return True
    current = _SigAction()
    if _LIBC.sigaction(signal.SIGTERM, None, ctypes.byref(current)) != 0:
        return False
    python_handler = signal.getsignal(signal.SIGTERM)
    if current.sa_handler in (None, _SIG_DFL, _SIG_IGN) or callable(python_handler):
        return False
    if current.sa_flags & _SA_SIGINFO:  # a three-argument handler: not one we can chain
        return False
    handler = _HANDLER(_on_sigterm)
    _sigterm["previous"] = _HANDLER(current.sa_handler)
    ours = _SigAction()
    ours.sa_handler = ctypes.cast(handler, ctypes.c_void_p).value
    ours.sa_mask = current.sa_mask
    ours.sa_flags = current.sa_flags
    ours.sa_restorer = current.sa_restorer
    if _LIBC.sigaction(signal.SIGTERM, ctypes.byref(ours), None) != 0:
        return False
    _sigterm["handler"] = handler  # keep the C callback alive
    return True
