"""Context parallelism: dtensor.context_attention, HybridStrategy(context=C, context_mode=...).

Equality with single-device JAX (float32) on 8 CPU devices for the function
itself, the example decoder and Flax's own attention (``nnx.MultiHeadAttention``
and ``nnx.dot_product_attention`` called by a model unchanged), gather and
ring, causal and not; the preset's layouts and errors; the TPU compiler's
program at a tiny size.
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
from dtensor.core.attention import CONTEXT_SCOPE
from examples.decoder import CONFIGS, Block, tensor_rules
from tests import signatures
from tests.test_decoder import _batches, _build, _reference, _step

B, S, H, KVH, D = 4, 32, 4, 2, 8
MESHES = {
    "context4-data2": [("data", 2), ("context", 4)],
    "data2-fsdp2-context2": [("data", 2), ("fsdp", 2), ("context", 2)],
    "fsdp2-context2-tensor2": [("fsdp", 2), ("context", 2), ("tensor", 2)],
}


def _qkv(seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, S, H, D))
    k = jax.random.normal(ks[1], (B, S, KVH, D))
    v = jax.random.normal(ks[2], (B, S, KVH, D))
    mask = jax.random.bernoulli(ks[3], 0.7, (B, 1, S, S)).at[..., 0].set(True)
    return q, k, v, mask


def _loss(q, k, v, **kw):
    return (dtensor.context_attention(q, k, v, **kw) ** 2 * jnp.arange(D)).sum()


def _jax_attention(q, k, v, causal=False, mask=None, window=None):
    """JAX's own attention with each option as an explicit mask: causal a lower triangle,
    ``window`` the band of the last ``window`` positions (``0 <= i - j < window``)."""
    i, j = jnp.arange(S)[:, None], jnp.arange(S)[None, :]
    allow = jnp.ones((S, S), bool)
    if causal:
        allow = allow & (j <= i)
    if window is not None:
        allow = allow & (i - j < window)
    full = allow if mask is None else allow & mask
    return jax.nn.dot_product_attention(q, k, v, mask=jnp.broadcast_to(full, (B, 1, S, S)))


def _jax_loss(q, k, v, **kw):
    return (_jax_attention(q, k, v, **kw) ** 2 * jnp.arange(D)).sum()


def _close(got, want, rtol, atol=0.0):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        bound = rtol * np.linalg.norm(b) + atol * np.sqrt(b.size)
        assert np.linalg.norm(a - b) <= bound, (a.shape, np.abs(a - b).max())


# --------------------------------------------------------------- dtensor.context_attention
def test_context_attention_without_a_context_axis_is_jax_s_attention():
    q, k, v, mask = _qkv()
    for causal in (True, False):
        want = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_allclose(
            dtensor.context_attention(q, k, v, causal=causal), want, rtol=1e-5, atol=1e-6
        )
    want = jax.nn.dot_product_attention(q, k, v, mask=mask)
    got = dtensor.context_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    keys = jnp.arange(S) < S - 3  # a mask of lower rank (padded keys), broadcast as JAX does
    want = jax.nn.dot_product_attention(q, k, v, mask=keys)
    got = dtensor.context_attention(q, k, v, mask=keys)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # a sliding window: the band of the last 5 positions
    got = dtensor.context_attention(q, k, v, causal=True, window=5)
    want = _jax_attention(q, k, v, causal=True, window=5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, jax.nn.dot_product_attention(q, k, v, is_causal=True))
    # implementation="auto" on CPU is XLA's attention, not a TPU kernel
    got = dtensor.context_attention(q, k, v, causal=True, implementation="auto")
    np.testing.assert_allclose(got, dtensor.context_attention(q, k, v, causal=True), rtol=0)


def test_context_attention_auto_is_splash_when_traced_for_a_tpu_topology():
    """implementation="auto" by the mesh's platform: the splash kernel in a program lowered for
    TPU chips from this CPU machine; XLA where the kernel cannot take the call (a mask)."""
    mesh = dtensor.create_mesh([("data", 8)], devices=dtensor.tpu_topology("v5e:2x4"))
    spec = jax.ShapeDtypeStruct((8, 256, 2, 128), jnp.bfloat16)

    def lowered(**kw):
        def f(q, k, v):
            return dtensor.context_attention(q, k, v, implementation="auto", **kw)

        with mesh:
            traced = jax.jit(f).trace(spec, spec, spec)
        return traced.lower(lowering_platforms=("tpu",)).as_text()

    assert "tpu_custom_call" in lowered(causal=True)
    assert "tpu_custom_call" not in lowered(causal=True, mask=jnp.ones((256, 256), bool))


@pytest.mark.parametrize("mode", ["gather", "ring", "ulysses"])
@pytest.mark.parametrize(
    "kw",
    [
        {"causal": True},
        {},
        {"mask": True},
        {"causal": True, "mask": True},
        {"causal": True, "window": 5},
    ],
    ids=["causal", "full", "mask", "causal-mask", "causal-window"],
)
@pytest.mark.parametrize("dims", list(MESHES.values()), ids=list(MESHES))
def test_context_attention_under_a_context_axis_matches_one_device(dims, kw, mode):
    """Against JAX's own attention with each option an explicit mask (the window a band)."""
    q, k, v, mask = _qkv()
    kw = {**kw, "mask": mask} if kw.get("mask") else kw
    want = _jax_attention(q, k, v, **kw)
    want_grads = jax.grad(_jax_loss, argnums=(0, 1, 2))(q, k, v, **kw)

    def attend_and_grads(q, k, v):  # the attention and its loss's gradients: one compile
        out = dtensor.context_attention(q, k, v, mode=mode, **kw)
        return out, jax.grad(lambda q, k, v: _loss(q, k, v, mode=mode, **kw), (0, 1, 2))(q, k, v)

    with dtensor.create_mesh(dims):
        compiled = jax.jit(attend_and_grads).lower(q, k, v).compile()
        got, grads = compiled(q, k, v)
    _close(got, want, 1e-5)
    _close(grads, want_grads, 1e-5)
    # The exchange over ``context`` is the mode's: K/V all-gathers, a ring of permutes, or
    # all-to-alls (q, k, v there, the output back; KV heads repeated where fewer than the
    # axis: KVH=2 over context 4, or 1 a device under tensor 2 over context 2) in the
    # forward pass (the backward pass's ops are JAX's ``transpose(...)``), and the other
    # modes' nowhere.
    text = compiled.as_text()
    exchange = [line for line in text.splitlines() if dtensor.core.attention.CONTEXT_SCOPE in line]
    forward = [line for line in exchange if "transpose(" not in line]
    kinds = {"gather": "all-gather", "ring": "collective-permute", "ulysses": "all-to-all"}
    assert any(kinds[mode] in line for line in forward)
    for other in set(kinds) - {mode}:
        assert not any(f"{kinds[other]}(" in line for line in exchange), other
    if mode == "ulysses":
        assert sum(" all-to-all(" in line for line in forward) == 4


