"""A Llama/Gemma-style decoder in Flax NNX, with the public shapes of Gemma 2B and 7B.

RMSNorm, rotary position embeddings, grouped-query attention, a gated GELU
MLP and tied input/output embeddings, as in Gemma. Layers are a Python list
(``scan=False``) or one stacked module run by ``nnx.scan`` (``scan=True``).
Variables are stored as ``param_dtype`` (float32); ``dtype`` is the compute
dtype each weight read is cast to (bfloat16 gives the MaxText pattern:
float32 master weights, bfloat16 matmuls). ``dtype=None`` (the default, as in
Flax's own layers) computes in the dtype the weights are read in: float32, or
bfloat16 under a preset's ``mixed_precision=strategies.MixedPrecision()``,
which casts each read; ``remat=True`` recomputes each
block in the backward pass (``nnx.remat``), keeping only block inputs.

    >>> from examples.decoder import CONFIGS, param_count
    >>> round(param_count(CONFIGS["2b"]) / 1e9, 2), round(param_count(CONFIGS["7b"]) / 1e9, 2)
    (2.51, 8.54)

Large sizes are for ahead-of-time compiles: build them with
``nnx.eval_shape(lambda: Decoder(CONFIGS["7b"], rngs=nnx.Rngs(0)))``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["CONFIGS", "Block", "Decoder", "DecoderConfig", "loss_fn", "param_count"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Shapes and options of a :class:`Decoder`."""

    vocab: int
    d_model: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffw: int
    max_len: int = 8192
    rope_base: float = 10_000.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    scan: bool = False

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)


#: Size presets. ``2b`` and ``7b`` are Gemma's public shapes.
CONFIGS: dict[str, DecoderConfig] = {
    "tiny": DecoderConfig(
        vocab=128, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffw=128
    ),
    "small": DecoderConfig(
        vocab=512, d_model=256, layers=4, heads=8, kv_heads=2, head_dim=32, ffw=1024
    ),
    "2b": DecoderConfig(
        vocab=256128, d_model=2048, layers=18, heads=8, kv_heads=1, head_dim=256, ffw=16384
    ),
    "7b": DecoderConfig(
        vocab=256128, d_model=3072, layers=28, heads=16, kv_heads=16, head_dim=256, ffw=24576
    ),
}


def param_count(cfg: DecoderConfig) -> int:
    """Parameters of a decoder (embeddings included, counted once: they are tied)."""
    d, h, k, hd, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffw
    block = 2 * d + d * h * hd * 2 + d * k * hd * 2 + 3 * d * f
    return cfg.vocab * d + cfg.layers * block + d


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, cfg: DecoderConfig) -> nnx.Param:
    init = jax.nn.initializers.normal(1.0 / math.sqrt(fan_in))
    return nnx.Param(init(rngs.params(), shape, cfg.param_dtype))


class RMSNorm(nnx.Module):
    """``x / rms(x) * (1 + scale)`` (Gemma's form: the scale starts at 0)."""

    def __init__(self, dim: int, cfg: DecoderConfig):
        self.scale = nnx.Param(jnp.zeros((dim,), cfg.param_dtype))
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * (1.0 + self.scale[...].astype(jnp.float32))).astype(self.dtype or x.dtype)


def _read(param: nnx.Param, dtype: Any) -> jax.Array:
    """``param``'s value in ``dtype`` (``None``: as read, e.g. cast by a preset's mixed precision)."""
    value = param[...]
    return value if dtype is None else value.astype(dtype)


def rope(x: jax.Array, positions: jax.Array, base: float) -> jax.Array:
    """Rotary embeddings on ``x`` of shape (batch, seq, heads, head_dim)."""
    half = x.shape[-1] // 2
    freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[:, None].astype(jnp.float32) * freq[None, :]  # (seq, half)
    sin, cos = jnp.sin(angle)[None, :, None, :], jnp.cos(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with rotary embeddings."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, h, k, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.query = _param(rngs, (d, h, hd), d, cfg)
        self.key = _param(rngs, (d, k, hd), d, cfg)
        self.value = _param(rngs, (d, k, hd), d, cfg)
        self.out = _param(rngs, (h, hd, d), h * hd, cfg)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.dtype
        q = jnp.einsum("bsd,dhk->bshk", x, _read(self.query, dt))
        k = jnp.einsum("bsd,dhk->bshk", x, _read(self.key, dt))
        v = jnp.einsum("bsd,dhk->bshk", x, _read(self.value, dt))
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        b, s, _, hd = q.shape
        group = cfg.heads // cfg.kv_heads
        q = q.reshape(b, s, cfg.kv_heads, group, hd) * (hd**-0.5)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
        causal = positions[:, None] >= positions[None, :]
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, cfg.heads, hd)
        return jnp.einsum("bshk,hkd->bsd", ctx, _read(self.out, dt))


class MLP(nnx.Module):
    """Gated GELU feed-forward: ``down(gelu(gate(x)) * up(x))``."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.gate = _param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.up = _param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.down = _param(rngs, (cfg.ffw, cfg.d_model), cfg.ffw, cfg)
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = jax.nn.gelu(x @ _read(self.gate, dt)) * (x @ _read(self.up, dt))
        return h @ _read(self.down, dt)


class Block(nnx.Module):
    """One pre-norm decoder layer: attention then MLP, each with a residual."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions)
        return x + self.mlp(self.mlp_norm(x))


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on Explicit mesh axes laid out like the (batch-split) tokens."""
    spec = getattr(getattr(jax.typeof(tokens), "sharding", None), "spec", None)
    parts = tuple(getattr(spec, "partitions", ()) or ())
    if any(entry is not None for entry in parts):
        return table.at[tokens].get(out_sharding=jax.sharding.PartitionSpec(*parts, None))
    return jnp.take(table, tokens, axis=0)


def _run_block(block: Block, x: jax.Array, positions: jax.Array) -> jax.Array:
    return block(x, positions)


class Decoder(nnx.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab), float32."""

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab, cfg.d_model), 1, cfg)
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.layers = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = _read(self.embed, cfg.dtype)
        x = lookup(embed, tokens) * jnp.asarray(math.sqrt(cfg.d_model), embed.dtype)
        positions = jnp.arange(tokens.shape[-1])
        run = nnx.remat(_run_block, prevent_cse=not cfg.scan) if cfg.remat else _run_block
        if cfg.scan:

            @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
            def body(x: jax.Array, block: Block, positions: jax.Array) -> jax.Array:
                return run(block, x, positions)

            x = body(x, self.layers, positions)
        else:
            for block in self.blocks:
                x = run(block, x, positions)
        x = self.final_norm(x)
        return jnp.einsum("bsd,vd->bsv", x, embed).astype(jnp.float32)


def loss_fn(model: Decoder, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["x"]`` against ``batch["y"]``."""
    import optax

    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
