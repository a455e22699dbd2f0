"""Per-tensor memory plans (``remat_policy=``): keep, offload or recompute each activation.

Each plan trains as on one device (SGD, every tensor compared); the compiled TPU program
(libtpu, ahead of time) moves to host memory exactly the tensors the plan offloads, and
nothing else; Flax's own attention is planned by module class without changing its code.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor.analysis.host_link import host_transfers
from examples.decoder import CONFIGS, Block, Decoder, loss_fn
from strategies.reads.remat_plan import RematPolicy, parse

CFG = CONFIGS["tiny"].replace(layers=2)


def _step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _build(cfg):
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def _batches(n=2, rows=8, seq=16):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        w = rng.integers(0, CFG.vocab, size=(rows, seq + 1)).astype(np.int32)
        out.append({"x": w[:, :-1], "y": w[:, 1:]})
    return out


def _close(model, want_params, tol=1e-5):
    """Every parameter within ``tol`` of the reference (relative to its norm; 1e-7 absolute
    for the near-zero ones, such as Flax attention's biases after two steps)."""
    have = jax.device_get(nnx.state(model, nnx.Param))
    for a, b in zip(jax.tree.leaves(have), jax.tree.leaves(want_params), strict=True):
        assert np.linalg.norm(np.asarray(a) - b) <= tol * np.linalg.norm(b) + 1e-7


@pytest.mark.parametrize(
    "policy",
    [
        "qkv_proj_offloaded",
        "minimal_offloaded",
        "save_dot_except_mlp",
        "decoder_layer_input=offload,query_proj=device,mlpwo=remat",
    ],
)
@pytest.mark.parametrize("scan", [False, True])
def test_every_plan_trains_the_decoder_as_on_one_device(policy, scan):
    cfg = CFG.replace(scan=scan)
    batches = _batches()
    model, opt = _build(cfg)
    step = nnx.jit(_step)
    want = [float(step(model, opt, b)) for b in batches]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    # XLA's plan (the TPU default) for the scanned stack, gathers at reads for the list
    s = strategies.HybridStrategy(
        data=2, fsdp=4, min_shard_bytes=0, gather_at_read=not scan, remat=(Block,),
        remat_policy=policy,
    )  # fmt: skip
    with s.scope():
        model, opt = _build(cfg)
    got = [float(s.run(_step, args=(model, opt, b))) for b in batches]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(model, want_params, tol=3e-5 if scan else 1e-5)


def _tpu_program(policy, *, scan, cfg=CFG):
    devices = dtensor.tpu_topology("v5e:2x4")
    s = strategies.HybridStrategy(
        1, 8, 1, min_shard_bytes=0, devices=devices, remat=(Block,), remat_policy=policy
    )
    model, opt = nnx.eval_shape(lambda: _build(cfg.replace(scan=scan)))
    batch = {k: jax.ShapeDtypeStruct((16, 128), jnp.int32) for k in ("x", "y")}
    return s.explain(_step, args=(model, opt, batch))


# One chip's share of each named tensor (16 rows over 8 chips, 128 tokens, f32): the
# tiny decoder has 4 query heads, 2 KV heads of 16, d_model 64 and ffw 128.
SHAPES = {
    "query_proj": (2, 128, 4, 16),
    "key_proj": (2, 128, 2, 16),
    "value_proj": (2, 128, 2, 16),
    "decoder_layer_input": (2, 128, 64),
}


def _moved(traffic, direction):
    """The shapes moved ``direction``, once per time each runs, without size-1 dimensions
    (one layer's slice of the stacked buffer of a scanned stack is ``[1, ...]``)."""
    shapes = []
    for t in traffic.transfers:
        if t.direction == direction:
            shapes += [tuple(d for d in t.shape if d != 1)] * t.count
    return sorted(shapes)


@pytest.mark.parametrize("scan", [False, True])
def test_the_tpu_program_offloads_exactly_the_tensors_the_plan_names(scan):
    assert (CFG.heads, CFG.kv_heads, CFG.head_dim, CFG.d_model) == (4, 2, 16, 64)
    layers = CFG.layers
    for policy, names in [
        (None, ()),
        ("save_qkv_proj", ()),
        ("qkv_proj_offloaded", ("query_proj", "key_proj", "value_proj")),
        ("decoder_layer_input=offload", ("decoder_layer_input",)),
    ]:
        report = _tpu_program(policy, scan=scan)
        moved = host_transfers(report.compiled.as_text())
        want = sorted(SHAPES[n] for n in names for _ in range(layers))
        got, back = _moved(moved, "to host"), _moved(moved, "from host")
        each = sum(4 * np.prod(SHAPES[n]) for n in names) * layers
        if jax.__version__ == "0.10.2":  # the pinned libtpu (0.0.42): each once a layer, each way
            assert got == back == want, (policy, scan, got, back)
            assert moved.to_host_bytes == moved.from_host_bytes == each, policy
        # any libtpu: exactly the named tensors move, each at least once a layer (0.0.50 also
        # sends the last scanned layer's through a copy beside the stacked host buffer)
        assert set(got) == set(back) == set(want), (policy, scan, got, back)
        assert all(got.count(x) >= want.count(x) for x in set(want)), (policy, scan, got)
        assert min(moved.to_host_bytes, moved.from_host_bytes) >= each, policy


def test_offloaded_tensors_live_in_host_memory_and_the_floor_counts_the_host_link():
    """32 scanned layers, each offloading its four attention projections: the compiler's
    host temporaries are exactly those tensors, and the floor's host-link term is their
    bytes over the chip's link (a floor the tiny model's compute never reaches)."""
    cfg = CFG.replace(layers=32, scan=True)
    names = ("query_proj", "key_proj", "value_proj", "out_proj")
    kept = _tpu_program("save_dot_except_mlp", scan=True, cfg=cfg)
    offloaded = _tpu_program({n: "offload" for n in names}, scan=True, cfg=cfg)
    moved = host_transfers(offloaded.compiled.as_text())
    per_layer = 4 * sum(np.prod(SHAPES.get(n, (2, 128, 64))) for n in names)  # f32
    assert moved.to_host_bytes == moved.from_host_bytes == 32 * per_layer
    assert offloaded.compiled.memory_analysis().host_temp_size_in_bytes == 32 * per_layer
    assert kept.compiled.memory_analysis().host_temp_size_in_bytes == 0
    floor = offloaded.step_floor
    assert floor.host_link_bytes_per_s == 32e9
    assert floor.host_link_seconds == pytest.approx(32 * per_layer / 32e9)
    assert floor.bound == "host link" and floor.seconds == floor.host_link_seconds
    assert kept.step_floor.host_link_seconds == 0 and kept.step_floor.bound != "host link"


class AttentionBlock(nnx.Module):
    """Flax's own attention and MLP layers, unchanged: planned by class, not by name."""

    def __init__(self, d, rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=d, qkv_features=d, decode=False, rngs=rngs
        )
        self.up = nnx.Linear(d, 2 * d, rngs=rngs)
        self.down = nnx.Linear(2 * d, d, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.down(nnx.gelu(self.up(x)))


class FlaxModel(nnx.Module):
    def __init__(self, rngs, d=16, layers=2):
        self.blocks = nnx.List([AttentionBlock(d, rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _flax_step(model, optimizer, x, y):
    def loss(m):
        return jnp.mean((m(x)[..., 0] - y) ** 2)

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


FLAX_PLAN = {(AttentionBlock, "input"): "offload", (nnx.LinearGeneral, "output"): "device"}


def test_a_model_we_did_not_write_is_planned_by_module_class_and_trains_as_on_one_device():
    rng = np.random.default_rng(1)
    data = [
        (rng.normal(size=(8, 8, 16)).astype(np.float32), rng.normal(size=(8, 8)).astype(np.float32))
        for _ in range(2)
    ]

    def build():
        model = FlaxModel(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)

    model, opt = build()
    step = nnx.jit(_flax_step)
    want = [float(step(model, opt, x, y)) for x, y in data]
    want_params = jax.device_get(nnx.state(model, nnx.Param))
    s = strategies.FullyShardedStrategy(
        min_shard_bytes=0, remat=(AttentionBlock,), remat_policy=FLAX_PLAN
    )
    with s.scope():
        model, opt = build()
    got = [float(s.run(_flax_step, args=(model, opt, x, y))) for x, y in data]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    _close(model, want_params)
    # ... and on a TPU each block's input goes to host memory, each projection stays
    devices = dtensor.tpu_topology("v5e:2x4")
    t = strategies.FullyShardedStrategy(
        min_shard_bytes=0, devices=devices, remat=(AttentionBlock,), remat_policy=FLAX_PLAN
    )
    model, opt = nnx.eval_shape(build)
    args = (jax.ShapeDtypeStruct((16, 128, 16), jnp.float32),) * 1
    args += (jax.ShapeDtypeStruct((16, 128), jnp.float32),)
    text = t.explain(_flax_step, args=(model, opt, *args)).compiled.as_text()
    moved = host_transfers(text)
    assert _moved(moved, "to host") == [(2, 128, 16)] * 2


def test_a_plan_naming_what_the_model_never_names_is_an_error_naming_what_it_does():
    s = strategies.HybridStrategy(
        data=2, fsdp=4, min_shard_bytes=0, remat=(Block,), remat_policy="qproj=offload"
    )
    with s.scope():
        model, opt = _build(CFG)
    with pytest.raises(ValueError, match=r"names \['qproj'\], .*its blocks name \[.*'query_proj'"):
        s.run(_step, args=(model, opt, _batches(1)[0]))
    with pytest.raises(ValueError, match=r"gives 'query_proj' the choice 'host'; valid choices"):
        strategies.FullyShardedStrategy(remat_policy={"query_proj": "host"})
    with pytest.raises(ValueError, match=r"both to keep on device and to offload"):
        RematPolicy(device=("x",), offload=("x",))
    with pytest.raises(TypeError, match=r"\(ModuleClass, 'input' \| 'output'\)"):
        RematPolicy(offload=((Block, "hidden"),))
    with pytest.raises(
        ValueError, match=r"'qkv_proj_ofloaded' is not a checkpoint policy.*MaxText"
    ):
        strategies.FullyShardedStrategy(remat_policy="qkv_proj_ofloaded")


def test_maxtext_policy_names_mean_maxtext_s_tensors():
    assert parse("full") is None
    assert parse("minimal") == "checkpoint_dots_with_no_batch_dims"
    assert parse("save_qkv_proj").device == ("query_proj", "key_proj", "value_proj")
    assert set(parse("minimal_offloaded").offload) == {
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo"
    }  # fmt: skip
    assert parse({"decoder_layer_input": "offload", "context": "remat"}) == RematPolicy(
        offload=("decoder_layer_input",)
    )
    assert re.fullmatch(r"Block\.input", RematPolicy(offload=((Block, "input"),)).names()[1][0])
