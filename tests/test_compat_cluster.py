"""Tests for dtensor.compat: each private JAX read, and its public fallback when JAX moves it.

These are the only tests that name ``jax._src``: they simulate an upgrade of
JAX that moves an internal, and check what dtensor does instead.
"""

from __future__ import annotations

import sys

import jax
import pytest

from dtensor import compat


def test_cluster_types_lists_the_environments_jax_detects() -> None:
    names = {t.__name__ for t in compat.cluster_types()}
    assert {"SlurmCluster", "OmpiCluster", "GceTpuCluster"} <= names
    assert all(isinstance(t, type) for t in compat.cluster_types())


def test_cluster_types_is_empty_when_jax_drops_its_registry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr("jax._src.clusters.ClusterEnv._cluster_types")
    assert compat.cluster_types() == ()
    assert compat.detected_cluster() is None


def test_cluster_types_is_empty_when_jax_moves_its_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jax._src.clusters", None)
    monkeypatch.delattr("jax._src.clusters")
    assert compat.cluster_types() == ()


def _env(name: str, *, present: bool | Exception, opt_in: bool = False) -> type:
    def is_env_present() -> bool:
        if isinstance(present, Exception):
            raise present
        return present

    return type(
        name, (), {"is_env_present": staticmethod(is_env_present), "opt_in_only_method": opt_in}
    )


def test_detected_cluster_takes_the_first_present_environment() -> None:
    types = (
        _env("Absent", present=False),
        _env("OptIn", present=True, opt_in=True),
        _env("Broken", present=RuntimeError("no metadata server")),
        _env("Slurmish", present=True),
        _env("Later", present=True),
    )
    assert compat.detected_cluster(types) == "Slurmish"
    assert compat.detected_cluster(types[:3]) is None


def test_no_jax_cluster_is_detected_on_a_plain_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("SLURM_JOB_ID", "OMPI_MCA_orte_hnp_uri", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(var, raising=False)
    found = compat.detected_cluster(
        tuple(t for t in compat.cluster_types() if "Tpu" not in t.__name__)
    )
    assert found is None


def test_preemption_sync_manager_is_none_in_one_process() -> None:
    assert compat.preemption_sync_manager() is None


def test_preemption_sync_manager_reads_jax_global_state(monkeypatch: pytest.MonkeyPatch) -> None:
    manager = object()
    monkeypatch.setattr(
        "jax._src.distributed.global_state.preemption_sync_manager", manager, raising=False
    )
    assert compat.preemption_sync_manager() is manager


def test_preemption_sync_manager_is_none_when_jax_moves_its_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "jax._src.distributed", None)
    monkeypatch.delattr("jax._src.distributed")
    assert compat.preemption_sync_manager() is None


def test_xla_runtime_errors_are_caught_through_the_public_name() -> None:
    from jax._src.lib import _jax

    assert jax.errors.JaxRuntimeError is _jax.JaxRuntimeError


def test_use_gloo_address_registers_a_cpu_backend_before_jax_starts_it(tmp_path) -> None:
    import subprocess

    code = (
        "from dtensor import compat; ok = compat.use_gloo_address('127.0.0.1'); "
        "import jax; from jax._src import xla_bridge; "
        "f = xla_bridge._backend_factories['cpu'].factory; "
        "print(ok, f.__qualname__, len(jax.devices()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["True", "use_gloo_address.<locals>.make_client", "1"], out.stderr


def test_use_gloo_address_is_too_late_once_the_backends_run() -> None:
    jax.devices()
    assert compat.use_gloo_address("127.0.0.1") is False


def test_use_gloo_address_warns_and_keeps_jax_s_choice_when_jax_moves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(compat, "backends_initialized", lambda: False)  # as before any JAX call
    monkeypatch.delattr("jax._src.xla_bridge.make_cpu_client")
    with pytest.warns(RuntimeWarning, match=r"could not pass the address 10\.0\.0\.7 to gloo"):
        assert compat.use_gloo_address("10.0.0.7") is False
