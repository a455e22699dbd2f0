"""HybridStrategy gathers ``fsdp``-split weights at their reads (``gather_at_read``, CPU default).

On ``Mesh(data=2, fsdp=4, tensor=1)`` each matmul kernel is all-gathered over
``fsdp`` where it is read and its gradient reduce-scattered over ``fsdp``,
then all-reduced over ``data`` at shard size. Figures come from the compiled
program (``strategy.explain``); values are compared with single-device JAX.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from tests.models import (
    lm_batches,
    lm_loss,
    make_train_step,
    rel_err,
)
from tests.strategies.test_fsdp_comm import MODELS

DATA, FSDP = 2, 4
N = DATA * FSDP
TOL = 1e-5  # as tests/strategies/test_conformance.py


def _ring(n):
    return (n - 1) / n


def _hybrid(**kw):
    return strategies.HybridStrategy(data=DATA, fsdp=FSDP, min_shard_bytes=0, **kw)


def _build(strategy, model_name):
    model_cls, loss_fn, batches = MODELS[model_name]
    with strategy.scope():
        model = model_cls(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, opt, make_train_step(loss_fn), batches


def _explain(strategy, model_name):
    model, opt, step, batches = _build(strategy, model_name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*XLA's own plan")  # no fallback
        return strategy.explain(step, args=(model, opt, batches(1)[0]))


def _param_bytes(rep):
    params = [v for v in rep.variables if v.trainable]
    kernels = sum(v.global_bytes for v in params if v.path.endswith("kernel"))
    others = sum(v.global_bytes for v in params if not v.path.endswith("kernel"))
    return kernels, others


def test_gather_at_read_defaults():
    assert _hybrid().gather_at_read is True  # CPU
    assert _hybrid(gather_at_read=False).gather_at_read is False
    opts = _hybrid().read_options()
    assert opts.gather and opts.axes == ("data", "fsdp") and opts.reshard_after_forward
    assert opts.explicit_axes == ("data", "fsdp", "tensor") and opts.preset == "HybridStrategy"
    assert not _hybrid(reshard_after_forward=False).read_options().reshard_after_forward
    # Without it: XLA's plan (XLA gathers and decides what to keep, as under FullyShardedStrategy;
    # wrapping the owners rematerialised a decoder whole, its remat= blocks inside it).
    plain = _hybrid(gather_at_read=False).read_options()
    assert not plain.gather and plain.axes == ("fsdp",) and not plain.reshard_after_forward
    # fsdp=1: nothing to gather (TensorParallelStrategy, pure data parallelism).
    assert not strategies.HybridStrategy(data=8).read_options().gather
    assert not strategies.TensorParallelStrategy(tensor_parallel=2).read_options().gather


def test_gather_at_read_needs_tensor_1():
    assert strategies.HybridStrategy(data=2, fsdp=2, tensor=2).gather_at_read is False
    with pytest.raises(ValueError, match=r"gather_at_read=True\) needs tensor=1 \(got tensor=2\)"):
        strategies.HybridStrategy(data=2, fsdp=2, tensor=2, gather_at_read=True)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_matches_single_device(model_name):
    model_cls, loss_fn, make_batches = MODELS[model_name]
    with jax.default_device(jax.devices()[0]):
        ref_model = model_cls(rngs=nnx.Rngs(0))
        ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)
        ref_step = nnx.jit(make_train_step(loss_fn))
        ref_losses = [float(ref_step(ref_model, ref_opt, b)) for b in make_batches()]
    strategy = _hybrid()
    model, opt, step, _ = _build(strategy, model_name)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*XLA's own plan")
        losses = [float(strategy.run(step, args=(model, opt, b))) for b in make_batches()]
    np.testing.assert_allclose(losses, ref_losses, rtol=TOL)
    got = dict(jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)))
    for path, want in jax.tree_util.tree_leaves_with_path(nnx.state(ref_model, nnx.Param)):
        assert rel_err(got[path], want) <= TOL, jax.tree_util.keystr(path)
    # The variables leave the Explicit region in their storage layouts.
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state((model, opt)), is_leaf=lambda v: isinstance(v, nnx.Variable)
    ):
        name = dtensor.core.tree.path_str(path).split("/", 1)[1]
        want = strategy.storage_layout_fn(name, var).layout
        assert var.get_value().sharding.is_equivalent_to(want.sharding, var.get_value().ndim), path


@pytest.mark.parametrize("model_name", list(MODELS))
def test_collectives_by_hand(model_name):
    """Matmul kernels: gathered over fsdp, gradient reduce-scattered over fsdp, the
    shard all-reduced over data. Biases, norms, the embedding table (not matmul
    operands): gathered, gradient all-reduced over all devices, as the loss.
    (reshard_after_forward=False: each weight gathered once.)"""
    rep = _explain(_hybrid(reshard_after_forward=False), model_name)
    kernels, others = _param_bytes(rep)
    kinds = rep.by_kind()
    assert kinds["reduce-scatter"] == pytest.approx(_ring(FSDP) * kernels)
    assert kinds["all-gather"] == pytest.approx(_ring(FSDP) * (kernels + others))
    assert kinds["all-reduce"] == pytest.approx(
        2 * _ring(N) * (others + 4) + 2 * _ring(DATA) * kernels / FSDP
    )
    assert {c.mesh_axes for c in rep.collectives if c.kind == "reduce-scatter"} == {("fsdp",)}
    # No all-reduce of a whole kernel's gradient: each operand is at most a
    # non-kernel leaf or a kernel's fsdp shard.
    largest = max(
        max(v.global_bytes for v in rep.variables if v.trainable and not v.path.endswith("kernel")),
        max(v.global_bytes for v in rep.variables if v.path.endswith("kernel")) // FSDP,
    )
    for c in rep.collectives:
        if c.kind == "all-reduce":
            assert int(np.prod(c.shape)) * 4 <= largest


def test_without_gather_at_read_xla_all_reduces_full_gradients():
    rep = _explain(_hybrid(gather_at_read=False), "transformer")
    kernels, others = _param_bytes(rep)
    assert "reduce-scatter" not in rep.by_kind()
    assert rep.by_kind()["all-reduce"] >= 2 * _ring(FSDP) * (kernels + others)


def test_mixed_precision_gathers_bf16_and_reduce_scatters_f32_on_tpu():
    from tests.strategies.test_fsdp_options import tpu_mixed_precision_dtypes

    devices = dtensor.tpu_topology("v5e:2x2")  # libtpu comes with the dev extra (tpu-aot)
    strategy = strategies.HybridStrategy(
        data=2,
        fsdp=2,
        devices=devices,
        min_shard_bytes=0,
        mixed_precision=strategies.MixedPrecision(),
        gather_at_read=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*XLA's own plan")
        assert tpu_mixed_precision_dtypes(strategy) == ({"bf16"}, {"f32"})


def test_fallback_warning_names_hybrid():
    from tests.strategies.test_fsdp_comm import RawLookup

    strategy = _hybrid()
    with strategy.scope():
        model = RawLookup(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.warns(RuntimeWarning, match=r"^HybridStrategy: the step does not trace"):
        rep = strategy.explain(make_train_step(lm_loss), args=(model, opt, lm_batches(1)[0]))
    assert "reduce-scatter" not in rep.by_kind()
