"""`Strategy.run(..., donate_argnums=...)` and `explain(...)`: functional steps donate as `jax.jit` does."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from tests.models import MLPModel, linen_step, make_train_step, mlp_batches, mlp_loss, rel_err
from tests.strategies.test_conformance import TOL

PRESETS = {
    "fully_sharded": lambda: strategies.FullyShardedStrategy(min_shard_bytes=0),
    "mirrored": strategies.MirroredStrategy,
}


def _setup(strategy, tx):
    model, step = linen_step(tx)
    batches = mlp_batches(3)
    params0 = model.init(jax.random.key(0), batches[0]["x"])["params"]
    return step, batches, params0


def _state(strategy, tx, params0):
    """``params0`` and its optimizer state in ``strategy``'s layouts."""
    params = strategy.distribute_variables(params0)
    return params, strategy.distribute_variables(tx.init(params))


def _run(strategy, step, tx, params0, batches, donate):
    params, opt_state = _state(strategy, tx, params0)
    losses = []
    for b in batches:
        given = jax.tree.leaves((params, opt_state))
        params, opt_state, loss = strategy.run(
            step, args=(params, opt_state, b), donate_argnums=donate
        )
        losses.append(float(loss))
        assert all(a.is_deleted() == bool(donate) for a in given)
    return losses, params


def _traced(step):
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    return counted, calls


@pytest.mark.parametrize("preset", list(PRESETS))
def test_donated_linen_step_matches_undonated_and_single_device(preset):
    tx = optax.adam(1e-2)
    strategy = PRESETS[preset]()
    step, batches, params0 = _setup(strategy, tx)

    params, opt_state = params0, tx.init(params0)
    ref_step = jax.jit(step)
    ref_losses = []
    for b in batches:
        params, opt_state, loss = ref_step(params, opt_state, b)
        ref_losses.append(float(loss))

    kept_losses, kept_params = _run(strategy, step, tx, params0, batches, ())
    losses, got = _run(strategy, step, tx, params0, batches, (0, 1))
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    np.testing.assert_allclose(losses, kept_losses, rtol=TOL)
    for (path, g), want, kept in zip(
        jax.tree_util.tree_leaves_with_path(got),
        jax.tree.leaves(params),
        jax.tree.leaves(kept_params),
        strict=True,
    ):
        assert rel_err(g, want) <= TOL, jax.tree_util.keystr(path)
        assert rel_err(g, kept) <= TOL, jax.tree_util.keystr(path)


def test_donation_deletes_the_donated_arrays_only():
    tx = optax.adam(1e-2)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    step, batches, params0 = _setup(s, tx)
    params, opt_state = _state(s, tx, params0)
    batch = jax.tree.map(lambda v: jax.device_put(v, s.batch_layout(v.ndim).sharding), batches[0])
    host = batches[1]
    new, new_opt, _ = s.run(step, args=(params, opt_state, batch), donate_argnums=(0, -2))
    assert all(a.is_deleted() for a in jax.tree.leaves((params, opt_state)))
    assert not any(a.is_deleted() for a in jax.tree.leaves(batch))  # on the mesh, not donated
    # Host (numpy) arguments are copied onto the mesh first: their copy is donated.
    out = s.run(step, args=(new, new_opt, host), donate_argnums=2)
    assert all(isinstance(v, np.ndarray) for v in jax.tree.leaves(host))
    assert np.isfinite(float(out[2]))


def test_explain_with_donation_aliases_the_state():
    tx = optax.adam(1e-2)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    step, batches, params0 = _setup(s, tx)
    params, opt_state = _state(s, tx, params0)
    args = (params, opt_state, batches[0])
    kept = s.explain(step, args=args)
    donated = s.explain(step, args=args, donate_argnums=(0, 1))
    for r in (kept, donated):
        assert r.alias_bytes_per_device is not None and r.peak_bytes_per_device is not None
    state_bytes = sum(
        a.addressable_shards[0].data.nbytes for a in jax.tree.leaves((params, opt_state))
    )
    assert kept.alias_bytes_per_device == 0
    assert donated.alias_bytes_per_device >= state_bytes
    assert donated.peak_bytes_per_device < kept.peak_bytes_per_device
    # explain donates nothing itself
    assert not any(a.is_deleted() for a in jax.tree.leaves((params, opt_state)))
    # The donated arguments are the report's variables, named by the step's parameters.
    paths = [v.path for v in donated.variables]
    assert kept.variables == () and kept.min_comm_bytes_per_device == 0
    assert {p.split("/")[0] for p in paths} == {"params", "opt_state"}
    assert "params/up/kernel" in paths
    assert donated.state_bytes_per_device == state_bytes
    assert [v.path for v in donated.variables if v.trainable] == [
        p for p in paths if p.startswith("params/")
    ]
    # Each trainable variable split over fsdp: two gathers and a reduce-scatter at the least.
    params_bytes = sum(a.nbytes for a in jax.tree.leaves(params))
    zero = donated.min_comm_references["weights gathered (ZeRO)"]
    assert zero == pytest.approx(3 * 7 / 8 * params_bytes)
    # XLA moves this tiny batch rather than the weights: below the weights' reference, at or
    # above the minimum (which allows that plan).
    assert donated.comm_bytes_per_device < zero and donated.comm_ratio >= 1
    assert donated.ideal_peak_bytes_per_device >= state_bytes