@pytest.mark.parametrize(
    "kw",
    [{"causal": True}, {"mask": True}, {"causal": True, "window": 5}],
    ids=["causal", "mask", "causal-window"],
)
@pytest.mark.parametrize(
    "dims",
    [[("context", 8)], [("context", 4), ("tensor", 2)]],
    ids=["context8", "context4-tensor2"],
)
def test_usp_is_ulysses_within_groups_and_a_ring_across_them(dims, kw):
    """USP over a context axis the heads do not divide: 4 heads over context 8 (groups of 4,
    a ring of 2), 2 heads a device under tensor=2 over context 4 (groups of 2, a ring of 2),
    the 2 KV heads (1 a device under tensor) repeated. Against JAX's attention, forward and
    gradients; the exchange is collective permutes under the attention's scope (the group's
    all-to-all as permutes, then the ring), no gather."""
    from dtensor.core.attention_xla import usp_factors

    assert usp_factors(8, 4) == (4, 2) and usp_factors(4, 2) == (2, 2)
    assert usp_factors(4, 4) == (4, 1) and usp_factors(4, 3) == (1, 4)  # Ulysses; the ring
    q, k, v, mask = _qkv()
    kw = {**kw, "mask": mask} if kw.get("mask") else kw
    want = _jax_attention(q, k, v, **kw)
    want_grads = jax.grad(_jax_loss, argnums=(0, 1, 2))(q, k, v, **kw)

    def attend_and_grads(q, k, v):
        out = dtensor.context_attention(q, k, v, mode="usp", **kw)
        return out, jax.grad(lambda q, k, v: _loss(q, k, v, mode="usp", **kw), (0, 1, 2))(q, k, v)

    with dtensor.create_mesh(dims):
        compiled = jax.jit(attend_and_grads).lower(q, k, v).compile()
        got, grads = compiled(q, k, v)
    _close(got, want, 1e-5)
    _close(grads, want_grads, 1e-5)
    exchange = [ln for ln in compiled.as_text().splitlines() if CONTEXT_SCOPE in ln]
    forward = [ln for ln in exchange if "transpose(" not in ln]
    # q, k, v into the group and the output back: (U - 1) permutes each; the ring: R - 1
    # steps of K and V
    u, r = (4, 2) if dims == [("context", 8)] else (2, 2)
    permutes = sum("collective-permute(" in ln for ln in forward)
    assert permutes >= 4 * (u - 1) + 2 * (r - 1), permutes
    assert not any("all-gather(" in ln for ln in exchange)


