"""Mixtures of experts: dtensor.expert_mlp, HybridStrategy(expert=E), the decoder's MoE block.

Equality with single-device JAX (float32) on 8 CPU devices, the layouts of the
expert rule, explain's dispatch figures, and the TPU and GPU compilers' programs
(ragged all-to-all) at a tiny size.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dtensor
import strategies
from examples.decoder import CONFIGS, Block, Decoder, loss_fn
from strategies.presets.tensor_parallel import expert_dim
from tests import signatures
from tests.test_decoder import _batches, _build, _step

E, D, F, K = 8, 16, 32, 2


def _moe_inputs(batch=4, seq=16, seed=0):
    key = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(key[0], (batch, seq, D))
    probs = jax.nn.softmax(jax.random.normal(key[1], (batch, seq, E)))
    weights, ids = jax.lax.top_k(probs, K)
    gate, up = (jax.random.normal(k, (E, D, F)) / 4 for k in key[2:4])
    down = jax.random.normal(key[4], (E, F, D)) / 6
    return x, ids, weights, gate, up, down


def _moe_loss(x, weights, gate, up, down, ids):
    return (dtensor.expert_mlp(x, ids, weights, gate, up, down) ** 2).sum()


def _close(got, want, rtol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), (a.shape, np.abs(a - b).max())


# ------------------------------------------------------------------------- dtensor.expert_mlp
def _by_hand(x, ids, weights, gate, up, down, activation=jax.nn.silu):
    """Each token's k experts one at a time (numpy): ``sum_j w_j down_e(act(t gate_e) * (t
    up_e))``, or ``down_e(act(t up_e))`` without ``gate``."""
    x, ids, weights, up, down = (np.asarray(a, np.float64) for a in (x, ids, weights, up, down))
    gate = None if gate is None else np.asarray(gate, np.float64)
    out = np.zeros(x.shape)
    for index in np.ndindex(*x.shape[:-1]):
        t = x[index]
        for j in range(ids.shape[-1]):
            e = int(ids[index + (j,)])
            if gate is None:
                h = np.asarray(activation(t @ up[e]))
            else:
                h = np.asarray(activation(t @ gate[e])) * (t @ up[e])
            out[index] += weights[index + (j,)] * (h @ down[e])
    return out


def test_expert_mlp_without_mesh_is_each_token_s_weighted_experts():
    x, ids, weights, gate, up, down = _moe_inputs(batch=2, seq=4)
    got = dtensor.expert_mlp(x, ids, weights, gate, up, down)
    want = _by_hand(x, ids, weights, gate, up, down)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "dims",
    [
        [("data", 2), ("expert", 4)],
        [("data", 2), ("fsdp", 2), ("expert", 2)],
        [("expert", 8)],
        [("data", 8)],
        [("data", 2), ("expert", 2), ("tensor", 2)],
        [("fsdp", 4), ("tensor", 2)],
    ],
    ids=[
        "data2-expert4",
        "data2-fsdp2-expert2",
        "expert8",
        "data8",
        "data2-expert2-tensor2",
        "fsdp4-tensor2",
    ],
)
def test_expert_mlp_under_a_mesh_matches_one_device_forward_and_backward(dims):
    x, ids, weights, gate, up, down = _moe_inputs()
    want = dtensor.expert_mlp(x, ids, weights, gate, up, down)
    want_grads = jax.grad(_moe_loss, argnums=(0, 1, 2, 3, 4))(x, weights, gate, up, down, ids)
    mesh = dtensor.create_mesh(dims)
    with mesh:
        got = jax.jit(dtensor.expert_mlp)(x, ids, weights, gate, up, down)
        grads = jax.jit(jax.grad(_moe_loss, argnums=(0, 1, 2, 3, 4)))(
            x, weights, gate, up, down, ids
        )
        text = jax.jit(dtensor.expert_mlp).lower(x, ids, weights, gate, up, down).as_text()
    _close(got, want, 1e-6)
    _close(grads, want_grads, 1e-6)
    # Over an expert axis the tokens travel (all-to-all); without one each device runs all.
    assert ("all_to_all" in text) == (dict(dims).get("expert", 1) > 1)
    if dict(dims).get("tensor", 1) > 1:  # each device half of every expert's hidden units
        dots = "\n".join(line for line in text.splitlines() if "dot_general" in line)
        assert f"x{D}x{F // 2}xf32>" in dots and f"x{D}x{F}xf32>" not in dots


def test_expert_mlp_under_jax_s_own_set_mesh_matches_one_device():
    """Under ``jax.set_mesh`` (no dtensor mesh) a traced call sees only JAX's abstract mesh:
    the exchange is still chosen by its devices' platform (dense on CPU)."""
    x, ids, weights, gate, up, down = _moe_inputs()
    want = dtensor.expert_mlp(x, ids, weights, gate, up, down)
    mesh = dtensor.create_mesh([("data", 2), ("expert", 4)], axis_types="auto")
    with jax.set_mesh(mesh.jax_mesh):
        got = jax.jit(dtensor.expert_mlp)(x, ids, weights, gate, up, down)
    _close(got, want, 1e-6)


