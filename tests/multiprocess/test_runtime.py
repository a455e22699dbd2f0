"""dtensor.runtime: cluster resolution (in-process) and real multi-process jobs."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

import dtensor
from dtensor.runtime import (
    ClusterConfigError,
    ClusterSpec,
    cluster,
    parse_tf_config,
    resolve_cluster,
)
from dtensor.runtime import process as runtime
from dtensor.runtime.exit_codes import EXIT_PEER_LOST

from .util import report, run_worker

LAUNCHER_ENV = {
    "DTENSOR_COORDINATOR": "127.0.0.1:4321",
    "DTENSOR_NUM_PROCESSES": "4",
    "DTENSOR_PROCESS_ID": "2",
}


# ------------------------------------------------------------ resolution
def test_tf_config_workers_only():
    spec = parse_tf_config(
        json.dumps(
            {
                "cluster": {"worker": ["h0:1", "h1:2", "h2:3"]},
                "task": {"type": "worker", "index": 2},
            }
        )
    )
    assert spec == ClusterSpec("h0:1", 3, 2, "TF_CONFIG")


def test_tf_config_chief_is_process_zero():
    cluster = {"chief": ["c:9"], "worker": ["w0:9", "w1:9"], "ps": ["p:9"]}
    assert (
        parse_tf_config({"cluster": cluster, "task": {"type": "chief", "index": 0}}).process_id == 0
    )
    spec = parse_tf_config({"cluster": cluster, "task": {"type": "worker", "index": 1}})
    assert (spec.coordinator_address, spec.num_processes, spec.process_id) == ("c:9", 3, 2)


@pytest.mark.parametrize(
    ("tf_config", "match"),
    [
        ("{not json", r"TF_CONFIG is not valid JSON \(Expecting property name"),
        ("[1, 2]", r"TF_CONFIG is not a JSON object; got \[1, 2\]"),
        ('{"task": {"type": "worker", "index": 0}}', r"TF_CONFIG has no 'cluster' entry"),
        (
            '{"cluster": {"ps": ["p:1"]}, "task": {}}',
            r"'cluster' has neither a 'worker' nor a 'chief' list",
        ),
        (
            '{"cluster": {"worker": "h:1"}, "task": {}}',
            r"'cluster.worker' is not a list of 'host:port' strings",
        ),
        (
            '{"cluster": {"worker": ["h"]}, "task": {}}',
            r"'cluster.worker' is not a list of 'host:port' strings",
        ),
        (
            '{"cluster": {"chief": ["a:1", "b:1"]}, "task": {}}',
            r"'cluster.chief' lists more than one address",
        ),
        ('{"cluster": {"worker": ["h:1"]}}', r"has no 'task' object saying which process this is"),
        (
            '{"cluster": {"worker": ["h:1", "h:2"]}, "task": {"type": "worker", "index": 2}}',
            r"task index 2 is out of range for the 2 'worker' address\(es\)",
        ),
        (
            '{"cluster": {"worker": ["h:1"], "ps": ["p:1"]}, "task": {"type": "ps", "index": 0}}',
            r"task type 'ps' is not a worker",
        ),
        (
            '{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": "0"}}',
            r"'task.index' is not an integer",
        ),
    ],
)
def test_tf_config_errors(tf_config, match):
    with pytest.raises(ClusterConfigError, match=match) as info:
        parse_tf_config(tf_config)
    assert "A valid TF_CONFIG looks like" in str(info.value)


def test_resolve_order_and_sources():
    assert resolve_cluster(environ={}) is None
    assert resolve_cluster(environ=LAUNCHER_ENV) == ClusterSpec(
        "127.0.0.1:4321", 4, 2, "dtensor.launch"
    )
    tf = json.dumps({"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}})
    assert resolve_cluster(environ={"TF_CONFIG": tf}).source == "TF_CONFIG"
    # The launcher's variables win over TF_CONFIG; explicit arguments win over both.
    assert resolve_cluster(environ={**LAUNCHER_ENV, "TF_CONFIG": tf}).source == "dtensor.launch"
    spec = resolve_cluster("h:5", 2, 0, environ=LAUNCHER_ENV)
    assert spec == ClusterSpec("h:5", 2, 0, "arguments")


def test_resolve_errors():
    with pytest.raises(ClusterConfigError, match=r"got only some of .* \(process_id missing\)"):
        resolve_cluster("h:1", 2, environ={})
    with pytest.raises(ClusterConfigError, match=r"DTENSOR_PROCESS_ID='two' is not an integer"):
        resolve_cluster(environ={**LAUNCHER_ENV, "DTENSOR_PROCESS_ID": "two"})
    with pytest.raises(
        ClusterConfigError,
        match=r"process_id \(from dtensor.launch\) is 4, but with num_processes=4 the valid ids are 0..3",
    ):
        resolve_cluster(environ={**LAUNCHER_ENV, "DTENSOR_PROCESS_ID": "4"})
    with pytest.raises(
        ClusterConfigError,
        match=r"num_processes \(from arguments\) is 0; it must be an integer >= 1",
    ):
        resolve_cluster("h:1", 0, 0, environ={})
    with pytest.raises(
        ClusterConfigError,
        match=r"coordinator_address \(from arguments\) is 'localhost'; it must be 'host:port'",
    ):
        resolve_cluster("localhost", 2, 0, environ={})


def test_jax_cluster_detection_is_used(monkeypatch):
    # SLURM variables are what JAX's SlurmCluster looks for.
    for name, value in {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("DTENSOR_COORDINATOR", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_cluster() == ClusterSpec(None, None, None, "jax:SlurmCluster")


# ------------------------------------------------- single process, in-process
def test_single_process_functions(monkeypatch):
    for name in ("DTENSOR_COORDINATOR", "TF_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cluster, "_jax_cluster", lambda: None)
    assert dtensor.initialize() is None
    assert (dtensor.client_id(), dtensor.num_clients()) == (0, 1)
    dtensor.barrier("anything")
    dtensor.barrier("anything")
    dtensor.shutdown()
    assert not runtime.is_initialized()


def test_barrier_name_error():
    with pytest.raises(ValueError, match=r"barrier name '' is not valid; give a non-empty string"):
        dtensor.barrier("")


def test_initialize_after_backends_started():
    jax.devices()
    with pytest.raises(
        dtensor.DistributedRuntimeError, match=r"called after JAX had started its backends"
    ):
        dtensor.initialize("127.0.0.1:1", 2, 0)


def test_local_device_count_error(monkeypatch):
    monkeypatch.setattr(runtime.compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(runtime, "_connect", lambda *a, **k: pytest.fail("must not connect"))
    with pytest.raises(ClusterConfigError, match=r"local_device_count=0 is not valid"):
        dtensor.initialize("127.0.0.1:1", 2, 0, local_device_count=0)


# ------------------------------------------------------ real processes
def expected_sums(n: int, local: int) -> tuple[float, list[float]]:
    blocks = [
        np.arange(local * 3, dtype=np.float32).reshape(local, 3) + 100.0 * p for p in range(n)
    ]
    full = np.concatenate(blocks)
    return float(full.sum()), full.sum(axis=0).tolist()


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("n", "k"), [(2, 2), (4, 1)])
def test_global_sum_and_barrier_through_launcher(n, k):
    result = run_worker("collective", n, "launcher", devices_per_process=k)
    assert result.returncode == 0, report(result)
    total, cols = expected_sums(n, k)
    results = _results(result)
    for rank, r in enumerate(results):
        assert r["client_id"] == r["process_index"] == r["process_id"] == rank
        assert r["num_clients"] == r["num_processes"] == n
        assert r["source"] == "dtensor.launch"
        assert (r["local_devices"], r["devices"]) == (k, n * k)
        assert r["mesh_process_order"] == [p for p in range(n) for _ in range(k)]
        assert r["global_shape"] == [n * k, 3]
        assert r["sum"] == total
        assert r["col_sums"] == cols
        assert r["seen_after_barrier"] == list(range(n))
        assert r["initialize_again_same"] is True
        assert r["initialize_other_job"].startswith("dtensor.initialize() was already called with")
    assert results[0]["lone_barrier"].startswith(
        f"barrier('only-process-0') on process 0: not all {n} processes arrived within 1 s"
    )
    assert all(r["lone_barrier"] is None for r in results[1:])
    # Rank 0 printed the cluster table; the others did not.
    assert "dtensor cluster" in result.outputs[0]
    assert all("dtensor cluster" not in out for out in result.outputs[1:])
    assert "dtensor.launch" in result.outputs[0] and "127.0.0.1:" in result.outputs[0]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_tf_config_resolves_to_the_cluster():
    result = run_worker("collective", 2, "tf_config", devices_per_process=2)
    assert result.returncode == 0, report(result)
    total, _ = expected_sums(2, 2)
    for rank, r in enumerate(_results(result)):
        assert r["source"] == "TF_CONFIG"
        assert (r["client_id"], r["num_clients"], r["devices"]) == (rank, 2, 4)
        assert r["sum"] == total


def _results(result):
    from .util import results

    return results(result)


# ------------------------------------------------------------- faults
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sigkilled_peer_stops_the_others_naming_it():
    # stop_on_failure=False: the launcher must not stop them; the runtime has to.
    result = run_worker(
        "faults", 2, "kill", "4", devices_per_process=2, stop_on_failure=False, timeout_s=90
    )
    assert not result.timed_out, report(result)
    assert result.returncodes[1] == 128 + 9, report(result)
    assert result.returncodes[0] == EXIT_PEER_LOST, report(result)
    assert "process 0 of 2 lost process 1" in result.outputs[0], report(result)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_exception_in_one_process_fails_the_job():
    result = run_worker(
        "faults", 2, "raise", "4", devices_per_process=1, stop_on_failure=False, timeout_s=90
    )
    assert not result.timed_out, report(result)
    assert result.returncodes[1] == 1, report(result)
    assert "ValueError: process 1 failed on purpose" in result.outputs[1]
    assert "process 1 of 2 stopped by an uncaught ValueError" in result.outputs[1]
    assert result.returncodes[0] == EXIT_PEER_LOST, report(result)
    assert "lost process 1" in result.outputs[0], report(result)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_wrong_coordinator_address_fails_within_timeout():
    result = run_worker("faults", 1, "wrong_address", timeout_s=45)
    assert result.returncode == 0, report(result)
    out = result.outputs[0]
    assert (
        "CAUGHT dtensor.initialize(): process 1 of 2 could not reach the coordinator at 127.0.0.1:"
        in out
    )
    assert "Connection refused" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_process_that_never_joins():
    result = run_worker("faults", 1, "alone", timeout_s=45)
    assert result.returncode == EXIT_PEER_LOST, report(result)
    assert (
        "process 0 of 2: not all processes joined the job at coordinator 127.0.0.1:"
        in result.outputs[0]
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_coordinator_port_in_use():
    result = run_worker("faults", 1, "busy_port", timeout_s=45)
    assert result.returncode == 0, report(result)
    out = result.outputs[0]
    assert (
        "CAUGHT dtensor.initialize(): process 0 cannot start the coordinator at 127.0.0.1:" in out
    )
    assert "is already in use on this host" in out


def test_tf_config_cluster_not_an_object():
    with pytest.raises(ClusterConfigError, match=r"'cluster' is not an object of task type"):
        parse_tf_config({"cluster": ["h:1"], "task": {"type": "worker", "index": 0}})


def test_jax_initialize_failure_is_reported(monkeypatch):
    def fail(*args, **kwargs):
        raise RuntimeError("UNKNOWN: Failed to start RPC server")

    monkeypatch.setattr(runtime.compat, "backends_initialized", lambda: False)
    monkeypatch.setattr(runtime, "_check_port_free", lambda spec: None)
    monkeypatch.setattr(jax.distributed, "initialize", fail)
    with pytest.raises(
        dtensor.DistributedRuntimeError,
        match=r"process 0 could not start the job at coordinator 127.0.0.1:9 \(from arguments\): "
        r"UNKNOWN: Failed to start RPC server",
    ):
        dtensor.initialize("127.0.0.1:9", 2, 0, local_device_count=None)
    assert not runtime.is_initialized()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_sigkilled_coordinator_stops_the_others():
    # Process 0 runs the coordination service. JAX's client aborts the others
    # (LOG(FATAL), SIGABRT) as soon as it sees it gone; our SIGABRT handler then
    # names process 0 in one line and exits with EXIT_PEER_LOST.
    result = run_worker(
        "faults",
        2,
        "kill_coordinator",
        "4",
        devices_per_process=2,
        stop_on_failure=False,
        timeout_s=90,
    )
    assert not result.timed_out, report(result)
    assert result.returncodes[0] == 128 + 9, report(result)
    assert result.returncodes[1] == EXIT_PEER_LOST, report(result)
    out = result.outputs[1]
    assert "process 1 of 2 lost process 0 (the coordinator at 127.0.0.1:" in out, report(result)
