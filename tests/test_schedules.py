"""Pipeline schedules that interleave forward and backward: 1F1B, interleaved 1F1B, zero-bubble.

The tick tables (every op once, in dependency order; the bubble by formula; the
activations held flat in the microbatch count), the SPMD loop against ``jax.grad``,
and ``HybridStrategy(stage=S, schedule=...)`` on the example decoder (a scanned stack
and a list of blocks) and a Flax model of Flax's own layers, with a user's unchanged
step, under ``stage`` x ``data``, ``stage`` x ``fsdp`` x ``tensor``, experts and
context, plain SGD compared per tensor with single-device JAX; the compiled program's
permutes; the errors.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from dtensor.core.interleaved import run_schedule, vjp_inexact
from dtensor.core.schedules import INTERLEAVED_SCHEDULES, make_schedule
from examples.decoder import CONFIGS, Block, Decoder, loss_fn, tensor_rules
from strategies.reads.pipeline import PipelineError
from tests.test_decoder import _batches

SIZES = [(2, 4, 1), (4, 8, 1), (4, 6, 1), (3, 5, 1)]
ROUNDS = [(2, 4, 2), (4, 8, 2), (2, 6, 3)]


def _cases():
    for name in INTERLEAVED_SCHEDULES:
        for S, M, R in ROUNDS if name == "interleaved-1f1b" else SIZES:
            yield pytest.param(name, S, M, R, id=f"{name}-S{S}-M{M}-R{R}")


# ------------------------------------------------------------------ the tick tables
@pytest.mark.parametrize(("name", "S", "M", "R"), list(_cases()))
def test_each_op_runs_once_after_what_it_needs(name, S, M, R):
    sched = make_schedule(name, S, M, R)
    V = R * S
    at = {"F": {}, "B": {}, "W": {}}
    for t, row in enumerate(sched.ops):
        assert len(row) == S
        for s, ops in enumerate(row):
            for kind, op in zip("FBW", ops, strict=True):
                if op is None:
                    continue
                m, v = op
                assert v % S == s and (m, v) not in at[kind]
                at[kind][(m, v)] = t
    every = {(m, v) for m in range(M) for v in range(V)}
    assert set(at["F"]) == set(at["B"]) == every
    assert set(at["W"]) == (every if name == "zero-bubble" else set())
    for m, v in every:
        if v:  # a forward after the previous virtual stage's (a tick to move)
            assert at["F"][(m, v)] > at["F"][(m, v - 1)]
        # the backward after the next virtual stage's, the last after the loss
        after = at["F"][(m, v)] if v == V - 1 else at["B"][(m, v + 1)]
        assert at["B"][(m, v)] > after
        if name == "zero-bubble":
            assert at["W"][(m, v)] >= at["B"][(m, v)]


@pytest.mark.parametrize("S", [2, 4, 8])
def test_1f1b_bubble_is_the_formula_and_its_activations_flat_in_microbatches(S):
    for M in (2 * S, 4 * S, 8 * S):
        one = make_schedule("1f1b", S, M)
        assert one.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))
        # Stage s holds 2(S - s) microbatches at most, whatever M: GPipe holds M + S - 1.
        assert one.in_flight == tuple(2 * (S - s) for s in range(S))
        assert one.slots["stash"] == 2 * S
        # zero-bubble: a smaller bubble (M ticks of weight gradients, not M + S - 1) with
        # the same activations held at its peak (stage 0, where the W follows the B at once)
        zb = make_schedule("zero-bubble", S, M)
        assert zb.bubble_fraction == pytest.approx(2 * (S - 1) / (3 * M + 2 * (S - 1)))
        assert zb.bubble_fraction < one.bubble_fraction
        assert max(zb.in_flight) == max(one.in_flight)
        # interleaved over 2 rounds: a smaller bubble, about as many layers' inputs held
        two = make_schedule("interleaved-1f1b", S, M, 2)
        assert two.bubble_fraction < one.bubble_fraction
        assert max(two.in_flight) / 2 <= max(one.in_flight)


def test_schedules_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        make_schedule("interleaved-1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="goes round the stages once"):
        make_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="interleaved schedules are"):
        make_schedule("gpipe", 4, 8)


# ------------------------------------------------------------------ the loop
@pytest.mark.parametrize("keep", ["inputs", "residuals"])
@pytest.mark.parametrize(
    ("name", "S", "R"), [("1f1b", 4, 1), ("zero-bubble", 4, 1), ("interleaved-1f1b", 2, 2)]
)
def test_loop_is_jax_grad_of_the_layers_run_in_order(name, S, R, keep):
    """Weights, a shared input (its gradient summed over layers), side inputs, a scalar
    the layers add to, and the loss's own parameter: each gradient as jax.grad's, whether a
    stage keeps layer inputs (and recomputes the layers) or the vjp's residuals."""
    from dtensor import create_mesh

    L, B, D, M = 8, 16, 8, 8
    k = jax.random.split(jax.random.key(0), 5)
    w = {"w": jax.random.normal(k[0], (L, D, D)) * 0.4, "b": jnp.zeros((L, D))}
    head, shared = jax.random.normal(k[1], (D,)), jax.random.normal(k[2], (D,))
    x, side = jax.random.normal(k[3], (B, D)), jax.random.uniform(k[4], (B, D))

    def layer(w, sh, carry, sd):
        h, acc = carry
        y = jnp.tanh(h @ w["w"] + w["b"] + sh) * sd
        return y, acc + jnp.mean(y**2)

    def loss_of(head, y):
        h, acc = y
        return jnp.mean((h @ head) ** 2) + 0.1 * acc

    def plain(w, head, shared, x, side):
        carry = (x, jnp.zeros(()))
        for i in range(L):
            carry = layer(jax.tree.map(lambda a, i=i: a[i], w), shared, carry, side)
        return loss_of(head, carry)

    def per_microbatch(w, head, shared, x, side):  # the mean of each microbatch's loss
        return jnp.mean(jnp.stack([plain(w, head, shared, x[m::M], side[m::M]) for m in range(M)]))

    want = jax.value_and_grad(per_microbatch, argnums=(0, 1, 2, 3, 4))(w, head, shared, x, side)

    def scheduled(w, head, shared, x, side):
        def loss(y, m, acc):
            total, d_head = acc
            value, pull = vjp_inexact(loss_of, (head, y), (True, True))
            dh, dy = pull(jnp.asarray(1.0 / M))
            return dy, (total + value / M, d_head + dh)

        acc, dw, dsh, (dx, _), dside = run_schedule(
            layer, w, shared, (x, jnp.zeros(())), side, loss, (jnp.zeros(()), jnp.zeros_like(head)),
            schedule=make_schedule(name, S, M, R), batch_axes=("data",), keep=keep,
        )  # fmt: skip
        return acc[0], (dw, acc[1], dsh, dx, dside)

    with create_mesh([("stage", S), ("data", 8 // S)]):
        got = jax.jit(scheduled)(w, head, shared, x, side)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


# ------------------------------------------------------------------ the preset
def _sgd_step(model, optimizer, batch):  # a user's step, unchanged from one device
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _build(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)


def _one_device(cfg, batches):
    model, opt = _build(cfg)
    step = nnx.jit(_sgd_step)
    return [float(step(model, opt, b)) for b in batches], jax.device_get(
        nnx.state(model, nnx.Param)
    )


def _per_tensor(got, want, rtol=1e-5):
    """Plain SGD: each parameter's change equals single-device JAX's, tensor by tensor."""
    flat_got = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(flat_got, jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), (
            jax.tree_util.keystr(path),
            np.abs(a - b).max(),
        )


def _loops_run(monkeypatch):
    """The schedules whose loop the strategy runs, in order (GPipe's transposed loop, a
    fallback, would train to the same numbers)."""
    from strategies.reads import pipeline_grad

    ran: list[str] = []
    loop = pipeline_grad.run_schedule

    def spy(*args, **kw):
        ran.append(kw["schedule"].name)
        return loop(*args, **kw)

    monkeypatch.setattr(pipeline_grad, "run_schedule", spy)
    return ran


@pytest.mark.parametrize(
    ("schedule", "layers", "dims"),
    [
        ("1f1b", "scan", {"stage": 4, "data": 2}),
        ("1f1b", "list", {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}),
        ("interleaved-1f1b", "scan", {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}),
        ("interleaved-1f1b", "list", {"stage": 4, "data": 2}),
        ("zero-bubble", "scan", {"stage": 2, "data": 1, "fsdp": 2, "tensor": 2}),
        ("zero-bubble", "list", {"stage": 4, "data": 2}),
    ],
)
def test_decoder_trains_by_each_schedule_as_on_one_device(schedule, layers, dims, monkeypatch):
    ran = _loops_run(monkeypatch)
    cfg = CONFIGS["tiny"].replace(layers=8, scan=layers == "scan")
    batches = _batches(cfg, batch=16)
    want, want_params = _one_device(cfg, batches)
    kw = {"rules": tensor_rules(cfg)} if dims.get("tensor", 1) > 1 else {}
    s = strategies.HybridStrategy(
        pipeline=(Block,), min_shard_bytes=0, microbatches=8, schedule=schedule, **dims, **kw
    )
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_sgd_step, args=(model, opt, b))) for b in batches]
    assert ran == [schedule]  # traced once, run three times
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    _per_tensor(jax.device_get(nnx.state(model, nnx.Param)), want_params)


