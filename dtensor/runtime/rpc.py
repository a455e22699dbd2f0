"""Messages and arrays between the tasks of a parameter-server job, on JAX's own machinery.

- **Small messages** (JSON) go through the coordination service's key-value
  store that ``jax.distributed`` starts on process 0: a request is a key
  ``dtensor/rpc/<task>/<incarnation>/<lane>/req/<n>``, its reply the same
  with ``rep``. Each *lane* is one ordered conversation (one per thread of the
  chief that talks to that task); the serving task answers each lane from its
  own thread, blocking on the store (no polling loop on the hot path).
- **Arrays** go point to point through ``jax.experimental.transfer``: every
  task starts a transfer server; the owner *offers* a list of arrays under a
  random id (``await_pull``) and the reader *pulls* it with the shapes and
  dtypes it expects. Nothing else moves arrays, and nothing is a collective, so
  tasks that take no part in an exchange never wait for it.
- **Liveness**: a serving task publishes ``dtensor/rpc/task/<process>`` (its
  incarnation and transfer address) when it starts; the peer monitor's
  heartbeat key (``dtensor/alive/<process>``) says whether it still runs. A
  restarted task publishes a new incarnation, so its old lanes are dead and
  new ones start from zero.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from dtensor import compat
from dtensor.runtime import hosts

__all__ = ["Channel", "PeerGone", "TaskInfo", "Transfers", "Watch"]

_PREFIX = "dtensor/rpc/"
STOP_KEY = _PREFIX + "stop"


class PeerGone(RuntimeError):
    """The task a message or a pull was for stopped (died, or was restarted) before it answered."""


def _deadline_exceeded(error: Exception) -> bool:
    text = str(error)
    return "DEADLINE_EXCEEDED" in text or "NOT_FOUND" in text


def task_key(process: int) -> str:
    return f"{_PREFIX}task/{process}"


@dataclasses.dataclass(frozen=True, slots=True)
class TaskInfo:
    """What a serving task published: its incarnation and its transfer server's address."""

    process: int
    incarnation: str
    address: str

    @classmethod
    def read(cls, client: Any, process: int) -> TaskInfo | None:
        raw = try_get(client, task_key(process))
        if raw is None:
            return None
        d = json.loads(raw)
        return cls(process, d["incarnation"], d["address"])

    @classmethod
    def wait(cls, client: Any, process: int, timeout_s: float) -> TaskInfo:
        raw = client.blocking_key_value_get(task_key(process), int(timeout_s * 1000))
        d = json.loads(raw)
        return cls(process, d["incarnation"], d["address"])

    def publish(self, client: Any) -> None:
        value = json.dumps({"incarnation": self.incarnation, "address": self.address})
        client.key_value_set(task_key(self.process), value, allow_overwrite=True)


def try_get(client: Any, key: str) -> str | None:
    """A key's value, or ``None`` when it is not set (never waits)."""
    try:
        return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 - the store says NOT_FOUND by raising
        if "NOT_FOUND" in str(e):
            return None
        raise


class Watch:
    """Whether a task is alive: its heartbeat key changed within ``timeout_s`` and its
    incarnation is still the one this watch started with."""

    def __init__(self, client: Any, info: TaskInfo, timeout_s: float) -> None:
        self.client, self.info, self.timeout_s = client, info, timeout_s
        self._beat: str | None = None
        self._since = time.monotonic()

    def alive(self) -> bool:
        now = time.monotonic()
        beat = try_get(self.client, f"dtensor/alive/{self.info.process}")
        if beat != self._beat:
            self._beat, self._since = beat, now
        if now - self._since > self.timeout_s:
            return False
        raw = try_get(self.client, task_key(self.info.process))
        return raw is None or json.loads(raw)["incarnation"] == self.info.incarnation


