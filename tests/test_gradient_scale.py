"""Every preset and every HybridStrategy axis scales its gradients as single-device JAX does.

The equality tests train with Adam, whose update is invariant to a tensor's
gradient scale where ``eps`` is far below the gradients: a gradient summed
over a mesh axis where it should be averaged (8 times too large under
``data=8``) trains the same parameters. Plain SGD does not hide it: here each
preset, and HybridStrategy with each of its axes, takes one SGD step of the
tiny example decoder (8 CPU devices, one compile each), and each tensor's
update (parameters after minus before) must be single-device JAX's to 1e-4 in
norm. A tensor whose gradient is zero in exact arithmetic (a key bias in
softmax attention; none in this decoder) steps by float32 noise on any device
count: one whose single-device update is under 1e-5 of the largest update's
RMS (per element) is held to that floor instead.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from examples.decoder import CONFIGS, Block, Decoder, tensor_rules
from tests.test_decoder import _batches, _step

LR = 0.5
RTOL = 1e-4
FLOOR = 1e-5

# One block: every kind of tensor the decoder has, and one compile of half the program of two
# (a scale is a tensor's, not a layer's). The stages need a layer each at least.
TINY = CONFIGS["tiny"].replace(layers=1)
SCAN = CONFIGS["tiny"].replace(scan=True)
DEEP = CONFIGS["tiny"].replace(layers=4)  # a circular schedule needs 2 rounds of 2 stages
MOE = CONFIGS["tiny-moe"].replace(layers=1)


def _layout():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    return strategies.LayoutStrategy(mesh, dtensor.LayoutMap(mesh, tensor_rules(TINY, "model")))


def _hybrid(**kw):
    return lambda cfg: strategies.HybridStrategy(min_shard_bytes=0, **kw)


# name -> (config, strategy factory taking the config)
CASES = {
    # the presets
    "one_device": (TINY, lambda cfg: strategies.OneDeviceStrategy()),
    "mirrored": (TINY, lambda cfg: strategies.MirroredStrategy()),
    "multi_worker_mirrored": (TINY, lambda cfg: strategies.MultiWorkerMirroredStrategy()),
    "central_storage": (TINY, lambda cfg: strategies.CentralStorageStrategy()),
    "tpu": (TINY, lambda cfg: strategies.TPUStrategy(devices=jax.devices())),
    "parameter_server": (
        TINY,
        lambda cfg: strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2)),
    ),
    "fully_sharded": (TINY, lambda cfg: strategies.FullyShardedStrategy(min_shard_bytes=0)),
    "tensor_parallel": (
        TINY,
        lambda cfg: strategies.TensorParallelStrategy(2, rules=tensor_rules(cfg)),
    ),
    "hybrid": (
        TINY,
        lambda cfg: strategies.HybridStrategy(2, 2, 2, rules=tensor_rules(cfg), min_shard_bytes=0),
    ),
    "layout": (TINY, lambda cfg: _layout()),
    # HybridStrategy's axes, one at a time beside data
    "data": (TINY, _hybrid(data=8)),
    "fsdp": (TINY, _hybrid(data=4, fsdp=2)),
    "tensor": (TINY, lambda cfg: _hybrid(data=4, tensor=2, rules=tensor_rules(cfg))(cfg)),
    "stage-scan-gpipe": (SCAN, _hybrid(data=4, stage=2, microbatches=4, pipeline=(Block,))),
    "stage-list-circular": (
        DEEP,
        _hybrid(data=4, stage=2, microbatches=2, schedule="circular", pipeline=(Block,)),
    ),
    "context-gather": (TINY, _hybrid(data=4, context=2, context_mode="gather")),
    "context-ring": (TINY, _hybrid(data=4, context=2, context_mode="ring")),
    "expert": (MOE, _hybrid(data=4, expert=2)),
}


def _build(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)


def _params(model):
    return {
        jax.tree_util.keystr(p): np.asarray(jax.device_get(v), np.float64)
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }


@functools.cache
def _single_device_update(cfg):
    """One SGD step of single-device JAX: ``{path: params after - before}``."""
    batch = _batches(cfg, n=1, batch=16)[0]
    with jax.default_device(jax.devices()[0]):
        model, opt = _build(cfg)
        before = _params(model)
        nnx.jit(_step)(model, opt, batch)
        return {k: v - before[k] for k, v in _params(model).items()}


def _rms(a):
    return float(np.sqrt(np.mean(a**2)))


def _check_updates(got, want):
    """Each tensor's update within ``RTOL`` of ``want``'s in norm; float32 noise (an update
    under ``FLOOR`` of the largest RMS) within that floor."""
    floor = FLOOR * max(_rms(w) for w in want.values())
    bad = {}
    for path, w in want.items():
        err = np.linalg.norm(got[path] - w)
        noise = _rms(w) <= floor
        bound = floor * np.sqrt(w.size) if noise else RTOL * np.linalg.norm(w)
        if not err <= bound:
            bad[path] = (err / max(np.linalg.norm(w), 1e-30), bound)
    assert not bad, f"updates off single-device JAX's (relative error, bound): {bad}"


def test_the_check_sees_any_tensor_s_update_scaled_by_a_thousandth():
    want = _single_device_update(TINY)
    _check_updates(want, want)
    floor = FLOOR * max(_rms(w) for w in want.values())
    assert all(_rms(w) > floor for w in want.values())  # no tensor is held to the floor
    for path in want:
        with pytest.raises(AssertionError, match="updates off single-device"):
            _check_updates({**want, path: want[path] * 1.001}, want)


@pytest.mark.parametrize("case", list(CASES))
def test_one_sgd_step_updates_every_tensor_as_single_device_jax(case):
    cfg, make = CASES[case]
    want = _single_device_update(cfg)
    s = make(cfg)
    with s.scope():
        model, opt = _build(cfg)
    before = _params(model)
    s.run(_step, args=(model, opt, _batches(cfg, n=1, batch=16)[0]))
    after = _params(model)
    assert after.keys() == want.keys()
    got = {k: after[k] - before[k] for k in after}
    assert all(np.any(g != 0) for g in got.values())  # every tensor stepped
    _check_updates(got, want)
