"""dtensor.runtime.hosts on one host: the override variable, loopback, routes (across hosts:
tests/multiprocess/test_hosts.py)."""

from __future__ import annotations

import pytest

from dtensor.runtime import hosts, rpc


def test_the_override_takes_an_address_or_an_interface_name() -> None:
    assert hosts.forced_address({"DTENSOR_INTERFACE": "10.0.0.9"}) == "10.0.0.9"
    assert hosts.forced_address({"DTENSOR_INTERFACE": "lo"}) == "127.0.0.1"
    assert hosts.forced_address({"DTENSOR_TRANSFER_HOST": "10.0.0.8"}) == "10.0.0.8"  # older name
    both = {"DTENSOR_INTERFACE": "10.0.0.9", "DTENSOR_TRANSFER_HOST": "10.0.0.8"}
    assert hosts.forced_address(both) == "10.0.0.9"
    assert hosts.forced_address({}) is None


def test_transfer_servers_follow_the_override_and_keep_loopback_for_a_loopback_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DTENSOR_INTERFACE", raising=False)
    monkeypatch.delenv("DTENSOR_TRANSFER_HOST", raising=False)
    assert hosts.chosen_address() is None  # no job joined in this process
    assert rpc.transfer_host("127.0.0.1:1234") == "127.0.0.1"
    assert rpc.transfer_host("localhost:1234") == "127.0.0.1"
    assert rpc.transfer_host("10.0.0.7:1234", environ={"DTENSOR_INTERFACE": "lo"}) == "127.0.0.1"


def test_loopback_is_recognised_by_address_and_by_name() -> None:
    assert hosts.is_loopback("127.0.1.1") and hosts.is_loopback("[::1]")
    assert hosts.is_loopback("localhost")
    assert not hosts.is_loopback("10.77.0.1")
    assert hosts.route_source("127.0.0.1") == "127.0.0.1"
    assert hosts.route_source("no such host.invalid") is None