def test_expert_mlp_ungated_and_imbalanced_routing():
    """Without a gate, gelu, every token to the same two experts: one device receives all
    rows (the dropless buffer's worst case), the others none; still each token's experts by
    hand, with a mesh and without."""
    x, _, weights, _, up, down = _moe_inputs()
    ids = jnp.broadcast_to(jnp.asarray([5, 6], jnp.int32), weights.shape)
    want = _by_hand(x, ids, weights, None, up, down, activation=jax.nn.gelu)
    alone = dtensor.expert_mlp(x, ids, weights, None, up, down, activation=jax.nn.gelu)
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-5)
    with dtensor.create_mesh([("data", 2), ("expert", 4)]):
        got = jax.jit(lambda *a: dtensor.expert_mlp(*a, activation=jax.nn.gelu))(
            x, ids, weights, None, up, down
        )
    _close(got, want, 1e-6)


def _ragged_all_to_all_model(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, **kw
):
    """``jax.lax.ragged_all_to_all`` as its documentation defines it, in numpy, for XLA:CPU
    (which has no ragged all-to-all): every device's arguments all-gathered over the axis,
    then each device writes what each peer sends it. It also checks what the collective
    trusts its caller with: each receiver expects what its sender sends, every slice lies
    within its buffers, and no two slices land on the same rows."""
    assert not kw.get("axis_index_groups")
    me = jax.lax.axis_index(axis_name)
    peers = [
        jax.lax.all_gather(a, axis_name)
        for a in (operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    ]

    def model(output, me, operands, starts, sends, lands, recvs):
        result, written = np.array(output), np.zeros(len(output), bool)
        for sender in range(len(operands)):
            size = int(sends[sender, me])
            assert size == recvs[me, sender], (sender, me, size, recvs[me])
            src, dst = int(starts[sender, me]), int(lands[sender, me])
            assert 0 <= src and src + size <= operands.shape[1], (sender, src, size)
            assert 0 <= dst and dst + size <= len(result), (sender, dst, size)
            assert not written[dst : dst + size].any(), (sender, dst, size)
            result[dst : dst + size] = operands[sender, src : src + size]
            written[dst : dst + size] = True
        return result

    shape = jax.ShapeDtypeStruct(output.shape, output.dtype)
    return jax.pure_callback(model, shape, output, me, *peers)


@pytest.mark.parametrize(
    ("dims", "routing"),
    [
        ([("data", 2), ("expert", 4)], "random"),
        ([("data", 2), ("expert", 4)], "imbalanced"),
        ([("expert", 8)], "random"),
        ([("data", 2), ("fsdp", 2), ("expert", 2)], "random"),
    ],
    ids=["data2-expert4", "data2-expert4-imbalanced", "expert8", "data2-fsdp2-expert2"],
)
def test_ragged_exchange_on_a_model_of_the_collective_is_one_device_s(monkeypatch, dims, routing):
    """The ragged path (TPU's and GPU's) run on CPU with ``ragged_all_to_all`` replaced by a
    numpy model of it: the offsets and sizes it computes, out and back, give each token's
    experts as on one device (so as the dense exchange, which
    test_expert_mlp_under_a_mesh_matches_one_device_forward_and_backward checks on the same
    inputs), forward; with every token routed to the same two experts (one device receives
    all rows) too. An offset one row off fails."""
    x, ids, weights, gate, up, down = _moe_inputs()
    if routing == "imbalanced":
        ids = jnp.broadcast_to(jnp.asarray([5, 6], jnp.int32), weights.shape)
    want = dtensor.expert_mlp(x, ids, weights, gate, up, down)
    calls = []

    def model(*args, **kw):
        calls.append(kw["axis_name"])
        return _ragged_all_to_all_model(*args, **kw)

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", model)
    ragged = functools.partial(dtensor.expert_mlp, exchange="ragged")
    with dtensor.create_mesh(dims):
        got = jax.jit(ragged)(x, ids, weights, gate, up, down)
    assert calls == ["expert", "expert"]  # out and back
    _close(got, want, 1e-6)
    if routing != "random" or len(dims) != 2:
        return

    def one_off(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, **kw):
        return _ragged_all_to_all_model(
            operand, output, input_offsets, send_sizes, output_offsets + 1, recv_sizes, **kw
        )

    monkeypatch.setattr(jax.lax, "ragged_all_to_all", one_off)
    ragged = functools.partial(dtensor.expert_mlp, exchange="ragged")  # traced anew
    with pytest.raises((AssertionError, jax.errors.JaxRuntimeError)):
        with dtensor.create_mesh(dims):
            _close(jax.jit(ragged)(x, ids, weights, gate, up, down), want, 1e-6)


def test_expert_mlp_errors_name_the_sizes_and_the_fix():
    x, ids, weights, gate, up, down = _moe_inputs()
    with dtensor.create_mesh([("data", 2), ("expert", 4)]):
        with pytest.raises(
            ValueError, match=r"6 experts .* do not divide over the mesh axis 'expert' of size 4"
        ):
            dtensor.expert_mlp(x, ids, weights, gate[:6], up[:6], down[:6])
        with pytest.raises(ValueError, match=r"12 tokens .* do not divide over the token axes"):
            dtensor.expert_mlp(x[:1, :12], ids[:1, :12], weights[:1, :12], gate, up, down)
    with pytest.raises(
        ValueError, match=r"w_down \(8, 16, 32\) must be \[experts, hidden, d_model\]"
    ):
        dtensor.expert_mlp(x, ids, weights, gate, up, jnp.swapaxes(down, 1, 2))
    with pytest.raises(ValueError, match="expert_ids .* must both be x's leading shape"):
        dtensor.expert_mlp(x, ids[..., :1], weights, gate, up, down)


# ------------------------------------------------------------------------- layouts
def test_expert_rule_and_hybrid_expert_layouts():
    assert expert_dim("blocks/0/moe/experts/up", (8, 64, 128)) == 0
    assert expert_dim("layers/moe/experts/down", (2, 8, 128, 64)) == 1  # scanned stack
    assert expert_dim("blocks/0/mlp/up", (64, 128)) is None
    assert expert_dim("experts", (8, 64)) is None  # rank 2: not a stack of matrices

    s = strategies.HybridStrategy(2, 2, 1, expert=2, min_shard_bytes=0)
    assert s.mesh.shape == {"data": 2, "fsdp": 2, "expert": 2, "tensor": 1}
    assert s.batch_axes == ("data", "fsdp", "expert") and s.num_replicas_in_sync == 8
    up = s.variable_layout("layers/moe/experts/up", np.zeros((2, 8, 64, 128), np.float32))
    assert up.sharding_specs == ("unsharded", "expert", "unsharded", "fsdp")
    dense = s.variable_layout("layers/attn/query", np.zeros((2, 64, 4, 16), np.float32))
    assert dense.sharding_specs == ("unsharded", ("fsdp", "expert"), "unsharded", "unsharded")
    assert s.rule_name("layers/moe/experts/up", np.zeros((2, 8, 64, 128))) == "expert"
    assert s.read_options().kept_axes("layers/moe/experts/up") == ("expert",)
    # expert=1 keeps today's mesh and layouts.
    assert strategies.HybridStrategy(2, 2, 2).mesh.dim_names == ("data", "fsdp", "tensor")

    with pytest.raises(ValueError, match=r"gather_at_read=True\) needs expert=1"):
        strategies.HybridStrategy(2, 1, 1, expert=4, gather_at_read=True)
    with pytest.raises(ValueError, match="expert-parallel size must be a positive integer"):
        strategies.HybridStrategy(expert=0)
    with pytest.warns(
        UserWarning, match=r"stack of 6 experts .* does not divide over the 'expert' axis of size 4"
    ):
        s4 = strategies.HybridStrategy(2, 1, 1, expert=4)
        assert s4.variable_layout("moe/experts/up", np.zeros((6, 8, 8))).is_fully_replicated()


# ------------------------------------------------------------------------- the decoder
def test_moe_decoder_aux_loss_and_counts():
    cfg = CONFIGS["tiny-moe"]
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(_batches(cfg, 1)[0]["x"])
    logits, aux = nnx.jit(lambda m, t: m(t, with_aux=True))(model, tokens)  # one compile
    assert logits.shape == (8, 16, cfg.vocab)
    # The Switch load-balancing loss is E * sum(fraction * probability): 1 when uniform,
    # here near it (a fresh router), and at most E.
    assert 0.9 < float(aux) < 2.0
    assert float(nnx.jit(loss_fn)(model, {"x": tokens, "y": tokens})) > 0
    stack = model.blocks[0].moe.experts
    assert stack.up[...].shape == (cfg.experts, cfg.d_model, cfg.ffw)


@functools.cache
def _one_device(cfg):
    """Single-device JAX on ``_batches(cfg)`` (Adam, ``eps=1e-6``): the first batch's gradients,
    then three steps' losses and the parameters after them. The meshes of one layer kind
    compare against the same run (made once in a process)."""
    batches = _batches(cfg)
    model, opt = _build(cfg, eps=1e-6)
    grads = nnx.jit(nnx.grad(loss_fn))(model, batches[0])
    step = nnx.jit(_step)
    losses = [float(step(model, opt, b)) for b in batches]
    return jax.device_get(grads), losses, jax.device_get(nnx.state(model, nnx.Param))


@pytest.mark.parametrize(
    ("data", "fsdp", "expert", "scan", "tensor"),
    [
        (2, 1, 4, False, 1),
        (2, 2, 2, False, 1),
        (2, 2, 2, True, 1),
        (1, 2, 4, True, 1),
        (1, 2, 2, True, 2),
    ],
    ids=[
        "expert4",
        "data2-fsdp2-expert2",
        "data2-fsdp2-expert2-scan-remat",
        "fsdp2-expert4-scan-remat",
        "fsdp2-expert2-tensor2-scan-remat",
    ],
)
def test_moe_decoder_trains_under_hybrid_expert_as_on_one_device(data, fsdp, expert, scan, tensor):
    """Three Adam steps of the MoE decoder under HybridStrategy(expert=E) = one device: the
    losses to float32 rounding, the first step's gradients to 2e-6, the parameters after
    three steps to 2e-5 (measured: 3e-6). Adam's ``eps`` is 1e-6 here: with the default 1e-8
    Adam divides each near-zero gradient (queries' reach 5e-9) by its own scale, so a float32
    rounding difference in one moves its parameter by up to the learning rate (measured: 1e-4
    relative on the queries with jax 0.12); a wrong dispatch moves them by ~1e-1."""
    cfg = CONFIGS["tiny-moe"].replace(scan=scan)
    batches = _batches(cfg)
    want_grads, want, want_params = _one_device(cfg)

    remat = (Block,) if scan else None
    s = strategies.HybridStrategy(data, fsdp, tensor, expert=expert, min_shard_bytes=0, remat=remat)
    assert s.mesh.shape["expert"] == expert and not s.gather_at_read
    with s.scope():
        model, opt = _build(cfg, eps=1e-6)
    grads = s.run(lambda m, b: nnx.grad(loss_fn)(m, b), args=(model, batches[0]))
    _close(jax.device_get(grads), want_grads, 2e-6)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    have = jax.device_get(nnx.state(model, nnx.Param))
    _close(have, want_params, 2e-5)
    experts = nnx.state(model, nnx.Param)
    up = (
        experts["layers"]["moe"]["experts"]["up"]
        if scan
        else experts["blocks"][0]["moe"]["experts"]["up"]
    )
    assert "expert" in str(up.sharding.spec)
    # with tensor: each expert's hidden units split over it too (Megatron within the experts)
    assert ("tensor" in str(up.sharding.spec)) == (tensor > 1)


def test_moe_checkpoint_round_trip_between_expert_and_fully_sharded(tmp_path):
    """Saved under HybridStrategy(expert=4), restored under FullyShardedStrategy and on one
    device: the same values, each in the restoring layout."""
    cfg = CONFIGS["tiny-moe"]
    s = strategies.HybridStrategy(2, 1, 1, expert=4, min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg)
    s.run(_step, args=(model, opt, _batches(cfg, 1)[0]))
    saved = jax.device_get(nnx.state(model, nnx.Param))
    dtensor.checkpoint.save(tmp_path / "ckpt", {"model": model})

    fsdp = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with fsdp.scope():
        other = Decoder(cfg, rngs=nnx.Rngs(1))
    dtensor.checkpoint.restore(tmp_path / "ckpt", {"model": other})
    _close(jax.device_get(nnx.state(other, nnx.Param)), saved, 0.0)
    up = other.blocks[0].moe.experts.up[...]
    assert "expert" not in str(up.sharding.spec)

    alone = Decoder(cfg, rngs=nnx.Rngs(2))
    dtensor.checkpoint.restore(tmp_path / "ckpt", {"model": alone})
    _close(jax.device_get(nnx.state(alone, nnx.Param)), saved, 0.0)


# ------------------------------------------------------------------------- explain
def test_explain_reports_the_dispatch_its_minimum_and_capacity():
    cfg = CONFIGS["tiny-moe"].replace(scan=True)
    s = strategies.HybridStrategy(2, 1, 1, expert=4, min_shard_bytes=0, remat=(Block,))
    with s.scope():
        model, opt = _build(cfg)
    report = s.explain(_step, args=(model, opt, _batches(cfg, 1)[0]))
    # Per layer and device: 8 x 16 / 8 = 16 tokens x 2 rows of 64 floats, out and back in
    # the forward pass, its recomputation and the backward pass; 3/4 leave the device.
    rows = 16 * 2 * 64 * 4
    assert report.dispatch_min_bytes_per_device == pytest.approx(cfg.layers * 6 * rows * 3 / 4)
    assert report.dispatch_capacity == 4
    # On CPU the exchange is dense (no ragged all-to-all in XLA:CPU): buffers padded 4x.
    assert report.dispatch_bytes_per_device == pytest.approx(
        4 * report.dispatch_min_bytes_per_device
    )
    assert report.min_comm_bytes_per_device >= report.dispatch_min_bytes_per_device
    assert "MoE dispatch" in str(report)


# ------------------------------------------------------------------------- TPU and GPU compilers
def _abstract(cfg, batch, seq):
    model, opt = nnx.eval_shape(lambda: _build(cfg))
    xy = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("x", "y")}
    return model, opt, xy


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_moe_decoder_compiles_for_tpu_and_gpu_with_ragged_all_to_all(platform):
    devices = (
        dtensor.tpu_topology("v5e:2x4") if platform == "tpu" else dtensor.gpu_topology("h100:1x8")
    )
    cfg = CONFIGS["tiny-moe"].replace(scan=True)
    s = strategies.HybridStrategy(
        1,
        2,
        1,
        expert=4,
        devices=devices,
        min_shard_bytes=0,
        remat=(Block,),
        mixed_precision=strategies.MixedPrecision(),
    )
    report = s.explain(_step, args=_abstract(cfg, 8, 64))
    text = report.compiled.as_text()
    assert "ragged-all-to-all" in text
    # The dispatch's all-to-alls over expert, out and back in each layer, forward and backward
    # (tests/signatures.py).
    signatures.assert_expert(report.collectives, layers=cfg.layers, named=platform == "tpu")
    assert report.dispatch_capacity == 4
    # Ragged: the compiled all-to-alls move the rows routed (bf16 under mixed precision).
    rows = 8 * 64 // 8 * 2 * 64 * 2
    assert report.dispatch_min_bytes_per_device == pytest.approx(cfg.layers * 6 * rows * 3 / 4)
    assert report.dispatch_bytes_per_device >= report.dispatch_min_bytes_per_device
    assert report.peak_bytes_per_device < 64 << 20
    # The experts split over expert x fsdp, the other variables FSDP-split over both (as
    # MaxText shards them): an eighth of each a chip, by the compiled arguments' shards.
    signatures.assert_splits(
        report, {"fsdp": 2, "expert": 4}, lambda path: True, batch_bytes=2 * 8 * 64 * 4 // 8
    )


