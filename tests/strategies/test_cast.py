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
                      0x3F808000, 0x3F818000, 0x7F7F8000, 0x00000000], np.uint32)  # fmt: skip
    # subnormals (ties and the largest, which rounds up to the smallest normal)
    subnormal = np.array([0x00008000, 0x00018000, 0x807FFFFF, 0x007F8000, 0x80000001], np.uint32)
    # NaNs of both signs: quiet, signalling (0x7F800001 would round to an infinity), with a
    # payload that carries when rounded (0x7FFFFFFF, 0x7F808000) or sits in the low half only
    nans = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7F808000, 0x7F807FFF, 0x7FA00000,
                     0x7FC12345], np.uint32)  # fmt: skip
    nans = np.concatenate([nans, nans | np.uint32(0x80000000)])
    x = jnp.asarray(np.concatenate([bits, ties, edges, subnormal, nans]).view(np.float32))
    nan = np.isnan(np.asarray(x))
    assert nan.sum() > 500 and (np.signbit(np.asarray(x)) & nan).sum() > 250
    want = np.asarray(x.astype(jnp.bfloat16)).view(np.uint16)
    for got in (to_bfloat16(x), jax.jit(to_bfloat16)(x)):
        # every pattern, NaNs too: a NaN keeps its sign and becomes the quiet NaN a convert gives
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want)
    w = jnp.linspace(-1.0, 1.0, x.size, dtype=jnp.float32)
    finite = jnp.where(jnp.isfinite(x), x, 0.0)

    def loss(cast):
        return lambda v: (cast(v).astype(jnp.float32) * w).sum()

    np.testing.assert_array_equal(
        jax.grad(loss(to_bfloat16))(finite),
        jax.grad(loss(lambda v: v.astype(jnp.bfloat16)))(finite),
    )
    with pytest.raises(TypeError, match=r"got a bfloat16 array of shape \(3,\).*float32 only"):
        to_bfloat16(jnp.ones(3, jnp.bfloat16))


def test_scanned_layers_differentiate_forward_and_reverse_as_through_the_convert(monkeypatch):
    """Forward mode (``jax.jacfwd`` along two directions, one the ``jax.jvp`` below), a
    Hessian-vector product (``jax.jvp`` of ``jax.grad``) and the gradient of a scanned decoder's
    loss under a preset with ``MixedPrecision``: the in-loop cast gives what XLA's convert
    (``hoist_casts=True``) gives. As a custom_vjp the cast had no forward mode; as a
    custom_jvp, JAX's partial evaluation of the scan dropped its rule and the Hessian-vector
    product came out wrong."""
    from flax import nnx

    from examples.decoder import CONFIGS, Decoder, loss_fn
    from strategies.reads import mixed_precision

    cfg = CONFIGS["tiny"].replace(scan=True)
    words = np.random.default_rng(0).integers(0, cfg.vocab, size=(8, 9)).astype(np.int32)
    batch = {"x": words[:, :-1], "y": words[:, 1:]}

    def derivatives(model, batch):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss(p):
            return loss_fn(nnx.merge(graphdef, p, rest), batch)

        v = jax.tree.map(
            lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), params
        )
        # jax.jacfwd along v (the jvp of the loss) and a second direction; the jvp of grad
        # gives the gradient and the Hessian-vector product.
        along = jax.jacfwd(
            lambda a: loss(jax.tree.map(lambda p, d: p + a[0] * d + a[1] * d * d, params, v))
        )(jnp.zeros(2))
        grad, hvp = jax.jvp(jax.grad(loss), (params,), (v,))
        return along, hvp, grad

    casts = []
    bits = mixed_precision.to_bfloat16
    monkeypatch.setattr(mixed_precision, "to_bfloat16", lambda x: casts.append(x) or bits(x))
    found = {}
    for hoist in (False, True):
        mp = strategies.MixedPrecision(hoist_casts=hoist)
        s = strategies.MirroredStrategy(mixed_precision=mp)
        with s.scope():
            model = Decoder(cfg, rngs=nnx.Rngs(0))
        found[hoist] = jax.device_get(s.run(derivatives, args=(model, batch)))
        assert bool(casts) != hoist  # the in-loop cast read the scanned layers, the convert not
        casts.clear()
    names = ("jacfwd", "hessian-vector product", "grad")
    for name, got, want in zip(names, found[False], found[True], strict=True):
        leaves = jax.tree.leaves(want)
        assert any(np.abs(w).max() > 0 for w in leaves), name
        for a, b in zip(jax.tree.leaves(got), leaves, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9 * np.abs(b).max(), err_msg=name)


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
