"""Peak memory in explain: XLA's peak, the ideal (ZeRO formula) and advice for the preset in use."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor.analysis.memory import DEFAULT_ADVICE, MemoryFit, out_of_memory
from dtensor.analysis.peak import PeakTerms, activation_peak_bytes, ideal_peak_bytes
from strategies.step.memory_advice import memory_advice

GIB = 1 << 30


def _sds(shape, layout):
    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=layout.sharding)


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def _sgd(params, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def test_peak_and_ideal_peak_of_a_fully_sharded_step():
    mesh = dtensor.create_mesh([("x", 8)])
    lay = lambda *specs: dtensor.Layout(list(specs), mesh)  # noqa: E731
    params = {
        "w1": _sds((16, 32), lay("x", None)),
        "b1": _sds((32,), lay("x")),
        "w2": _sds((32, 4), lay("x", None)),
    }
    batch = {"x": _sds((64, 16), lay("x", None)), "y": _sds((64, 4), lay("x", None))}
    r = dtensor.explain(_sgd, params, batch)
    assert r.peak_bytes_per_device == (
        r.argument_bytes_per_device
        + r.temp_bytes_per_device
        + r.output_bytes_per_device
        - r.alias_bytes_per_device
    )
    t = r.ideal_peak_terms
    assert t.state == t.gradients == (16 * 32 + 32 + 32 * 4) * 4 // 8 == 336
    assert t.gathered == (2048, 512, 128)  # every parameter is split over the data axis
    assert t.batch == (8 * 16 + 8 * 4) * 4  # the batch's per-device share
    traced = jax.jit(_sgd).trace(params, batch)
    assert t.activations == activation_peak_bytes(traced.jaxpr, batch_prefixes=[(64,)], replicas=8)
    assert t.activations >= 8 * 32 * 4  # at least h, kept for the backward pass
    assert r.ideal_peak_bytes_per_device == 336 + 336 + 2048 + 512 + t.activations + 160 * 4
    d = r.to_dict()
    assert d["ideal_peak_terms"]["gathered"] == [2048, 512, 128]
    assert d["peak_bytes_per_device"] == r.peak_bytes_per_device
    assert d["peak_ratio"] == pytest.approx(r.peak_bytes_per_device / r.ideal_peak_bytes_per_device)
    assert "peak, ideally (ZeRO formula)" in str(r)


def test_data_parallel_gathers_nothing():
    mesh = dtensor.create_mesh([("x", 8)])
    rep = dtensor.Layout.replicated(mesh, 2)
    params = {
        "w1": _sds((16, 32), rep),
        "b1": _sds((32,), dtensor.Layout.replicated(mesh, 1)),
        "w2": _sds((32, 4), rep),
    }
    batch = {
        "x": _sds((64, 16), dtensor.Layout(["x", None], mesh)),
        "y": _sds((64, 4), dtensor.Layout(["x", None], mesh)),
    }
    t = dtensor.explain(_sgd, params, batch).ideal_peak_terms
    assert t.gathered == () and t.state == t.gradients == (16 * 32 + 32 + 32 * 4) * 4


def test_ideal_formula_and_the_strategy_hook():
    terms = PeakTerms(state=100, gradients=50, gathered=(1000, 600, 400), activations=70, batch=5)
    assert ideal_peak_bytes(terms) == 100 + 50 + 1600 + 70 + 5
    s = strategies.FullyShardedStrategy()
    assert s.ideal_peak_bytes(terms) == ideal_peak_bytes(terms)
    s.mixed_precision = types.SimpleNamespace(param_dtype=jnp.bfloat16)  # gathers bf16
    assert s.ideal_peak_bytes(terms) == 100 + 50 + 800 + 70 + 5


class _FSDPWithoutOptions(strategies.FullyShardedStrategy):
    """A preset whose constructor takes none of the memory options (as older presets did)."""

    def __init__(self, devices=None):
        super().__init__(devices)


def test_advice_names_what_helps_for_the_preset_in_use():
    mirrored = memory_advice(strategies.MirroredStrategy())
    assert "FullyShardedStrategy" in mirrored and "shard them" in mirrored
    default = memory_advice(strategies.FullyShardedStrategy())
    assert "FullyShardedStrategy" not in default and "Shard the variables" not in default
    assert "more chips" in default and "smaller batch" in default
    assert (
        "remat=(YourBlock,)" in default
        and "mixed_precision=" in default
        and "offload_optimizer=True" in default
    )
    assert "reshard_after_forward" not in default  # already on by default
    assert "nnx.remat" not in default  # the preset's own option is named instead
    on = memory_advice(
        strategies.FullyShardedStrategy(
            remat=(nnx.Linear,),
            mixed_precision=strategies.MixedPrecision(),
            reshard_after_forward=False,
            offload_optimizer=True,
        )
    )
    assert "remat=" not in on and "mixed_precision=" not in on and "offload_optimizer" not in on
    assert "reshard_after_forward=True" in on
    # bf16 reads without bf16 arithmetic where a model pins float32 (Flax's Gemma)
    assert "MixedPrecision(module_dtype=True)" in on and "module_dtype" not in default
    # Where a preset lacks an option, the model-side equivalent is named instead.
    bare = memory_advice(_FSDPWithoutOptions())
    assert "nnx.remat" in bare and "bfloat16 compute in the model" in bare
    assert "remat=(YourBlock,)" not in bare and "offload_optimizer" not in bare
    assert "gather_at_read=True" in memory_advice(
        strategies.FullyShardedStrategy(gather_at_read=False)
    )
    assert "gather_at_read" not in default


def test_verdicts_carry_the_advice():
    fit = MemoryFit(
        "v5e", 16 * GIB, 1, 20 * GIB, 0, 0, 1 * GIB, 0, advice="Try remat=(YourBlock,)."
    )
    assert not fit.fits and str(fit).endswith("Try remat=(YourBlock,).")
    assert str(MemoryFit("v5e", 16 * GIB, 1, 20 * GIB, 0, 0, 0, 0)).endswith(DEFAULT_ADVICE)
    err = RuntimeError(
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
        "temporaries (20.00G) exceeds available HBM (15.75G)."
    )
    oom = out_of_memory(err, advice=memory_advice(strategies.FullyShardedStrategy()))
    assert "more chips" in str(oom) and "FullyShardedStrategy" not in str(oom)
    assert oom.required == 20 * GIB
