"""One conformance suite for every preset: the same Flax step must match single-device JAX."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from tests.models import (
    Block,
    MLPModel,
    linen_step,
    lm_batches,
    lm_loss,
    make_train_step,
    mlp_batches,
    mlp_loss,
    rel_err,
)


def _layout_strategy():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    rules = dtensor.LayoutMap(
        mesh, [("up/kernel", (None, "model")), ("down/kernel", ("model", None))]
    )
    return strategies.LayoutStrategy(mesh, rules)


PRESETS = {
    "one_device": lambda: strategies.OneDeviceStrategy(),
    "mirrored": lambda: strategies.MirroredStrategy(),
    "multi_worker_mirrored": lambda: strategies.MultiWorkerMirroredStrategy(),
    "central_storage": lambda: strategies.CentralStorageStrategy(),
    "tpu": lambda: strategies.TPUStrategy(devices=jax.devices()),
    "parameter_server": lambda: strategies.ParameterServerStrategy(
        strategies.FixedShardsPartitioner(2)
    ),
    "fully_sharded": lambda: strategies.FullyShardedStrategy(min_shard_bytes=0),
    "fully_sharded_keep": lambda: strategies.FullyShardedStrategy(
        min_shard_bytes=0, reshard_after_forward=False
    ),
    "fully_sharded_remat": lambda: strategies.FullyShardedStrategy(
        min_shard_bytes=0, remat=(nnx.Linear,), remat_policy="dots_saveable"
    ),
    "fully_sharded_offload": lambda: strategies.FullyShardedStrategy(
        min_shard_bytes=0, offload_optimizer=True
    ),
    "tensor_parallel": lambda: strategies.TensorParallelStrategy(tensor_parallel=2),
    "hybrid": lambda: strategies.HybridStrategy(data=2, fsdp=2, tensor=2, min_shard_bytes=0),
    "hybrid_remat": lambda: strategies.HybridStrategy(
        data=2, fsdp=2, tensor=2, min_shard_bytes=0, remat=(nnx.Linear,)
    ),
    "layout": _layout_strategy,
}

MODELS = {
    "mlp": (MLPModel, mlp_loss, mlp_batches),
    "transformer": (Block, lm_loss, lm_batches),
}

TOL = 1e-5


def _reference(model_cls, loss_fn, batches):
    model = model_cls(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = nnx.jit(make_train_step(loss_fn))
    losses = [float(step(model, opt, b)) for b in batches]
    return losses, nnx.state(model, nnx.Param)


_REFS: dict[str, tuple] = {}


def reference(name):
    if name not in _REFS:
        model_cls, loss_fn, make_batches = MODELS[name]
        with jax.default_device(jax.devices()[0]):
            _REFS[name] = _reference(model_cls, loss_fn, make_batches())
    return _REFS[name]


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("preset", list(PRESETS))
def test_nnx_step_matches_single_device(preset, model_name):
    model_cls, loss_fn, make_batches = MODELS[model_name]
    ref_losses, ref_params = reference(model_name)
    strategy = PRESETS[preset]()
    with strategy.scope():
        model = model_cls(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(loss_fn)
    losses = [float(strategy.run(step, args=(model, opt, b))) for b in make_batches()]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    params = nnx.state(model, nnx.Param)
    got = dict(jax.tree_util.tree_leaves_with_path(params))
    for path, want in jax.tree_util.tree_leaves_with_path(ref_params):
        assert rel_err(got[path], want) <= TOL, (preset, jax.tree_util.keystr(path))
    # The variables are still in the strategy's (storage) layouts and memories after the steps.
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state((model, opt)), is_leaf=lambda v: isinstance(v, nnx.Variable)
    ):
        value = var.get_value()
        name = dtensor.core.tree.path_str(path).split("/", 1)[1]
        want = strategy.storage_layout_fn(name, var).layout
        have = value.sharding
        assert have.memory_kind == (strategy.memory_kind(name, var) or "device"), (preset, path)
        have = have.with_memory_kind("device")
        assert have.is_equivalent_to(want.sharding, value.ndim), (preset, path)


@pytest.mark.parametrize(
    "preset",
    [
        "one_device",
        "mirrored",
        "fully_sharded",
        "parameter_server",
        "tensor_parallel",
        "central_storage",
    ],
)
def test_linen_functional_step_matches_single_device(preset):
    tx = optax.adam(1e-2)
    model, step = linen_step(tx)
    batches = mlp_batches()
    params0 = model.init(jax.random.key(0), batches[0]["x"])["params"]

    params, opt_state = params0, tx.init(params0)
    ref_step = jax.jit(step)
    ref_losses = []
    for b in batches:
        params, opt_state, loss = ref_step(params, opt_state, b)
        ref_losses.append(float(loss))
    ref_params = params

    strategy = PRESETS[preset]()
    params = strategy.distribute_variables(params0)
    opt_state = strategy.distribute_variables(tx.init(params))
    losses = []
    for b in batches:
        params, opt_state, loss = strategy.run(step, args=(params, opt_state, b))
        losses.append(float(loss))
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    for (path, got), (_, want) in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree_util.tree_leaves_with_path(ref_params),
        strict=True,
    ):
        assert rel_err(got, want) <= TOL, jax.tree_util.keystr(path)
