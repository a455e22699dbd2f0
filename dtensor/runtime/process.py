"""The multi-process runtime: ``initialize``, ``client_id``, ``num_clients``, ``barrier``.

A thin, loud layer over ``jax.distributed`` (JAX's coordination service, and
XLA's collectives: gloo on CPU, NCCL on GPU, ICI/DCN on TPU). What it adds:

- **Finding the cluster.** :func:`initialize` with no arguments reads, in
  order, the variables :mod:`dtensor.launch` sets (``DTENSOR_COORDINATOR``,
  ``DTENSOR_NUM_PROCESSES``, ``DTENSOR_PROCESS_ID``,
  ``DTENSOR_DEVICES_PER_PROCESS``), JAX's own cluster detection (Cloud TPU
  VMs, SLURM, Open MPI, Kubernetes), then a TensorFlow ``TF_CONFIG`` JSON.
  Nothing found means one process, and every function here still works.
- **Failing fast and by name.** A coordinator that cannot be reached is an
  error naming its address within ``timeout_s``. A peer that dies mid-run
  (or stops heartbeating) makes every other process print which process was
  lost and exit with status :data:`EXIT_PEER_LOST` within
  ``heartbeat_timeout_s`` (plus a few seconds); an uncaught exception in one
  process ends that process at once (no shutdown barrier to hang on), so the
  others follow within the same bound.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import os
import re
import socket
import sys
import threading
import time
from typing import Any

import jax

__all__ = [
    "ClusterConfigError",
    "ClusterSpec",
    "DistributedRuntimeError",
    "ENV_COORDINATOR",
    "ENV_DEVICES_PER_PROCESS",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "EXIT_PEER_LOST",
    "barrier",
    "client_id",
    "initialize",
    "is_initialized",
    "num_clients",
    "parse_tf_config",
    "resolve_cluster",
    "shutdown",
]

from dtensor.runtime.cluster import ENV_COORDINATOR as ENV_COORDINATOR
from dtensor.runtime.cluster import ENV_DEVICES_PER_PROCESS as ENV_DEVICES_PER_PROCESS
from dtensor.runtime.cluster import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from dtensor.runtime.cluster import ENV_PROCESS_ID as ENV_PROCESS_ID
from dtensor.runtime.cluster import EXIT_PEER_LOST as EXIT_PEER_LOST
from dtensor.runtime.cluster import LAUNCHER_SOURCE, int_env
from dtensor.runtime.cluster import ClusterConfigError as ClusterConfigError
from dtensor.runtime.cluster import ClusterSpec as ClusterSpec
from dtensor.runtime.cluster import DistributedRuntimeError as DistributedRuntimeError
from dtensor.runtime.cluster import parse_tf_config as parse_tf_config
from dtensor.runtime.cluster import resolve_cluster as resolve_cluster


# ------------------------------------------------------------------ runtime
@dataclasses.dataclass
class _State:
    spec: ClusterSpec | None = None
    initialized: bool = False
    watchdog: _Watchdog | None = None
    atexit_registered: bool = False
    barrier_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    previous_excepthook: Any = None


_state = _State()
_lock = threading.Lock()


def _die(message: str, code: int = EXIT_PEER_LOST) -> None:
    """Print ``message`` and end this process now (no atexit, no shutdown barrier)."""
    try:
        sys.stdout.flush()
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    finally:
        os._exit(code)


_ALIVE = "dtensor/alive/"
_DONE = "done"


class _Watchdog:
    """Each process's liveness, through the coordination service's key-value store.

    Every ``period`` seconds each process bumps its counter under
    ``dtensor/alive/<id>`` and reads the others'. A counter that has not moved
    for ``timeout`` seconds names a lost process; a store that cannot be
    reached means the coordinator (process 0) is gone. Either way this
    process prints who was lost and exits with :data:`EXIT_PEER_LOST`, well
    before JAX's own heartbeat (set longer) would abort it with a C++ trace.
    A process that finishes normally writes ``done`` first.
    """

    def __init__(self, client: Any, me: int, n: int, address: str, timeout: float) -> None:
        self.client, self.me, self.n, self.address = client, me, n, address
        self.timeout = float(timeout)
        self.period = max(0.2, min(1.0, self.timeout / 5))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dtensor-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        """Stop watching and tell the others this process ended on purpose."""
        if self.stop.is_set():
            return
        self.stop.set()
        self.thread.join(timeout=5)
        with contextlib.suppress(Exception):
            self.client.key_value_set(f"{_ALIVE}{self.me}", _DONE, allow_overwrite=True)

    def _run(self) -> None:
        start = time.monotonic()
        seen: dict[int, tuple[str | None, float]] = {i: (None, start) for i in range(self.n)}
        beat = 0
        failing_since: float | None = None
        while not self.stop.is_set():
            beat += 1
            try:
                self.client.key_value_set(f"{_ALIVE}{self.me}", str(beat), allow_overwrite=True)
                entries = self.client.key_value_dir_get(_ALIVE)
                failing_since = None
            except Exception as e:  # the store is process 0's: it may be gone
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if self.stop.is_set():
                    return
                if now - failing_since >= 3 * self.period:  # not a one-off RPC hiccup
                    _die(self._lost_message([0] if self.me != 0 else [], str(e)))
                    return
                self.stop.wait(self.period)
                continue
            now = time.monotonic()
            for key, value in entries:
                with contextlib.suppress(ValueError):
                    i = int(key.rstrip("/").rsplit("/", 1)[-1])
                    if seen.get(i, (None, 0.0))[0] != value:
                        seen[i] = (value, now)
            lost = [
                i
                for i, (value, when) in seen.items()
                if i != self.me and value != _DONE and now - when > self.timeout
            ]
            if lost and not self.stop.is_set():
                _die(self._lost_message(lost, f"no sign of life for {self.timeout:g} s"))
                return
            self.stop.wait(self.period)

    def _lost_message(self, lost: list[int], detail: str) -> str:
        if lost == [0] and self.me != 0:
            who = f"process 0 (the coordinator at {self.address})"
        elif lost:
            who = "process " + ", ".join(map(str, lost))
        else:
            who = "the coordination service"
        return (
            f"dtensor.runtime: process {self.me} of {self.n} lost {who}: it exited, was killed, "
            f"or stopped responding ({detail.strip()}). Stopping process {self.me} with exit "
            f"status {EXIT_PEER_LOST} so the job fails instead of hanging; look for the first "
            "error in the lost process's own output."
        )


_RUNTIME_STATUS = re.compile(
    r"^(UNKNOWN|UNAVAILABLE|INTERNAL|ABORTED|DEADLINE_EXCEEDED|CANCELLED|FAILED_PRECONDITION): "
    r"|gloo|nccl|connection (closed|reset|refused)",
    re.IGNORECASE,
)


def _maybe_peer_failure(exc_type: Any, exc: Any) -> bool:
    """Whether an uncaught exception looks like a collective failing for a lost peer.

    XLA reports runtime failures as ``JaxRuntimeError``, and some (gloo's
    "Connection closed by peer") as a ``ValueError`` whose text starts with
    an absl status code.
    """
    return issubclass(exc_type, jax.errors.JaxRuntimeError) or bool(
        _RUNTIME_STATUS.search(str(exc))
    )


def _excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    """Uncaught exception in a multi-process job: report it and leave at once.

    Waiting in JAX's shutdown barrier would hang this process while the
    others wait in a collective for it; exiting lets them see it is gone. An
    XLA runtime error is often a collective failing because a peer died, so
    for those the watchdog first gets one heartbeat timeout to name the lost
    process (it then ends this process with :data:`EXIT_PEER_LOST`).
    """
    hook = _state.previous_excepthook or sys.__excepthook__
    try:
        hook(exc_type, exc, tb)
        watchdog = _state.watchdog
        if watchdog is not None and _maybe_peer_failure(exc_type, exc):
            sys.stderr.write(
                f"dtensor.runtime: process {client_id()} of {num_clients()} got an XLA runtime "
                f"error; checking for up to {watchdog.timeout:g} s whether another process "
                "was lost.\n"
            )
            sys.stderr.flush()
            watchdog.stop.wait(watchdog.timeout + 3 * watchdog.period)
        sys.stderr.write(
            f"dtensor.runtime: process {client_id()} of {num_clients()} stopped by an uncaught "
            f"{exc_type.__name__}; the other processes will stop too.\n"
        )
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(1)


def _backends_started() -> bool:
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def _configure_cpu(local_device_count: int | None) -> None:
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if local_device_count is not None:
        if not isinstance(local_device_count, int) or local_device_count < 1:
            raise ClusterConfigError(
                f"local_device_count={local_device_count!r} is not valid; give a positive "
                "integer (the CPU devices to simulate in this process), or None."
            )
        jax.config.update("jax_num_cpu_devices", local_device_count)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    timeout_s: float = 60,
    heartbeat_timeout_s: float = 20,
    shutdown_timeout_s: float = 120,
    summary: bool = True,
) -> ClusterSpec | None:
    """Join this process to a multi-process job (a no-op for a single process).

    Call it first, before any JAX computation (even ``jax.devices()``). With
    no arguments the cluster comes from :mod:`dtensor.launch`'s variables,
    JAX's own detection (TPU VMs, SLURM, Open MPI, Kubernetes) or
    ``TF_CONFIG``; see :func:`resolve_cluster`. On CPU it selects gloo
    collectives and, given ``local_device_count`` (or the launcher's
    ``DTENSOR_DEVICES_PER_PROCESS``), that many simulated devices. Process 0
    prints one table of the resolved cluster.

    Args:
        coordinator_address: ``host:port`` of process 0 (which runs the
            coordination service there).
        num_processes: the number of processes.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        local_device_count: CPU devices to simulate in this process.
        timeout_s: how long to wait for the coordinator and all processes to
            join before failing.
        heartbeat_timeout_s: how long a silent process may go before the
            others declare it lost and exit with :data:`EXIT_PEER_LOST`.
        shutdown_timeout_s: how long a finished process waits at exit for
            the others to finish too (JAX's shutdown barrier). A process that
            ends with a non-zero ``sys.exit`` while the others wait for it in
            a collective fails the job only after this long; uncaught
            exceptions do not wait.
        summary: print the cluster table on process 0.

    Returns:
        The resolved cluster, or ``None`` for a single process.

    Raises:
        ClusterConfigError: a malformed cluster description.
        DistributedRuntimeError: called after JAX started its backends, the
            coordinator cannot be reached within ``timeout_s`` or its port is
            taken. (When not every process joins within ``timeout_s``, the
            waiting ones print who they waited for and exit with
            :data:`EXIT_PEER_LOST`: JAX cannot be interrupted there.)

    Examples:
        >>> import dtensor
        >>> dtensor.initialize() is None  # no cluster here: one process
        True
        >>> dtensor.client_id(), dtensor.num_clients()
        (0, 1)
    """
    with _lock:
        spec = resolve_cluster(coordinator_address, num_processes, process_id)
        env_count = os.environ.get(ENV_DEVICES_PER_PROCESS)
        if local_device_count is None and env_count and spec is not None:
            if spec.source == LAUNCHER_SOURCE:
                local_device_count = int_env(os.environ, ENV_DEVICES_PER_PROCESS)
        if spec is not None:
            spec = dataclasses.replace(spec, local_device_count=local_device_count)
        if _state.initialized:
            done = _state.spec
            asked = (coordinator_address, num_processes, process_id)
            if done is not None and (
                asked == (None, None, None)
                or asked == (done.coordinator_address, done.num_processes, done.process_id)
            ):
                return done
            raise DistributedRuntimeError(
                f"dtensor.initialize() was already called with {_state.spec}; now got {spec}. "
                "Call it once per process (or dtensor.shutdown() first)."
            )
        if spec is None:  # one process: nothing to join
            if local_device_count is not None and not _backends_started():
                _configure_cpu(local_device_count)
            return None
        if _backends_started():
            raise DistributedRuntimeError(
                f"dtensor.initialize() for a {spec.num_processes or 'multi'}-process job (from "
                f"{spec.source}) was called after JAX had started its backends; got a process "
                "where jax.devices() or a computation already ran. Call dtensor.initialize() "
                "first thing in the program, before any other JAX call."
            )
        _configure_cpu(local_device_count)
        spec = _connect(
            spec,
            timeout_s=timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
        )
        _state.initialized, _state.spec = True, spec
        _state.previous_excepthook = sys.excepthook
        sys.excepthook = _excepthook
        if not _state.atexit_registered:  # runs before JAX's own shutdown (registered earlier)
            atexit.register(_finish_watchdog)
            _state.atexit_registered = True
    devices = jax.devices()  # every process starts its backend: a collective step
    if summary and client_id() == 0:
        _print_summary(spec, devices)
    return spec


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _wait_for_coordinator(spec: ClusterSpec, deadline: float) -> None:
    """Until ``deadline``, try to open a TCP connection to the coordinator."""
    assert spec.coordinator_address is not None
    host, port = _split_address(spec.coordinator_address)
    last: Exception | None = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    raise DistributedRuntimeError(
        f"dtensor.initialize(): process {spec.process_id} of {spec.num_processes} could not "
        f"reach the coordinator at {spec.coordinator_address} (from {spec.source}) within the "
        f"timeout; the last attempt said: {last}. Check that the address is process 0's host "
        "and port, that process 0 is running, and that no firewall is in the way; or raise "
        "timeout_s if process 0 starts slowly."
    )


def _check_port_free(spec: ClusterSpec) -> None:
    """Process 0: the coordinator's port must be free (JAX can crash when it is not)."""
    assert spec.coordinator_address is not None
    _, port = _split_address(spec.coordinator_address)
    family, host = (socket.AF_INET6, "::") if socket.has_ipv6 else (socket.AF_INET, "0.0.0.0")
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            return  # e.g. no IPv6 here: let JAX try
        raise DistributedRuntimeError(
            f"dtensor.initialize(): process 0 cannot start the coordinator at "
            f"{spec.coordinator_address} (from {spec.source}): port {port} is already in use "
            f"on this host ({e.strerror}). Choose a free port (python -m dtensor.launch picks "
            "one by default), or stop the process holding it."
        ) from None


def _connect(
    spec: ClusterSpec, *, timeout_s: float, heartbeat_timeout_s: float, shutdown_timeout_s: float
) -> ClusterSpec:
    from jax._src import distributed

    deadline = time.monotonic() + timeout_s
    if spec.coordinator_address is not None and spec.process_id != 0:
        _wait_for_coordinator(spec, deadline)
    elif spec.coordinator_address is not None:
        _check_port_free(spec)
    joined = threading.Event()

    def join_timeout() -> None:
        if not joined.wait(max(0.0, deadline - time.monotonic())):
            _die(
                f"dtensor.initialize(): process {spec.process_id} of "
                f"{spec.num_processes or '?'}: not all processes joined the job at coordinator "
                f"{spec.coordinator_address} (from {spec.source}) within {timeout_s:g} s. Start "
                "every process (each with its own process_id), with the same coordinator "
                "address and number of processes, or raise timeout_s."
            )

    threading.Thread(target=join_timeout, name="dtensor-join-timeout", daemon=True).start()
    try:
        # JAX's own limits are the backstop; ours fire first and name who is missing.
        jax.distributed.initialize(
            spec.coordinator_address,
            spec.num_processes,
            spec.process_id,
            initialization_timeout=int(timeout_s) + 10,
            heartbeat_timeout_seconds=int(heartbeat_timeout_s) + 10,
            shutdown_timeout_seconds=int(shutdown_timeout_s),
        )
    except Exception as e:
        joined.set()
        jax.distributed.shutdown()
        raise DistributedRuntimeError(
            f"dtensor.initialize(): process {spec.process_id} could not start the job at "
            f"coordinator {spec.coordinator_address} (from {spec.source}): {e}. Check the "
            "address and that its port is free on process 0's host."
        ) from None
    joined.set()
    state = distributed.global_state
    spec = dataclasses.replace(
        spec,
        coordinator_address=state.coordinator_address,
        num_processes=state.num_processes,
        process_id=state.process_id,
    )
    _state.watchdog = _Watchdog(
        state.client,
        state.process_id,
        state.num_processes,
        str(state.coordinator_address),
        heartbeat_timeout_s,
    )
    _state.watchdog.start()
    return spec


def _finish_watchdog() -> None:
    if _state.watchdog is not None:
        _state.watchdog.finish()


def _print_summary(spec: ClusterSpec, devices: list[Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    per_process: dict[int, int] = {}
    for d in devices:
        per_process[d.process_index] = per_process.get(d.process_index, 0) + 1
    counts = sorted(set(per_process.values()))
    table = Table(title="dtensor cluster", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    table.add_row("processes", str(num_clients()))
    table.add_row("devices per process", ", ".join(map(str, counts)))
    table.add_row("devices in all", str(len(devices)))
    table.add_row("platform", f"{devices[0].platform} ({devices[0].device_kind})")
    table.add_row("coordinator", str(spec.coordinator_address))
    table.add_row("source", spec.source)
    Console(stderr=False).print(table)
    sys.stdout.flush()


def is_initialized() -> bool:
    """Whether this process joined a multi-process job with :func:`initialize`."""
    return jax.distributed.is_initialized()


def client_id() -> int:
    """This process's index in the job (0 for a single process).

    Examples:
        >>> import dtensor
        >>> dtensor.client_id()
        0
    """
    from jax._src import distributed

    return int(distributed.global_state.process_id) if is_initialized() else 0


def num_clients() -> int:
    """The number of processes in the job (1 for a single process).

    Examples:
        >>> import dtensor
        >>> dtensor.num_clients()
        1
    """
    from jax._src import distributed

    return int(distributed.global_state.num_processes) if is_initialized() else 1


def barrier(name: str, *, timeout_s: float = 60) -> None:
    """Wait until every process reaches ``barrier(name)`` (immediate for one process).

    Barriers with the same name may be used again; all processes must pass
    them in the same order.

    Args:
        name: what the processes wait for (appears in errors).
        timeout_s: how long to wait for the slowest process.

    Raises:
        DistributedRuntimeError: not every process arrived within ``timeout_s``.

    Examples:
        >>> import dtensor
        >>> dtensor.barrier("start")  # one process: returns at once
    """
    if not isinstance(name, str) or not name:
        raise ValueError(
            f"barrier name {name!r} is not valid; give a non-empty string naming the "
            "point all processes wait at, e.g. barrier('checkpoint-saved')."
        )
    if not is_initialized():
        return
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        return
    count = _state.barrier_counts.get(name, 0)
    _state.barrier_counts[name] = count + 1
    try:
        client.wait_at_barrier(f"dtensor/{name}/{count}", int(timeout_s * 1000))
    except Exception as e:
        raise DistributedRuntimeError(
            f"barrier({name!r}) on process {client_id()}: not all {num_clients()} processes "
            f"arrived within {timeout_s} s. A process is slower than timeout_s, took another "
            "path through the program, or failed; raise timeout_s or make every process call "
            f"barrier({name!r}) in the same order. Coordination service said: {e}"
        ) from None


def shutdown() -> None:
    """Leave the multi-process job (waits for the other processes; a no-op for one).

    Examples:
        >>> import dtensor
        >>> dtensor.shutdown()
    """
    with _lock:
        _finish_watchdog()
        _state.watchdog = None
        if is_initialized():
            jax.distributed.shutdown()
        if _state.previous_excepthook is not None and sys.excepthook is _excepthook:
            sys.excepthook = _state.previous_excepthook
        _state.spec, _state.initialized, _state.previous_excepthook = None, False, None
        _state.barrier_counts.clear()
