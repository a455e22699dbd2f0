"""The decoder's layers in Flax NNX: RMSNorm, rotary embeddings, grouped-query
:class:`Attention` (the platform's kernel by :func:`attention_kind`), the gated :class:`MLP`,
the routed mixture of experts (:class:`MoE` over stacked :class:`Experts`) and the
pre-norm :class:`Block`. ``examples/decoder.py`` re-exports every name here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

if TYPE_CHECKING:
    from examples.decoder_config import DecoderConfig

__all__ = [
    "MLP",
    "Attention",
    "Block",
    "Experts",
    "MoE",
    "RMSNorm",
    "attention_kind",
    "init_param",
    "read_param",
    "rope",
]


def init_param(
    rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, cfg: DecoderConfig
) -> nnx.Param:
    init = jax.nn.initializers.normal(1.0 / math.sqrt(fan_in))
    return nnx.Param(init(rngs.params(), shape, cfg.param_dtype))


class RMSNorm(nnx.Module):
    """``x / rms(x) * (1 + scale)`` (Gemma's form: the scale starts at 0), or
    ``x / rms(x) * scale`` (Llama's: it starts at 1)."""

    def __init__(self, dim: int, cfg: DecoderConfig):
        self.offset = 0.0 if cfg.block == "llama" else 1.0
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - self.offset, cfg.param_dtype))
        self.dtype = cfg.dtype
        self.eps = cfg.norm_eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.offset + self.scale[...].astype(jnp.float32)
        return (y * scale).astype(self.dtype or x.dtype)


def read_param(param: nnx.Param, dtype: Any) -> jax.Array:
    """``param``'s value in ``dtype`` (``None``: as read, e.g. cast by a preset's mixed precision)."""
    value = param[...]
    return value if dtype is None else value.astype(dtype)


def rope(x: jax.Array, positions: jax.Array, base: float | jax.Array) -> jax.Array:
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
        self.query = init_param(rngs, (d, h, hd), d, cfg)
        self.key = init_param(rngs, (d, k, hd), d, cfg)
        self.value = init_param(rngs, (d, k, hd), d, cfg)
        self.out = init_param(rngs, (h, hd, d), h * hd, cfg)
        if cfg.block == "gemma3":
            self.query_norm = RMSNorm(hd, cfg)
            self.key_norm = RMSNorm(hd, cfg)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        window: jax.Array | None = None,
        base: jax.Array | None = None,
    ) -> jax.Array:
        cfg, dt = self.cfg, self.cfg.dtype
        # Each tensor a per-tensor remat_policy can keep, offload or recompute is named as
        # MaxText names it (strategies.reads.remat_plan.DECODER_NAMES).
        q = checkpoint_name(
            jnp.einsum("bsd,dhk->bshk", x, read_param(self.query, dt)), "query_proj"
        )
        k = checkpoint_name(jnp.einsum("bsd,dhk->bshk", x, read_param(self.key, dt)), "key_proj")
        v = checkpoint_name(
            jnp.einsum("bsd,dhk->bshk", x, read_param(self.value, dt)), "value_proj"
        )
        if cfg.block == "gemma3":
            q, k = self.query_norm(q), self.key_norm(k)
        base = cfg.rope_base if base is None else base
        q, k = rope(q, positions, base), rope(k, positions, base)
        b, s, _, hd = q.shape
        group = cfg.heads // cfg.kv_heads
        q = q.reshape(b, s, cfg.kv_heads, group, hd) * (hd**-0.5)
        kind = attention_kind(cfg, q.dtype, s, window)
        splash = kind == "splash" and window is None
        if splash or _context_size() > 1:  # (a ``context`` axis: the sequence split over it)
            import dtensor

            ctx = dtensor.context_attention(
                q.reshape(b, s, cfg.heads, hd),
                k,
                v,
                causal=True,
                window=window,
                scale=1.0,
                implementation="splash" if splash else "xla",
            )
            return self._out(ctx)
        if kind == "cudnn" and window is None:  # query head i reads KV head i // group
            ctx = jax.nn.dot_product_attention(
                q.reshape(b, s, cfg.heads, hd),
                k,
                v,
                scale=1.0,
                is_causal=True,
                implementation="cudnn",
            )
            return self._out(ctx)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
        causal = positions[:, None] >= positions[None, :]
        if window is not None:  # a sliding-window layer sees the last ``window`` positions
            causal = causal & (positions[:, None] - positions[None, :] < window)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, cfg.heads, hd)
        return self._out(ctx)

    def _out(self, ctx: jax.Array) -> jax.Array:
        ctx = checkpoint_name(ctx, "context")
        out = jnp.einsum("bshk,hkd->bsd", ctx, read_param(self.out, self.cfg.dtype))
        return checkpoint_name(out, "out_proj")


