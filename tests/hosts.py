"""Two hosts on one machine: Linux network namespaces joined by a veth pair.

Each simulated host has its own network namespace (its own loopback, so one
host's ``127.0.0.1`` is not the other's), an address on the link between
them, its own host name (``unshare --uts``), and a Debian-style
``/etc/hosts`` (``127.0.1.1 <own name>`` plus the other host by name;
``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts`` over ``/etc/hosts``).
Anything that advertises a loopback address, or a host name resolving to
one, fails here as it would between real hosts.

Needs root and iproute2 (``ip``, ``tc``) and util-linux (``unshare``). A test
that asks for :func:`two_hosts` where they cannot be built fails saying why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

_counter = itertools.count()


class HostsUnavailable(RuntimeError):
    """The namespaces could not be built on this machine (not root, no iproute2...)."""


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise HostsUnavailable(
            f"{' '.join(cmd)!r} failed ({done.returncode}): {done.stderr.strip()}. Two simulated "
            "hosts need root, iproute2 (ip, tc) and util-linux (unshare); on Debian: "
            "apt-get install iproute2 util-linux, and run the tests as root."
        )


@dataclasses.dataclass(frozen=True)
class TwoHosts:
    """Two namespaces ``hosta`` (``10.77.0.1``) and ``hostb`` (``10.77.0.2``) and their link."""

    namespaces: tuple[str, str]
    links: tuple[str, str]
    names: tuple[str, str] = ("hosta", "hostb")
    addresses: tuple[str, str] = ("10.77.0.1", "10.77.0.2")

    def command(self, host: int, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on host ``host`` (0 or 1): in its namespace, under its host name."""
        name = self.names[host]
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[host],
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            name,
            *argv,
        ]

    def popen(
        self, host: int, argv: Sequence[str], env: Mapping[str, str], **kw: object
    ) -> subprocess.Popen[str]:
        """Start ``argv`` on host ``host``; stdout and stderr together, as text (a pipe unless
        ``stdout=`` says otherwise)."""
        options: dict[str, object] = {
            "stdout": subprocess.PIPE,
            "stderr": subprocess.STDOUT,
            "stdin": subprocess.DEVNULL,
            "text": True,
        }
        options.update(kw)
        return subprocess.Popen(self.command(host, argv), env=dict(env), **options)  # type: ignore[call-overload]

    def limit(self, rate: str = "1gbit", burst: str = "512kb", latency: str = "50ms") -> None:
        """A slow link: a token-bucket filter on both ends of the veth pair."""
        for ns, link in zip(self.namespaces, self.links, strict=True):
            _run("ip", "-n", ns, "link", "set", link, "txqueuelen", "1000")
            _run(
                "ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", link, "root", "tbf",
                "rate", rate, "burst", burst, "latency", latency,
            )  # fmt: skip

    def unlimit(self) -> None:
        for ns, link in zip(self.namespaces, self.links, strict=True):
            with contextlib.suppress(HostsUnavailable):
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", link, "root")


def _hosts_file(own: str, other: str, other_address: str) -> str:
    return f"127.0.0.1\tlocalhost\n127.0.1.1\t{own}\n{other_address}\t{other}\n"


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """Build two simulated hosts (unique names), yield them, delete everything built on exit."""
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            raise HostsUnavailable(
                f"{tool!r} is not installed, so two simulated hosts cannot be built. On Debian: "
                "apt-get install iproute2 util-linux."
            )
    tag = f"{os.getpid() % 100000}{next(_counter)}"
    namespaces = (f"dth{tag}a", f"dth{tag}b")
    links = (f"dtv{tag}a", f"dtv{tag}b")
    hosts = TwoHosts(namespaces, links)
    made: list[str] = []
    try:
        for ns in namespaces:
            _run("ip", "netns", "add", ns)
            made.append(ns)
        _run("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (ns, link) in enumerate(zip(namespaces, links, strict=True)):
            _run("ip", "link", "set", link, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{hosts.addresses[i]}/24", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(
                _hosts_file(hosts.names[i], hosts.names[1 - i], hosts.addresses[1 - i])
            )
            # no name server on these hosts: a look-up of an outside name (gcsfs asks for
            # Google's endpoints) fails at once instead of waiting for an unreachable server
            (folder / "resolv.conf").write_text(
                "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"
            )
        yield hosts
    finally:
        for ns in made:  # deleting a namespace deletes the veth end inside it, and the pair
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        subprocess.run(["ip", "link", "delete", links[0]], capture_output=True, timeout=30)


def finish(procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> list[tuple[int, str]]:
    """Wait for every process (killing, by PID, any still running at ``timeout_s``)."""
    import time

    deadline = time.monotonic() + timeout_s
    out: list[tuple[int, str]] = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate(timeout=10)
            text += f"\n<killed by the test at its {timeout_s:g} s timeout>"
        out.append((p.returncode, text))
    return out
