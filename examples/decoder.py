"""Gemma- and Llama-style decoders in Flax NNX, with the public shapes of Gemma 2B, 7B and
Gemma 3 12B, of Llama 2 7B and 70B, Llama 3.1 405B, and of Mixtral 8x7B (a mixture of experts).

Three kinds of block (``DecoderConfig.block``): ``"gemma"`` (RMSNorm with a
``1 + scale`` weight, rotary position embeddings, grouped-query attention, a
gated GELU MLP, tied input/output embeddings); ``"gemma3"`` (the same, plus
RMSNorm on queries and keys, norms after attention and MLP too, and five
sliding-window layers to each global one, as Gemma 3); ``"llama"`` (RMSNorm
with a plain weight, SwiGLU MLP, untied output head, as Llama 2). Layers are a Python list
(``scan=False``) or one stacked module run by ``nnx.scan`` (``scan=True``).
Variables are stored as ``param_dtype`` (float32); ``dtype`` is the compute
dtype each weight read is cast to (bfloat16 gives the MaxText pattern:
float32 master weights, bfloat16 matmuls). ``dtype=None`` (the default, as in
Flax's own layers) computes in the dtype the weights are read in: float32, or
bfloat16 under a preset's ``mixed_precision=strategies.MixedPrecision()``,
which casts each read; ``remat=True`` recomputes each
block in the backward pass (``nnx.remat``), keeping only block inputs.
``experts=E`` (``mixtral-8x7b``, ``tiny-moe``) makes each block's MLP a routed mixture of
``E`` experts (:class:`MoE`, dispatched by :func:`dtensor.expert_mlp`).

    >>> from examples.decoder import CONFIGS, param_count
    >>> round(param_count(CONFIGS["2b"]) / 1e9, 2), round(param_count(CONFIGS["7b"]) / 1e9, 2)
    (2.51, 8.54)
    >>> param_count(CONFIGS["llama2-7b"]), param_count(CONFIGS["llama2-70b"])
    (6738415616, 68976648192)
    >>> round(param_count(CONFIGS["mixtral-8x7b"]) / 1e9, 2)   # 46.7B, 12.9B active per token
    46.7

Large sizes are for ahead-of-time compiles: build them with
``nnx.eval_shape(lambda: Decoder(CONFIGS["7b"], rngs=nnx.Rngs(0)))``.

Pretrained Hugging Face checkpoints: :func:`from_hf_config` and :func:`hf_mapping`
(in ``examples/hf.py``, re-exported here).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "BLOCKS",
    "CONFIGS",
    "Block",
    "Experts",
    "MoE",
    "Decoder",
    "DecoderConfig",
    "from_hf_config",
    "hf_mapping",
    "layer_windows",
    "loss_fn",
    "model_flops",
    "param_count",
    "tensor_rules",
]


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
    block: str = "gemma"
    #: gemma3: the window of its local (sliding-window) layers, every ``global_every``-th
    #: layer global with rotary base ``global_rope_base``.
    sliding_window: int = 1024
    global_every: int = 6
    global_rope_base: float = 1_000_000.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    remat: bool = False
    scan: bool = False
    #: Mixture of experts: ``experts`` > 0 replaces each block's MLP by a routed
    #: :class:`MoE` of that many experts (each an MLP of ``ffw``), ``experts_per_token``
    #: chosen per token; ``aux_loss_weight`` scales the load-balancing loss in :func:`loss_fn`.
    experts: int = 0
    experts_per_token: int = 2
    aux_loss_weight: float = 0.01
    #: ``"auto"`` (the default): the platform's best, chosen when the step is traced for its
    #: devices (:func:`attention_kind`): splash on TPU, cuDNN on NVIDIA GPUs in bfloat16 or
    #: float16, XLA on CPU, in float32 on GPU, for Gemma 3 and where a kernel cannot take
    #: the shapes. ``"xla"``: attention as einsums (float32 scores of ``[batch, heads, seq,
    #: seq]``); ``"splash"``: the Pallas splash-attention kernel on TPU (causal; no scores
    #: kept; by :func:`dtensor.context_attention`, with separate dq and dk/dv backward
    #: kernels); ``"cudnn"``: cuDNN's fused attention on NVIDIA GPUs
    #: (``jax.nn.dot_product_attention(..., implementation="cudnn")``; no scores kept). Under
    #: a ``context`` mesh axis attention is :func:`dtensor.context_attention` (splash in its
    #: gather mode; else XLA per device).
    attention: str = "auto"
    #: The loss over the vocabulary in this many slices (:func:`chunked_cross_entropy`): one
    #: slice's float32 logits live at a time; 1 (the default): the whole logits at once.
    loss_chunks: int = 1
    #: RMSNorm's epsilon (Hugging Face's ``rms_norm_eps``: 1e-5 for Llama 2 and 3).
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.block not in BLOCKS:
            raise ValueError(
                f"DecoderConfig(block={self.block!r}) is not a block kind; valid: {BLOCKS}."
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"DecoderConfig(attention={self.attention!r}) is not an attention kind; valid: "
                f"{ATTENTION}."
            )
        if self.attention not in ("xla", "auto") and self.block == "gemma3":
            raise ValueError(
                f"DecoderConfig(attention={self.attention!r}) with block='gemma3': its "
                "sliding-window layers' windows are traced per layer, which the kernels' "
                "static masks cannot take; use attention='xla' for Gemma 3."
            )
        if self.experts and not 0 < self.experts_per_token <= self.experts:
            raise ValueError(
                f"DecoderConfig(experts={self.experts}, experts_per_token="
                f"{self.experts_per_token}): each token needs 1 to {self.experts} experts."
            )

    def replace(self, **changes: Any) -> DecoderConfig:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    @property
    def tied(self) -> bool:
        """Whether the output projection is the input embedding (Gemma) or its own (Llama)."""
        return self.block != "llama"


#: The block kinds.
BLOCKS = ("gemma", "gemma3", "llama")
#: The attention implementations.
ATTENTION = ("auto", "xla", "splash", "cudnn")


#: Size presets: ``2b``, ``7b`` (Gemma), ``gemma3-12b``, ``llama2-7b``, ``llama2-70b``,
#: ``llama3.1-8b``, ``llama3.1-405b`` are the public shapes; ``tiny-gemma3`` and ``tiny-llama`` small ones of
#: those blocks, for tests.
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
    # Gemma 3 12B (the text decoder; MaxText's gemma3-12b), Llama 2 7B and 70B (MaxText's
    # llama2-7b, llama2-70b): hidden, layers, heads, KV heads, head dim, MLP, vocab as published.
    "gemma3-12b": DecoderConfig(
        vocab=262144,
        d_model=3840,
        layers=48,
        heads=16,
        kv_heads=8,
        head_dim=256,
        ffw=15360,
        block="gemma3",
    ),
    "llama2-7b": DecoderConfig(
        vocab=32000,
        d_model=4096,
        layers=32,
        heads=32,
        kv_heads=32,
        head_dim=128,
        ffw=11008,
        block="llama",
    ),
    "llama2-70b": DecoderConfig(
        vocab=32000,
        d_model=8192,
        layers=80,
        heads=64,
        kv_heads=8,
        head_dim=128,
        ffw=28672,
        block="llama",
    ),
    # Llama 3.1 8B (MaxText's llama3.1-8b; rotary base 500,000, its long-context scaling left
    # out: it changes no shape).
    "llama3.1-8b": DecoderConfig(
        vocab=128256,
        d_model=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffw=14336,
        rope_base=500_000.0,
        block="llama",
    ),
    # Llama 3.1 405B (MaxText's llama3.1-405b; its rotary base 500,000, the long-context
    # rotary scaling left out: it changes no shape).
    "llama3.1-405b": DecoderConfig(
        vocab=128256,
        d_model=16384,
        layers=126,
        heads=128,
        kv_heads=8,
        head_dim=128,
        ffw=53248,
        rope_base=500_000.0,
        block="llama",
    ),
    "tiny-gemma3": DecoderConfig(
        vocab=128,
        d_model=64,
        layers=3,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffw=128,
        block="gemma3",
        sliding_window=4,
        global_every=2,
    ),
    "tiny-llama": DecoderConfig(
        vocab=128, d_model=64, layers=2, heads=4, kv_heads=2, head_dim=16, ffw=128, block="llama"
    ),
    # Mixtral 8x7B (MaxText's mixtral-8x7b): Llama blocks whose MLP is 8 experts, top-2,
    # rotary base 1,000,000, no sliding window.
    "mixtral-8x7b": DecoderConfig(
        vocab=32000,
        d_model=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffw=14336,
        rope_base=1_000_000.0,
        block="llama",
        experts=8,
        experts_per_token=2,
    ),
    "tiny-moe": DecoderConfig(
        vocab=128,
        d_model=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        ffw=64,
        block="llama",
        experts=8,
        experts_per_token=2,
    ),
}


def param_count(cfg: DecoderConfig) -> int:
    """Parameters of a decoder (embeddings included; counted once where they are tied)."""
    d, h, k, hd, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffw
    mlp = 3 * d * f if not cfg.experts else cfg.experts * (3 * d * f + d)  # experts + router
    block = 2 * d + d * h * hd * 2 + d * k * hd * 2 + mlp
    if cfg.block == "gemma3":
        block += 2 * d + 2 * hd  # post-attention and post-MLP norms; query and key norms
    embeddings = cfg.vocab * d * (1 if cfg.tied else 2)
    return embeddings + cfg.layers * block + d


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, cfg: DecoderConfig) -> nnx.Param:
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


def _read(param: nnx.Param, dtype: Any) -> jax.Array:
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
        self.query = _param(rngs, (d, h, hd), d, cfg)
        self.key = _param(rngs, (d, k, hd), d, cfg)
        self.value = _param(rngs, (d, k, hd), d, cfg)
        self.out = _param(rngs, (h, hd, d), h * hd, cfg)
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
        q = jnp.einsum("bsd,dhk->bshk", x, _read(self.query, dt))
        k = jnp.einsum("bsd,dhk->bshk", x, _read(self.key, dt))
        v = jnp.einsum("bsd,dhk->bshk", x, _read(self.value, dt))
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
            return jnp.einsum("bshk,hkd->bsd", ctx, _read(self.out, dt))
        if kind == "cudnn" and window is None:  # query head i reads KV head i // group
            ctx = jax.nn.dot_product_attention(
                q.reshape(b, s, cfg.heads, hd),
                k,
                v,
                scale=1.0,
                is_causal=True,
                implementation="cudnn",
            )
            return jnp.einsum("bshk,hkd->bsd", ctx, _read(self.out, dt))
        scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32)
        causal = positions[:, None] >= positions[None, :]
        if window is not None:  # a sliding-window layer sees the last ``window`` positions
            causal = causal & (positions[:, None] - positions[None, :] < window)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        ctx = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, cfg.heads, hd)
        return jnp.einsum("bshk,hkd->bsd", ctx, _read(self.out, dt))


def attention_kind(cfg: DecoderConfig, dtype: Any, seq: int, window: Any = None) -> str:
    """The attention ``cfg.attention`` stands for in a layer of ``seq`` tokens computing in
    ``dtype`` (``window``: a Gemma 3 layer's), on the platform the step is traced for.

    ``"auto"`` is ``"splash"`` on TPU where :func:`dtensor.core.attention.best_implementation`
    says the kernel takes the call (causal, gather mode under a ``context`` axis, whole blocks
    of 128 tokens a device), ``"cudnn"`` on GPU in bfloat16/float16 without a ``context``
    axis (head dim a multiple of 8, at most 128), else ``"xla"``; always ``"xla"`` for
    Gemma 3, whose windows are traced per layer.
    """
    if cfg.attention != "auto":
        return cfg.attention
    if cfg.block == "gemma3" or window is not None:
        return "xla"
    from dtensor.core import attention

    platform = attention.trace_platform()
    hd = cfg.head_dim
    if platform == "tpu":
        shape = jax.ShapeDtypeStruct((1, seq, cfg.heads, hd), dtype)
        return attention.best_implementation(shape, shape, causal=True)
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if platform in ("gpu", "cuda") and half and _context_size() == 1 and hd % 8 == 0 and hd <= 128:
        return "cudnn"
    return "xla"


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
        self.gate = _param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.up = _param(rngs, (cfg.d_model, cfg.ffw), cfg.d_model, cfg)
        self.down = _param(rngs, (cfg.ffw, cfg.d_model), cfg.ffw, cfg)
        self.dtype = cfg.dtype
        self.act = jax.nn.silu if cfg.block == "llama" else jax.nn.gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        h = self.act(x @ _read(self.gate, dt)) * (x @ _read(self.up, dt))
        return h @ _read(self.down, dt)


class Experts(nnx.Module):
    """``experts`` gated MLPs as stacked weights ``gate``/``up`` ``[E, d, f]`` and ``down``
    ``[E, f, d]``: under a module named ``experts``, the name HybridStrategy's expert rule
    splits over its ``expert`` axis."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        e, d, f = cfg.experts, cfg.d_model, cfg.ffw
        self.gate = _param(rngs, (e, d, f), d, cfg)
        self.up = _param(rngs, (e, d, f), d, cfg)
        self.down = _param(rngs, (e, f, d), f, cfg)


class MoE(nnx.Module):
    """A routed mixture of experts (Mixtral's): a float32 router picks each token's top
    ``experts_per_token`` experts (their softmax weights renormalised over the chosen), run
    dropless with grouped matmuls by :func:`dtensor.expert_mlp` (all-to-all dispatch over an
    ``expert`` mesh axis). Returns the output and the Switch Transformer load-balancing loss,
    ``E * sum_e(fraction routed to e * mean router probability of e)`` (1 when balanced)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.router = _param(rngs, (cfg.d_model, cfg.experts), cfg.d_model, cfg)
        self.experts = Experts(cfg, rngs)
        self.k = cfg.experts_per_token
        self.dtype = cfg.dtype
        self.act = jax.nn.silu if cfg.block == "llama" else jax.nn.gelu

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        import dtensor

        dt = self.dtype
        logits = jnp.einsum("bsd,de->bse", x, _read(self.router, dt)).astype(jnp.float32)
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
            _read(ex.gate, dt),
            _read(ex.up, dt),
            _read(ex.down, dt),
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


def lookup(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """``table[tokens]``; on Explicit mesh axes laid out like the (batch-split) tokens."""
    spec = getattr(getattr(jax.typeof(tokens), "sharding", None), "spec", None)
    parts = tuple(getattr(spec, "partitions", ()) or ())
    if any(entry is not None for entry in parts):
        return table.at[tokens].get(out_sharding=jax.sharding.PartitionSpec(*parts, None))
    return jnp.take(table, tokens, axis=0)


def _run_block(
    block: Block, x: jax.Array, positions: jax.Array, window: Any = None, base: Any = None
) -> jax.Array:
    return block(x, positions, window, base)


def _step_block(run: Any, block: Block, carry: Any, *args: Any) -> Any:
    """One layer on ``carry``: ``x``, or ``(x, aux loss so far)`` for MoE blocks."""
    if isinstance(carry, tuple):
        x, aux = carry
        x, layer_aux = run(block, x, *args)
        return x, aux + layer_aux
    return run(block, carry, *args)


def layer_windows(cfg: DecoderConfig) -> tuple[jax.Array, jax.Array] | None:
    """Gemma 3's attention window and rotary base of each layer (``None`` for other blocks):
    every ``global_every``-th layer is global (its window the whole ``max_len``)."""
    if cfg.block != "gemma3":
        return None
    local = [(i + 1) % cfg.global_every != 0 for i in range(cfg.layers)]
    windows = jnp.asarray([cfg.sliding_window if g else cfg.max_len for g in local], jnp.int32)
    bases = jnp.asarray([cfg.rope_base if g else cfg.global_rope_base for g in local], jnp.float32)
    return windows, bases


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
        if not cfg.tied:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab), cfg.d_model, cfg)

    def __call__(self, tokens: jax.Array, *, with_aux: bool = False) -> Any:
        """Logits; with ``with_aux``, ``(logits, aux)``: the MoE load-balancing loss averaged
        over layers (0 without experts)."""
        x, aux, head = self.features(tokens)
        logits = jnp.einsum("bsd,dv->bsv", x, head).astype(jnp.float32)
        return (logits, aux) if with_aux else logits

    def features(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The final normed hidden states ``(batch, seq, d_model)``, the MoE loss averaged
        over layers, and the output head ``(d_model, vocab)`` as read (the embedding's
        transpose when tied): the logits are ``features @ head``."""
        cfg = self.cfg
        embed = _read(self.embed, cfg.dtype)
        x = lookup(embed, tokens)
        if cfg.block != "llama":  # Gemma scales its embeddings by sqrt(d_model)
            x = x * jnp.asarray(math.sqrt(cfg.d_model), embed.dtype)
        positions = jnp.arange(tokens.shape[-1])
        run = nnx.remat(_run_block, prevent_cse=not cfg.scan) if cfg.remat else _run_block
        per_layer = layer_windows(cfg)
        carry: Any = (x, jnp.zeros((), jnp.float32)) if cfg.experts else x
        if cfg.scan:
            if per_layer is None:

                @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
                def body(carry: Any, block: Block, positions: jax.Array) -> Any:
                    return _step_block(run, block, carry, positions)

                carry = body(carry, self.layers, positions)
            else:

                @nnx.scan(in_axes=(nnx.Carry, 0, None, 0, 0), out_axes=nnx.Carry)
                def body_w(carry: Any, block: Block, positions: Any, window: Any, base: Any) -> Any:
                    return _step_block(run, block, carry, positions, window, base)

                carry = body_w(carry, self.layers, positions, *per_layer)
        else:
            for i, block in enumerate(self.blocks):
                extra = () if per_layer is None else (per_layer[0][i], per_layer[1][i])
                carry = _step_block(run, block, carry, positions, *extra)
        x, aux = carry if cfg.experts else (carry, jnp.zeros((), jnp.float32))
        x = self.final_norm(x)
        head = embed.T if cfg.tied else _read(self.head, cfg.dtype)
        return x, aux / cfg.layers, head


def model_flops(cfg: DecoderConfig, batch: int, seq: int) -> float:
    """One training step's model FLOPs, as MFU counts them (PaLM, Chowdhery et al. 2022,
    appendix B): ``6 x matmul parameters x tokens`` plus attention's
    ``12 x layers x heads x head_dim x seq x tokens``. Norm scales and an untied input
    embedding (a lookup) are not matmul parameters.

    Examples:
        >>> from examples.decoder import CONFIGS, model_flops
        >>> round(model_flops(CONFIGS["llama2-7b"], 1, 4096) / 1e12, 1)   # TFLOPs per sequence
        188.8
    """
    d, h, k, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
    # An MoE layer's matmul parameters per token: its router and the experts it runs.
    mlp = 3 * d * cfg.ffw * (cfg.experts_per_token if cfg.experts else 1) + d * cfg.experts
    matmul = cfg.layers * (2 * d * h * hd + 2 * d * k * hd + mlp) + cfg.vocab * d
    tokens = batch * seq
    return 6.0 * matmul * tokens + 12.0 * cfg.layers * cfg.heads * cfg.head_dim * seq * tokens


def tensor_rules(cfg: DecoderConfig, axis: str = "tensor") -> list[tuple[str, tuple[Any, ...]]]:
    """Megatron's tensor-parallel layouts of this decoder's variables, as ``(regex, specs)``
    rules (``HybridStrategy(rules=...)``): query/key/value and the MLP's gate/up split
    their heads or features, the attention out and MLP down their input, the embeddings
    (and Llama's head) the vocabulary. Scanned layers carry a leading layer dimension.

    Examples:
        >>> from examples.decoder import CONFIGS, tensor_rules
        >>> tensor_rules(CONFIGS["llama2-70b"])[0]
        ('attn/(query|key|value)$', (None, 'tensor', None))
        >>> tensor_rules(CONFIGS["llama2-70b"].replace(scan=True))[0][1]   # (layer, d, heads, hd)
        (None, None, 'tensor', None)
    """
    t, layer = axis, (None,) if cfg.scan else ()
    return [
        (r"attn/(query|key|value)$", (*layer, None, t, None)),
        (r"attn/out$", (*layer, t, None, None)),
        (r"mlp/(gate|up)$", (*layer, None, t)),
        (r"mlp/down$", (*layer, t, None)),
        (r"(^|/)embed$", (t, None)),
        (r"(^|/)head$", (None, t)),
    ]


def loss_fn(model: Decoder, batch: dict[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy of ``batch["x"]`` against ``batch["y"]``."""
    import optax

    cfg = model.cfg
    if cfg.loss_chunks > 1:
        x, aux, head = model.features(batch["x"])
        loss = chunked_cross_entropy(x, head, batch["y"], cfg.loss_chunks)
    elif not cfg.experts:
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    else:
        logits, aux = model(batch["x"], with_aux=True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss + cfg.aux_loss_weight * aux if cfg.experts else loss


def chunked_cross_entropy(
    x: jax.Array, head: jax.Array, targets: jax.Array, chunks: int
) -> jax.Array:
    """Mean cross-entropy of the logits ``x @ head`` against ``targets``, the vocabulary in
    ``chunks`` slices of the head: a scan keeps one slice's float32 logits at a time (a
    running log-sum-exp and the targets' logits), each recomputed in the backward pass
    (MaxText's vocabulary tiling). ``x`` ``(..., d)``, ``head`` ``(d, vocab)``."""
    vocab = head.shape[-1]
    if vocab % chunks:
        raise ValueError(
            f"chunked_cross_entropy: the vocabulary ({vocab}) does not divide into {chunks} "
            "chunks; choose loss_chunks dividing it."
        )
    n = vocab // chunks
    slices = head.reshape(head.shape[0], chunks, n).transpose(1, 0, 2)
    lead = targets.shape
    neg = jnp.full(lead, -jnp.inf, jnp.float32)

    @jax.checkpoint
    def body(carry: Any, piece: Any) -> Any:
        top, total, picked = carry
        w, j = piece
        logits = jnp.einsum("...d,dv->...v", x, w).astype(jnp.float32)
        new_top = jnp.maximum(top, logits.max(-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        local = targets - j * n
        inside = (local >= 0) & (local < n)
        mine = jnp.take_along_axis(logits, jnp.clip(local, 0, n - 1)[..., None], -1)[..., 0]
        return (new_top, total, picked + jnp.where(inside, mine, 0.0)), None

    init = (neg, jnp.zeros(lead, jnp.float32), jnp.zeros(lead, jnp.float32))
    (top, total, picked), _ = jax.lax.scan(body, init, (slices, jnp.arange(chunks)))
    return (top + jnp.log(total) - picked).mean()


# ---------------------------------------------------------- Hugging Face checkpoints
def _hf() -> Any:
    """``examples/hf.py``, whether this module is ``examples.decoder`` or loaded from its path."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    if __package__:
        return importlib.import_module(f"{__package__}.hf")
    key = "_dtensor_example_hf"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name("hf.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def from_hf_config(path_or_dict: Any, **changes: Any) -> DecoderConfig:
    """A :class:`DecoderConfig` from a Hugging Face ``config.json`` (Llama, Mistral, Mixtral,
    Gemma, Gemma 3 text): see ``examples/hf.py``."""
    return _hf().from_hf_config(path_or_dict, config_cls=DecoderConfig, **changes)


def hf_mapping(cfg: DecoderConfig, **options: Any) -> Any:
    """The :class:`dtensor.checkpoint.Mapping` between ``cfg``'s Hugging Face tensor names and
    this decoder's paths: see ``examples/hf.py``."""
    return _hf().hf_mapping(cfg, **options)
