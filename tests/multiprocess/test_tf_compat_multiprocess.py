"""tf.distribute's local results, extended and cluster_resolver in a real two-process job."""

from __future__ import annotations

import pytest

from .util import expect_ok, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(150)]


def test_local_results_roles_and_resolver_through_the_launcher():
    out = expect_ok(run_worker("tf_compat", 2, "launcher", devices_per_process=2), 2)
    for rank, r in enumerate(out):
        # Each process holds its own two of the four replicas' values.
        assert r["local_results"] == [2.0 * rank, 2.0 * rank + 1]
        assert r["task"] == ["worker", rank]
        assert r["cluster_spec"]["worker"][1] == "process-1"
        assert r["cluster_spec"]["worker"][0].startswith("127.0.0.1:")
        assert r["worker_devices"] == r["local_device_ids"]
        assert r["parameter_devices"] == 4
        assert r["should_checkpoint"] is True
        assert r["should_save_summary"] is (rank == 0)


def test_resolver_reads_tf_config():
    out = expect_ok(run_worker("tf_compat", 2, "tf_config", devices_per_process=2), 2)
    assert [r["task"] for r in out] == [["chief", 0], ["worker", 0]]
    assert list(out[0]["cluster_spec"]) == ["chief", "worker"]
    assert out[1]["cluster_spec"]["worker"] == ["127.0.0.1:10001"]
