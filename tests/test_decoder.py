"""The Gemma-style example decoder: trains under FullyShardedStrategy as on one device; public sizes."""

from __future__ import annotations

import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import strategies
from examples.decoder import CONFIGS, Block, Decoder, loss_fn, param_count

STEPS = 3
DEMO = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _batches(cfg, n=STEPS, batch=8, seq=16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        w = rng.integers(0, cfg.vocab, size=(batch, seq + 1)).astype(np.int32)
        out.append({"x": w[:, :-1], "y": w[:, 1:]})
    return out


def _step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _build(cfg, eps=1e-8):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2, eps=eps), wrt=nnx.Param)


def _reference(cfg, batches, eps=1e-8):
    model, opt = _build(cfg, eps)
    step = nnx.jit(_step)
    return [float(step(model, opt, b)) for b in batches], nnx.state(model, nnx.Param)


@pytest.mark.parametrize("variant", ["plain", "remat", "scan"])
def test_tiny_decoder_trains_under_fully_sharded_as_on_one_device(variant):
    cfg = CONFIGS["tiny"].replace(remat=variant == "remat", scan=variant == "scan")
    batches = _batches(cfg)
    want, want_params = _reference(cfg, batches)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg)
    with warnings.catch_warnings():
        # Unrolled layers are gathered at each read; reads of scanned (stacked) layers are
        # slices, which the gather-at-read plan leaves to XLA (it warns and falls back).
        warnings.simplefilter("ignore" if cfg.scan else "error", RuntimeWarning)
        got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert got[-1] < got[0]
    have = jax.device_get(nnx.state(model, nnx.Param))
    # Scanned layers are gathered slice by slice inside the scan and their gradients
    # all-reduced there (a different summation order than one device's): measured 1.5e-5
    # on the stacked kernels after 3 Adam steps, so 3e-5 for them; 1e-5 elsewhere.
    tol = 3e-5 if cfg.scan else 1e-5
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= tol * np.linalg.norm(b)


def test_gather_layers_trains_the_scanned_decoder_as_on_one_device():
    """``FullyShardedStrategy(gather_layers=True)`` (XLA's plan, remat=(Block,), nnx.scan):
    each layer gathered in the loop body, its gradient constrained back to its split."""
    cfg = CONFIGS["tiny-llama"].replace(scan=True)
    batches = _batches(cfg)
    # Adam's eps at 1e-3, so that a gradient's scale shows: at 1e-8 a correct run's parameters
    # were 1.2e-5 to 1.4e-5 off (float32 summation-order noise of near-zero gradients, each
    # divided by its own size; past 3e-5 with XLA's default CPU codegen elsewhere) and a run
    # whose scanned layers' gradients were doubled only 6.5e-5 to 7.1e-5 (its losses within
    # 1.3e-6). At 1e-3, with and without DTENSOR_TEST_XLA_DEFAULTS=1: 1.2e-7 against 2.3e-2.
    want, want_params = _reference(cfg, batches, eps=1e-3)
    s = strategies.FullyShardedStrategy(
        min_shard_bytes=0, gather_at_read=False, remat=(Block,), gather_layers=True
    )
    assert s.read_options().layer_gather
    with s.scope():
        model, opt = _build(cfg, eps=1e-3)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b)
    with pytest.raises(ValueError, match=r"gather_layers=True\) shapes XLA's plan.*remat=None"):
        strategies.FullyShardedStrategy(gather_at_read=False, gather_layers=True)
    with pytest.raises(ValueError, match=r"gather_at_read=True"):
        strategies.FullyShardedStrategy(gather_at_read=True, remat=(Block,), gather_layers=True)


@pytest.mark.parametrize("scan", [False, True])
def test_preset_mixed_precision_and_remat_compute_in_bf16_like_the_bf16_decoder(monkeypatch, scan):
    """MixedPrecision + remat=(Block,) on the preset = the decoder built with dtype=bf16 + remat.

    The decoder's ``dtype=None`` computes in the dtype its weights are read in,
    so the preset's bf16 reads make the whole forward pass bf16 (not bf16
    weights in float32 arithmetic).
    """
    import jax.numpy as jnp

    from examples import decoder

    cfg = CONFIGS["tiny"].replace(scan=scan)
    batches = _batches(cfg)
    want, _ = _reference(cfg.replace(dtype=jnp.bfloat16, remat=True), batches)
    seen = []
    mlp_call = decoder.MLP.__call__

    def spy(self, x):
        seen.append((x.dtype, self.gate[...].dtype))
        return mlp_call(self, x)

    monkeypatch.setattr(decoder.MLP, "__call__", spy)
    s = strategies.FullyShardedStrategy(
        min_shard_bytes=0, mixed_precision=strategies.MixedPrecision(), remat=(Block,)
    )
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    # The last trace is the compiled one (an earlier probe of the reads leaves them as stored);
    # a scan traces its body once for all layers.
    bf16 = np.dtype(jnp.bfloat16)
    n = 1 if scan else cfg.layers
    assert seen[-n:] == [(bf16, bf16)] * n
    # The preset also rounds the norms' scales to bf16 and reduces gradients in float32.
    np.testing.assert_allclose(got, want, rtol=1e-2)
    assert got[-1] < got[0]