def test_load_balanced_ring_gives_every_device_half_a_block_each_step():
    """Causal ring attention re-lays the sequence so device i holds chunks i and 2C-1-i: four
    extra permutes (q, k, v there, the output back, two halves each) and a three-way switch
    per step whose branches each compute half a block."""
    q, k, v, _ = _qkv()
    with dtensor.create_mesh([("data", 2), ("context", 4)]):
        jaxpr = jax.make_jaxpr(
            lambda q, k, v: dtensor.context_attention(q, k, v, causal=True, mode="ring")
        )(q, k, v)
    text = str(jaxpr)
    # 3 ring steps x (k, v) + 2 halves x (q, k, v, out)
    assert text.count("ppermute") == 3 * 2 + 2 * 4
    # One rematerialised step a device of the ring, its body a three-way switch.
    assert text.count("remat2[") == 4 and "cond[" in text and "branches=(" in text
    # Without causal masking there is nothing to balance: the contiguous layout, whole blocks.
    with dtensor.create_mesh([("data", 2), ("context", 4)]):
        plain = str(
            jax.make_jaxpr(lambda q, k, v: dtensor.context_attention(q, k, v, mode="ring"))(q, k, v)
        )
    assert plain.count("ppermute") == 3 * 2 and plain.count("remat2[") == 4
    assert "cond[" not in plain


def test_context_attention_errors_name_the_shapes_the_mesh_and_the_fix():
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match=r"key/value heads \(3\) must divide the heads \(4\)"):
        dtensor.context_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
    with dtensor.create_mesh([("data", 2), ("context", 4)]):
        with pytest.raises(ValueError, match=r"does not divide into 8 chunks.*context=4.*multiple"):
            dtensor.context_attention(q[:, :12], k[:, :12], v[:, :12], causal=True, mode="ring")
    with pytest.raises(ValueError, match="valid modes are"):
        dtensor.context_attention(q, k, v, mode="striped")
    # Ulysses gives each device whole heads: 4 heads, 2 a device under tensor=2, over context 4
    with dtensor.create_mesh([("context", 4), ("tensor", 2)]):
        with pytest.raises(
            ValueError,
            match=r"mode='ulysses'\): the 2 query heads a device holds \(of 4, split over "
            r"'tensor'\) do not divide over the mesh axis 'context' of size 4 .*mode='gather'",
        ):
            dtensor.context_attention(q, k, v, causal=True, mode="ulysses")


# --------------------------------------------------------------------- HybridStrategy(context=)
def test_hybrid_context_lays_the_sequence_over_context_and_weights_over_fsdp_and_context():
    s = strategies.HybridStrategy(2, 2, 1, context=2, min_shard_bytes=0)
    assert s.mesh.dim_names == ("data", "fsdp", "context", "tensor")
    assert s.batch_layout(2).sharding_specs == (("data", "fsdp"), "context")
    assert s.batch_layout(1).sharding_specs == (("data", "fsdp"),)
    assert s.variable_layout("mlp/up/kernel", jnp.zeros((64, 256))).sharding_specs == (
        "unsharded",
        ("fsdp", "context"),
    )
    assert not s.gather_at_read and s.num_replicas_in_sync == 4
    with pytest.raises(ValueError, match="context_mode='striped'.*valid modes"):
        strategies.HybridStrategy(context=2, context_mode="striped")
    with pytest.raises(ValueError, match="gather_at_read=True.*context=1"):
        strategies.HybridStrategy(context=2, gather_at_read=True)
    with pytest.raises(ValueError, match="context=0.*positive integer"):
        strategies.HybridStrategy(context=0)


