"""Mixed precision's cast of scanned layers: float32 to bfloat16 by the bits.

libtpu moves a convert of a scanned layer's weights out of the loop and keeps a bfloat16
copy of every layer's shard through the step; ``MixedPrecision`` casts such reads by the
bits instead (``strategies.reads.mixed_precision.to_bfloat16``), the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtensor
import strategies
from strategies.reads.mixed_precision import to_bfloat16


def test_the_bits_cast_gives_the_convert_s_values_and_gradient():
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    # ties to even (low half exactly 0x8000), both parities, and the edges
    ties = (rng.integers(0, 2**16, size=2000, dtype=np.uint32) << 16) | np.uint32(0x8000)
    edges = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000, 0x00000001, 0x80000000,
                      0x3F808000, 0x3F818000, 0x7F7F8000], np.uint32)  # fmt: skip
    x = jnp.asarray(np.concatenate([bits, ties, edges]).view(np.float32))
    got, want = to_bfloat16(x), x.astype(jnp.bfloat16)
    nan = np.isnan(np.asarray(x))
    assert nan.any() and np.isnan(np.asarray(got, np.float32)[nan]).all()
    np.testing.assert_array_equal(
        np.asarray(got)[~nan].view(np.uint16), np.asarray(want)[~nan].view(np.uint16)
    )
    w = jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32)
    finite = jnp.where(jnp.isfinite(x), x, 0.0)

    def loss(cast):
        return lambda v: (cast(v).astype(jnp.float32) * w).sum()

    np.testing.assert_array_equal(
        jax.grad(loss(to_bfloat16))(finite),
        jax.grad(loss(lambda v: v.astype(jnp.bfloat16)))(finite),
    )


@pytest.mark.slow
def test_scanned_layers_are_cast_inside_the_loop_on_tpu():
    """Gemma 2B's layers, 4 of them scanned (a 4096-word vocabulary), FullyShardedStrategy on v5e:2x4 with bf16 and
    remat: with XLA's convert libtpu holds a bfloat16 copy of every layer's shard (2
    bytes x the layers' parameters / 8 chips, 105 MiB); cast by the bits, the temporaries
    are 196 MiB smaller with libtpu 0.0.42 (jax 0.10: 488 -> 292 MiB) and 71 MiB smaller
    with libtpu 0.0.50 (jax 0.12: 531 -> 460 MiB), at the same FLOPs. A hoisted cast would
    save nothing."""
    from examples.decoder import CONFIGS, Block, param_count
    from tests.test_compose import _step
    from tests.test_experts import _abstract

    cfg = CONFIGS["2b"].replace(scan=True, layers=4, vocab=4096)
    embed = cfg.vocab * cfg.d_model * (1 if cfg.tied else 2)
    copy = 2 * (param_count(cfg) - embed) / 8
    temps, floors = {}, {}
    for hoist in (True, False):
        s = strategies.FullyShardedStrategy(
            devices=dtensor.tpu_topology("v5e:2x4"),
            remat=(Block,),
            mixed_precision=strategies.MixedPrecision(hoist_casts=hoist),
        )
        report = s.explain(_step, args=_abstract(cfg, 8, 256))
        temps[hoist] = report.compiled.memory_analysis().temp_size_in_bytes
        floors[hoist] = report.step_floor.flops_per_device
    assert temps[True] - temps[False] >= 0.5 * copy, (temps, copy)
    assert floors[True] == floors[False]


def test_the_in_loop_cast_keeps_explain_s_minimum():
    """explain's per-matmul minimum follows a weight through the bits cast as through a
    convert: the scanned decoder's minimum is the same under both casts (the cast hid the
    scanned layers' matmuls, a minimum 18x too low)."""
    import optax
    from flax import nnx

    from examples.decoder import CONFIGS, Decoder, loss_fn
    from examples.decoder_layers import Block

    cfg = CONFIGS["tiny"].replace(scan=True)
    words = np.random.default_rng(0).integers(0, cfg.vocab, size=(8, 17)).astype(np.int32)
    batch = {"x": words[:, :-1], "y": words[:, 1:]}

    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    found = []
    for hoist in (False, True):
        cast = strategies.MixedPrecision(param_dtype=jnp.bfloat16, hoist_casts=hoist)
        s = strategies.FullyShardedStrategy(
            min_shard_bytes=0, gather_at_read=False, mixed_precision=cast, remat=(Block,)
        )
        with s.scope():
            model = Decoder(cfg, rngs=nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        found.append(s.explain(step, args=(model, opt, batch)).min_comm_references)
    in_loop, hoisted = found
    assert in_loop == hoisted
    per_matmul = hoisted["per matmul: cheaper of weight or activations"]
    assert 0 < per_matmul < hoisted["weights gathered (ZeRO)"]