@pytest.mark.parametrize(
    ("size", "scan"),
    [("tiny-gemma3", False), ("tiny-gemma3", True), ("tiny-llama", False), ("tiny-llama", True)],
)
def test_gemma3_and_llama_blocks_train_under_fully_sharded_as_on_one_device(size, scan):
    cfg = CONFIGS[size].replace(scan=scan)
    batches = _batches(cfg)
    # Adam's eps at 1e-3 (tests/test_compose.py says why): at 1e-8 each gradient element is
    # divided by its own size, so float32 summation-order noise of the elements near zero
    # moves the scanned Llama's attention kernels by 3.04e-5 in norm on jax 0.12 here.
    want, want_params = _reference(cfg, batches, eps=1e-3)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg, eps=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert len(set(got)) == STEPS  # the steps trained (each loss differs)
    have = jax.device_get(nnx.state(model, nnx.Param))
    # Scanned layers: as above. Gemma 3's query/key and post norms (rsqrt of sums) amplify
    # float32 summation-order noise (its tiny loss starts at 61.7, a saturated softmax):
    # measured 1.02e-5 unrolled and 1.7e-4 scanned (attention out kernel; with Adam's eps at
    # 1e-8, before the 1e-3 above) while the losses agree to 1e-6; a wrong window or rotary
    # base moves the losses themselves.
    tol = {(False, False): 1e-5, (True, False): 3e-5, (False, True): 3e-5}.get(
        (scan, cfg.block == "gemma3"), 5e-4
    )
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        # Norm scales start at 0 (Gemma's 1 + scale), so their own size is no yardstick: at
        # least 1.0 (a real bug moves them by the learning rate, 1e-2, per element).
        assert np.linalg.norm(np.asarray(a) - b) <= tol * max(np.linalg.norm(b), 1.0)


@pytest.mark.parametrize(
    ("size", "scan"), [("tiny-llama", False), ("tiny-gemma3", False), ("tiny-llama", True)]
)
def test_blocks_train_under_hybrid_tensor_parallel_as_on_one_device(size, scan):
    """The decoder's Megatron rules (``tensor_rules``) under data x fsdp x tensor = 2 x 2 x 2;
    scanned with ``remat=(Block,)``: each layer's weights gathered over fsdp in the loop."""
    from examples.decoder import tensor_rules

    cfg = CONFIGS[size].replace(scan=scan)
    batches = _batches(cfg)
    want, want_params = _reference(cfg, batches)
    remat = (Block,) if scan else None
    s = strategies.HybridStrategy(2, 2, 2, rules=tensor_rules(cfg), min_shard_bytes=0, remat=remat)
    assert s.read_options().layer_gather == scan
    if not scan:
        key = s.variable_layout("blocks/0/attn/key", np.zeros((64, 2, 16)))
        assert key.sharding_specs[1] == "tensor"
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    have = jax.device_get(nnx.state(model, nnx.Param))
    # As under FullyShardedStrategy; scanned, the gathered layers' gradients are summed in
    # another order and the sequence is split over tensor (seen: 5.0e-5 on a stacked MLP
    # kernel after 3 Adam steps; a real bug moves parameters by ~1e-2).
    tol = 1e-4 if scan else 3e-5 if cfg.block == "gemma3" else 1e-5
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= tol * max(np.linalg.norm(b), 1.0)


