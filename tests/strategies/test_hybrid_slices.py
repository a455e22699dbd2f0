"""HybridStrategy(across_slices=...): which axis spans the slices of a multi-slice TPU topology.

The devices are libtpu's (``dtensor.tpu_topology("v5e:2x2", num_slices=2)``: 2
slices of 4 chips); the collectives that cross slices come from the TPU
compiler's program (``strategy.explain``). On CPU (no slices) the option
changes nothing: the step still matches single-device JAX.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from strategies.placement.slices import slice_count
from tests.models import (
    abstract_block_step,
    deep_mlp_step,
    make_train_step,
    rel_err,
)
from tests.strategies.test_conformance import MODELS, TOL, reference


@pytest.fixture(scope="module")
def two_slices():
    return dtensor.tpu_topology("v5e:2x2", num_slices=2)


def _slices(mesh: dtensor.Mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.slice_index, otypes=[int])(mesh.devices)


def _hybrid(devices, **kw):
    return strategies.HybridStrategy(devices=devices, min_shard_bytes=0, **kw)


def test_data_across_slices_puts_one_slice_in_each_data_row(two_slices):
    s = _hybrid(two_slices, data=-1, fsdp=4, across_slices="data")
    assert s.mesh.shape == {"data": 2, "fsdp": 4, "tensor": 1}
    assert s.across_slices == "data"
    slices = _slices(s.mesh)
    assert slices[0].flatten().tolist() == [0] * 4 and slices[1].flatten().tolist() == [1] * 4
    # Each replica (an fsdp row) is a whole slice, every chip once.
    assert {d.id for d in s.mesh.devices[0].flat} == {d.id for d in two_slices[:4]}
    assert {d.id for d in s.mesh.devices[1].flat} == {d.id for d in two_slices[4:]}
    assert s.num_replicas_in_sync == 8


def test_fsdp_across_slices_puts_the_slices_along_fsdp(two_slices):
    s = _hybrid(two_slices, data=1, fsdp=8, across_slices="fsdp")
    assert s.across_slices == "fsdp"
    assert _slices(s.mesh)[0, :, 0].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    # With data=2 too: each data row's fsdp group has half its devices in each slice.
    s = _hybrid(two_slices, data=2, fsdp=4, across_slices="fsdp")
    assert _slices(s.mesh)[:, :, 0].tolist() == [[0, 0, 1, 1], [0, 0, 1, 1]]
    assert {d.id for d in s.mesh.devices.flat} == {d.id for d in two_slices}


def test_default_is_data_when_a_replica_fits_in_a_slice(two_slices):
    assert _hybrid(two_slices, data=2, fsdp=2, tensor=2).across_slices == "data"
    assert _hybrid(two_slices, data=-1, fsdp=4).across_slices == "data"
    # An fsdp group larger than a slice: it has to span them.
    assert _hybrid(two_slices, data=1, fsdp=8).across_slices == "fsdp"
    assert _slices(_hybrid(two_slices, data=1, fsdp=8).mesh)[0, :, 0].tolist() == [0] * 4 + [1] * 4


@pytest.mark.parametrize("across", [None, "data", "fsdp"])
def test_one_slice_is_unchanged(across):
    for devices in (dtensor.tpu_topology("v5e:2x2"), jax.devices()):
        assert slice_count(devices) == 1
        s = _hybrid(devices, data=-1, fsdp=2, across_slices=across)
        plain = dtensor.create_mesh([("data", -1), ("fsdp", 2), ("tensor", 1)], devices=devices)
        assert s.mesh == plain and s.across_slices is None
        assert [d.id for d in s.mesh.devices.flat] == [d.id for d in plain.devices.flat]


def test_errors(two_slices):
    with pytest.raises(
        ValueError,
        match=r"HybridStrategy\(data=1, fsdp=8, tensor=1, across_slices='data'\) over the 8 "
        r"devices it uses \(2 slices of 4 TPU v5 lite devices\): the 'data' axis \(size 1\) must "
        r"be a multiple of the 2 slices.*Pass data=-1, fsdp=4, tensor=1 \(each replica within "
        r"one slice of 4\), or across_slices='fsdp'",
    ):
        _hybrid(two_slices, data=1, fsdp=8, across_slices="data")
    with pytest.raises(
        ValueError,
        match=r"across_slices='fsdp'\) over .*the 'fsdp' axis \(size 1\) must be a multiple of "
        r"the 2 slices.*Pass fsdp a multiple of 2, e.g. data=1, fsdp=8, tensor=1",
    ):
        _hybrid(two_slices, data=8, fsdp=1, across_slices="fsdp")
    with pytest.raises(
        ValueError,
        match=r"HybridStrategy\(data=1, fsdp=1, tensor=8\) over .*: neither data \(1\) nor fsdp "
        r"\(1\) is a multiple of 2, so no axis can span the slices",
    ):
        _hybrid(two_slices, data=1, fsdp=1, tensor=8)
    # Checked on every platform, so a typo fails on a laptop before it reaches the slices.
    with pytest.raises(
        ValueError, match=r"this mesh has no 'stage' axis; across_slices='stage' needs "
    ):
        _hybrid(two_slices, data=8, fsdp=1, across_slices="stage")
    with pytest.raises(
        ValueError,
        match=r"HybridStrategy\(across_slices='tensor'\) names no axis that can span slices; "
        r"valid values are None \(choose by the sizes\), 'data', 'fsdp' and 'stage'",
    ):
        strategies.HybridStrategy(data=-1, across_slices="tensor")


_SIZES = {"data": dict(data=-1, fsdp=4), "fsdp": dict(data=1, fsdp=8)}


def _reports(devices, step, args):
    return {
        across: _hybrid(devices, across_slices=across, **sizes).explain(step, args=args)
        for across, sizes in _SIZES.items()
    }


def _dcn(rep):
    return [c for c in rep.collectives if c.network == "dcn"]


def test_explain_dcn_collective_kinds(two_slices):
    """A transformer block (embedding, attention, MLP, head) on the TPU compiler."""
    out = _reports(two_slices, *abstract_block_step(16))
    # "data": only the gradient all-reduces between the two replicas cross DCN; every
    # gather and reduce-scatter of fsdp stays within a slice.
    dcn = _dcn(out["data"])
    assert dcn and {c.kind for c in dcn} == {"all-reduce"}
    assert {c.mesh_axes for c in dcn} == {("data",)} and {c.group_size for c in dcn} == {2}
    assert all(c.network == "ici" for c in out["data"].collectives if c.kind != "all-reduce")
    assert out["data"].dcn_bytes_per_device == sum(c.total_bytes_per_device for c in dcn)
    # "fsdp": the weights' all-gathers cross DCN too.
    kinds = {c.kind for c in _dcn(out["fsdp"])}
    assert {"all-gather", "all-reduce"} <= kinds
    assert {c.mesh_axes for c in _dcn(out["fsdp"])} == {("fsdp",)}


def test_explain_dcn_bytes_and_floor():
    """Two 1024 x 1024 float32 kernels: under "data" each chip sends its fsdp shard of the
    gradients across DCN once (a 2-slice all-reduce sends what it reduces), plus the loss;
    under "fsdp" the weights cross too, and the step's floor is higher."""
    devices = dtensor.tpu_topology("v5e:2x2", num_slices=2)
    step, args = deep_mlp_step(2, 1024)
    out = _reports(devices, step, args)
    grads = sum(
        v.size * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(nnx.state(args[0], nnx.Param))
    )
    assert grads == 2 * 1024 * 1024 * 4
    shard = grads / 4
    loss = 128 * 4  # one float32, padded to a TPU lane row
    assert out["data"].dcn_bytes_per_device == shard + loss
    assert out["fsdp"].dcn_bytes_per_device > 1.4 * out["data"].dcn_bytes_per_device
    assert out["data"].step_time_floor_seconds < out["fsdp"].step_time_floor_seconds


