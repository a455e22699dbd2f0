"""Cross-device ops: each choice compiles to the collectives it promises and trains like the default."""

from __future__ import annotations

import re
import threading
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from strategies.replica.cross_device_ops import (
    CrossDeviceOpsError,
    RingAllReduce,
    StepWatchdog,
    packs_for,
)
from tests.models import MLPModel, linen_step, make_train_step, mlp_batches, mlp_loss, rel_err

GRAD_FLOATS = 16 * 64 + 64 + 64 * 8 + 8  # MLPModel's parameters: 1608 floats
STEPS = 3


def _train(strategy):
    with strategy.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(mlp_loss)
    batches = mlp_batches(steps=STEPS)
    report = strategy.explain(step, args=(model, opt, batches[0]))
    losses = [float(strategy.run(step, args=(model, opt, b))) for b in batches]
    return losses, jax.tree.leaves(nnx.state(model, nnx.Param)), report


_DEFAULT: list = []


def default_run():
    if not _DEFAULT:
        _DEFAULT.append(_train(strategies.MirroredStrategy()))
    return _DEFAULT[0]


def _grad_collectives(report):
    """(kind, axes, elements) of the collectives that move gradients (not the loss's few elements)."""
    return sorted(
        (c.kind, c.mesh_axes, int(np.prod(c.shape)))
        for c in report.collectives
        if np.prod(c.shape) > 8
    )


