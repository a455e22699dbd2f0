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


def _build(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _reference(cfg, batches):
    model, opt = _build(cfg)
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
    assert "ideal peak (ZeRO formula)" in aot.summary(tpu)