@pytest.mark.parametrize("mode", ["gather", "ring", "ulysses"])
@pytest.mark.parametrize(
    ("kw", "scan"),
    [
        ({"data": 2, "context": 4}, False),
        ({"data": 1, "fsdp": 2, "tensor": 2, "context": 2}, True),
    ],
    ids=["context4-data2", "fsdp2-tensor2-context2-scan-remat"],
)
def test_decoder_trains_under_hybrid_context_as_on_one_device(kw, scan, mode):
    """Three Adam steps (``eps=1e-3``: tests/test_compose.py says why; at 1e-6 Adam divides
    each element by its own scale and hides a gradient's) equal to one device's, and the
    mode's exchange in the compiled step (tests/signatures.py): K/V all-gathers over
    ``context``, or a ring of permutes and no K/V gather."""
    cfg = CONFIGS["tiny"].replace(scan=scan)
    batches = _batches(cfg)
    model, opt = _build(cfg, eps=1e-3)
    step = nnx.jit(_step)
    want = [float(step(model, opt, b)) for b in batches]
    want_params = nnx.state(model, nnx.Param)
    # The decoder's Megatron rules: its names match none of the preset's own, so without them
    # a tensor axis would split no variable (replicated, the same numbers).
    rules = tensor_rules(cfg) if kw.get("tensor", 1) > 1 else None
    s = strategies.HybridStrategy(
        **kw, context_mode=mode, min_shard_bytes=0, remat=(Block,) if scan else None, rules=rules
    )
    with s.scope():
        model, opt = _build(cfg, eps=1e-3)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params, 2e-5)
    report = s.explain(_step, args=(model, opt, batches[0]))
    assert report.context_bytes_per_device > 0
    assert report.context_bytes_per_device < report.comm_bytes_per_device
    rows = 8 // (kw["data"] * kw.get("fsdp", 1))  # the batch of 8 over the batch axes
    kv = (rows, 16, cfg.kv_heads // kw.get("tensor", 1), cfg.head_dim)  # heads over tensor
    if mode == "gather":
        signatures.assert_context_gather(report.collectives, kv=kv, layers=cfg.layers)
    elif mode == "ring":
        signatures.assert_context_ring(
            report.collectives, kv=kv, layers=cfg.layers, context=kw["context"]
        )
    else:  # 4 heads (2 KV heads, repeated) over context 4, or 2 over context 2 under tensor
        signatures.assert_context_ulysses(report.collectives, layers=cfg.layers)
    if rules:  # the activations' all-reduces over tensor, the sequence split over context
        # (at these sizes XLA:CPU's plan all-gathers the MLP's and q/k/v's tensor-split weights
        # for the forward pass rather than their activations: attention out's all-reduce is
        # the forward's one a layer)
        seq = 16 // kw["context"]
        signatures.assert_tensor(
            report.collectives, rows=rows, seq=seq, d_model=64, layers=2, per_layer=1
        )


def test_decoder_trains_by_usp_over_context_8_as_on_one_device():
    """The tiny decoder's 4 heads over context 8: USP groups of 4 (Ulysses, the 2 KV heads
    repeated) and a ring of 2 across them; three Adam steps equal to one device's."""
    cfg = CONFIGS["tiny"]
    batches = _batches(cfg)
    model, opt = _build(cfg, eps=1e-3)
    step = nnx.jit(_step)
    want = [float(step(model, opt, b)) for b in batches]
    want_params = nnx.state(model, nnx.Param)
    s = strategies.HybridStrategy(1, 1, 1, context=8, context_mode="usp", min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg, eps=1e-3)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params, 2e-5)
    report = s.explain(_step, args=(model, opt, batches[0]))
    scoped = [c for c in report.collectives if CONTEXT_SCOPE in c.op_name]
    assert scoped and {c.kind for c in scoped} == {"collective-permute"}
    assert report.context_bytes_per_device > 0