CASES = {
    "num_packs": (
        lambda: strategies.MirroredStrategy(
            cross_device_ops=strategies.AllReduceCrossDeviceOps(num_packs=2)
        ),
        [("all-reduce", ("replica",), 584), ("all-reduce", ("replica",), 1024)],
    ),
    "bytes_per_pack": (
        lambda: strategies.MirroredStrategy(
            cross_device_ops=strategies.AllReduceCrossDeviceOps(bytes_per_pack=4096)
        ),
        [("all-reduce", ("replica",), 584), ("all-reduce", ("replica",), 1024)],
    ),
    "one_device": (
        lambda: strategies.MirroredStrategy(
            cross_device_ops=strategies.ReductionToOneDevice(reduce_to_device=3)
        ),
        [("collective-permute", ("replica",), GRAD_FLOATS)] * 14,  # 7 in, 7 out
    ),
    "hierarchical": (
        lambda: strategies.MirroredStrategy(
            cross_device_ops=strategies.HierarchicalCopyAllReduce()
        ),
        [  # within the group of 4, across the 2 groups on a quarter, back within the group
            ("all-gather", ("replica",), GRAD_FLOATS),
            ("all-reduce", ("group",), GRAD_FLOATS // 4),
            ("reduce-scatter", ("replica",), GRAD_FLOATS // 4),
        ],
    ),
    "ring": (
        lambda: strategies.MultiWorkerMirroredStrategy(
            communication_options=strategies.CommunicationOptions(implementation="ring")
        ),
        [("collective-permute", ("worker", "replica"), GRAD_FLOATS // 8)] * 14,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_choice_compiles_to_its_collectives_and_matches_default(case):
    make, want = CASES[case]
    ref_losses, ref_params, _ = default_run()
    losses, params, report = _train(make())
    got = _grad_collectives(report)
    if case == "ring":  # MultiWorkerMirrored names both axes (worker has size 1 here)
        got = [(k, ("worker", "replica"), n) for k, _, n in got]
    assert got == sorted(want)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(params, ref_params, strict=True):
        assert rel_err(a, b) <= 1e-5


def test_default_is_one_xla_all_reduce():
    _, _, report = default_run()
    assert {c.kind for c in report.collectives} == {"all-reduce"}
    assert len({c.name for c in report.collectives}) == 1  # one combined (tuple) all-reduce
    assert sum(int(np.prod(c.shape)) for c in report.collectives if c.shape) == GRAD_FLOATS
    s = strategies.MirroredStrategy(cross_device_ops=strategies.AllReduceCrossDeviceOps())
    assert s.gradient_reduction is None
    mw = strategies.MultiWorkerMirroredStrategy(
        communication_options=strategies.CommunicationOptions()
    )
    assert mw.gradient_reduction is None


def test_packs():
    shapes = [(8,), (64, 8), (64,), (16, 64)]
    assert packs_for(strategies.AllReduceCrossDeviceOps(bytes_per_pack=4096), shapes) == [
        2336,
        4096,
    ]
    assert packs_for(strategies.AllReduceCrossDeviceOps(bytes_per_pack=1), shapes) == [
        32,
        2048,
        256,
        4096,
    ]
    assert (
        sum(packs_for(strategies.AllReduceCrossDeviceOps(num_packs=3), shapes)) == GRAD_FLOATS * 4
    )
    assert len(packs_for(strategies.AllReduceCrossDeviceOps(num_packs=3), shapes)) == 3


def test_communication_options_map_to_ops():
    opts = strategies.CommunicationOptions
    assert opts(bytes_per_pack=64).cross_device_ops() == strategies.AllReduceCrossDeviceOps(
        bytes_per_pack=64
    )
    assert (
        opts(implementation=strategies.CommunicationImplementation.RING).cross_device_ops()
        == RingAllReduce()
    )
    assert opts().cross_device_ops() is None
    mw = strategies.MultiWorkerMirroredStrategy(
        communication_options=opts(bytes_per_pack=1024, timeout_seconds=30)
    )
    assert mw.gradient_reduction == strategies.AllReduceCrossDeviceOps(bytes_per_pack=1024)
    assert mw.communication_options.timeout_seconds == 30


def test_errors():
    with pytest.raises(CrossDeviceOpsError, match="NCCL is NVIDIA's collective library.*'cpu'"):
        strategies.MirroredStrategy(cross_device_ops=strategies.NcclAllReduce())
    with pytest.raises(CrossDeviceOpsError, match="NCCL is NVIDIA's collective library"):
        strategies.MultiWorkerMirroredStrategy(
            communication_options=strategies.CommunicationOptions(implementation="nccl")
        )
    with pytest.raises(CrossDeviceOpsError, match="implementation='tree'.*AUTO, RING, NCCL"):
        strategies.CommunicationOptions(implementation="tree")
    with pytest.raises(CrossDeviceOpsError, match="bytes_per_pack=-1"):
        strategies.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(CrossDeviceOpsError, match="timeout_seconds=0"):
        strategies.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(CrossDeviceOpsError, match="num_packs=0"):
        strategies.AllReduceCrossDeviceOps(num_packs=0)
    with pytest.raises(CrossDeviceOpsError, match="bytes_per_pack='x'"):
        strategies.AllReduceCrossDeviceOps(bytes_per_pack="x")
    with pytest.raises(CrossDeviceOpsError, match="both num_packs=2 and bytes_per_pack=8"):
        strategies.AllReduceCrossDeviceOps(num_packs=2, bytes_per_pack=8)
    with pytest.raises(CrossDeviceOpsError, match="into 3 groups, which needs a multiple of 3"):
        strategies.MirroredStrategy(
            cross_device_ops=strategies.HierarchicalCopyAllReduce(num_groups=3)
        )
    with pytest.raises(CrossDeviceOpsError, match="its 'worker' axis, of size 1, not 2"):
        strategies.MultiWorkerMirroredStrategy(
            cross_device_ops=strategies.HierarchicalCopyAllReduce(num_groups=2)
        )
    with pytest.raises(CrossDeviceOpsError, match="needs two replica axes"):
        strategies.replica.cross_device_ops.resolve(
            strategies.HierarchicalCopyAllReduce(),
            strategies.MirroredStrategy().mesh,
            ("replica",),
            what="X",
        )
    with pytest.raises(CrossDeviceOpsError, match="neither a replica index in 0..7"):
        strategies.MirroredStrategy(
            cross_device_ops=strategies.ReductionToOneDevice(reduce_to_device=9)
        )
    with pytest.raises(CrossDeviceOpsError, match="is not a cross-device ops object"):
        strategies.MirroredStrategy(cross_device_ops="nccl")
    with pytest.raises(CrossDeviceOpsError, match="is not a strategies.CommunicationOptions"):
        strategies.MultiWorkerMirroredStrategy(communication_options={"bytes_per_pack": 1})
    with pytest.raises(CrossDeviceOpsError, match="got both cross_device_ops"):
        strategies.MultiWorkerMirroredStrategy(
            cross_device_ops=strategies.ReductionToOneDevice(),
            communication_options=strategies.CommunicationOptions(bytes_per_pack=8),
        )


def test_functional_step_is_refused_with_explicit_ops():
    s = strategies.MirroredStrategy(cross_device_ops=strategies.ReductionToOneDevice())
    tx = optax.adam(1e-2)
    model, step = linen_step(tx)
    batch = mlp_batches(steps=1)[0]
    params = s.distribute_variables(model.init(jax.random.key(0), batch["x"])["params"])
    with pytest.raises(
        CrossDeviceOpsError, match="reduces gradients where an nnx.Optimizer applies them"
    ):
        s.run(step, args=(params, s.distribute_variables(tx.init(params)), batch))


@pytest.mark.parametrize("root", [5, 0])
def test_device_root_and_scalar_outputs(root):
    s = strategies.MirroredStrategy(
        cross_device_ops=strategies.ReductionToOneDevice(reduce_to_device=jax.devices()[root])
    )
    with s.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(mlp_loss)(model, batch)
        opt.update(model, grads)
        return loss, model(batch["x"])

    batch = mlp_batches(steps=1)[0]
    # Every other replica sends into the chosen root, and the root sends the sum back out.
    text = s.explain(step, args=(model, opt, batch)).compiled.as_text()
    pairs = {
        (int(a), int(b)) for a, b in re.findall(r"source_target_pairs=\{\{(\d+),(\d+)\}\}", text)
    }
    others = set(range(8)) - {root}
    assert {a for a, b in pairs if b == root} == others
    assert {b for a, b in pairs if a == root} == others
    assert all(root in pair for pair in pairs)

    ref_model = MLPModel(rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.sgd(0.1), wrt=nnx.Param)
    want_loss, want_preds = nnx.jit(step)(ref_model, ref_opt, batch)
    loss, preds = s.run(step, args=(model, opt, batch))
    assert preds.shape == (16, 8)  # batch outputs are concatenated
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    # The reduced gradient reached every replica: updated parameters and outputs match.
    np.testing.assert_allclose(np.asarray(preds), np.asarray(want_preds), rtol=1e-5, atol=1e-6)
    for path, want in jax.tree_util.tree_leaves_with_path(nnx.state(ref_model, nnx.Param)):
        got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)))[path]
        assert rel_err(got, want) < 1e-5, path


def test_step_watchdog_fires_on_a_stuck_step():
    fired: list[str] = []
    dog = StepWatchdog(0.2, what="test", on_timeout=fired.append)

    class Done:
        def block_until_ready(self):
            return self

    class Stuck:
        def block_until_ready(self):
            threading.Event().wait()

    dog.watch(Done())
    time.sleep(0.5)
    assert fired == []
    dog.watch(Stuck())
    deadline = time.monotonic() + 10
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fired and "step 2 did not finish within timeout_seconds=0.2" in fired[0]
