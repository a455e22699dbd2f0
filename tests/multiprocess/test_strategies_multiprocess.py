"""Presets across real processes (dtensor.launch) match single-process training."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from tests.models import MLPModel, make_train_step, mlp_batches, mlp_loss, rel_err
from tests.multiprocess.util import expect_ok, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def _reference():
    with jax.default_device(jax.devices()[0]):
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = nnx.jit(make_train_step(mlp_loss))
        losses = [float(step(model, opt, b)) for b in mlp_batches()]
    params = {
        jax.tree_util.keystr(p): np.asarray(v)
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    return losses, params


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("preset", "feed", "processes", "devices"),
    [
        ("multi_worker_mirrored", "global", 2, 2),
        # one device a process, each feeding its own rows (four such processes, on two hosts:
        # tests/multiprocess/test_hosts.py)
        ("multi_worker_mirrored", "per_process", 2, 1),
        ("fully_sharded", "per_process", 2, 2),
        # one device (and one central copy) per process: every process runs the step
        ("one_device", "per_process", 2, 2),
        ("central_storage", "global", 2, 2),
    ],
)
def test_preset_across_processes_matches_single_process(preset, feed, processes, devices):
    ref_losses, ref_params = _reference()
    result = run_worker(
        "train_strategy", processes, preset, feed, devices_per_process=devices, timeout_s=150
    )
    outs = expect_ok(result, processes)
    for out in outs:
        assert out["replicas"] == (processes if preset == "one_device" else processes * devices)
        np.testing.assert_allclose(out["losses"], ref_losses, rtol=1e-5)
        for path, want in ref_params.items():
            assert rel_err(np.asarray(out["params"][path]), want) <= 1e-5, (out["rank"], path)
    if preset == "one_device":
        assert outs[0]["mesh"] == "Mesh(device=2)"
        for out in outs:
            assert "names a device of process" in out["refused"], out["refused"]
            assert "Leave device= out for one device per process" in out["refused"]
    if preset == "multi_worker_mirrored":
        assert outs[0]["mesh"] == f"Mesh(worker={processes}, replica={devices})"