def test_moe_decoder_in_pipeline_stages_compiles_for_tpu():
    """A mixture of experts inside pipeline stages: the pipeline maps its layer over the
    stages (``jax.vmap``), which gave every grouped matmul a batch dimension libtpu refuses
    ("number of batch dimensions should be 0, got 1": Mixtral's stage x expert plans). The
    grouped matmuls loop over a batch instead, forward and backward; the floor counts the
    same FLOPs as without stages (no matmul recomputed by the loop)."""
    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=True)
    kw = dict(
        devices=dtensor.tpu_topology("v5e:2x4"),
        min_shard_bytes=0,
        remat=(Block,),
        mixed_precision=strategies.MixedPrecision(),
    )
    staged = strategies.HybridStrategy(
        1, 2, 1, stage=2, expert=2, pipeline=(Block,), microbatches=2, **kw
    )
    report = staged.explain(_step, args=_abstract(cfg, 8, 64))
    text = report.compiled.as_text()
    # The grouped matmuls compiled, forward and backward, in a loop inside the dispatch.
    names = set(re.findall(r'op_name="([^"]*grouped_k2_of4/ragged_dot_general[^"]*)"', text))
    assert {name.startswith("jit(pure)/transpose(") for name in names} == {True, False}
    assert all("expert_dispatch/" in name and "/while/body/" in name for name in names)
    assert "ragged-all-to-all" in text  # the dispatch over expert inside the stages
    # The same model without stages on the same 8 chips (fsdp 4 x expert 2): a stage's
    # device runs half the layers on the whole batch's microbatches, so the same FLOPs
    # over 8 chips, plus only the pipeline's fill and drain bubble (2 + 1 ticks of 2).
    flat = strategies.HybridStrategy(1, 4, 1, expert=2, **kw).explain(
        _step, args=_abstract(cfg, 8, 64)
    )
    ratio = report.step_floor.flops_per_device / flat.step_floor.flops_per_device
    assert 1.0 <= ratio <= 1.5 + 1e-6, ratio