class Channel:
    """One lane of requests to a serving task; :meth:`call` sends one and waits for its reply."""

    def __init__(self, client: Any, info: TaskInfo, lane: int) -> None:
        self.client, self.info, self.lane = client, info, lane
        self._base = f"{_PREFIX}{info.process}/{info.incarnation}/{lane}/"
        self._seq = 0

    def call(
        self, message: dict[str, Any], alive: Callable[[], bool], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send ``message``; wait for the reply while ``alive()`` holds (else :class:`PeerGone`)."""
        n = self._seq
        self._seq += 1
        self.client.key_value_set(f"{self._base}req/{n}", json.dumps(message))
        key = f"{self._base}rep/{n}"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                raw = self.client.blocking_key_value_get(key, 500)
                break
            except Exception as e:  # noqa: BLE001 - a timeout, or the store going away
                if not _deadline_exceeded(e):
                    raise
            if not alive():
                raise PeerGone(
                    f"process {self.info.process} stopped before it answered {message.get('op')!r}"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise PeerGone(
                    f"process {self.info.process} did not answer {message.get('op')!r} within {timeout_s:g} s"
                )
        self.client.key_value_delete(key)
        return json.loads(raw)


def serve_lane(
    client: Any,
    info: TaskInfo,
    lane: int,
    handle: Callable[[dict[str, Any]], dict[str, Any]],
    stop: threading.Event,
) -> None:
    """Answer the requests of one lane, in order, until ``stop`` is set."""
    base = f"{_PREFIX}{info.process}/{info.incarnation}/{lane}/"
    n = 0
    while not stop.is_set():
        try:
            raw = client.blocking_key_value_get(f"{base}req/{n}", 500)
        except Exception as e:  # noqa: BLE001 - a timeout, or the store going away
            if _deadline_exceeded(e):
                continue
            if stop.is_set():
                return
            raise
        client.key_value_delete(f"{base}req/{n}")
        reply = handle(json.loads(raw))
        client.key_value_set(f"{base}rep/{n}", json.dumps(reply))
        n += 1


# ------------------------------------------------------------------ arrays
#: The older name of ``DTENSOR_INTERFACE`` (:mod:`dtensor.runtime.hosts`), still read.
ENV_TRANSFER_HOST = hosts.ENV_TRANSFER_HOST


def transfer_host(coordinator: str | None, environ: Any = None) -> str:
    """The address of this host that the job's other tasks reach it at.

    ``DTENSOR_INTERFACE`` (an address or an interface name) when set; in a
    job, the address :func:`dtensor.initialize` chose and printed for this
    process (never loopback when the job spans hosts: see
    :mod:`dtensor.runtime.hosts`); otherwise loopback for a coordinator on
    loopback, else the local end of the route to the coordinator.
    ``gethostname()`` is not used: on many machines (Debian's
    ``/etc/hosts``, containers) it resolves to a loopback address no other
    host can reach.

    Examples:
        >>> transfer_host("127.0.0.1:1234")
        '127.0.0.1'
        >>> transfer_host("10.0.0.7:1234", environ={"DTENSOR_INTERFACE": "10.0.0.9"})
        '10.0.0.9'
    """
    forced = hosts.forced_address(environ)
    if forced:
        return forced
    chosen = hosts.chosen_address()
    if chosen is not None:
        return chosen
    if coordinator is None:
        return "127.0.0.1"
    host, _, port = coordinator.rpartition(":")
    if hosts.is_loopback(host):
        return "127.0.0.1"
    return hosts.route_source(host, int(port or 9)) or hosts.default_route_address() or "127.0.0.1"


def _bind(host: str) -> str:
    return f"[{host}]:0" if ":" in host else f"{host}:0"


def announce(role: Any, address: str) -> None:
    """One line on stderr saying where this task's transfer server listens (as TF's
    servers say where they started)."""
    print(f"dtensor: {role.task_type} {role.task_index}: transfers at {address}", file=sys.stderr)


def spec_of(x: Any) -> list[Any]:
    """``[shape, dtype name]`` of an array, as messages carry it."""
    return [list(np.shape(x)), str(jax.numpy.dtype(x.dtype))]


class Transfers:
    """This task's transfer server: offer arrays to peers, pull arrays from them.

    Arrays travel from and to this process's first local device (a peer never
    needs to know how this task lays them out); ``bytes_offered`` and
    ``bytes_pulled`` count what moved.
    """

    def __init__(self, coordinator: str | None = None) -> None:
        from jax.experimental import transfer

        self.device = jax.local_devices()[0]
        host = transfer_host(coordinator or compat.coordinator_address())
        self.server = transfer.start_transfer_server(self.device.client, _bind(host), [_bind(host)])
        self._conns: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.bytes_offered = 0
        self.bytes_pulled = 0

    def address(self) -> str:
        return str(self.server.address())

    def offer(self, leaves: Sequence[Any]) -> int:
        """Offer ``leaves`` for one pull; returns the id a peer pulls them with."""
        if not leaves:
            return 0
        uuid = secrets.randbits(62)
        single = [jax.device_put(x, self.device) for x in leaves]
        self.server.await_pull(uuid, single)
        with self._lock:
            self.bytes_offered += sum(int(x.nbytes) for x in single)
        return uuid

    def pull(
        self, address: str, uuid: int, specs: Sequence[Any], timeout_s: float = 60
    ) -> list[Any]:
        """Pull what a peer offered as ``uuid`` (``specs``: ``[shape, dtype]`` per array)."""
        if not specs:
            return []
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self.server.connect(address)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        want = [
            jax.ShapeDtypeStruct(tuple(s), jax.numpy.dtype(d), sharding=sharding) for s, d in specs
        ]
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)
        try:
            out = list(conn.pull(uuid, want, timeout=deadline))
            jax.block_until_ready(out)
        except Exception as e:  # noqa: BLE001 - XLA's error for a peer that went away
            with self._lock:
                self._conns.pop(address, None)
            raise PeerGone(f"pulling arrays from {address} failed: {e}") from None
        with self._lock:
            self.bytes_pulled += sum(int(x.nbytes) for x in out)
        return out


def new_incarnation() -> str:
    return secrets.token_hex(6)
