"""Flax's own Gemma (the flax sdist's examples/gemma, unchanged) under FullyShardedStrategy.

The code is fetched at install time (``make third-party``, run by ``make test``)
into ``sys.prefix/share/flax-examples/<version>``; these tests fail, naming the
target, when it was not (and skip on a flax whose sdist has no pinned sha256).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import strategies
from benchmarks import flax_gemma, third_party
from benchmarks import flax_gemma_model as fg

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _fetched():
    version = third_party.flax_version()
    if version not in third_party.FLAX_SDIST_SHA256:  # make test-latest's newest flax
        pytest.skip(
            f"flax {version} has no pinned sdist sha256 in benchmarks/third_party.py; Flax's "
            f"Gemma is tested on the pinned flax {sorted(third_party.FLAX_SDIST_SHA256)} (make test)"
        )
    try:
        third_party.gemma_dir()
    except third_party.MissingThirdParty as err:
        pytest.fail(str(err))


def _batches(steps: int = 2, batch: int = 8, seq: int = 16):
    """One batch ``steps`` times (the loss must fall on it)."""
    x = np.random.default_rng(0).integers(0, 128, (batch, seq)).astype(np.int32)
    return [{"x": x, "y": np.roll(x, -1, axis=1)}] * steps


def _reference(cfg, batches, eps=1e-8):
    model, opt = fg.build(cfg, eps=eps)
    step = nnx.jit(fg.train_step)
    return [float(step(model, opt, b)) for b in batches], nnx.state(model, nnx.Param)


@pytest.mark.parametrize("plan", ["xla", "xla-remat", "gather-remat"])
def test_flax_gemma_trains_under_fully_sharded_as_on_one_device(plan):
    _, modules, _ = fg.flax_gemma()
    cfg = fg.config("tiny")
    batches = _batches()
    # AdamW's eps at 1e-3, so that a gradient's scale shows: with the gathered weights'
    # gradients doubled the parameters end 0.14 off (the losses 5.4e-3), where at eps 1e-8
    # they were 7.1e-5 off and the losses 2e-7; a correct run's, at most 1.2e-6 either way
    # (with and without DTENSOR_TEST_XLA_DEFAULTS=1).
    want, want_params = _reference(cfg, batches, eps=1e-3)
    # "xla": XLA's plan, as on TPU; "gather": each weight gathered at its read (CPU's
    # default), Flax's ScaledEmbed (its own __call__) reaching the lookup through super().
    s = strategies.FullyShardedStrategy(
        min_shard_bytes=0,
        gather_at_read=plan.startswith("gather"),
        remat=(modules.Block,) if plan.endswith("remat") else (),
    )
    with s.scope():
        model, opt = fg.build(cfg, eps=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to XLA's plan
        got = [float(s.run(fg.train_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b)
    assert type(model.embedder) is modules.ScaledEmbed  # the user's objects keep their class


def _tensor_strategy(data=1, fsdp=4, devices=None):
    """``data x fsdp x 2`` over Flax's own tensor layouts, remat by Flax's Block."""
    _, modules, _ = fg.flax_gemma()
    return strategies.HybridStrategy(
        data, fsdp, 2, rules=fg.tensor_rules(), remat=(modules.Block,), min_shard_bytes=0,
        devices=devices,
    )  # fmt: skip


def test_flax_gemma_trains_under_flax_s_own_tensor_layouts_as_on_one_device():
    """HybridStrategy with tensor_rules(): the tensor entries of Flax's own
    ShardingConfig.fsdp_tp_sharding (heads, KV heads, MLP features, vocabulary), FSDP on the
    other dimensions; the step equals the single-device one."""
    cfg = fg.config("tiny")
    batches = _batches()
    want, want_params = _reference(cfg, batches, eps=1e-3)  # a gradient's scale shows
    s = _tensor_strategy()
    with s.scope():
        model, opt = fg.build(cfg, eps=1e-3)
    layouts, _ = s.variable_layouts(model)
    block = layouts["layers"][0]
    specs = {
        "attn/q_einsum": block["attn"]["q_einsum"]["kernel"],  # [heads, d, head_dim]
        "attn/kv_einsum": block["attn"]["kv_einsum"]["kernel"],  # [2, kv_heads, d, head_dim]
        "attn/attn_vec_einsum": block["attn"]["attn_vec_einsum"]["kernel"],  # [heads, hd, d]
        "mlp/gate_proj": block["mlp"]["gate_proj"]["kernel"],  # [d, hidden]
        "mlp/down_proj": block["mlp"]["down_proj"]["kernel"],  # [hidden, d]
        "embedder": layouts["embedder"]["embedding"],  # [vocab, d]
    }
    tensor_dim = {k: list(v.sharding_specs).index("tensor") for k, v in specs.items()}
    assert tensor_dim == {
        "attn/q_einsum": 0,
        "attn/kv_einsum": 1,
        "attn/attn_vec_einsum": 0,
        "mlp/gate_proj": 1,
        "mlp/down_proj": 0,
        "embedder": 0,
    }
    assert all("fsdp" in v.sharding_specs for v in specs.values())
    got = [float(s.run(fg.train_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b)


def test_flax_gemma_s_tensor_plan_all_reduces_activations_on_a_tpu_topology():
    """The tensor axis is used, not only laid out: libtpu's program of the tiny model on
    v5e:2x4 all-reduces each block's activations over ``tensor`` (attention out, MLP down),
    forward and backward, and the weights Flax's layouts split (nothing else) take half
    their bytes a chip (data=4 x tensor=2: no fsdp to split the rest)."""
    import dtensor
    from tests import signatures as sig

    cfg = fg.config("tiny")
    s = _tensor_strategy(4, 1, dtensor.tpu_topology("v5e:2x4"))
    model, opt = nnx.eval_shape(lambda: fg.build(cfg))
    batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32) for k in ("x", "y")}
    report = s.explain(fg.train_step, args=(model, opt, batch))
    sig.assert_tensor(report.collectives, rows=8 // 4, seq=32, d_model=cfg.embed_dim, layers=2)
    split = re.compile(r"(einsum|_proj)/kernel$|embedder/embedding$")
    rows = 2 * (8 // 4) * 32 * 4  # x and y, int32, a data shard's rows
    sig.assert_splits(report, {"tensor": 2}, lambda p: bool(split.search(p)), batch_bytes=rows)


def test_module_dtype_computes_as_the_model_built_in_bf16():
    """MixedPrecision(module_dtype=True) on Flax's Gemma = Flax's own dtype=bfloat16 config."""
    batches = _batches(1)
    out = {}
    for name, cfg, mp in [
        ("module", fg.config("tiny"), strategies.MixedPrecision(module_dtype=True)),
        ("model", fg.config("tiny", dtype=jnp.bfloat16), strategies.MixedPrecision()),
    ]:
        s = strategies.FullyShardedStrategy(
            min_shard_bytes=0, gather_at_read=False, mixed_precision=mp
        )
        with s.scope():
            model, opt = fg.build(cfg)
        out[name] = [float(s.run(fg.train_step, args=(model, opt, b))) for b in batches]
        if name == "module":  # the user's modules keep their float32 compute dtype
            assert model.layers[0].mlp.gate_proj.dtype == jnp.float32
    assert out["module"] == out["model"]


def test_scan_is_refused_with_the_change_it_needs():
    with pytest.raises(ValueError, match="Python list .* Drop --scan"):
        fg.aot_step(["--model-size", "tiny", "--scan"], devices=jax.devices()[:8])


def test_tiny_compiles_for_tpu_with_bf16_compute_and_remat():
    from dtensor.tpu import aot

    argv = ["--strategy", "fully_sharded", "--model-size", "tiny", "--batch-size", "4"]
    argv += ["--seq-len", "32", "--mixed-precision", "bf16-compute", "--remat"]
    result = aot.compile_script(ROOT / fg.__file__, argv, topology="v5e:2x2")
    fit = result.report.memory_fit
    assert fit is not None and fit.fits
    assert result.report.step_time_floor_seconds


@pytest.mark.parametrize("doc", ["docs/guides/large_models.md"])
def test_docs_show_the_flax_gemma_table_from_its_json(doc, capsys):
    flax_gemma.main(["--markdown"])
    table = capsys.readouterr().out.strip().splitlines()
    lines = (ROOT / doc).read_text().splitlines()
    i = lines.index(table[0])
    assert lines[i : i + len(table)] == table
    payload = json.loads((ROOT / "benchmarks" / "results" / "flax_gemma.json").read_text())
    assert len(table) == len(payload["rows"]) + 2  # header, rule, one line a row
    assert payload["fit"]["best"] is None or any(payload["fit"]["best"] in line for line in table)
    # the prose after the table quotes each row's peak and floor as the JSON has them
    prose = " ".join(lines[i + len(table) : i + len(table) + 20])
    for r in payload["rows"]:
        assert f"{r['peak_bytes_per_chip'] / 2**30:.2f} GiB" in prose, r["option"]
        if r.get("step_time_floor_seconds"):
            assert f"{r['step_time_floor_seconds'] * 1e3:.0f} ms" in prose, r["option"]


def test_explain_advice_for_the_preset_as_given_names_module_dtype():
    argv = ["--strategy", "fully_sharded", "--model-size", "tiny", "--batch-size", "8"]
    strategy, _, _ = fg.aot_step(
        [*argv, "--mixed-precision", "bf16", "--remat"], devices=jax.devices()[:8]
    )
    assert "MixedPrecision(module_dtype=True)" in strategy.memory_advice()


def test_missing_or_unpinned_code_names_the_make_target(monkeypatch, tmp_path):
    monkeypatch.setattr(third_party, "cache_dir", lambda version=None: tmp_path)
    with pytest.raises(third_party.MissingThirdParty, match=r"run `make third-party`"):
        third_party.gemma_dir()
    with pytest.raises(
        third_party.MissingThirdParty, match=r"no sha256 pinned for the flax 0\.0\.1"
    ):
        third_party.fetch("0.0.1")


def test_the_search_takes_flax_s_gemma_with_the_knobs_its_script_has():
    """A model this project did not write: the search_facts hook's shapes (parameters counted
    from the abstract model), its flags only (no scan, stages, context or experts: Flax's
    blocks are a list) and bf16-compute for bf16 (its modules pin float32 arithmetic); a
    tensor plan's command compiles for a TPU slice through Flax's own tensor layouts."""
    from dtensor.tpu import aot
    from dtensor.tpu.plans import ModelFacts, enumerate_plans, plan_from_argv

    argv = ["--model-size", "tiny", "--batch-size", "8", "--seq-len", "32"]
    facts = ModelFacts.from_dict(fg.search_facts(argv))
    model, _ = nnx.eval_shape(lambda: fg.build(fg.config("tiny")))
    assert facts.params == sum(v.size for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    plans = enumerate_plans(facts, chips=8)
    assert {p.precision for p in plans} == {"none", "bf16-compute"}
    assert {p.tensor for p in plans} == {1, 2}  # 4 heads, 2 KV heads
    assert {(p.stage, p.context, p.expert, p.scan) for p in plans} == {(1, 1, 1, False)}
    for p in plans:  # the script's parser takes every plan's flags, and they read back
        fg.parse_args([*argv, *p.flags()])
        assert plan_from_argv(p.flags(), chips=8) == p
    hybrid = next(
        p for p in plans if p.tensor == 2 and p.precision == "bf16-compute" and p.remat == "full"
    )
    assert "module_dtype=True" in hybrid.strategy_line()
    result = aot.compile_script(ROOT / fg.__file__, [*argv, *hybrid.flags()], topology="v5e:2x4")
    tensor = {v.path for v in result.report.variables if "tensor" in v.layout}  # the model: 0/
    assert {"0/layers/0/attn/q_einsum/kernel", "0/layers/1/mlp/down_proj/kernel"} <= tensor
    assert result.report.step_time_floor_seconds


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b"])
def test_flax_gemma_trains_in_pipeline_stages_as_on_one_device(schedule):
    """Flax's Gemma unchanged under stage=2: its blocks (a Python list, each returning
    ``(cache, x)``, local and global attention alternating) pipelined as pairs; plain SGD,
    every parameter compared tensor by tensor with single-device JAX."""
    import optax

    _, modules, _ = fg.flax_gemma()
    cfg = fg.config("tiny", num_layers=4)
    batches = _batches()

    def build():
        model = fg.build(cfg)[0]
        return model, nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)

    def step(model, optimizer, batch):  # fg.train_step with plain SGD
        loss, grads = nnx.value_and_grad(fg.loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    model, opt = build()
    jitted = nnx.jit(step)
    want = [float(jitted(model, opt, b)) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.HybridStrategy(
        2, stage=2, microbatches=4, schedule=schedule, pipeline=(modules.Block,), min_shard_bytes=0
    )
    with s.scope():
        model, opt = build()
    got = [float(s.run(step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    have = jax.device_get(nnx.state(model, nnx.Param))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(have), jax.tree.leaves(want_params), strict=True
    ):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b), jax.tree_util.keystr(
            path
        )