@pytest.mark.parametrize(
    ("donate", "error", "match"),
    [
        (3, ValueError, r"run\(donate_argnums=3\): position 3 is out of range .* 0 to 2 .*args="),
        ((0, -4), ValueError, r"position -4 is out of range.*-3 to -1"),
        ("0", TypeError, r"must be an int or a sequence of ints.*'0' \(a str\).*donate_argnums=\("),
        ((0, 1.0), TypeError, r"holds 1\.0 \(a float\)"),
        (True, TypeError, r"holds True \(a bool\)"),
    ],
)
def test_bad_donate_argnums_raise_before_compiling(donate, error, match):
    tx = optax.sgd(0.1)
    s = strategies.MirroredStrategy()
    step, batches, params0 = _setup(s, tx)
    counted, calls = _traced(step)
    params, opt_state = _state(s, tx, params0)
    with pytest.raises(error, match=match):
        s.run(counted, args=(params, opt_state, batches[0]), donate_argnums=donate)
    with pytest.raises(error, match=match.replace("run", "explain")):
        s.explain(counted, args=(params, opt_state, batches[0]), donate_argnums=donate)
    assert not calls
    assert not any(a.is_deleted() for a in jax.tree.leaves((params, opt_state)))


def test_donation_is_part_of_the_compile_key():
    tx = optax.sgd(0.1)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    step, batches, params0 = _setup(s, tx)
    counted, calls = _traced(step)
    params, opt_state = _state(s, tx, params0)
    for b in batches[:2]:  # the second call has the first one's outputs' shardings
        params, opt_state, _ = s.run(counted, args=(params, opt_state, b), donate_argnums=(0, 1))
    n = len(calls)
    new, new_opt, _ = s.run(counted, args=(params, opt_state, batches[2]))
    assert len(calls) == n + 1  # a second compile, without donation
    assert not any(a.is_deleted() for a in jax.tree.leaves((params, opt_state)))
    s.run(counted, args=(new, new_opt, batches[0]), donate_argnums=[1, 0])  # the first again
    assert len(calls) == n + 1
    assert all(a.is_deleted() for a in jax.tree.leaves((new, new_opt)))


def test_donating_nnx_arguments_is_accepted():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with s.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(mlp_loss)
    b = mlp_batches(1)[0]
    want = float(s.run(step, args=(model, opt, b)))
    got = float(s.run(step, args=(model, opt, b), donate_argnums=(0, 1)))
    assert got < want  # a second step, on the updated model
    assert not any(a.is_deleted() for a in jax.tree.leaves(nnx.state(model)))
    assert s.explain(step, args=(model, opt, b), donate_argnums=(0, 1)).peak_bytes_per_device


def test_per_replica_run_donates():
    s = strategies.MirroredStrategy()
    x = jax.device_put(np.arange(16.0, dtype=np.float32), s.batch_layout(1).sharding)
    out = s.run(lambda x: x * 2, args=(x,), per_replica=True, donate_argnums=0)
    assert x.is_deleted()
    assert s.gather(out).tolist() == [2.0 * i for i in range(16)]


def test_explicit_reduction_refuses_donated_arrays():
    s = strategies.MirroredStrategy(
        cross_device_ops=strategies.AllReduceCrossDeviceOps(num_packs=2)
    )
    with s.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = make_train_step(mlp_loss)
    b = mlp_batches(1)[0]
    with pytest.raises(
        ValueError, match=r"run\(donate_argnums=2\).*does not donate array arguments"
    ):
        s.run(step, args=(model, opt, b), donate_argnums=2)
    assert np.isfinite(float(s.run(step, args=(model, opt, b), donate_argnums=(0, 1))))