def attention_kind(cfg: DecoderConfig, dtype: Any, seq: int, window: Any = None) -> str:
    """The attention ``cfg.attention`` stands for in a layer of ``seq`` tokens computing in
    ``dtype`` (``window``: a Gemma 3 layer's), on the platform the step is traced for.

    ``"auto"`` is :func:`dtensor.core.attention.best_implementation`'s choice, the one
    ``dtensor.context_attention(implementation="auto")`` makes: ``"splash"`` on TPU where the
    kernel takes the call (causal, gather mode under a ``context`` axis, whole blocks of 128
    tokens a device), ``"cudnn"`` on NVIDIA GPUs in bfloat16/float16 without a ``context``
    axis (head dim a multiple of 8, at most 128), else ``"xla"``; always ``"xla"`` for
    Gemma 3, whose windows are traced per layer.
    """
    if cfg.attention != "auto":
        return cfg.attention
    if cfg.block == "gemma3" or window is not None:
        return "xla"
    from dtensor.core.attention import best_implementation

    shape = jax.ShapeDtypeStruct((1, seq, cfg.heads, cfg.head_dim), dtype)
    return best_implementation(shape, shape, causal=True)


def _context_size() -> int:
    """The size of the current mesh's ``context`` axis (1 without one)."""
    import dtensor

    mesh = dtensor.current_mesh()
    if mesh is not None:
        return mesh.shape.get("context", 1)
    abstract = jax.sharding.get_abstract_mesh()
    return 1 if abstract.empty else dict(abstract.shape).get("context", 1)


class MLP(nnx.Module):
    """Gated feed-forward: ``down(act(gate(x)) * up(x))``, GELU (Gemma) or SiLU (Llama's SwiGLU)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.gate = init_param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.up = init_param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.down = init_param(rngs, (cfg.ffw, cfg.d_model), cfg.ffw, cfg)
        self.dtype = cfg.dtype
        self.act = jax.nn.silu if cfg.block == "llama" else jax.nn.gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        gate = checkpoint_name(x @ read_param(self.gate, dt), "mlpwi_0")
        up = checkpoint_name(x @ read_param(self.up, dt), "mlpwi_1")
        return checkpoint_name((self.act(gate) * up) @ read_param(self.down, dt), "mlpwo")


class Experts(nnx.Module):
    """``experts`` gated MLPs as stacked weights ``gate``/``up`` ``[E, d, f]`` and ``down``
    ``[E, f, d]``: under a module named ``experts``, the name HybridStrategy's expert rule
    splits over its ``expert`` axis."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, d, f = cfg.experts, cfg.d_model, cfg.ffw
        self.gate = init_param(rngs, (e, d, f), d, cfg)
        self.up = init_param(rngs, (e, d, f), d, cfg)
        self.down = init_param(rngs, (e, f, d), f, cfg)


class MoE(nnx.Module):
    """A routed mixture of experts (Mixtral's): a float32 router picks each token's top
    ``experts_per_token`` experts (their softmax weights renormalised over the chosen), run
    dropless with grouped matmuls by :func:`dtensor.expert_mlp` (all-to-all dispatch over an
    ``expert`` mesh axis). Returns the output and the Switch Transformer load-balancing loss,
    ``E * sum_e(fraction routed to e * mean router probability of e)`` (1 when balanced)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.router = init_param(rngs, (cfg.d_model, cfg.experts), cfg.d_model, cfg)
        self.experts = Experts(cfg, rngs)
        self.k = cfg.experts_per_token
        self.dtype = cfg.dtype
        self.act = jax.nn.silu if cfg.block == "llama" else jax.nn.gelu

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        import dtensor

        dt = self.dtype
        logits = jnp.einsum("bsd,de->bse", x, read_param(self.router, dt)).astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        weights, ids = jax.lax.top_k(probs, self.k)
        weights = weights / weights.sum(-1, keepdims=True)
        e = probs.shape[-1]
        routed = jax.nn.one_hot(ids, e, dtype=jnp.float32).sum(-2)  # (b, s, e)
        fraction = routed.mean((0, 1)) / self.k
        aux = e * jnp.sum(fraction * probs.mean((0, 1)))
        ex = self.experts
        y = dtensor.expert_mlp(
            x,
            ids,
            weights.astype(x.dtype),
            read_param(ex.gate, dt),
            read_param(ex.up, dt),
            read_param(ex.down, dt),
            activation=self.act,
        )
        return y, aux


class Block(nnx.Module):
    """One pre-norm decoder layer: attention then MLP, each with a residual (Gemma 3: each
    output normed too). ``window``/``base``: a Gemma 3 layer's attention window and rotary base."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg)
        if cfg.experts:
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = MLP(cfg, rngs)
        if cfg.block == "gemma3":
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg)

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        window: jax.Array | None = None,
        base: jax.Array | None = None,
    ) -> Any:
        x = checkpoint_name(x, "decoder_layer_input")
        y = self.attn(self.attn_norm(x), positions, window, base)
        if hasattr(self, "post_attn_norm"):
            y = self.post_attn_norm(y)
        x = x + y
        aux = None
        if hasattr(self, "moe"):  # an MoE block returns its load-balancing loss too
            y, aux = self.moe(self.mlp_norm(x))
        else:
            y = self.mlp(self.mlp_norm(x))
        if hasattr(self, "post_mlp_norm"):
            y = self.post_mlp_norm(y)
        return x + y if aux is None else (x + y, aux)
