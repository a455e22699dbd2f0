"""Addresses other hosts can reach: the one address each process of a job binds and advertises.

A multi-process job moves data over two kinds of socket besides the
coordination service: XLA's gloo collectives (CPU) and dtensor's transfer
servers (:mod:`dtensor.runtime.rpc`). Each advertises an address of its host
that the other processes connect to. On Debian, Ubuntu and most containers
the host's own name resolves to a loopback address (``127.0.1.1``), which no
other host reaches; gloo then fails with "Connection refused,
remote=[127.0.1.1]", and a transfer server bound there can never be pulled
from. :func:`settle`, called by :func:`dtensor.initialize` right after the
processes joined, chooses one address per process:

1. ``DTENSOR_INTERFACE`` when set: an address of this host (``10.0.0.7``) or
   the name of an interface (``eth0``, whose IPv4 address is used), as
   PyTorch users set ``GLOO_SOCKET_IFNAME``. (``DTENSOR_TRANSFER_HOST``, the
   older name, is still read.)
2. Otherwise the processes publish their host names through the
   coordination service. On one host (the same name and boot id for all) the
   address is the local end of the route to the coordinator: loopback for a
   job on ``127.0.0.1``, as ``dtensor.launch`` starts it.
3. In a job across hosts a loopback address is never used: the local end of
   the route to the coordinator if that is not loopback, else of the route
   to another host's process, else of the default route; none of them means
   an error naming :data:`ENV_INTERFACE`.

Every process prints the address it chose (``dtensor: process 1 (ps 0) on
hosta: collectives and transfers at 10.77.0.1 (...)``). Then every process
opens a TCP connection to every other one's address (a probe listener each
runs for that) within ``timeout_s``; a process that cannot reach another
makes the whole job stop at once, every process printing the same line
naming both tasks, the address tried and the fix (the one that could not
reach exits with status 1, the others with
:data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST`), instead of waiting
silently for a message that never arrives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import ipaddress
import json
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from dtensor.runtime import peers
from dtensor.runtime.cluster import ClusterConfigError
from dtensor.runtime.exit_codes import EXIT_PEER_LOST

__all__ = [
    "ENV_INTERFACE",
    "Placement",
    "chosen_address",
    "default_route_address",
    "forced_address",
    "interface_address",
    "is_loopback",
    "route_source",
    "settle",
]

ENV_INTERFACE = "DTENSOR_INTERFACE"
"""This host's address (or interface name) for the job's collectives and transfers."""
ENV_TRANSFER_HOST = "DTENSOR_TRANSFER_HOST"
"""The older name of :data:`ENV_INTERFACE` (read when that is not set)."""

_PREFIX = "dtensor/hosts/"
_ANY_REMOTE = "198.51.100.1"  # TEST-NET-2: a UDP connect picks the default route, sends nothing
_SIOCGIFADDR = 0x8915

_chosen: list[Placement] = []


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address, or a name resolved here) is a loopback address.

    Examples:
        >>> from dtensor.runtime.hosts import is_loopback
        >>> is_loopback("127.0.1.1"), is_loopback("::1"), is_loopback("10.0.0.7")
        (True, True, False)
    """
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def route_source(host: str, port: int = 9) -> str | None:
    """The local address of the route to ``host`` (found without sending anything), or ``None``.

    Examples:
        >>> from dtensor.runtime.hosts import route_source
        >>> route_source("127.0.0.1")
        '127.0.0.1'
    """
    host = host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: picks the route, sends nothing
            return str(s.getsockname()[0])
    except (OSError, UnicodeError):
        return None


def default_route_address() -> str | None:
    """The local address of this host's default route, or ``None`` (no default route)."""
    address = route_source(_ANY_REMOTE)
    return None if address is None or is_loopback(address) else address