def test_experts_benchmark_table_is_the_guide_s():
    """The large-models guide's MoE table is ``benchmarks.experts --markdown`` of the
    results file, and the results hold what the guide says of them."""
    import json
    from pathlib import Path

    from benchmarks import experts

    root = Path(__file__).resolve().parents[1]
    rows = json.loads((root / "benchmarks" / "results" / "experts.json").read_text())["rows"]
    guide = (root / "docs" / "guides" / "large_models.md").read_text()
    assert experts.markdown(rows) in guide
    mixtral = next(r for r in rows if r["size"] == "mixtral-8x7b" and r["topology"] == "v5p:4x4x2")
    assert mixtral["maxtext_peak_gib"] == 28.00 and mixtral["fits"]
    assert f"{mixtral['peak_gib']:.2f} GiB" in guide
    # MaxText's own compile (benchmarks.maxtext_side row 6) reproduces the figure.
    assert mixtral["maxtext_measured_peak_gib"] == mixtral["maxtext_peak_gib"]
    assert (
        f"ICI term, {mixtral['maxtext_ici_ms']} ms, is beside our {mixtral['ici_ms']} ms" in guide
    )
    assert f"{mixtral['maxtext_counted_tflops_per_chip']} TFLOP per" in guide
    assert all(r["dispatch_mib"] >= r["dispatch_min_mib"] > 0 for r in rows)
