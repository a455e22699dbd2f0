"""Pipeline parallelism: dtensor.core.pipeline.pipeline, HybridStrategy(stage=S, pipeline=(Block,)).

Equality with single-device JAX (float32) on 8 CPU devices for the engine
itself, the example decoder with scanned layers and as a list of blocks, and a
Flax model written as a Python list of ``nnx.MultiHeadAttention`` blocks;
GPipe and circular; ``stage=4, data=2`` and ``stage=2, fsdp=2, tensor=2``;
the layouts, explain's report, checkpoints across presets, the errors, and the
TPU compiler's program with the stages over DCN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor import checkpoint
from dtensor.core.pipeline import bubble_fraction, pipeline
from examples.decoder import CONFIGS, Block, tensor_rules
from strategies.reads.pipeline import PipelineError
from tests.test_decoder import _batches, _build, _step

MESHES = {
    "stage4-data2": {"stage": 4, "data": 2},
    "stage2-fsdp2-tensor2": {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2},
}


def _close(got, want, rtol=1e-5):
    """Each array within ``rtol`` of the reference in norm (Adam's updates of gradients
    summed in another order differ elementwise by more than they do in norm)."""
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), (a.shape, np.abs(a - b).max())


# ----------------------------------------------------------------------- the engine
def _layer(w, x):
    return jnp.tanh(x @ w["w"]) * w["s"] + x


def _by_stage(w, mesh):
    """Each stacked weight split along its layer dimension over ``stage``."""
    return jax.tree.map(
        lambda a: jax.device_put(
            a, dtensor.Layout(["stage"] + [None] * (a.ndim - 1), mesh).sharding
        ),
        w,
    )


def _weights(n=8, d=16):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": jax.random.normal(k1, (n, d, d)) * 0.3, "s": jax.random.uniform(k2, (n, d))}


@pytest.mark.parametrize(
    "repeats, microbatches, remat",
    [(1, 4, False), (1, 2, True), (2, 4, False), (2, 8, True)],
    ids=["gpipe", "gpipe-remat-m2", "circular", "circular-remat-m8"],
)
def test_pipeline_matches_the_layers_run_in_order(repeats, microbatches, remat):
    mesh = dtensor.create_mesh([("stage", 4), ("data", 2)])
    w, x = _weights(), jax.random.normal(jax.random.key(1), (16, 16))
    side = jax.random.uniform(jax.random.key(2), (16, 16))

    def staged(w, x, side):
        return _layer(w, x) * side

    def loss(w, x, side):
        y = pipeline(
            staged,
            w,
            x,
            side=side,
            stages=4,
            microbatches=microbatches,
            repeats=repeats,
            batch_axes=("data",),
            remat=remat,
        )
        return (y**2).sum()

    def reference(w, x, side):
        y = x
        for i in range(8):  # each layer, then the side factor
            y = _layer(jax.tree.map(lambda a, i=i: a[i], w), y) * side
        return (y**2).sum()

    with mesh:
        ws = _by_stage(w, mesh)
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(ws, x, side)
    want = jax.value_and_grad(reference, argnums=(0, 1))(w, x, side)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    _close(got[1], want[1])


def test_pipeline_moves_activations_by_collective_permutes_over_stage():
    mesh = dtensor.create_mesh([("stage", 4), ("data", 2)])
    w, x = _weights(), jnp.ones((16, 16))

    def loss(w, x):
        return pipeline(_layer, w, x, stages=4, microbatches=4, batch_axes=("data",)).sum()

    with mesh:
        ws = _by_stage(w, mesh)
        report = dtensor.explain(jax.grad(loss), ws, x)
    permutes = [c for c in report.collectives if c.kind == "collective-permute"]
    assert permutes and all(c.mesh_axes == ("stage",) for c in permutes)
    # One microbatch (4 rows / 2 data shards x 16 floats) after each stage's 2 layers,
    # M + S - 1 = 7 times, forward and backward: what each device sends at least.
    assert report.stage_bytes_per_device >= 2 * 7 * 2 * 16 * 4
    # The stacked weights stay where they are (GPipe): nothing gathers them.
    assert not [c for c in report.collectives if c.kind in ("all-gather", "all-to-all")]


def test_bubble_fraction_by_schedule():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, repeats=2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0.0


def test_pipeline_refuses_what_it_cannot_schedule():
    w, x = _weights(6), jnp.ones((8, 16))
    with pytest.raises(ValueError, match=r"6 layers do not divide into 1 round\(s\) of 4 stages"):
        pipeline(_layer, w, x, stages=4, microbatches=2)
    with pytest.raises(ValueError, match="a batch of 8 does not divide into 3 microbatches"):
        pipeline(_layer, _weights(8), x, stages=4, microbatches=3)
    with pytest.raises(
        ValueError, match="circular schedule .* needs at least as many microbatches"
    ):
        pipeline(_layer, _weights(8), x, stages=4, microbatches=2, repeats=2)


# ----------------------------------------------------------------------- the preset
# Adam's eps at 1e-3 (tests/test_compose.py says why): at 1e-6 Adam divides each gradient
# element by its own scale, so a tensor's gradient 1 % off still passes 1e-5 on the parameters.
EPS = 1e-3


def _reference(cfg, batches):
    model, opt = _build(cfg, eps=EPS)
    step = nnx.jit(_step)
    return [float(step(model, opt, b)) for b in batches], nnx.state(model, nnx.Param)


def _decoder_run(cfg, batches, **kw):
    if kw.get("tensor", 1) > 1:  # the decoder's Megatron rules (its names match no preset's)
        kw = {"rules": tensor_rules(cfg), **kw}
    s = strategies.HybridStrategy(pipeline=(Block,), min_shard_bytes=0, **kw)
    with s.scope():
        model, opt = _build(cfg, eps=EPS)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    return s, model, got


@pytest.mark.parametrize("schedule", ["gpipe", "circular"])
@pytest.mark.parametrize("layers", ["scan", "list"])
@pytest.mark.parametrize("dims", list(MESHES.values()), ids=list(MESHES))
def test_decoder_trains_in_stages_as_on_one_device(dims, layers, schedule):
    cfg = CONFIGS["tiny"].replace(layers=8, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _reference(cfg, batches)
    s, model, got = _decoder_run(cfg, batches, microbatches=8, schedule=schedule, **dims)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)
    if layers == "scan":  # each stage holds its layers
        spec = dtensor.fetch_layout(model.layers.mlp.up.get_value()).sharding_specs
        assert spec[0] == "stage"
    else:  # each block split over every stage (and fsdp), re-stacked in the step
        spec = dtensor.fetch_layout(model.blocks[3].mlp.up.get_value()).sharding_specs
        assert any("stage" in (e if isinstance(e, tuple) else (e,)) for e in spec)


def test_decoder_in_stages_with_remat_and_mixed_precision_matches_unpipelined():
    """remat=(Block,) and MixedPrecision inside the stages: the same losses and parameters as
    the same preset without a pipeline (bfloat16 compute, so not single-device float32's)."""
    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    batches = _batches(cfg, batch=16)
    kw = {
        "remat": (Block,),
        "mixed_precision": strategies.MixedPrecision(),
        "min_shard_bytes": 0,
        "rules": tensor_rules(cfg),
    }
    flat = strategies.HybridStrategy(2, 2, 2, **kw)
    with flat.scope():
        model, opt = _build(cfg, eps=EPS)
    start = jax.device_get(nnx.state(model, nnx.Param))
    want = [float(flat.run(_step, args=(model, opt, b))) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(1, 2, 2, stage=2, microbatches=4, pipeline=(Block,), **kw)
    with s.scope():
        model, opt = _build(cfg, eps=EPS)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=2e-2)
    assert got[-1] < got[0]
    # Each parameter's change over the three steps within 5 % of the unpipelined one's (in
    # norm). bfloat16 keeps 8 significant bits (2^-8 = 0.4 % a rounding), and the stages
    # round each microbatch's activations and sum its gradients in another order: measured
    # 1.5 % at most (the stacked key kernels). A microbatch's gradient lost or counted twice
    # moves an update by tens of percent.
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b, b0 in zip(
        jax.tree.leaves(have), jax.tree.leaves(want_params), jax.tree.leaves(start), strict=True
    ):
        a, b, b0 = (np.asarray(x, np.float64) for x in (a, b, b0))
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b - b0), a.shape


