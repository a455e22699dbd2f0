"""`Strategy.run` (global and per-replica), reduce, gather, distributed values, get_strategy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor import UNSHARDED as U
from strategies import PerReplica, ReduceOp
from tests.models import MLPModel, linen_step, make_train_step, mlp_batches, mlp_loss, rel_err


def _model_and_opt(strategy, tx=None):
    with strategy.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)
    return model, opt


def _reference_step(batch, tx=None):
    model = MLPModel(rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx or optax.sgd(0.1), wrt=nnx.Param)
    loss = nnx.jit(make_train_step(mlp_loss))(model, opt, batch)
    return float(loss), model


# ---------------------------------------------------------------- compiling
def test_run_compiles_once_per_input_signature():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    model, opt = _model_and_opt(s)
    traced = []

    def step(model, opt, batch):
        traced.append(batch["x"].shape)
        return make_train_step(mlp_loss)(model, opt, batch)

    # One compile per signature: the first call traces (the FSDP preset traces
    # twice while compiling: a probe, then the step), later calls never do.
    small = mlp_batches(steps=3, batch=16)
    s.run(step, args=(model, opt, small[0]))
    per_compile = len(traced)
    assert per_compile >= 1 and set(traced) == {(16, 16)}
    for b in small[1:]:
        s.run(step, args=(model, opt, b))
    assert len(traced) == per_compile
    big = mlp_batches(steps=2, batch=32, seed=1)
    for b in big:
        s.run(step, args=(model, opt, b))
    assert traced == [(16, 16)] * per_compile + [(32, 16)] * per_compile
    s.run(step, args=(model, opt, small[0]))
    assert len(traced) == 2 * per_compile
    assert int(opt.step.get_value()) == 6


def test_run_recompiles_for_a_new_dtype_or_static_argument():
    s = strategies.MirroredStrategy()
    traced = []

    def f(x, scale):
        traced.append((x.dtype, scale))
        return x * scale

    x = np.arange(16, dtype=np.float32)
    np.testing.assert_allclose(s.run(f, args=(x, 2.0)), x * 2)
    np.testing.assert_allclose(s.run(f, args=(x + 1, 2.0)), (x + 1) * 2)
    np.testing.assert_allclose(s.run(f, args=(x, 3.0)), x * 3)
    np.testing.assert_allclose(s.run(f, args=(x.astype(np.int32), 2.0)), x * 2)
    assert traced == [(jnp.float32, 2.0), (jnp.float32, 3.0), (jnp.int32, 2.0)]


# ---------------------------------------------------------------- NNX steps
def test_nnx_step_mutates_model_and_optimizer_in_place():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    tx = optax.adam(1e-2)
    model, opt = _model_and_opt(s, tx)
    before = np.asarray(model.up.kernel.get_value())
    batch = mlp_batches(steps=1)[0]
    loss = s.run(make_train_step(mlp_loss), args=(model, opt, batch))
    ref_loss, ref_model = _reference_step(batch, tx)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    after = model.up.kernel.get_value()
    assert not np.allclose(np.asarray(after), before)
    assert rel_err(after, ref_model.up.kernel.get_value()) < 1e-5
    assert int(opt.step.get_value()) == 1
    mu = opt.opt_state[0].mu["up"]["kernel"].get_value()
    assert float(jnp.abs(mu).sum()) > 0
    # Still in the strategy's layouts, model and optimizer state alike.
    assert dtensor.fetch_layout(after).sharding_specs == (U, "fsdp")
    assert dtensor.fetch_layout(mu).sharding_specs == (U, "fsdp")


def test_nnx_step_keyword_arguments():
    s = strategies.MirroredStrategy()
    model, opt = _model_and_opt(s)
    batch = mlp_batches(steps=1)[0]
    loss = s.run(
        make_train_step(mlp_loss), args=(model,), kwargs={"optimizer": opt, "batch": batch}
    )
    assert float(loss) == pytest.approx(_reference_step(batch)[0], rel=1e-5)
    assert int(opt.step.get_value()) == 1


def test_pure_functional_step():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    tx = optax.adam(1e-2)
    model, step = linen_step(tx)
    batches = mlp_batches(steps=2)
    params0 = model.init(jax.random.key(0), batches[0]["x"])["params"]
    ref_p, ref_o = params0, tx.init(params0)
    params, opt_state = s.distribute_variables(params0), s.distribute_variables(tx.init(params0))
    for b in batches:
        ref_p, ref_o, ref_loss = jax.jit(step)(ref_p, ref_o, b)
        params, opt_state, loss = s.run(step, args=(params, opt_state, b))
        assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert rel_err(params["up"]["kernel"], ref_p["up"]["kernel"]) < 1e-5
    assert isinstance(params["up"]["kernel"], jax.Array)
    assert dtensor.fetch_layout(params["up"]["kernel"]).mesh == s.mesh


# ------------------------------------------------------------ input layouts
def _seen_sharding(strategy, x):
    seen = []

    def f(x):
        jax.debug.inspect_array_sharding(x, callback=seen.append)
        return x + 1

    out = strategy.run(f, args=(x,))
    return seen[0], out


def test_host_batches_get_the_batch_layout_and_results_are_global_arrays():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    x = np.arange(32.0, dtype=np.float32).reshape(16, 2)
    seen, out = _seen_sharding(s, x)
    assert seen.is_equivalent_to(s.batch_layout(2).sharding, 2)
    assert isinstance(out, jax.Array)
    assert out.shape == (16, 2)
    assert len(out.sharding.device_set) == 8
    assert dtensor.fetch_layout(out).mesh == s.mesh
    np.testing.assert_array_equal(np.asarray(out), x + 1)
    # A single-device jax array (not on any mesh) is a host batch too.
    seen, _ = _seen_sharding(s, jnp.asarray(x))
    assert seen.is_equivalent_to(s.batch_layout(2).sharding, 2)


def test_arrays_already_on_the_mesh_keep_their_layout():
    s = strategies.MirroredStrategy()
    replicated = dtensor.copy_to_mesh(
        np.ones((16, 2), np.float32), dtensor.Layout.replicated(s.mesh, 2)
    )
    seen, out = _seen_sharding(s, replicated)
    assert seen.is_fully_replicated
    assert dtensor.fetch_layout(out).is_fully_replicated()
    inner = dtensor.copy_to_mesh(
        np.ones((3, 16), np.float32), dtensor.Layout([U, "replica"], s.mesh)
    )
    seen, _ = _seen_sharding(s, inner)  # 3 rows: it would not divide as a batch
    assert seen.is_equivalent_to(dtensor.Layout([U, "replica"], s.mesh).sharding, 2)


def test_run_outside_and_inside_scope():
    s = strategies.MirroredStrategy()
    model, opt = _model_and_opt(s)
    batch = mlp_batches(steps=1)[0]
    inside = []

    def step(model, opt, batch):
        inside.append((strategies.get_strategy(), dtensor.current_mesh()))
        return make_train_step(mlp_loss)(model, opt, batch)

    assert dtensor.current_mesh() is None
    loss = s.run(step, args=(model, opt, batch))
    assert dtensor.current_mesh() is None
    assert inside[0][1] == s.mesh  # run sets the mesh itself
    assert float(loss) == pytest.approx(_reference_step(batch)[0], rel=1e-5)
    with s.scope():
        assert s.run(lambda x: x.sum(), args=(np.ones((8, 2), np.float32),)) == 16.0


# -------------------------------------------------------------- per replica
def test_per_replica_ids_and_all_reduce():
    s = strategies.MirroredStrategy()
    assert strategies.get_replica_context() is None
    assert strategies.in_cross_replica_context()
    contexts = []

    def fn(x):
        ctx = strategies.get_replica_context()
        contexts.append((ctx.num_replicas_in_sync, strategies.in_cross_replica_context()))
        total = x.sum()  # this replica's rows: 2 of them
        return {
            "id": ctx.replica_id_in_sync_group,
            "rows": x,
            "sum": ctx.all_reduce(ReduceOp.SUM, total),
            "mean": ctx.all_reduce("mean", total),
            "max": ctx.all_reduce(ReduceOp.MAX, total),
            "min": ctx.all_reduce(ReduceOp.MIN, total),
            "tree": ctx.all_reduce("sum", {"a": total, "b": 2 * total}),
        }

    x = np.arange(16, dtype=np.float32)
    out = s.run(fn, args=(x,), per_replica=True)
    assert contexts == [(8, False)]
    assert strategies.get_replica_context() is None
    per = jax.tree.leaves(out, is_leaf=lambda v: isinstance(v, PerReplica))
    assert all(isinstance(v, PerReplica) for v in per)
    assert out["id"].value.tolist() == list(range(8))
    assert [int(v) for v in out["id"].values] == list(range(8))
    assert len(out["id"]) == 8
    partial = x.reshape(8, 2).sum(1)  # [1, 5, 9, ...]
    np.testing.assert_allclose(out["sum"].value, np.full(8, partial.sum()))
    np.testing.assert_allclose(out["mean"].value, np.full(8, partial.mean()))
    np.testing.assert_allclose(out["max"].value, np.full(8, partial.max()))
    np.testing.assert_allclose(out["min"].value, np.full(8, partial.min()))
    np.testing.assert_allclose(out["tree"]["b"].value, np.full(8, 2 * partial.sum()))
    np.testing.assert_array_equal(out["rows"].value, x.reshape(8, 2))
    # reduce() and gather() of the per-replica outputs.
    assert float(s.reduce("sum", out["id"])) == 28
    assert float(s.reduce(ReduceOp.MEAN, out["rows"], axis=0)) == x.mean()
    np.testing.assert_allclose(s.reduce("sum", out["rows"]), x.reshape(8, 2).sum(0))
    np.testing.assert_array_equal(s.gather(out["rows"], axis=0), x)
    assert dtensor.fetch_layout(s.gather(out["rows"], axis=0)).is_fully_replicated()


def test_per_replica_replica_ids_over_two_batch_axes():
    s = strategies.HybridStrategy(data=2, fsdp=2, tensor=2)
    out = s.run(
        lambda x: strategies.get_replica_context().replica_id_in_sync_group,
        args=(np.zeros((8,)),),
        per_replica=True,
    )
    assert out.value.tolist() == [0, 1, 2, 3]


def test_per_replica_nnx_step_matches_global_step_and_keeps_layouts():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)  # variables split on `tensor`
    model, opt = _model_and_opt(s)

    def step(model, opt, batch):
        ctx = strategies.get_replica_context()
        loss, grads = nnx.value_and_grad(mlp_loss)(model, batch)
        opt.update(model, ctx.all_reduce("mean", grads))
        return ctx.all_reduce("mean", loss)

    batch = mlp_batches(steps=1)[0]
    loss = s.run(step, args=(model, opt, batch), per_replica=True)
    ref_loss, ref_model = _reference_step(batch)
    np.testing.assert_allclose(loss.value, np.full(4, ref_loss), rtol=1e-5)
    assert rel_err(model.up.kernel.get_value(), ref_model.up.kernel.get_value()) < 1e-5
    assert rel_err(model.down.kernel.get_value(), ref_model.down.kernel.get_value()) < 1e-5
    assert dtensor.fetch_layout(model.up.kernel.get_value()).sharding_specs == (U, "tensor")
    assert dtensor.fetch_layout(model.down.kernel.get_value()).sharding_specs == ("tensor", U)


def test_one_device_per_replica_context():
    s = strategies.OneDeviceStrategy()

    def fn(x):
        ctx = strategies.get_replica_context()
        return ctx.replica_id_in_sync_group, ctx.all_reduce("sum", x.sum())

    ids, total = s.run(fn, args=(np.ones((4,), np.float32),), per_replica=True)
    assert ids.value.tolist() == [0]
    assert total.value.tolist() == [4.0]


# ------------------------------------------------------------ reduce/gather
def test_reduce_per_replica_values():
    s = strategies.MirroredStrategy()
    v = s.experimental_distribute_values_from_function(
        lambda ctx: np.array(
            [ctx.replica_id_in_sync_group, 10 * ctx.replica_id_in_sync_group], np.float32
        )
    )
    stacked = np.array([[i, 10 * i] for i in range(8)], np.float32)
    np.testing.assert_allclose(s.reduce(ReduceOp.SUM, v), stacked.sum(0))
    np.testing.assert_allclose(s.reduce(ReduceOp.MEAN, v), stacked.mean(0))
    np.testing.assert_allclose(s.reduce(ReduceOp.MAX, v), stacked.max(0))
    np.testing.assert_allclose(s.reduce(ReduceOp.MIN, v), stacked.min(0))
    # With axis: also along that dimension of each replica's value.
    assert float(s.reduce("sum", v, axis=0)) == stacked.sum()
    assert float(s.reduce("max", v, axis=0)) == 70.0
    assert float(s.reduce("min", v, axis=0)) == 0.0
    assert float(s.reduce("mean", v, axis=0)) == pytest.approx(stacked.mean())
    # A pytree of per-replica values.
    tree = s.reduce("sum", {"a": v, "b": [v]})
    np.testing.assert_allclose(tree["b"][0], stacked.sum(0))


def test_reduce_global_arrays_along_an_axis():
    s = strategies.MirroredStrategy()
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    g = s.run(lambda x: x, args=(x,))
    np.testing.assert_allclose(s.reduce("sum", g, axis=0), x.sum(0))
    np.testing.assert_allclose(s.reduce("mean", g, axis=0), x.mean(0))
    np.testing.assert_allclose(s.reduce("max", g, axis=1), x.max(1))
    np.testing.assert_allclose(s.reduce("min", g, axis=0), x.min(0))
    # No axis: a global array already is one value.
    np.testing.assert_array_equal(s.reduce("sum", g), x)


def test_gather_per_replica_and_global():
    s = strategies.MirroredStrategy()
    v = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group, np.int32)
    )
    g0 = s.gather(v, axis=0)
    assert g0.shape == (16, 3)
    np.testing.assert_array_equal(g0[:, 0], np.repeat(np.arange(8), 2))
    g1 = s.gather(v, axis=1)
    assert g1.shape == (2, 24)
    np.testing.assert_array_equal(g1[0], np.repeat(np.arange(8), 3))
    assert dtensor.fetch_layout(g1).is_fully_replicated()
    batch = s.run(lambda x: x, args=(np.arange(16, dtype=np.float32),))
    assert dtensor.fetch_layout(batch).sharding_specs == ("replica",)
    whole = s.gather(batch, axis=0)
    assert dtensor.fetch_layout(whole).is_fully_replicated()
    np.testing.assert_array_equal(whole, np.arange(16))


def test_distribute_values_from_function():
    s = strategies.MirroredStrategy(devices=jax.devices()[:4])
    seen = []

    def value_fn(ctx):
        seen.append((ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
        return {
            "id": np.int32(ctx.replica_id_in_sync_group),
            "v": np.full((3,), ctx.replica_id_in_sync_group * 1.5),
        }

    out = s.experimental_distribute_values_from_function(value_fn)
    assert seen == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert isinstance(out["id"], PerReplica)
    assert out["id"].value.tolist() == [0, 1, 2, 3]
    assert out["v"].value.shape == (4, 3)
    np.testing.assert_allclose(out["v"].values[3], [4.5, 4.5, 4.5])
    # Each replica's value lives on its own device.
    shard_devices = {sh.device: int(sh.data[0]) for sh in out["id"].value.addressable_shards}
    assert shard_devices == {d: i for i, d in enumerate(jax.devices()[:4])}


def test_model_built_under_another_strategy_is_relaid_by_run():
    # A model built under one strategy runs under another, relaid out by it.
    a = strategies.MirroredStrategy()
    with a.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    b = strategies.FullyShardedStrategy(min_shard_bytes=0)
    x = np.ones((8, 16), np.float32)
    out = b.run(lambda m, o, x: m(x).sum(), args=(model, opt, x))
    assert np.isfinite(float(out))
    assert dtensor.fetch_layout(model.up.kernel.get_value()).mesh == b.mesh
    assert jax.tree.leaves(nnx.state(model))[0].sharding.mesh == b.mesh.jax_mesh


# ------------------------------------------------------------- get_strategy
def test_get_strategy_inside_and_outside_scope():
    default = strategies.get_strategy()
    assert isinstance(default, strategies.OneDeviceStrategy)
    assert strategies.get_strategy() is default
    s = strategies.FullyShardedStrategy()
    with s.scope() as entered:
        assert entered is s
        assert strategies.get_strategy() is s
        assert dtensor.current_mesh() == s.mesh
        with s.scope():  # the same strategy again is fine
            assert strategies.get_strategy() is s
        assert strategies.get_strategy() is s
    assert strategies.get_strategy() is default
    assert dtensor.current_mesh() is None


@pytest.mark.parametrize("preset", ["mirrored", "fully_sharded", "central_storage"])
def test_cache_graph_gives_the_same_training(preset):
    results = []
    for cache_graph in (False, True):
        s = strategies.from_name(preset)
        model, opt = _model_and_opt(s, optax.adam(1e-2))
        step = make_train_step(mlp_loss)
        losses = [
            float(s.run(step, args=(model, opt, b), cache_graph=cache_graph)) for b in mlp_batches()
        ]
        results.append((losses, np.asarray(model.up.kernel.get_value()), int(opt.step.get_value())))
    (l0, k0, n0), (l1, k1, n1) = results
    np.testing.assert_array_equal(l0, l1)
    np.testing.assert_array_equal(k0, k1)
    assert n0 == n1 == 5


@pytest.mark.parametrize("cache_graph", [False, True])
def test_a_step_that_changes_the_models_structure_gets_a_clear_error(cache_graph):
    s = strategies.MirroredStrategy()
    model, opt = _model_and_opt(s)

    def grows(model, opt, batch):
        model.extra = nnx.Param(jnp.zeros(()))
        return make_train_step(mlp_loss)(model, opt, batch)

    with pytest.raises(ValueError, match="changed its models' structure"):
        s.run(grows, args=(model, opt, mlp_batches(1)[0]), cache_graph=cache_graph)