@pytest.mark.slow
def test_remat_blocks_keep_the_batch_split_under_xla_plan():
    """XLA's plan (``gather_at_read=False``) with ``remat=(Block,)`` on scanned layers: each
    block's input and output are constrained to the batch split, and it trains as on one device."""
    cfg = CONFIGS["tiny"].replace(scan=True)
    batches = _batches(cfg)
    want, _ = _reference(cfg, batches)
    s = strategies.FullyShardedStrategy(min_shard_bytes=0, gather_at_read=False, remat=(Block,))
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("preset", ["fully_sharded", "hybrid"])
def test_scanned_layers_keep_the_batch_split_without_remat_on_a_tpu_topology(preset):
    """XLA's plan (the TPU default) without ``remat=``: every module is swapped so that one
    layer of a scanned stack keeps its batch-shaped inputs and outputs split over the batch
    axes, as the ``remat=`` blocks' are. Before, the scan's carry took the layout the
    embedding lookup left and libtpu computed layers for the whole batch on every chip
    (scanned Gemma 2B, fully sharded, v5e:4x4: 24.4 GiB a chip, f32[18,16,1,8,1024,1024]
    attention scores kept; here 36 whole-batch values in the tiny decoder's program)."""
    import re

    import jax.numpy as jnp

    import dtensor

    cfg = CONFIGS["tiny"].replace(scan=True, layers=4)
    devices = dtensor.tpu_topology("v5e:2x4")
    s = (
        strategies.FullyShardedStrategy(min_shard_bytes=0, devices=devices)
        if preset == "fully_sharded"
        else strategies.HybridStrategy(1, 8, 1, min_shard_bytes=0, devices=devices)
    )
    assert s.read_options().layer_batch_split
    model, opt = nnx.eval_shape(lambda: _build(cfg))
    batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.int32) for k in ("x", "y")}
    text = s.explain(_step, args=(model, opt, batch)).compiled.as_text()
    whole = [line for line in text.splitlines() if re.search(r"= (f32|bf16)\[16,128,", line)]
    assert not whole, whole[:3]  # each chip holds 16 / 8 = 2 rows of every activation
    assert re.search(r"= (f32|bf16)\[2,128,", text)


@pytest.mark.slow
def test_scanned_layers_without_remat_train_under_xla_plan_as_on_one_device():
    """The same constraints on CPU (``gather_at_read=False``, no remat): the values are the
    single-device ones."""
    cfg = CONFIGS["tiny"].replace(scan=True)
    batches = _batches(cfg)
    want, want_params = _reference(cfg, batches, eps=1e-3)  # Adam that sees a gradient's scale
    s = strategies.FullyShardedStrategy(min_shard_bytes=0, gather_at_read=False)
    with s.scope():
        model, opt = _build(cfg, eps=1e-3)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # The parameters too (the last step's update shows in no loss): measured at most 1.1e-7
    # (4.5e-7 without the floor of 1.0: the norm scales start at 0); with the gradients of the
    # scanned layers' norm scales doubled 1.6e-2 (the losses 3.7e-5 off), with those of their
    # inputs 2.6e-2.
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * max(np.linalg.norm(b), 1.0)


def test_swapped_block_constrains_its_batch_shaped_inputs_and_outputs_in_scanned_layers():
    """Each layer of a scanned stack keeps its (batch, seq, d) input and output split over the
    batch axes (and the sequence over ``sequence_axes``); unrolled layers are left to XLA."""
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec

    import dtensor
    from strategies.reads import swaps

    cfg = CONFIGS["tiny"].replace(scan=True)
    x, positions = jnp.zeros((8, 16, 64)), jnp.arange(16)

    def constrained(module, call, remat=True, **kw):
        if remat:
            swaps.swap_call(module, remat=True, batch_axes=("fsdp",), **kw)
        graphdef, state = nnx.split(module)  # the swapped class is recorded in the graphdef
        with dtensor.create_mesh([("fsdp", 4), ("tensor", 2)]):
            jaxpr = jax.make_jaxpr(lambda s, x: call(nnx.merge(graphdef, s), x))(state, x)
        found = []

        def walk(j):
            for e in j.eqns:
                if e.primitive.name == "sharding_constraint":
                    found.append((e.invars[0].aval.shape, e.params["sharding"].spec))
                for value in e.params.values():  # sub-jaxprs (scan, remat, custom_vjp)
                    for sub in value if isinstance(value, tuple | list) else (value,):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            walk(inner)

        walk(jaxpr.jaxpr)
        return found

    def scanned(stack, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x, positions)

        return body(x, stack)

    stack = Decoder(cfg, rngs=nnx.Rngs(0)).layers
    # the (batch, seq, d) input and output, not the (seq,) positions
    assert constrained(stack, scanned) == [((8, 16, 64), PartitionSpec("fsdp"))] * 2
    # HybridStrategy's sequence parallelism: the sequence split over tensor too.
    stack = Decoder(cfg, rngs=nnx.Rngs(0)).layers
    split = [((8, 16, 64), PartitionSpec("fsdp", "tensor"))] * 2
    assert constrained(stack, scanned, sequence_axes=("tensor",)) == split
    # ... and Megatron's gathers: the sublayers holding tensor-split weights (swap_entry) take
    # the sequence whole over tensor and split their outputs again; the norms run split.
    stack = Decoder(cfg, rngs=nnx.Rngs(0)).layers
    swaps.swap_entry(stack.attn)
    swaps.swap_entry(stack.mlp)
    whole = ((8, 16, 64), PartitionSpec("fsdp"))
    got = constrained(stack, scanned, sequence_axes=("tensor",), layer_sequence_axes=())
    # the layer's input; attention's input and output; the MLP's; the layer's output
    assert got == [split[0], whole, split[0], whole, split[0], split[0]], got
    block = Block(CONFIGS["tiny"], nnx.Rngs(0))
    assert constrained(block, lambda b, x: b(x, positions)) == []
    # Without remat (XLA's plan, no remat=): every module swapped, the layer's input and
    # output constrained once (its sublayers, sliced too, are not layers of their own)
    stack = Decoder(cfg, rngs=nnx.Rngs(0)).layers
    for _, module in nnx.iter_graph(stack):
        if isinstance(module, nnx.Module) and swaps.owns_variables(module):
            swaps.swap_call(module, remat=False, batch_axes=("fsdp",))
    assert constrained(stack, scanned, remat=False) == [((8, 16, 64), PartitionSpec("fsdp"))] * 2