@pytest.mark.parametrize("model_name", list(MODELS))
def test_cpu_run_with_across_slices_matches_single_device(model_name):
    """CPU devices have no slices: across_slices="data" builds the same mesh, same numbers."""
    model_cls, loss_fn, make_batches = MODELS[model_name]
    ref_losses, ref_params = reference(model_name)
    strategy = strategies.HybridStrategy(data=2, fsdp=4, min_shard_bytes=0, across_slices="data")
    assert strategy.mesh == strategies.HybridStrategy(data=2, fsdp=4).mesh
    assert strategy.across_slices is None
    with strategy.scope():
        model = model_cls(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(loss_fn)
    losses = [float(strategy.run(step, args=(model, opt, b))) for b in make_batches()]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)))
    for path, want in jax.tree_util.tree_leaves_with_path(ref_params):
        assert rel_err(got[path], want) <= TOL, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    ("flag", "mesh", "across"),
    [
        (["--across-slices", "data"], {"data": 2, "fsdp": 4, "tensor": 1}, "data"),
        (["--across-slices", "fsdp"], {"data": 1, "fsdp": 8, "tensor": 1}, "fsdp"),
        (["--tensor", "2", "--across-slices", "data"], {"data": 2, "fsdp": 2, "tensor": 2}, "data"),
        (["--tensor", "2"], {"data": 2, "fsdp": 2, "tensor": 2}, "data"),  # the default
    ],
)
def test_train_py_across_slices_flag(two_slices, flag, mesh, across):
    from examples import options

    args = options.parse_args(["--strategy", "hybrid", *flag])
    strategy, _, applied = options.build_strategy(args, two_slices)
    assert strategy.mesh.shape == mesh and strategy.across_slices == across
    assert applied.get("across_slices") == ("strategy" if "--across-slices" in flag else None)
    # On CPU devices (one "slice") the same flag leaves fsdp over every device.
    strategy, _, _ = options.build_strategy(args, jax.devices())
    assert strategy.mesh.shape == {**mesh, "data": 1, "fsdp": 8 // mesh["tensor"]}
    assert strategy.across_slices is None
    # A preset without the option says so.
    args = options.parse_args(["--strategy", "fully_sharded", *flag])
    applied = options.build_strategy(args, two_slices)[2]
    assert applied.get("across_slices") == ("not available" if "--across-slices" in flag else None)


def test_guide_across_slices_table_is_the_results_table(capsys):
    """The large-models guide's "Across slices" figures are fsdp_scale --markdown slices'."""
    from pathlib import Path

    from benchmarks import fsdp_scale

    fsdp_scale.main(["--markdown", "slices"])
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 + 2, table  # data and fsdp across the 2 slices
    assert {"`Mesh(data=2, fsdp=32, tensor=1)`", "`Mesh(data=1, fsdp=64, tensor=1)`"} <= {
        cell.strip() for line in table[2:] for cell in line.split("|")
    }
    guide = Path(__file__).resolve().parents[2] / "docs" / "guides" / "large_models.md"
    lines = guide.read_text().splitlines()
    assert not [line for line in table if line not in lines]
