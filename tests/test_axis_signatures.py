"""Each HybridStrategy axis is used: its collectives in the compiled step, its split of the arguments.

The equality tests (tests/test_pipeline.py, test_context.py, test_experts.py,
test_compose.py...) show that each axis computes single-device JAX's numbers,
which a silently replicated axis does too. Here the tiny example decoder's
training step under each axis beside ``data`` (8 CPU devices) is compiled once
and read back through ``explain()``: the axis's collectives (tests/signatures.py
says which) and the per-device argument bytes, which fall by the axis's size
for what it splits. The TPU compiler's programs (libtpu, deviceless) are read
the same way: ``tensor`` here, ``context`` gather and ring in
tests/test_context.py, ``expert`` in tests/test_experts.py; all six axes at
once in tests/test_compose.py.

Each case is compiled by the one test that reads it (a shared fixture would
compile a case on each worker that runs one of its readers).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from examples.decoder import CONFIGS, Block, Decoder, tensor_rules
from tests import signatures as sig
from tests.test_decoder import _batches, _step

TINY = CONFIGS["tiny"]
BATCH, SEQ = 16, 16
D = TINY.d_model
KV = (BATCH // 4, SEQ, TINY.kv_heads, TINY.head_dim)  # K (or V) of the whole sequence, a device
BATCH_BYTES = 2 * BATCH * SEQ * 4  # x and y, int32

CASES = {
    # name: (config, HybridStrategy's arguments, the axis, what it splits, batch shards)
    "tensor": (
        TINY,
        dict(data=4, tensor=2, rules=tensor_rules(TINY)),
        "tensor",
        r"attn/(query|key|value|out)$|mlp/(gate|up|down)$|embed$",
        4,
    ),
    # min_shard_bytes=0 and tiny sizes that divide: fsdp, context and expert split every
    # variable (but the optimizer's step count, a scalar)
    "fsdp": (TINY, dict(data=4, fsdp=2), "fsdp", r".", 8),
    "stage-scan-gpipe": (
        TINY.replace(scan=True),
        dict(data=4, stage=2, microbatches=4, pipeline=(Block,)),
        "stage",
        r"/layers/",
        4,
    ),
    "stage-list-circular": (
        TINY.replace(layers=4),
        dict(data=4, stage=2, microbatches=2, schedule="circular", pipeline=(Block,)),
        "stage",
        r"/blocks/",
        4,
    ),
    "context-gather": (TINY, dict(data=4, context=2, context_mode="gather"), "context", r".", 8),
    "context-ring": (TINY, dict(data=4, context=2, context_mode="ring"), "context", r".", 8),
    # the experts split their experts dimension over expert, the rest is FSDP-split over it
    "expert": (CONFIGS["tiny-moe"], dict(data=4, expert=2), "expert", r".", 8),
}


def _build(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _compiled(name):
    """The case's strategy and its step's explain() report, its argument split checked: the
    variables it names split over the axis, the compiled arguments' bytes fallen by 2 for
    them."""
    cfg, kw, axis, splits, batch_shards = CASES[name]
    s = strategies.HybridStrategy(min_shard_bytes=0, **kw)
    with s.scope():
        model, opt = _build(cfg)
    report = s.explain(_step, args=(model, opt, _batches(cfg, n=1, batch=BATCH, seq=SEQ)[0]))
    pattern = re.compile(splits)
    sig.assert_splits(
        report,
        {axis: 2},
        lambda path: bool(pattern.search(path)),
        batch_bytes=BATCH_BYTES // batch_shards,
    )
    return s, report


def test_tensor_all_reduces_activations_and_halves_the_matmul_weights():
    _, report = _compiled("tensor")
    sig.assert_tensor(report.collectives, rows=BATCH // 4, seq=SEQ, d_model=D, layers=2)


def test_fsdp_gathers_the_weights_reduce_scatters_their_gradients_and_halves_all():
    """The gather-at-read plan (CPU's default): each block weight all-gathered over fsdp and
    its gradient reduce-scattered to its half (the embedding, read by a gather, all-reduces)."""
    _, report = _compiled("fsdp")
    weights = {
        v.path: (v.shape, _half(v.shape, v.layout))
        for v in report.variables
        if re.search(r"attn/(query|key|value|out)$|mlp/(gate|up|down)$", v.path)
    }
    assert len(weights) == 2 * 7
    sig.assert_fsdp(report.collectives, weights, reduce_scatter=True)


def _half(shape, layout):
    """``shape`` with its dimension named ``fsdp`` in ``layout`` halved."""
    specs = layout.strip("[]").split(", ")
    return tuple(n // 2 if s == "fsdp" else n for n, s in zip(shape, specs, strict=True))


@pytest.mark.parametrize(
    ("name", "rows", "ticks"),
    [("stage-scan-gpipe", 1, 4 + 2 - 1), ("stage-list-circular", 2, 2 * 2 + 2 - 1)],
    ids=["scan-gpipe", "list-circular"],
)
def test_stage_permutes_microbatches_has_a_bubble_and_halves_the_layers(name, rows, ticks):
    """A microbatch (16 rows / M / data 4) passed on once a tick, each way; the bubble."""
    s, report = _compiled(name)
    sig.assert_stage(
        report.collectives,
        rows=rows,
        seq=SEQ,
        d_model=D,
        ticks=ticks,
        bubble=report.bubble_fraction,
        stages=2,
    )
    assert report.bubble_fraction == s.bubble_fraction
    if name == "stage-list-circular":  # the list's blocks re-stacked by stage in the step
        assert sig.over(report.collectives, "all-to-all", "stage")


def test_context_gather_all_gathers_k_and_v_and_runs_no_ring():
    _, report = _compiled("context-gather")
    sig.assert_context_gather(report.collectives, kv=KV, layers=2)
    with pytest.raises(AssertionError):  # what tells the modes apart: no ring here
        sig.assert_context_ring(report.collectives, kv=KV, layers=2, context=2)


def test_context_ring_permutes_k_and_v_and_never_gathers_them():
    _, report = _compiled("context-ring")
    sig.assert_context_ring(report.collectives, kv=KV, layers=2, context=2)
    with pytest.raises(AssertionError):  # and no K/V gather here
        sig.assert_context_gather(report.collectives, kv=KV, layers=2)


def test_expert_dispatches_by_all_to_all():
    _, report = _compiled("expert")
    sig.assert_expert(report.collectives, layers=2)
    assert report.dispatch_bytes_per_device > 0
    stacks = [v for v in report.variables if "/experts/" in v.path]
    assert len(stacks) == 2 * 3 and all(v.layout.startswith("[expert,") for v in stacks)


# ----------------------------------------------------------------------- TPU (libtpu, no TPU)
def test_tensor_all_reduces_activations_on_a_tpu_topology():
    """data=4 x tensor=2 on v5e:2x4: the same activation all-reduces over ``tensor``, and the
    compiled arguments' shards halve what the tensor rules split."""
    s = strategies.HybridStrategy(
        4, 1, 2, rules=tensor_rules(TINY), devices=dtensor.tpu_topology("v5e:2x4")
    )
    model, opt = nnx.eval_shape(lambda: _build(TINY))
    batch = {k: jax.ShapeDtypeStruct((BATCH, 64), jnp.int32) for k in ("x", "y")}
    report = s.explain(_step, args=(model, opt, batch))
    sig.assert_tensor(report.collectives, rows=BATCH // 4, seq=64, d_model=D, layers=2)
    pattern = re.compile(CASES["tensor"][3])
    sig.assert_splits(
        report, {"tensor": 2}, lambda p: bool(pattern.search(p)), batch_bytes=2 * BATCH * 64
    )


def test_sequence_parallel_tensor_gathers_activations_never_the_weights_on_a_tpu_topology():
    """HybridStrategy's sequence parallelism (scanned layers, ``remat=``, fsdp x tensor on
    v5e:2x4): each layer's kept input is split along the sequence over ``tensor``; attention
    and the MLP take it gathered (all-gathers of ``[rows, seq, d]`` over ``tensor``, forward
    and backward) and split their outputs again. Left to XLA, libtpu gathered each layer's
    weights over ``tensor`` instead (llama2-70b, tensor=4: every MLP kernel whole on a chip)."""
    cfg = TINY.replace(scan=True)
    s = strategies.HybridStrategy(
        1,
        4,
        2,
        rules=tensor_rules(cfg),
        remat=(Block,),
        min_shard_bytes=0,
        devices=dtensor.tpu_topology("v5e:2x4"),
    )
    assert s.read_options().sequence_axes == ("tensor",)
    model, opt = nnx.eval_shape(lambda: _build(cfg))
    seq = 64
    batch = {k: jax.ShapeDtypeStruct((BATCH, seq), jnp.int32) for k in ("x", "y")}
    report = s.explain(_step, args=(model, opt, batch))
    f, hd = cfg.ffw, cfg.head_dim
    sig.assert_sequence_parallel(
        report.collectives,
        rows=BATCH // 4,
        seq=seq,
        d_model=D,
        layers=cfg.layers,
        # a layer's weights whole over tensor, as libtpu gathered them without the plan
        weights=[(D, f), (f, D), (D, cfg.heads, hd), (cfg.heads, hd, D), (D, cfg.kv_heads, hd)],
    )
