"""tf.distribute names a custom training loop calls: experimental_local_results, extended, cluster_resolver."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import strategies
from strategies import tf_compat


def _per_replica(s):
    return s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )


def test_local_results_of_per_replica_values_are_each_replicas_value():
    s = strategies.MirroredStrategy()
    results = s.experimental_local_results(_per_replica(s))
    assert isinstance(results, tuple)
    assert [float(r) for r in results] == [float(i) for i in range(8)]


def test_local_results_of_a_tree_of_per_replica_values_is_one_tree_per_replica():
    s = strategies.MirroredStrategy()
    v = {"a": _per_replica(s), "b": 5}
    results = s.experimental_local_results(v)
    assert len(results) == 8
    assert float(results[3]["a"]) == 3.0 and results[3]["b"] == 5


def test_local_results_of_run_per_replica_outputs():
    s = strategies.MirroredStrategy()
    out = s.run(lambda x: jnp.sum(x), args=(np.ones((16, 2), "f4"),), per_replica=True)
    assert [float(r) for r in s.experimental_local_results(out)] == [4.0] * 8


def test_local_results_of_a_plain_value_is_a_one_tuple():
    s = strategies.OneDeviceStrategy()
    x = jnp.ones((3,))
    assert s.experimental_local_results(x)[0] is x
    assert s.experimental_local_results(x) == (x,)


def test_extended_devices_and_roles():
    s = strategies.MirroredStrategy()
    ext = s.extended
    assert ext is s.extended
    assert ext.worker_devices == tuple(jax.local_devices())
    assert set(ext.parameter_devices) == set(jax.devices())
    assert ext.should_checkpoint is True and ext.should_save_summary is True


def test_extended_parameter_devices_of_central_storage_is_the_parameter_device():
    s = strategies.CentralStorageStrategy()
    assert s.extended.parameter_devices == (jax.devices()[0],)
    assert len(s.extended.worker_devices) == 8


def test_variable_created_in_scope_is_where_the_variable_lives():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with s.scope():
        layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    assert s.extended.variable_created_in_scope(layer.kernel)
    assert s.extended.variable_created_in_scope(layer.kernel.get_value())
    other = strategies.OneDeviceStrategy(devices=jax.devices()[7:])
    assert not other.extended.variable_created_in_scope(layer.kernel)
    assert not s.extended.variable_created_in_scope(np.ones(3))


def test_cluster_resolver_is_none_for_one_process():
    assert strategies.MirroredStrategy().cluster_resolver is None


def test_cluster_resolver_from_tf_config(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    tf_config = {
        "cluster": {"chief": ["c:7"], "worker": ["w0:7", "w1:7"]},
        "task": {"type": "worker", "index": 0},
    }
    r = tf_compat.cluster_resolver({"TF_CONFIG": json.dumps(tf_config)})
    assert (r.task_type, r.task_id) == ("worker", 0)
    assert r.cluster_spec() == {"chief": ["c:7"], "worker": ["w0:7", "w1:7"]}
    assert r.num_accelerators() == {}  # CPU devices are not accelerators
    assert r.rpc_layer == "grpc"


def test_cluster_resolver_from_the_launcher(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    env = {
        "DTENSOR_COORDINATOR": "127.0.0.1:1234",
        "DTENSOR_NUM_PROCESSES": "2",
        "DTENSOR_PROCESS_ID": "1",
    }
    r = tf_compat.cluster_resolver(env)
    assert (r.task_type, r.task_id) == ("worker", 1)
    assert r.cluster_spec() == {"worker": ["127.0.0.1:1234", "process-1"]}