def test_block_kinds_differ_where_they_should():
    from examples.decoder import layer_windows

    llama = nnx.eval_shape(lambda: Decoder(CONFIGS["tiny-llama"], rngs=nnx.Rngs(0)))
    assert llama.head.shape == (64, 128)  # untied
    assert float(Decoder(CONFIGS["tiny-llama"], rngs=nnx.Rngs(0)).final_norm.scale[0]) == 1.0
    gemma3 = nnx.eval_shape(lambda: Decoder(CONFIGS["tiny-gemma3"], rngs=nnx.Rngs(0)))
    assert not hasattr(gemma3, "head") and gemma3.blocks[0].attn.query_norm.scale.shape == (16,)
    windows, bases = layer_windows(CONFIGS["tiny-gemma3"])
    assert windows.tolist() == [4, 8192, 4] and bases.tolist() == [1e4, 1e6, 1e4]
    assert layer_windows(CONFIGS["gemma3-12b"])[0].tolist().count(8192) == 8
    # A sliding window hides the early tokens from late positions: with every layer local,
    # the last logits do not depend on the first token.
    local = CONFIGS["tiny-gemma3"].replace(global_every=10**6, layers=1)
    model = Decoder(local, rngs=nnx.Rngs(0))
    tokens = np.arange(12, dtype=np.int32)[None] % 128
    other = tokens.copy()
    other[0, 0] = 77
    a, b = model(tokens), model(other)
    np.testing.assert_array_equal(np.asarray(a[0, -1]), np.asarray(b[0, -1]))
    assert not np.allclose(np.asarray(a[0, 0]), np.asarray(b[0, 0]))
    with pytest.raises(ValueError, match=r"block='mamba'\) is not a block kind"):
        CONFIGS["tiny"].replace(block="mamba")


def test_published_parameter_counts_by_eval_shape():
    # Llama 2 (Touvron et al. 2023; the Hugging Face checkpoints' parameter counts) and the
    # Gemma 3 technical report (Table 1, 12B: 1,012M embedding + 10,759M non-embedding
    # parameters; the 417M vision encoder is not part of the text decoder MaxText compiles).
    published = {
        "llama2-7b": 6_738_415_616,
        "llama2-70b": 68_976_648_192,
        "gemma3-12b": (1_012e6 + 10_759e6),
        # Llama 3.1 405B (Llama Team 2024, Table 3: 126 layers, 16,384 wide, 128 heads, 8 KV
        # heads, FFN 53,248, vocabulary 128,000 + 256 special tokens; the Hugging Face count)
        "llama3.1-405b": 405_853_388_800,
        # Llama 3.1 70B (the Hugging Face count): Llama 2 70B's layers, Llama 3's vocabulary
        "llama3.1-70b": 70_553_706_496,
    }
    for name, want in published.items():
        cfg = CONFIGS[name].replace(scan=True)
        model = nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert count == param_count(cfg)
        assert abs(count - want) <= 0.001 * want, (name, count, want)
    seventy = nnx.eval_shape(
        lambda: Decoder(CONFIGS["llama2-70b"].replace(scan=True), rngs=nnx.Rngs(0))
    )
    assert seventy.layers.attn.key.shape == (80, 8192, 8, 128)
    assert seventy.layers.mlp.down.shape == (80, 28672, 8192)
    assert seventy.head.shape == (8192, 32000) and seventy.embed.shape == (32000, 8192)