class _FlaxBlock(nnx.Module):
    """A pre-norm block of Flax's own layers: nnx.MultiHeadAttention (causal) and an MLP."""

    def __init__(self, d, rngs):
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        # No biases: a key bias's gradient is exactly zero (softmax ignores a constant per
        # query), so Adam turns its float32 noise into full-size steps on any device count.
        self.attn = nnx.MultiHeadAttention(4, d, decode=False, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(d, rngs=rngs)
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class _FlaxListModel(nnx.Module):
    """Embedding, a Python list of blocks (as Flax's Gemma writes its layers), a head."""

    def __init__(self, rngs, vocab=64, d=32, layers=4):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.layers = nnx.List([_FlaxBlock(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)  # [batch, 1, seq, seq]: cut into microbatches
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def _flax_step(model, opt, batch):
    def loss(m):
        logits = m(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    value, grads = nnx.value_and_grad(loss)(model)
    opt.update(model, grads)
    return value


def _flax_build():
    # Adam's eps at 1e-3 (tests/test_compose.py says why): at 1e-6 the elements whose
    # gradient is near eps turn float32 rounding (the stages sum in another order) into
    # 1.4e-5 of a kernel in norm after three steps on jax 0.12 (within 1e-5 on 0.10).
    model = _FlaxListModel(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-3), wrt=nnx.Param)


def _flax_batches(n=3):
    rng = np.random.default_rng(1)
    w = rng.integers(0, 64, size=(n, 16, 17)).astype(np.int32)
    return [{"x": b[:, :-1], "y": b[:, 1:]} for b in w]


@pytest.mark.parametrize(
    ("schedule", "remat"), [("gpipe", False), ("circular", False), ("gpipe", True)]
)
def test_flax_model_with_a_list_of_blocks_trains_in_stages_as_on_one_device(schedule, remat):
    """With remat and fsdp, each block's weights are read through a gather of its own (one
    read function a Variable): the blocks still count as identical (they were refused)."""
    batches = _flax_batches()
    model, opt = _flax_build()
    step = nnx.jit(_flax_step)
    want = [float(step(model, opt, b)) for b in batches]
    want_params = nnx.state(model, nnx.Param)
    s = strategies.HybridStrategy(
        *((1, 2) if remat else (2,)),
        stage=4,
        microbatches=4,
        schedule=schedule,
        pipeline=(_FlaxBlock,),
        remat=(_FlaxBlock,) if remat else None,
        min_shard_bytes=0,
    )
    with s.scope():
        model, opt = _flax_build()
    got = [float(s.run(_flax_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params)


def test_explain_reports_the_schedule_bubble_and_stage_traffic():
    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    s = strategies.HybridStrategy(2, stage=4, microbatches=8, pipeline=(Block,), min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg)
    report = s.explain(_step, args=(model, opt, _batches(cfg, batch=16)[0]))
    assert report.pipeline_schedule == "gpipe, 4 stages x 8 microbatches"
    assert report.bubble_fraction == pytest.approx(3 / 11)
    # Each iteration passes a microbatch's hidden states [16 / 8 / 2, 16, 64] float32 on,
    # forward and backward, 8 + 3 iterations.
    assert report.stage_bytes_per_device >= 2 * 11 * 1 * 16 * 64 * 4
    assert "pipeline" in str(report) and "bubble" in str(report)
    rules = {v.path: v.rule for v in report.variables}
    assert rules["0/layers/mlp/up"].startswith("pipeline stack")
    circular = strategies.HybridStrategy(
        2, stage=4, microbatches=8, schedule="circular", pipeline=(Block,)
    )
    with circular.scope():
        model, opt = _build(cfg)
    assert circular.bubble_fraction == pytest.approx(3 / (2 * 8 + 3))  # 8 layers: 2 rounds


def test_checkpoint_saved_in_stages_restores_under_fully_sharded_and_back(tmp_path):
    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    batches = _batches(cfg, batch=16)
    s, model, _ = _decoder_run(cfg, batches[:1], stage=4, data=2, microbatches=4)
    checkpoint.save(tmp_path / "a", {"model": model})
    want = jax.device_get(nnx.state(model, nnx.Param))
    fsdp = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with fsdp.scope():
        other, _ = _build(cfg)
    checkpoint.restore(tmp_path / "a", {"model": other})
    layout = dtensor.fetch_layout(other.layers.mlp.up.get_value())
    assert "stage" not in layout.mesh.dim_names
    _close(jax.device_get(nnx.state(other, nnx.Param)), want, rtol=0)
    checkpoint.save(tmp_path / "b", {"model": other})
    with s.scope():
        back, _ = _build(cfg)
    checkpoint.restore(tmp_path / "b", {"model": back})
    assert dtensor.fetch_layout(back.layers.mlp.up.get_value()).sharding_specs[0] == "stage"
    _close(jax.device_get(nnx.state(back, nnx.Param)), want, rtol=0)


# ----------------------------------------------------------------------- errors
def test_stage_needs_the_block_class_and_a_schedule():
    with pytest.raises(ValueError, match=r"stage=4\) needs pipeline=\(Block,\)"):
        strategies.HybridStrategy(2, stage=4)
    with pytest.raises(ValueError, match="valid schedules are"):
        strategies.HybridStrategy(2, stage=4, pipeline=(Block,), schedule="pipedream")
    with pytest.raises(ValueError, match="circular schedule needs at least as many microbatches"):
        strategies.HybridStrategy(
            2, stage=4, microbatches=2, pipeline=(Block,), schedule="circular"
        )
    with pytest.raises(ValueError, match="pass stage=S > 1"):
        strategies.HybridStrategy(pipeline=(Block,))
    with pytest.raises(ValueError, match=r"gather_at_read=True\) needs stage=1"):
        strategies.HybridStrategy(2, stage=4, pipeline=(Block,), gather_at_read=True)


class _Skips(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([nnx.Linear(8, 8, rngs=rngs) for _ in range(4)])

    def __call__(self, x):
        for i, b in enumerate(self.blocks):
            x = b(x) if i != 2 else b(x * 2)  # something between blocks
        return x


def test_blocks_with_something_between_them_are_refused_by_name():
    s = strategies.HybridStrategy(2, stage=4, pipeline=(nnx.Linear,), min_shard_bytes=0)
    with s.scope():
        model = _Skips(nnx.Rngs(0))
    with pytest.raises(PipelineError, match="block 2 was called with something else as its input"):
        s.run(lambda m, x: m(x).sum(), args=(model, np.ones((8, 8), np.float32)))


def test_a_stack_not_run_by_nnx_scan_is_refused():
    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    s = strategies.HybridStrategy(2, stage=4, pipeline=(Block,), min_shard_bytes=0)
    with s.scope():
        model, _ = _build(cfg)

    def step(model, x):  # reads the stack's weights but never calls the blocks
        return model.layers.mlp.up.get_value().sum() + x.sum()

    with pytest.raises(PipelineError, match="ran no blocks of those classes in stages"):
        s.run(step, args=(model, np.ones((8, 4), np.float32)))


# ----------------------------------------------------------------------- TPU
def test_stages_over_dcn_compile_for_two_tpu_slices():
    """stage=2 across two v5p:4x4x2 slices (libtpu's devices): only the activations' permutes
    cross DCN; fsdp within each slice."""
    devices = dtensor.tpu_topology("v5p:4x4x2", num_slices=2)
    s = strategies.HybridStrategy(
        1,
        32,
        stage=2,
        microbatches=2,
        pipeline=(Block,),
        across_slices="stage",
        devices=devices,
        min_shard_bytes=0,
        remat=(Block,),
        mixed_precision=strategies.MixedPrecision(),
    )
    assert s.across_slices == "stage" and dict(s.mesh.shape) == {
        "data": 1,
        "stage": 2,
        "fsdp": 32,
        "tensor": 1,
    }
    cfg = CONFIGS["tiny"].replace(layers=4, scan=True)
    model, opt = nnx.eval_shape(lambda: _build(cfg))
    batch = {
        "x": jax.ShapeDtypeStruct((64, 128), jnp.int32),
        "y": jax.ShapeDtypeStruct((64, 128), jnp.int32),
    }
    report = s.explain(_step, args=(model, opt, batch))
    nets = dict(report.stage_bytes_by_network)
    assert nets.get("dcn", 0) > 0 and nets.get("ici", 0) == 0
    assert report.bubble_fraction == pytest.approx(1 / 3)
    # Over DCN: the permutes and the small all-reduces of the replicated (non-stage)
    # variables' gradients; no weight gathers.
    dcn = [c for c in report.collectives if c.network == "dcn"]
    assert {c.kind for c in dcn} <= {"collective-permute", "all-reduce"}


def test_preemption_handler_resumes_a_pipelined_run(tmp_path):
    from strategies.failure_handling import PreemptionCheckpointHandler

    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    batches = _batches(cfg, n=3, batch=16)
    s = strategies.HybridStrategy(2, stage=4, microbatches=4, pipeline=(Block,), min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg)
    h = PreemptionCheckpointHandler(
        tmp_path, {"model": model, "opt": opt}, save_interval_steps=2, async_save=False
    )
    for b in batches[:2]:
        h.run(s.run, _step, args=(model, opt, b))
    h.close()
    want = float(s.run(_step, args=(model, opt, batches[2])))
    with s.scope():
        model2, opt2 = _build(cfg)
    h2 = PreemptionCheckpointHandler(tmp_path, {"model": model2, "opt": opt2})
    assert h2.total_run_calls == 2
    assert dtensor.fetch_layout(model2.layers.mlp.up.get_value()).sharding_specs[0] == "stage"
    assert float(h2.run(s.run, _step, args=(model2, opt2, batches[2]))) == want
    h2.close()


def test_pipeline_benchmark_table_is_the_guide_s():
    """The guide's pipeline table is ``benchmarks.pipeline --markdown`` of the results file,
    and the results hold what the guide says of them (the README links to it)."""
    import json
    from pathlib import Path

    from benchmarks import pipeline as bench

    root = Path(__file__).resolve().parents[1]
    rows = json.loads((root / "benchmarks" / "results" / "pipeline.json").read_text())["rows"]
    guide = " ".join((root / "docs" / "guides" / "large_models.md").read_text().split())
    assert " ".join(bench.markdown(rows).split()) in guide
    by = {(r["global_batch"], r["options"], r["topology"]): r for r in rows}
    base = "--stage 2 --microbatches"
    two, four, circular, data, h100 = (
        by[(64, f"{base} 2", "v5p:4x4x2")],
        by[(64, f"{base} 4", "v5p:4x4x2")],
        by[(64, f"{base} 2 --schedule circular", "v5p:4x4x2")],
        by[(64, "--across-slices data", "v5p:4x4x2")],
        by[(64, f"{base} 2", "h100:8x8")],
    )
    # 1F1B's activations flat in M (32-row microbatches, the batch growing with M) where
    # GPipe's grow; zero-bubble's smaller bubble bought with a recomputed forward; the
    # interleaved schedule under MaxText's peak.
    flat = [
        by[(32 * m, f"{base} {m} --schedule 1f1b", "v5p:4x4x2")]["peak_gib"] for m in (8, 16, 32)
    ]
    grows = [by[(32 * m, f"{base} {m}", "v5p:4x4x2")]["peak_gib"] for m in (8, 16, 32)]
    assert max(flat) <= 1.05 * min(flat) and grows[2] > 1.5 * grows[0]
    one = by[(64, f"{base} 2 --schedule 1f1b", "v5p:4x4x2")]
    zb = by[(64, f"{base} 2 --schedule zero-bubble", "v5p:4x4x2")]
    inter = by[(64, f"{base} 2 --schedule interleaved-1f1b", "v5p:4x4x2")]
    assert one["peak_gib"] < two["peak_gib"] and one["bubble_fraction"] == pytest.approx(1 / 3)
    assert zb["bubble_fraction"] < one["bubble_fraction"] and zb["floor_ms"] > one["floor_ms"]
    assert inter["peak_gib"] < two["maxtext_peak_gib"] and inter["floor_bound"] == "DCN"
    for r, text in ((flat, "30.59, 31.04 and 31.71 GiB"), (grows, "33.54, 40.52, 55.47 GiB")):
        assert text.replace(" and", ",").split(" GiB")[0].split(", ") == [f"{x:.2f}" for x in r]
        assert text in guide
    assert two["maxtext_peak_gib"] == 24.30 and data["maxtext_peak_gib"] == 42.77
    # MaxText's default schedule on our stored stack: 1 idle tick in 81, but the weights
    # re-stacked by stage over DCN every step (all-to-alls beside the stage permutes).
    assert circular["bubble_fraction"] == pytest.approx(1 / 81)
    assert circular["dcn_gib"] > 2 * circular["stage_permute_by_network_gib"]["dcn"]
    assert circular["floor_bound"] == "DCN" and circular["peak_gib"] > two["peak_gib"]
    assert two["peak_gib"] < data["peak_gib"] and two["dcn_gib"] < data["dcn_gib"] / 10
    assert two["bubble_fraction"] == pytest.approx(1 / 3)
    assert four["bubble_fraction"] == pytest.approx(1 / 5)
    assert two["stage_permute_by_network_gib"]["dcn"] > 0
    assert h100["stage_permute_by_network_gib"]["ib"] > 0
    # MaxText's own compile of the pipeline (benchmarks.maxtext_side, row 7): its peak is the
    # figure quoted beside ours, its floor the one the texts compare with.
    side = json.loads((root / "benchmarks" / "results" / "maxtext_side.json").read_text())
    (mt,) = [r for r in side["rows"] if r["topology"] == "2 x v5p:4x4x2 pipeline"]
    assert round(mt["peak_bytes_per_chip"] / (1 << 30), 2) == two["maxtext_peak_gib"]
    for text in (guide,):
        assert f"{two['peak_gib']:.2f} GiB per chip" in text
        assert f"{two['ratio_to_maxtext']:.2f}x" in text
        assert f"{data['peak_gib'] - two['peak_gib']:.1f} GiB" in text
        assert f"{two['dcn_gib']:.2f} GiB a chip" in text
        assert f"{mt['step_time_floor_seconds'] * 1e3:.0f} ms" in text
        assert f"{two['floor_ms']:.0f} ms" in text
    assert f"{h100['peak_gib']:.2f} GiB per GPU" in guide
    for figure in (f"{circular['peak_gib']:.2f} GiB", f"{circular['floor_ms']:.0f} ms"):
        assert figure in guide


# ------------------------------------------------- scalars the layers add to (an MoE loss)
def test_pipeline_accumulates_scalars_per_microbatch_and_averages_them():
    """A scalar in the carry is each microbatch's own accumulator; the result is their mean:
    the whole batch's value for a sum of per-layer means, each microbatch's for a product."""
    mesh = dtensor.create_mesh([("stage", 4), ("data", 2)])
    w, x = _weights(), jax.random.normal(jax.random.key(1), (16, 16))

    def layer(w, carry):
        x, (linear, product) = carry
        y = _layer(w, x)
        return y, (linear + (y**2).mean(), product + y.mean() * (y**2).mean())

    def run_all(w, x):
        return jax.lax.scan(lambda c, lw: (layer(lw, c), None), (x, (0.0, 0.0)), w)[0]

    def loss(w, x, M=4):
        zero = jnp.zeros((), jnp.float32)
        y, (linear, product) = pipeline(
            layer, w, (x, (zero, zero)), stages=4, microbatches=M, batch_axes=("data",)
        )
        return (y**2).sum() + linear + 3 * product

    def reference(w, x, M=4):
        y, (linear, _) = run_all(w, x)  # the whole batch's sum of means
        product = jnp.mean(jnp.stack([run_all(w, x[m::M])[1][1] for m in range(M)]))
        return (y**2).sum() + linear + 3 * product

    with mesh:
        got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(_by_stage(w, mesh), x)
    want = jax.value_and_grad(reference, argnums=(0, 1))(w, x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    _close(got[1], want[1])
    # The product's mean over microbatches is not the whole batch's (what M changes), so
    # the reference above tells the two apart.
    whole = float(run_all(w, x)[1][1])
    micro = float(jnp.mean(jnp.stack([run_all(w, x[m::4])[1][1] for m in range(4)])))
    assert abs(whole - micro) > 1e-3 * abs(whole)
