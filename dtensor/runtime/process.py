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
  error naming its address within ``timeout_s``. A process that ends with a
  non-zero status (``sys.exit(N)``, an uncaught exception) records it and
  leaves at once (no shutdown barrier to hang on); one that is killed or
  stops heartbeating is noticed within ``heartbeat_timeout_s``; the
  coordinator's death is noticed at once. Every other process then prints
  one line naming the lost process and what happened, and exits with status
  :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST` (:mod:`dtensor.runtime.peers`; every status is
  listed in :mod:`dtensor.runtime.exit_codes`).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from dtensor import compat
from dtensor.runtime import hosts, peers, watchdog

__all__ = ["barrier", "client_id", "initialize", "is_initialized", "num_clients", "shutdown"]

from dtensor.runtime.cluster import (
    ENV_DEVICES_PER_PROCESS,
    LAUNCHER_SOURCE,
    ClusterConfigError,
    ClusterSpec,
    DistributedRuntimeError,
    int_env,
    resolve_cluster,
)


# ------------------------------------------------------------------ runtime
@dataclasses.dataclass
class _State:
    spec: ClusterSpec | None = None
    initialized: bool = False
    monitor: peers.PeerMonitor | None = None
    atexit_registered: bool = False
    barrier_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    previous_excepthook: Any = None
    previous_exit: Any = None
    exit_status: int = 0
    shutdown_timeout_s: float = 120


_state = _State()
_lock = threading.Lock()
_SYS_EXIT = sys.exit


def _excepthook(exc_type: Any, exc: Any, tb: Any) -> None:
    """Uncaught exception in a multi-process job: report it, record status 1 and leave at once.

    Waiting in JAX's shutdown barrier would hang this process while the
    others wait in a collective for it; leaving (with an exit record) lets
    them name it. A collective that failed because a peer was lost ends with
    that peer named instead (:func:`dtensor.runtime.peers.await_loss`).
    """
    hook = _state.previous_excepthook or sys.__excepthook__
    try:
        peers.await_loss(_state.monitor, exc_type, exc)  # a lost peer's echo: name the peer
        hook(exc_type, exc, tb)
        peers.report_uncaught(_state.monitor, exc_type)
    finally:
        os._exit(1)


def _recording_exit(status: Any = None) -> None:
    """``sys.exit`` while in a job: remember the status the main thread asks for, then exit."""
    if threading.current_thread() is threading.main_thread():
        if status is None:
            _state.exit_status = 0
        elif isinstance(status, int) and not isinstance(status, bool):
            _state.exit_status = status & 0xFF  # what the OS reports, as for exit(3) in C
        else:  # a message: Python prints it and exits with 1
            _state.exit_status = 1
    (_state.previous_exit or _SYS_EXIT)(status)


def _at_exit() -> None:
    """Runs before JAX's own exit hook (which holds the shutdown barrier).

    A non-zero ``sys.exit`` status is recorded for the others and the process
    leaves with it now; a normal end waits, still watching, for the others to
    end too, so the barrier after it cannot hang on a failed process.
    """
    monitor = _state.monitor
    if monitor is None or monitor.stop.is_set():
        return
    status = _state.exit_status
    if status != 0:
        monitor.leave(status, f"exited with status {status}")
    monitor.finish(_state.shutdown_timeout_s)


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
    heartbeat_timeout_s: float | None = None,
    shutdown_timeout_s: float = 120,
    summary: bool = True,
    tolerate: Sequence[int] = (),
    names: Mapping[int, str] | None = None,
) -> ClusterSpec | None:
    """Join this process to a multi-process job (a no-op for a single process).

    Call it first, before any JAX computation (even ``jax.devices()``). With
    no arguments the cluster comes from :mod:`dtensor.launch`'s variables,
    JAX's own detection (TPU VMs, SLURM, Open MPI, Kubernetes) or
    ``TF_CONFIG``; see :func:`resolve_cluster`. On CPU it selects gloo
    collectives and, given ``local_device_count`` (or the launcher's
    ``DTENSOR_DEVICES_PER_PROCESS``), that many simulated devices. Process 0
    prints one table of the resolved cluster.

    In a multi-process job it also starts watching the other processes
    (:mod:`dtensor.runtime.peers`) and, until :func:`shutdown`, replaces
    ``sys.excepthook`` and ``sys.exit`` (to learn this process's exit status;
    a ``raise SystemExit(N)`` that bypasses ``sys.exit`` is not seen, and such
    a process ends as if with status 0 while the others wait for it).

    Args:
        coordinator_address: ``host:port`` of process 0 (which runs the
            coordination service there).
        num_processes: the number of processes.
        process_id: this process's index, ``0 <= process_id < num_processes``.
        local_device_count: CPU devices to simulate in this process.
        timeout_s: how long to wait for the coordinator and all processes to
            join before failing.
        heartbeat_timeout_s: how long a silent process (killed, hung) may go
            before the others declare it lost and exit with
            :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST`: each survivor
            names it and ends within ``heartbeat_timeout_s + 10`` s (about a
            second under :mod:`dtensor.launch`, and for a non-zero exit, an
            uncaught exception or the coordinator's death). Default
            ``$DTENSOR_HEARTBEAT_TIMEOUT_S``, else 15, the same in every
            process; JAX's own limit is set beyond it
            (:mod:`dtensor.runtime.watchdog`, which also ends a process 143
            at most ``$DTENSOR_SIGTERM_GRACE_S``, default 60 s, after SIGTERM).
        shutdown_timeout_s: how long a finished process waits at exit for
            the others to finish too (JAX's shutdown barrier); it stops
            waiting, with :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST`, as soon as one of them is
            lost.
        summary: print the cluster table on process 0.
        tolerate: processes whose loss does not stop this one (the workers of a ps job).
        names: how messages name processes (``{1: "ps 0"}``).

    Returns:
        The resolved cluster, or ``None`` for a single process.

    Raises:
        ClusterConfigError: a malformed cluster description.
        DistributedRuntimeError: called after JAX started its backends, the
            coordinator cannot be reached within ``timeout_s`` or its port is
            taken. (When not every process joins within ``timeout_s``, the
            waiting ones print who they waited for and exit with
            :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST`: JAX cannot be interrupted there.)

    Examples:
        >>> import dtensor
        >>> dtensor.initialize() is None  # no cluster here: one process
        True
        >>> dtensor.client_id(), dtensor.num_clients()
        (0, 1)
    """
    with _lock:
        spec = resolve_cluster(coordinator_address, num_processes, process_id)
        heartbeat_timeout_s = watchdog.heartbeat_timeout(heartbeat_timeout_s)
        grace_s = watchdog.sigterm_grace()
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
            if local_device_count is not None and not compat.backends_initialized():
                _configure_cpu(local_device_count)
            return None
        if compat.backends_initialized():
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
            names=names,
        )
        watchdog.guard_sigterm(f"process {spec.process_id} of {spec.num_processes}", grace_s)
        if _state.monitor is not None:  # before any loss can matter: no step has run yet
            _state.monitor.tolerate, _state.monitor.names = frozenset(tolerate), dict(names or {})
        _state.initialized, _state.spec = True, spec
        _state.shutdown_timeout_s = shutdown_timeout_s
        _state.previous_excepthook, sys.excepthook = sys.excepthook, _excepthook
        _state.previous_exit, _state.exit_status = sys.exit, 0
        sys.exit = _recording_exit
        if not _state.atexit_registered:  # runs before JAX's own shutdown (registered earlier)
            atexit.register(_at_exit)
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
    spec: ClusterSpec,
    *,
    timeout_s: float,
    heartbeat_timeout_s: float,
    shutdown_timeout_s: float,
    names: Mapping[int, str] | None = None,
) -> ClusterSpec:
    deadline = time.monotonic() + timeout_s
    if spec.coordinator_address is not None and spec.process_id != 0:
        _wait_for_coordinator(spec, deadline)
    elif spec.coordinator_address is not None:
        _check_port_free(spec)
    joined = threading.Event()

    def join_timeout() -> None:
        if not joined.wait(max(0.0, deadline - time.monotonic())):
            peers.die(
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
            **compat.distributed_timeouts(
                initialization_timeout=int(timeout_s) + 10,
                heartbeat_timeout_seconds=watchdog.jax_heartbeat_timeout(heartbeat_timeout_s),
                shutdown_timeout_seconds=int(shutdown_timeout_s),
            ),
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
    if spec.process_id is None or spec.num_processes is None:  # JAX detected the cluster
        spec = dataclasses.replace(
            spec, num_processes=jax.process_count(), process_id=jax.process_index()
        )
    spec = dataclasses.replace(
        spec, coordinator_address=compat.coordinator_address() or spec.coordinator_address
    )
    assert spec.process_id is not None and spec.num_processes is not None
    # one address per process that the others reach, for gloo and the transfer servers
    client, where = compat.distributed_client(), (spec.process_id, spec.num_processes)
    placement = hosts.settle(
        client, *where, spec.coordinator_address, timeout_s=timeout_s, names=names
    )
    compat.use_gloo_address(placement.address)
    monitor = peers.PeerMonitor.from_env(
        client, *where, spec.coordinator_address, heartbeat_timeout_s
    )
    _state.monitor = monitor
    monitor.start()
    peers.install_abort_hook(monitor)
    return spec


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
    if _state.spec is not None and _state.spec.process_id is not None:
        return _state.spec.process_id
    return jax.process_index() if is_initialized() else 0


def num_clients() -> int:
    """The number of processes in the job (1 for a single process).

    Examples:
        >>> import dtensor
        >>> dtensor.num_clients()
        1
    """
    if _state.spec is not None and _state.spec.num_processes is not None:
        return _state.spec.num_processes
    return jax.process_count() if is_initialized() else 1


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
    client = compat.distributed_client()
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


def peer_monitor() -> peers.PeerMonitor | None:
    """This process's watch on the others (``None`` outside a multi-process job)."""
    return _state.monitor


def shutdown() -> None:
    """Leave the multi-process job (waits for the other processes; a no-op for one).

    Examples:
        >>> import dtensor
        >>> dtensor.shutdown()
    """
    with _lock:
        if _state.monitor is not None:
            _state.monitor.finish(_state.shutdown_timeout_s)
            peers.uninstall_abort_hook()
        _state.monitor = None
        hosts.forget()
        if is_initialized():
            compat.distributed_shutdown()
        if _state.previous_excepthook is not None and sys.excepthook is _excepthook:
            sys.excepthook = _state.previous_excepthook
        if _state.previous_exit is not None and sys.exit is _recording_exit:
            sys.exit = _state.previous_exit
        _state.spec, _state.initialized, _state.previous_excepthook = None, False, None
        _state.previous_exit = None
        _state.barrier_counts.clear()