def test_public_sizes_by_eval_shape():
    for name, billions in (("2b", 2.51), ("7b", 8.54)):
        cfg = CONFIGS[name]
        model = nnx.eval_shape(lambda cfg=cfg: Decoder(cfg, rngs=nnx.Rngs(0)))
        params = nnx.state(model, nnx.Param)
        count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        assert count == param_count(cfg)
        assert round(count / 1e9, 2) == billions
    seven = nnx.eval_shape(lambda: Decoder(CONFIGS["7b"], rngs=nnx.Rngs(0)))
    assert seven.embed.shape == (256128, 3072)
    assert seven.blocks[0].attn.key.shape == (3072, 16, 256)
    assert seven.blocks[0].mlp.gate.shape == (3072, 24576)
    assert len(seven.blocks) == 28 and isinstance(seven.blocks[0], Block)
    two = nnx.eval_shape(lambda: Decoder(CONFIGS["2b"], rngs=nnx.Rngs(0)))
    assert two.blocks[0].attn.key.shape == (2048, 1, 256) and len(two.blocks) == 18


def test_tiny_decoder_compiles_ahead_of_time_like_on_cpu(capsys):
    from dtensor.tpu import aot

    module = aot.load_script(DEMO)
    argv = [
        "--strategy",
        "fully_sharded",
        "--model-size",
        "tiny",
        "--batch-size",
        "16",
        "--seq-len",
        "32",
    ]
    tpu = aot.compile_script(
        module, argv + ["--mixed-precision", "bf16", "--remat"], topology="v5e:4x4"
    )
    printed = capsys.readouterr().out
    assert "mixed_precision: " in printed and "remat: " in printed
    assert set(module.LAST_OPTIONS) == {"mixed_precision", "remat"}
    cpu_strategy, step, args = module.aot_step(argv, devices=jax.devices())
    cpu = cpu_strategy.explain(step, args=tuple(args))
    r = tpu.report
    # The same variables, shapes and layouts (split on the same dimension) on both compilers.
    assert [(v.path, v.shape, v.dtype, v.layout) for v in r.variables] == [
        (v.path, v.shape, v.dtype, v.layout) for v in cpu.variables
    ]
    assert r.mesh == "Mesh(fsdp=16)" and cpu.mesh == "Mesh(fsdp=8)"
    assert r.memory_fit.fits and r.peak_bytes_per_device > 0 and r.ideal_peak_bytes_per_device > 0
    assert (
        r.ideal_peak_terms.gathered
        and "all-gather" in r.by_kind()
        and "all-gather" in cpu.by_kind()
    )
    assert "peak, ideally (ZeRO formula)" in aot.summary(tpu)


@pytest.mark.parametrize("size", ["tiny", "tiny-llama"])
def test_model_flops_is_the_hand_count_and_the_traced_step_s_matmuls(size):
    """Every MFU ceiling divides by model_flops: the tiny shapes counted by hand, and the
    same figure from the dot_generals of the traced training step (forward and backward)."""
    from dtensor.analysis.floor import matmul_flops
    from examples.decoder import model_flops

    cfg = CONFIGS[size]
    assert (cfg.vocab, cfg.d_model, cfg.layers, cfg.heads, cfg.kv_heads) == (128, 64, 2, 4, 2)
    assert (cfg.head_dim, cfg.ffw) == (16, 128)
    batch, seq = 2, 8
    # Matmul parameters of one layer: query 64x(4*16), key and value 64x(2*16) each,
    # out (4*16)x64, gate, up and down 64x128 each.
    layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 3 * (64 * 128)
    assert layer == 36_864
    params = 2 * layer + 128 * 64  # 2 layers + the output projection (tied or not): 81_920
    tokens = batch * seq
    # 2 FLOPs a multiply-add, x3 for forward + the two backward matmuls of each.
    dense = 6 * params * tokens
    # scores q.k and the weighted sum of values: 2 matmuls of 2*seq*head_dim per token and
    # head, forward and backward (x3), in each of the 2 layers.
    attention = 3 * 2 * (2 * seq * 16) * 4 * tokens * 2
    assert dense + attention == 8_060_928
    assert model_flops(cfg, batch, seq) == dense + attention

    model = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))  # shapes only
    graphdef, state = nnx.split(model)
    data = {k: jax.ShapeDtypeStruct((batch, seq), np.int32) for k in ("x", "y")}

    def grads(state, data):
        return jax.grad(lambda s: loss_fn(nnx.merge(graphdef, s), data))(state)

    assert matmul_flops(jax.make_jaxpr(grads)(state, data)) == dense + attention