def test_moe_decoder_with_experts_and_context_inside_1f1b_stages_trains_as_on_one_device():
    """stage x expert x context: the experts' all-to-alls and the context's gathers inside
    each stage's ticks, the MoE load-balancing loss per microbatch (the mean of each
    microbatch's, as every pipeline schedule takes it: tests/test_compose.py); with remat,
    so the stages keep layer inputs and recompute (the other decoder tests keep residuals)."""
    from tests.test_compose import _micro_aux_loss

    cfg = CONFIGS["tiny-moe"].replace(layers=4, scan=True)
    batches = _batches(cfg, batch=8)
    step = _micro_aux_loss(4)
    model, opt = _build(cfg)
    jitted = nnx.jit(step)
    want = [float(jitted(model, opt, b)) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(
        1, stage=2, expert=2, context=2, microbatches=4, schedule="1f1b",
        pipeline=(Block,), min_shard_bytes=0, remat=(Block,),  # layer inputs kept
    )  # fmt: skip
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_sgd_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _per_tensor(jax.device_get(nnx.state(model, nnx.Param)), want_params)


def test_flax_list_model_trains_by_zero_bubble_as_on_one_device():
    """Flax's own layers (nnx.MultiHeadAttention blocks in a Python list, a causal mask cut
    into microbatches as a side input) and the user's step returning aux logits."""
    from tests.test_pipeline import _flax_batches, _FlaxBlock, _FlaxListModel

    def loss(m, batch):  # the batch an argument (cut into microbatches), not a closure
        logits = m(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), logits

    def step(model, opt, batch):
        (value, logits), grads = nnx.value_and_grad(loss, has_aux=True)(model, batch)
        opt.update(model, grads)
        return value, logits

    def build():
        model = _FlaxListModel(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    batches = _flax_batches()
    model, opt = build()
    jitted = nnx.jit(step)
    want = [jax.device_get(jitted(model, opt, b)) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(
        2,
        stage=4,
        microbatches=4,
        schedule="zero-bubble",
        pipeline=(_FlaxBlock,),
        min_shard_bytes=0,
    )
    with s.scope():
        model, opt = build()
    got = [jax.device_get(s.run(step, args=(model, opt, b))) for b in batches]
    for (loss, logits), (want_loss, want_logits) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        # the logits of every row, in the batch's order (each microbatch's, put back)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    _per_tensor(jax.device_get(nnx.state(model, nnx.Param)), want_params)


def _while_bodies_with_permutes(text):
    """Each computation of the HLO ``text`` with its collective permutes' source-target pairs."""
    bodies, name, pairs = {}, None, []
    for line in text.splitlines():
        head = re.match(r"^\s*%?([\w.\-]+) .*\{\s*$", line)
        if head and "=" not in line.split("{")[0]:
            name, pairs = head.group(1), []
            bodies[name] = pairs
        found = re.search(
            r"collective-permute(?:-start)?\(.*source_target_pairs=\{([^}]*\}(?:,\{[^}]*\})*)\}",
            line,
        )
        if found and name is not None:
            pairs.append(found.group(1))
    return {k: v for k, v in bodies.items() if v}


def test_the_compiled_loop_permutes_both_ways_in_one_body_and_explain_knows_it():
    """The steady-state ticks' body sends activations one stage on and input gradients one
    stage back; explain reports the schedule, its bubble and the stage traffic."""
    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    s = strategies.HybridStrategy(
        2, stage=4, microbatches=8, schedule="1f1b", pipeline=(Block,), min_shard_bytes=0
    )
    with s.scope():
        model, opt = _build(cfg)
    report = s.explain(_sgd_step, args=(model, opt, _batches(cfg, batch=16)[0]))
    assert report.pipeline_schedule == "1f1b, 4 stages x 8 microbatches"
    assert report.bubble_fraction == pytest.approx(3 / 11)
    assert report.stage_bytes_per_device > 0
    bodies = _while_bodies_with_permutes(report.compiled.as_text())
    both = [pairs for pairs in bodies.values() if len(set(pairs)) >= 2]
    assert both, sorted(bodies)


def test_a_loss_running_the_blocks_twice_is_refused_by_name():
    cfg = CONFIGS["tiny"].replace(layers=4, scan=True)

    def step(model, optimizer, batch):
        def twice(m, b):
            return loss_fn(m, b) + loss_fn(m, b)

        loss, grads = nnx.value_and_grad(twice)(model, batch)
        optimizer.update(model, grads)
        return loss

    s = strategies.HybridStrategy(2, stage=2, microbatches=4, schedule="1f1b", pipeline=(Block,))
    with s.scope():
        model, opt = _build(cfg)
    with pytest.raises(PipelineError, match="runs the pipelined blocks 2 times"):
        s.run(step, args=(model, opt, _batches(cfg, batch=8)[0]))


def test_a_loss_closing_over_its_batch_is_told_to_take_it_as_an_argument():
    cfg = CONFIGS["tiny"].replace(layers=4, scan=True)

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)
        optimizer.update(model, grads)
        return loss

    s = strategies.HybridStrategy(2, stage=2, microbatches=4, schedule="1f1b", pipeline=(Block,))
    with s.scope():
        model, opt = _build(cfg)
    with pytest.raises(
        PipelineError, match=r"take the batch as an argument.*loss_fn\(model, batch\)"
    ):
        s.run(step, args=(model, opt, _batches(cfg, batch=8)[0]))


def test_preset_refuses_interleaved_microbatches_not_a_multiple_of_the_stages():
    with pytest.raises(ValueError, match="multiple of 4"):
        strategies.HybridStrategy(
            2, stage=4, microbatches=6, schedule="interleaved-1f1b", pipeline=(Block,)
        )
    with pytest.raises(ValueError, match="'circular' or 'interleaved-1f1b'"):
        strategies.HybridStrategy(2, stage=4, repeats=2, schedule="1f1b", pipeline=(Block,))


def test_the_guide_shows_each_schedule_s_tick_table_as_rendered():
    """docs/guides/large_models.md's pictures are the tables the loop runs, with their
    bubbles and what stage 0 holds."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs/guides/large_models.md").read_text()
    block = text.split("```text\n1f1b, S=4")[1].split("```")[0]
    shown = "1f1b, S=4" + block
    found = re.findall(r"^(\S+, S=.*)\n((?:stage .*\n)+)", shown, flags=re.M)
    assert [t.split(",")[0] for t, _ in found] == ["1f1b", "interleaved-1f1b", "zero-bubble"]
    for title, table in found:
        name, rest = title.split(", ", 1)
        sizes = dict(re.findall(r"([SMR])=(\d+)", rest))
        sched = make_schedule(name, int(sizes["S"]), int(sizes["M"]), int(sizes.get("R", 1)))
        assert table.rstrip("\n") == sched.render(), name
        assert f"bubble {sched.bubble_fraction:.1%}" in title
        if "stage 0 holds" in title:
            assert f"stage 0 holds {sched.in_flight[0]} microbatches" in title


def test_the_search_tries_the_schedules_and_prices_what_each_holds():
    """--search enumerates 1F1B and interleaved 1F1B beside GPipe and circular (zero-bubble
    only by name), and the analytic model holds 1F1B's activations flat in M where GPipe's
    cover the batch, its bubble by the table, and its recomputed forward."""
    from dtensor.analysis.hardware import CHIPS
    from dtensor.tpu.estimate import estimate
    from dtensor.tpu.plans import Plan, enumerate_plans
    from tests.test_search import _facts

    facts = _facts(params=2 * 10**9, layers=16, hidden=2048, ffn=8192, batch=64, seq=2048)
    plans = enumerate_plans(facts, chips=8)
    assert {p.schedule for p in plans if p.stage > 1} == {
        "gpipe", "circular", "1f1b", "interleaved-1f1b",
    }  # fmt: skip
    chip = CHIPS["TPU v5 lite"]

    def est(schedule, m, remat="full"):
        return estimate(
            Plan(fsdp=4, stage=2, microbatches=m, schedule=schedule, remat=remat), facts, chip
        )

    gpipe = [est("gpipe", m).activation_bytes for m in (4, 8, 16)]
    one = [est("1f1b", m).activation_bytes for m in (4, 8, 16)]
    assert one[0] == gpipe[0]  # M = 2S: every microbatch in flight either way
    assert one[1] == pytest.approx(gpipe[1] / 2) and one[2] == pytest.approx(gpipe[2] / 4)
    # the bubble by the table (1F1B's is GPipe's), the recomputation as remat says; without
    # remat the residuals of the microbatches in flight are kept (more than layer inputs)
    for remat in ("full", "none"):
        one, gpipe = est("1f1b", 8, remat), est("gpipe", 8, remat)
        assert one.compute_seconds == pytest.approx(gpipe.compute_seconds)
        assert est("zero-bubble", 8, remat).compute_seconds > one.compute_seconds
        assert one.activation_bytes == pytest.approx(gpipe.activation_bytes / 2)
    assert est("1f1b", 8, "none").activation_bytes > est("1f1b", 8, "full").activation_bytes


def test_1f1b_with_remat_and_mixed_precision_matches_the_unpipelined_preset():
    """bfloat16 reads (MixedPrecision) and remat=(Block,) with the 1F1B loop: the losses and
    each parameter's change as the same preset without stages (not float32 single-device:
    bfloat16 rounds each microbatch's activations; tests/test_pipeline.py says by how much)."""
    from tests.test_decoder import _build as build_adam
    from tests.test_pipeline import EPS

    cfg = CONFIGS["tiny"].replace(layers=8, scan=True)
    batches = _batches(cfg, batch=16)
    kw = {"remat": (Block,), "mixed_precision": strategies.MixedPrecision(), "min_shard_bytes": 0}
    flat = strategies.HybridStrategy(2, 2, **kw)
    with flat.scope():
        model, opt = build_adam(cfg, eps=EPS)
    start = jax.device_get(nnx.state(model, nnx.Param))
    want = [float(flat.run(_sgd_step, args=(model, opt, b))) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(
        1, 2, 2, stage=2, microbatches=4, schedule="1f1b", pipeline=(Block,),
        rules=tensor_rules(cfg), **kw,
    )  # fmt: skip
    with s.scope():
        model, opt = build_adam(cfg, eps=EPS)
    got = [float(s.run(_sgd_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=2e-2)
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b, b0 in zip(
        jax.tree.leaves(have), jax.tree.leaves(want_params), jax.tree.leaves(start), strict=True
    ):
        a, b, b0 = (np.asarray(x, np.float64) for x in (a, b, b0))
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b - b0), a.shape


def test_nnx_grad_without_the_value_takes_the_schedule_too(monkeypatch):
    """``nnx.grad`` (jax.grad underneath, no value) of the unchanged loss under 1F1B runs the
    schedule's loop (not GPipe's transposed one, which would give the same numbers): the
    parameters after an SGD step as single-device JAX's, tensor by tensor."""
    ran = _loops_run(monkeypatch)
    cfg = CONFIGS["tiny"].replace(layers=4, scan=True)
    batch = _batches(cfg, n=1, batch=8)[0]

    def step(model, optimizer, batch):
        optimizer.update(model, nnx.grad(loss_fn)(model, batch))

    model, opt = _build(cfg)
    nnx.jit(step)(model, opt, batch)
    want = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(
        2, stage=2, microbatches=4, schedule="1f1b", pipeline=(Block,), min_shard_bytes=0
    )
    with s.scope():
        model, opt = _build(cfg)
    s.run(step, args=(model, opt, batch))
    assert ran == ["1f1b"]
    _per_tensor(jax.device_get(nnx.state(model, nnx.Param)), want)