def interface_address(name: str) -> str | None:
    """The IPv4 address of the interface ``name`` (``"eth0"``), or ``None`` if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def forced_address(environ: Mapping[str, str] | None = None) -> str | None:
    """The address :data:`ENV_INTERFACE` (or ``DTENSOR_TRANSFER_HOST``) asks for, or ``None``.

    Raises:
        ClusterConfigError: it names an interface that has no IPv4 address.

    Examples:
        >>> from dtensor.runtime.hosts import forced_address
        >>> forced_address({"DTENSOR_INTERFACE": "10.0.0.9"})
        '10.0.0.9'
        >>> forced_address({"DTENSOR_INTERFACE": "lo"})
        '127.0.0.1'
        >>> forced_address({}) is None
        True
    """
    env = os.environ if environ is None else environ
    name = _override_name(env)
    value = env.get(name)
    if not value:
        return None
    if value in {n for _, n in socket.if_nameindex()}:
        address = interface_address(value)
        if address is None:
            raise ClusterConfigError(
                f"{name}={value!r} names an interface of this host that has no IPv4 address. "
                f"Set {name} to an address of this host the other hosts reach, or to another "
                f"interface (this host has {sorted(n for _, n in socket.if_nameindex())})."
            )
        return address
    return value


def _override_name(env: Mapping[str, str]) -> str:
    return ENV_INTERFACE if env.get(ENV_INTERFACE) else ENV_TRANSFER_HOST


def chosen_address() -> str | None:
    """The address :func:`settle` chose for this process (``None`` before, or for one process)."""
    return _chosen[0].address if _chosen else None


def forget() -> None:
    """Drop the chosen address (:func:`dtensor.shutdown`)."""
    _chosen.clear()


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where the processes of a job are: the address each chose, and on which host.

    Attributes:
        me: this process's index.
        address: the address this process binds and advertises.
        how: why that address (``"DTENSOR_INTERFACE"``, ``"route to process 2 on hostb"``...).
        hostnames: each process's host name.
        addresses: each process's chosen address.
    """

    me: int
    address: str
    how: str
    hostnames: tuple[str, ...]
    addresses: tuple[str, ...]

    @property
    def num_hosts(self) -> int:
        return len(set(self.hostnames))