class _Attend(nnx.Module):
    """A model written for one device: Flax's multi-head attention, or its function."""

    def __init__(self, rngs, causal, direct):
        self.embed = nnx.Embed(64, 32, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
        self.qkv = nnx.Linear(32, 3 * 32, rngs=rngs)
        self.head = nnx.Linear(32, 64, rngs=rngs)
        self.causal, self.direct = causal, direct

    def __call__(self, x):
        h = self.embed(x)
        if self.direct:  # nnx.dot_product_attention called by the model itself
            q, k, v = jnp.split(self.qkv(h).reshape(*h.shape[:2], 4, 24), 3, axis=-1)
            a = nnx.dot_product_attention(q, k, v, is_causal=self.causal)
            h = h + a.reshape(*h.shape[:2], 4 * 8) @ jnp.ones((32, 32)) / 32
        else:
            mask = nnx.make_causal_mask(x) if self.causal else None
            h = h + self.attn(h, mask=mask)
        return self.head(h)


def _attend_step(model, opt, batch):
    def loss_fn(m, b):
        return optax.softmax_cross_entropy_with_integer_labels(m(b["x"]), b["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    opt.update(model, grads)
    return loss


@pytest.mark.parametrize("mode", ["gather", "ring", "ulysses"])
@pytest.mark.parametrize(
    ("causal", "direct"),
    [(True, False), (False, False), (True, True)],
    ids=["mha-causal-mask", "mha-full", "dot_product_attention-is_causal"],
)
def test_flax_attention_trains_under_hybrid_context_unchanged(causal, direct, mode):
    def build():  # Adam's eps at 1e-3: tests/test_compose.py says why
        m = _Attend(nnx.Rngs(0), causal, direct)
        return m, nnx.Optimizer(m, optax.adam(1e-2, eps=1e-3), wrt=nnx.Param)

    x = np.random.default_rng(1).integers(0, 64, size=(3, 8, 16)).astype(np.int32)
    batches = [{"x": x[i], "y": (x[i] * 7 + 1) % 64} for i in range(3)]
    model, opt = build()
    step = nnx.jit(_attend_step)
    want = [float(step(model, opt, b)) for b in batches]
    want_params = nnx.state(model, nnx.Param)
    s = strategies.HybridStrategy(2, context=4, context_mode=mode, min_shard_bytes=0)
    with s.scope():
        model, opt = build()
    got = [float(s.run(_attend_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # atol: the key bias's gradient is 0 in exact arithmetic (it adds the same score to every
    # key of a query), so that parameter is float32 rounding (~1e-6) on both sides.
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params, 2e-5, atol=1e-6)
    # Flax's attention went through dtensor.context_attention (its exchange, the mode's, is in
    # the program), and Flax's function is itself again outside the step.
    report = s.explain(_attend_step, args=(model, opt, batches[0]))
    assert report.context_bytes_per_device > 0
    kv = (8 // 2, 16, 4, 8)  # the sequence's K (or V) over the data shards: 4 heads of 8
    if mode == "gather":
        signatures.assert_context_gather(report.collectives, kv=kv, layers=1)
    elif mode == "ring":
        signatures.assert_context_ring(report.collectives, kv=kv, layers=1, context=4)
    else:
        signatures.assert_context_ulysses(report.collectives, layers=1)
    assert nnx.dot_product_attention.__module__ == "flax.nnx.nn.attention"


@pytest.mark.parametrize("mode", ["gather", "ring", "ulysses"])
def test_decoder_under_context_compiles_for_tpu(mode):
    """data=2 x context=4 on v5e:2x4 (libtpu): each mode's exchange in the TPU program
    (tests/signatures.py), figures a program of the other mode cannot meet, and the
    arguments split over ``context``."""
    devices = dtensor.tpu_topology("v5e:2x4")
    cfg = CONFIGS["tiny"].replace(scan=True)
    s = strategies.HybridStrategy(
        2,
        1,
        1,
        context=4,
        context_mode=mode,
        devices=devices,
        min_shard_bytes=0,
        remat=(Block,),
        mixed_precision=strategies.MixedPrecision(),
    )
    model, opt = nnx.eval_shape(lambda: _build(cfg))
    batch = {
        "x": jax.ShapeDtypeStruct((8, 256), jnp.int32),
        "y": jax.ShapeDtypeStruct((8, 256), jnp.int32),
    }
    report = s.explain(_step, args=(model, opt, batch))
    per_layer = 8 // 2 * 256 * cfg.kv_heads * cfg.head_dim * 2  # one K (or V), bf16, a device
    kv = (8 // 2, 256, cfg.kv_heads, cfg.head_dim)  # K (or V) of the whole sequence, a device
    scoped = [c for c in report.collectives if CONTEXT_SCOPE in c.op_name]
    permuted = sum(c.total_bytes_per_device for c in scoped if c.kind == "collective-permute")
    gathered = sum(c.total_bytes_per_device for c in scoped if c.kind == "all-gather")
    if mode == "gather":
        signatures.assert_context_gather(report.collectives, kv=kv, layers=cfg.layers)
        # K and V all-gathered in each layer's forward (and again under remat), gradients
        # reduce-scattered back: at least 2 x (C-1)/C of K and V a layer, per device.
        assert gathered >= cfg.layers * 2 * 2 * per_layer * 3 / 4 and permuted == 0
        # libtpu lowers the gradients' reduce-scatter to an all-reduce of the gathered K/V
        # over context, without the name scope: counted as context traffic all the same.
        shapes = {
            (c.shape, c.dtype)
            for c in report.collectives
            if c.kind == "all-gather" and CONTEXT_SCOPE in c.op_name
        }
        back = [
            c
            for c in report.collectives
            if c.kind == "all-reduce"
            and c.mesh_axes == ("context",)
            and (c.shape, c.dtype) in shapes
        ]
        assert len(back) >= 2  # K and V
        assert report.context_bytes_per_device == pytest.approx(
            sum(c.total_bytes_per_device for c in scoped)
            + sum(c.total_bytes_per_device for c in back)
        )
    elif mode == "ulysses":
        # q, k, v to a head split and the output back, forward (again under remat) and
        # backward: all-to-alls over context, of which the other modes have none; 4 heads
        # over context 4, the 2 KV heads repeated twice; the splash kernel on each device's
        # whole sequence (256 rows: the gather's 64 a device are too few for its blocks).
        signatures.assert_context_ulysses(report.collectives, layers=cfg.layers)
        exchanged = sum(c.total_bytes_per_device for c in scoped if c.kind == "all-to-all")
        q_bytes = 8 // 2 * 256 // 4 * cfg.heads * cfg.head_dim * 2  # a device's rows, bf16
        assert exchanged >= cfg.layers * 3 * 4 * q_bytes * 3 / 4 and gathered == permuted == 0
        assert report.context_bytes_per_device == pytest.approx(exchanged)
        assert "tpu_custom_call" in report.compiled.as_text()
    else:
        signatures.assert_context_ring(report.collectives, kv=kv, layers=cfg.layers, context=4)
        # The ring moves each device's K and V chunks C-1 times a layer in the forward pass,
        # again in its recomputation (remat) and in the backward pass: permutes over context,
        # of which a gather program has none; and it gathers no K/V.
        assert permuted >= 3 * cfg.layers * 2 * 3 * per_layer / 4 and gathered == 0
        assert report.context_bytes_per_device == pytest.approx(permuted)
    # Every variable FSDP-split over context: a quarter of each a chip, as the compiled
    # arguments' shards say.
    signatures.assert_splits(
        report, {"context": 4}, lambda path: True, batch_bytes=2 * 8 // 2 * 256 * 4 // 4
    )
    assert report.peak_bytes_per_device is not None


@pytest.mark.parametrize("kernel", ["splash", "cudnn"])
def test_decoder_s_attention_kernels_compile_for_their_platform(kernel):
    """attention='splash' (Pallas, TPU) and 'cudnn' (cuDNN's fused attention, NVIDIA GPUs):
    the compiled program calls the kernel (and XLA's does not). On GPU the kernel keeps no
    [seq, seq] scores where XLA:GPU keeps a layer's float32 scores (a sequence of 1024);
    libtpu's XLA fuses the einsums' softmax, so on TPU the call is what is checked, on a
    sequence of two of the kernel's 128-token blocks (libtpu compiles XLA's attention at 1024
    tokens in three times the time)."""
    devices = (
        dtensor.tpu_topology("v5e:2x4") if kernel == "splash" else dtensor.gpu_topology("h100:1x8")
    )
    seq = 256 if kernel == "splash" else 1024
    batch = {
        "x": jax.ShapeDtypeStruct((8, seq), jnp.int32),
        "y": jax.ShapeDtypeStruct((8, seq), jnp.int32),
    }
    temps = {}
    for attention in ("auto", "xla"):  # "auto": the topology's kernel, not the CPU backend's
        cfg = CONFIGS["tiny"].replace(scan=True, attention=attention, head_dim=128)
        s = strategies.FullyShardedStrategy(
            devices, min_shard_bytes=0, remat=(Block,), mixed_precision=strategies.MixedPrecision()
        )
        model, opt = nnx.eval_shape(lambda cfg=cfg: _build(cfg))
        report = s.explain(_step, args=(model, opt, batch))
        temps[attention] = report.temp_bytes_per_device
        text = report.compiled.as_text()
        marker = "tpu_custom_call" if kernel == "splash" else "__cudnn$fmha"
        assert (marker in text) == (attention == "auto")
        if attention == "auto" and kernel == "splash":  # by dtensor.context_attention
            assert "splash_mqa_dq" in text and "splash_mqa_dkv" in text  # a dq kernel of its own
    if kernel == "cudnn":  # a layer's float32 scores (a sequence, 4 heads, 1024 x 1024): 16 MiB
        assert temps["xla"] - temps["auto"] > 8 << 20


def test_auto_attention_is_the_platform_s_kernel_where_it_takes_the_call():
    """DecoderConfig(attention='auto') (the default) by the platform of the mesh the step is
    traced under, not the CPU backend an ahead-of-time compile runs on."""
    from examples.decoder import attention_kind

    assert {cfg.attention for cfg in CONFIGS.values()} == {"auto"}
    tpu = dtensor.create_mesh([("fsdp", 8)], devices=dtensor.tpu_topology("v5e:2x4"))
    gpu = dtensor.create_mesh([("fsdp", 8)], devices=dtensor.gpu_topology("h100:1x8"))
    cpu = dtensor.create_mesh([("fsdp", 8)])
    llama, gemma3 = CONFIGS["tiny"].replace(head_dim=128), CONFIGS["tiny-gemma3"]
    bf16, f32 = jnp.bfloat16, jnp.float32

    def kind(mesh, cfg=llama, dtype=bf16, seq=1024, window=None):
        with mesh:
            return attention_kind(cfg, dtype, seq, window)

    assert kind(tpu) == kind(tpu, dtype=f32) == "splash"
    assert kind(gpu) == "cudnn" and kind(gpu, dtype=jnp.float16) == "cudnn"
    assert kind(cpu) == kind(cpu, dtype=f32) == "xla"
    assert kind(gpu, dtype=f32) == "xla"  # cuDNN's fused attention takes bf16/fp16 only
    assert kind(tpu, seq=1000) == "xla"  # not whole blocks of 128 for the kernel
    assert kind(tpu, cfg=gemma3) == kind(gpu, cfg=gemma3) == "xla"  # traced windows
    assert kind(tpu, window=jnp.int32(64)) == "xla"
    assert kind(tpu, cfg=llama.replace(attention="xla")) == "xla"  # an explicit choice stays
    assert kind(cpu, cfg=llama.replace(attention="splash")) == "splash"
    context = dtensor.create_mesh(
        [("fsdp", 2), ("context", 4)], devices=dtensor.tpu_topology("v5e:2x4")
    )
    assert kind(context) == "splash"  # gather mode: the kernel on the gathered keys
    with dtensor.core.attention.context_mode("ring"):
        assert kind(context) == "xla"
    assert kind(context, seq=256) == "xla"  # 64 queries a device
    gpu_context = dtensor.create_mesh(
        [("fsdp", 2), ("context", 4)], devices=dtensor.gpu_topology("h100:1x8")
    )
    assert kind(gpu_context) == "xla"  # no per-shard cuDNN path under a context axis
    seen = []  # inside jax.jit under jax.set_mesh only the abstract mesh is seen: its platform

    def f(x):
        seen.append(dtensor.core.attention.trace_platform())
        return x

    with jax.set_mesh(tpu.jax_mesh):
        jax.jit(f).trace(jax.ShapeDtypeStruct((8,), jnp.float32))
    assert seen == ["tpu"]


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_chunked_cross_entropy_is_the_loss_and_gradients_of_whole_logits(size):
    """DecoderConfig(loss_chunks=4): the loss over four vocabulary slices, the float32 logits
    of one at a time, equals the whole logits' loss and gradients (float32)."""
    from examples.decoder import Decoder, loss_fn

    cfg = CONFIGS[size]
    batch = _batches(cfg)[0]
    value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn))  # one compile each, not op by op
    want, want_grads = value_and_grad(Decoder(cfg, rngs=nnx.Rngs(0)), batch)
    chunked = Decoder(cfg.replace(loss_chunks=4), rngs=nnx.Rngs(0))
    got, grads = value_and_grad(chunked, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    _close(grads, want_grads, 1e-5)
    with pytest.raises(ValueError, match=r"vocabulary \(128\) does not divide into 3"):
        nnx.eval_shape(loss_fn, Decoder(cfg.replace(loss_chunks=3), rngs=nnx.Rngs(0)), batch)


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_loss_tiled_by_tokens_is_the_loss_and_gradients_of_whole_logits(size):
    """DecoderConfig(loss_chunks=4, loss_tiling="tokens"): the tokens in four slices, each
    slice's gradients taken in the forward pass, give the whole logits' loss and gradients
    (float32); under a loss scaled by 3 the gradients scale too (the cotangent is applied)."""
    from examples.decoder import Decoder, loss_fn

    cfg = CONFIGS[size]
    batch = _batches(cfg)[0]
    value_and_grad = nnx.jit(nnx.value_and_grad(loss_fn))  # one compile each, not op by op
    want, want_grads = value_and_grad(Decoder(cfg, rngs=nnx.Rngs(0)), batch)
    tiled = Decoder(cfg.replace(loss_chunks=4, loss_tiling="tokens"), rngs=nnx.Rngs(0))
    got, grads = value_and_grad(tiled, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    _close(grads, want_grads, 1e-5)
    tripled = nnx.jit(nnx.grad(lambda m, b: 3.0 * loss_fn(m, b)))(tiled, batch)
    _close(tripled, jax.tree.map(lambda g: 3.0 * g, want_grads), 1e-5)
    seq = batch["x"].shape[-1]
    bad = Decoder(cfg.replace(loss_chunks=5, loss_tiling="tokens"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=rf"sequence \({seq} tokens\) does not divide into 5"):
        nnx.eval_shape(loss_fn, bad, batch)


def test_loss_tiled_by_tokens_trains_like_one_device_under_hybrid_context():
    """The token slices under HybridStrategy(fsdp=2, context=4) on 8 devices (the sequence
    split over ``context``, a slice every fourth token): three Adam steps (eps=1e-3) equal
    one device's with the whole logits."""
    cfg = CONFIGS["tiny"]
    batches = _batches(cfg)
    want, want_params = _reference(cfg, batches, eps=1e-3)
    s = strategies.HybridStrategy(fsdp=2, context=4, min_shard_bytes=0)
    with s.scope():
        model, opt = _build(cfg.replace(loss_chunks=4, loss_tiling="tokens"), eps=1e-3)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(jax.device_get(nnx.state(model, nnx.Param)), want_params, 2e-5)


def test_floor_counts_cudnn_attention_flops_causal_halved():
    """cuDNN's fused attention (jax.nn.dot_product_attention(implementation='cudnn')) in the
    floor: two matmuls forward, five backward (p recomputed), halved for a causal mask."""
    from dtensor.analysis.floor import matmul_flops

    q = jnp.zeros((2, 256, 8, 128), jnp.bfloat16)
    k = jnp.zeros((2, 256, 2, 128), jnp.bfloat16)
    one = 2 * 2 * 256 * 256 * 8 * 128  # one [q, k] matmul over every head
    for causal, share in ((True, 0.5), (False, 1.0)):

        def loss(q, k, v, causal=causal):
            out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
            return out.astype(jnp.float32).sum()

        assert matmul_flops(jax.make_jaxpr(loss)(q, k, k)) == 2 * one * share
        assert matmul_flops(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k)) == 7 * one * share


def test_long_context_benchmark_table_is_the_guide_s():
    """The large-models guide's long-context table is ``benchmarks.long_context --markdown`` of
    the results file, and the results hold what the guide says of them."""
    import json
    from pathlib import Path

    from benchmarks import long_context

    root = Path(__file__).resolve().parents[1]
    rows = json.loads((root / "benchmarks" / "results" / "long_context.json").read_text())["rows"]
    guide = " ".join((root / "docs" / "guides" / "large_models.md").read_text().split())
    assert " ".join(long_context.markdown(rows).split()) in guide
    whole, tiled, by_tokens, longest, a100, h100, ulysses, ulysses_16, gather_16 = rows
    assert whole["maxtext_peak_gib"] == tiled["maxtext_peak_gib"] == 37.97
    assert tiled["peak_gib"] < tiled["maxtext_peak_gib"] < whole["peak_gib"]
    assert f"needs {tiled['peak_gib']:.2f} GiB per chip with the vocabulary in 8 slices" in guide
    assert f"it is {whole['peak_gib']:.2f} GiB, {whole['ratio_to_maxtext']:.2f}x" in guide
    assert f"{tiled['ratio_to_maxtext']:.2f}x" in guide
    assert longest["seq_len"] == 131072 and f"the same {longest['peak_gib']:.2f} GiB" in guide
    assert a100["fits"] and h100["fits"]
    # MaxText's own compile of the 32768-token row (benchmarks.maxtext_side, row 8).
    side = json.loads((root / "benchmarks" / "results" / "maxtext_side.json").read_text())
    (mt,) = [r for r in side["rows"] if r["topology"] == "v5p:4x4x2 context 32768"]
    assert round(mt["peak_bytes_per_chip"] / (1 << 30), 2) == tiled["maxtext_peak_gib"]
    assert f"gives {mt['step_time_floor_seconds'] * 1e3:.0f} ms" in guide
    assert f"ours with the vocabulary in 8 slices is {tiled['floor_ms']:.0f} ms" in guide
    # the tokens in slices: the whole logits' floor (nothing recomputed) at the slices' peak
    assert by_tokens["floor_ms"] < tiled["floor_ms"] and by_tokens["peak_gib"] < whole["peak_gib"]
    assert by_tokens["floor_ms"] <= mt["step_time_floor_seconds"] * 1e3
    assert (
        f"the tokens in 8 slices (`--loss-tiling tokens`) need {by_tokens['peak_gib']:.2f} GiB "
        f"at {by_tokens['floor_ms']:.1f} ms" in guide
    )
    assert f"{tiled['floor_ms'] / (mt['step_time_floor_seconds'] * 1e3):.3f}x it" in guide
    assert f"needs {a100['peak_gib']:.2f} GiB per A100 80GB and {h100['peak_gib']:.2f} GiB" in guide
    # Ulysses: at or under the gather on peak and floor, with less over context, at context 8
    # and at 16, past the 8 KV heads (repeated)
    for uly, gather in ((ulysses, tiled), (ulysses_16, gather_16)):
        assert "--context-mode ulysses" in uly["command"] and "ulysses" not in gather["command"]
        assert uly["peak_gib"] < gather["peak_gib"] and uly["floor_ms"] <= gather["floor_ms"]
        assert uly["context_gib"] < gather["context_gib"] and uly["fits"]
    assert ulysses_16["seq_len"] == 131072 and "context=16" in ulysses_16["mesh"]
    assert (
        f"{ulysses['peak_gib']:.2f} GiB a chip against the gather's {tiled['peak_gib']:.2f}"
        in guide
    )
    assert f"Ulysses needs {ulysses_16['peak_gib']:.2f} GiB a chip" in guide
    assert (
        f"the gather, {gather_16['peak_gib']:.2f} GiB and {gather_16['context_gib']:.2f} GiB"
        in guide
    )


def test_train_py_context_flags_build_the_preset_and_the_model_options():
    from examples import options

    args = options.parse_args(
        ["--strategy", "hybrid", "--model-size", "tiny", "--context", "4", "--context-mode", "ring"]
        + ["--attention", "splash", "--loss-chunks", "4"]
    )
    strategy, changes, applied = options.build_strategy(args, jax.devices(), block_cls=Block)
    assert strategy.mesh.shape == {"data": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert strategy.context_mode == "ring" and applied["context"] == "strategy"
    assert changes["attention"] == "splash" and changes["loss_chunks"] == 4
    args = options.parse_args(["--strategy", "fully_sharded", "--context", "4"])
    assert options.build_strategy(args, jax.devices())[2]["context"] == "not available"
    with pytest.raises(ValueError, match="--expert x --context 16 does not divide the 8"):
        args = options.parse_args(["--strategy", "hybrid", "--context", "8", "--expert", "2"])
        options.build_strategy(args, jax.devices())
