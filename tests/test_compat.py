"""dtensor.compat: each private JAX use, and its public fallback."""

from __future__ import annotations

import jax
import pytest

from dtensor import compat


@pytest.fixture
def joined(monkeypatch):
    """Pretend this process joined a job (JAX's state as jax.distributed.initialize leaves it)."""
    from jax._src import distributed

    client = object()
    monkeypatch.setattr(distributed.global_state, "client", client)
    monkeypatch.setattr(distributed.global_state, "coordinator_address", "10.0.0.1:1234")
    return client


def test_distributed_client_none_outside_a_job():
    assert not jax.distributed.is_initialized()
    assert compat.distributed_client() is None


def test_distributed_client_is_jaxs(joined):
    assert jax.distributed.is_initialized()  # the public test agrees
    assert compat.distributed_client() is joined


def test_distributed_client_follows_the_public_test(joined, monkeypatch):
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    assert compat.distributed_client() is None


def test_coordinator_address(joined):
    assert compat.coordinator_address() == "10.0.0.1:1234"


def test_coordinator_address_none_outside_a_job():
    assert compat.coordinator_address() is None


def test_backends_initialized_after_devices():
    jax.devices()
    assert compat.backends_initialized() is True


def test_backends_initialized_reads_jax(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    assert compat.backends_initialized() is False


def test_detected_cluster(monkeypatch):
    for name in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    assert compat.detected_cluster() in (None, "GceTpuCluster", "OmpiCluster", "K8sCluster")
    for name, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    assert compat.detected_cluster() == "SlurmCluster"