class _Probe:
    """A listener on every interface that answers each connection with this process's token."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        if socket.has_dualstack_ipv6():
            try:
                self.sock = socket.create_server(
                    ("", 0), family=socket.AF_INET6, dualstack_ipv6=True
                )
            except OSError:
                self.sock = socket.create_server(("", 0))
        else:
            self.sock = socket.create_server(("", 0))
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, name="dtensor-hosts-probe", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with contextlib.suppress(OSError), conn:
                conn.sendall(self.token.encode() + b"\n")


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _reach(address: str, port: int, token: str, deadline: float) -> str | None:
    """Connect to ``address:port`` and check the token; ``None`` on success, else why not."""
    refused_until = time.monotonic() + 2.0
    last = "no answer"
    while True:
        try:
            with socket.create_connection((address.strip("[]"), port), timeout=2.0) as s:
                s.settimeout(2.0)
                got = s.recv(64).decode(errors="replace").strip()
            if got == token:
                return None
            last = "another program answered there"
        except OSError as e:
            last = e.strerror or type(e).__name__
            if isinstance(e, ConnectionRefusedError) and time.monotonic() > refused_until:
                return last.lower()
        if time.monotonic() > deadline:
            return last.lower()
        time.sleep(0.2)


class _Store:
    """One round of the exchange: publish this process's value, read everyone's."""

    def __init__(self, client: Any, me: int, n: int, deadline: float, names: Any) -> None:
        self.client, self.me, self.n, self.deadline, self.names = client, me, n, deadline, names

    def round(self, name: str, value: dict[str, Any]) -> list[dict[str, Any]]:
        self.client.key_value_set(
            f"{_PREFIX}{name}/{self.me}", json.dumps(value), allow_overwrite=True
        )
        out: list[dict[str, Any]] = []
        for j in range(self.n):
            if j == self.me:
                out.append(value)
                continue
            left = max(1, int((self.deadline - time.monotonic()) * 1000))
            try:
                out.append(
                    json.loads(self.client.blocking_key_value_get(f"{_PREFIX}{name}/{j}", left))
                )
            except Exception as e:  # noqa: BLE001 - the store's timeout, or the store going away
                peers.die(
                    f"dtensor.runtime: {self.names(self.me)} waited for {self.names(j)} to say "
                    f"which address it uses, in vain ({' '.join(str(e).split())[:200]}). It "
                    "joined the job but stopped, or is stuck; look at its own output.",
                    EXIT_PEER_LOST,
                )
        return out


def settle(
    client: Any,
    me: int,
    n: int,
    coordinator: str | None,
    *,
    timeout_s: float = 60,
    names: Mapping[int, str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Placement:
    """Choose this process's address (see the module docstring), print it, and check reachability.

    Every process of the job must call it, in the same order relative to its
    other uses of the coordination service. It ends the process (one line,
    status 1 or :data:`~dtensor.runtime.exit_codes.EXIT_PEER_LOST`) when a
    process cannot reach another within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    label = dict(names or {})

    def who(p: int, hosts: list[str] | None = None) -> str:
        where = f" on {hosts[p]}" if hosts else ""
        role = label.get(p)
        return f"{role} (process {p}{where})" if role else f"process {p}{where}"

    store = _Store(client, me, n, deadline, who)
    forced = forced_address(environ)
    host = socket.gethostname()
    coordinator_host = None if coordinator is None else coordinator.rpartition(":")[0]
    first = (
        forced
        or (route_source(coordinator_host) if coordinator_host else None)
        or default_route_address()
        or "127.0.0.1"
    )
    probe = _Probe()
    seen = store.round(
        "seen",
        {
            "host": host,
            "boot": _boot_id(),
            "address": first,
            "port": probe.port,
            "token": probe.token,
        },
    )
    hosts = [s["host"] for s in seen]
    elsewhere = [
        j for j, s in enumerate(seen) if (s["host"], s["boot"]) != (host, seen[me]["boot"])
    ]
    if forced:
        address, how = (
            forced,
            f"set by {_override_name(os.environ if environ is None else environ)}",
        )
    elif not elsewhere:
        address, how = first, "one host: the route to the coordinator"
    elif not is_loopback(first):
        address, how = first, "the route to the coordinator"
    else:
        address, how = "", ""
        for j in elsewhere:
            source = None if is_loopback(seen[j]["address"]) else route_source(seen[j]["address"])
            if source and not is_loopback(source):
                address, how = source, f"the route to process {j} on {hosts[j]}"
                break
        if not address and (default := default_route_address()):
            address, how = default, "the default route"
        if not address:
            peers.die(
                f"dtensor.runtime: {who(me, hosts)} finds no address that the job's other hosts "
                f"reach: its routes to the coordinator and to the other hosts' processes all "
                f"leave by loopback. Set {ENV_INTERFACE} on {host} to this host's address on the "
                f"network the other hosts share (or its interface, e.g. {ENV_INTERFACE}=eth0), "
                f"or fix /etc/hosts so that {coordinator_host!r} does not resolve to loopback.",
                1,
            )
    print(
        f"dtensor: {who(me, hosts)}: collectives and transfers at {address} ({how})",
        file=sys.stderr,
        flush=True,
    )
    final = [s["address"] for s in store.round("final", {"address": address})]
    failures = []
    for j in range(n):
        if j != me:
            why = _reach(final[j], seen[j]["port"], seen[j]["token"], deadline)
            if why is not None:
                failures.append([j, f"{final[j]}:{seen[j]['port']}", why])
    results = store.round("probe", {"failures": failures})
    bad = [(i, f) for i, r in enumerate(results) for f in r["failures"]]
    if bad:
        i, (j, tried, why) = bad[0]
        hint = (
            f": {label.get(j, f'process {j}')} advertised a loopback address, which no other host reaches"
            if is_loopback(final[j])
            else ""
        )
        message = (
            f"dtensor.runtime: {who(i, hosts)} cannot reach {who(j, hosts)} at {tried} ({why}){hint}. "
            f"Set {ENV_INTERFACE} on {hosts[j]} to its address on the network the hosts share (or its "
            f"interface, e.g. {ENV_INTERFACE}=eth0), or fix /etc/hosts there so that "
            f"{hosts[j]!r} resolves to that address, not loopback; and let TCP between the hosts "
            "through any firewall."
        )
        if me != i:
            message += f" Stopping {who(me)} with exit status {EXIT_PEER_LOST}."
        code = 1 if me == i else EXIT_PEER_LOST
        if me != 0:
            # The store goes with process 0, and JAX aborts (SIGABRT) a process that is still
            # connected when it does: say so only once this process's line is out, exiting.
            peers.die(
                message,
                code,
                then=lambda: client.key_value_set(f"{_PREFIX}gone/{me}", "1", allow_overwrite=True),
            )
        end = time.monotonic() + 5
        for k in range(1, n):
            with contextlib.suppress(Exception):
                client.blocking_key_value_get(
                    f"{_PREFIX}gone/{k}", max(1, int((end - time.monotonic()) * 1000))
                )
        time.sleep(0.5)  # their os._exit follows their "gone" at once
        peers.die(message, code)
    placement = Placement(me, address, how, tuple(hosts), tuple(final))
    _chosen[:] = [placement]
    return placement
