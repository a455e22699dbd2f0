"""The decoder's configuration: :class:`DecoderConfig`, the size presets (:data:`CONFIGS`:
Gemma 2B/7B, Gemma 3 12B, Llama 2 7B/70B, Llama 3.1 8B/405B, Mixtral 8x7B and small ones for
tests) and :func:`param_count`. ``examples/decoder.py`` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = ["ATTENTION", "BLOCKS", "CONFIGS", "DecoderConfig", "param_count"]


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
    #: How the loss is sliced: ``"vocab"`` (:func:`chunked_cross_entropy`: slices of the
    #: vocabulary, the logits recomputed in the backward pass) or ``"tokens"``
    #: (:func:`fused_cross_entropy`: slices of the tokens, gradients taken in the forward
    #: pass, nothing recomputed).
    loss_tiling: str = "vocab"
    #: RMSNorm's epsilon (Hugging Face's ``rms_norm_eps``: 1e-5 for Llama 2 and 3).
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.loss_tiling not in ("vocab", "tokens"):
            raise ValueError(
                f"DecoderConfig(loss_tiling={self.loss_tiling!r}) is not a tiling; valid: "
                "'vocab', 'tokens'."
            )
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
#: ``llama3.1-8b``, ``llama3.1-70b``, ``llama3.1-405b`` are the public shapes; ``tiny-gemma3`` and ``tiny-llama`` small ones of
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
# Llama 3.1 70B (MaxText's llama3.1-70b; the Ironwood recipes' model): Llama 2 70B's layers
# with Llama 3's vocabulary and rotary base.
CONFIGS["llama3.1-70b"] = CONFIGS["llama2-70b"].replace(vocab=128256, rope_base=500_000.0)


def param_count(cfg: DecoderConfig) -> int:
    """Parameters of a decoder (embeddings included; counted once where they are tied)."""
    d, h, k, hd, f = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffw
    mlp = 3 * d * f if not cfg.experts else cfg.experts * (3 * d * f + d)  # experts + router
    block = 2 * d + d * h * hd * 2 + d * k * hd * 2 + mlp
    if cfg.block == "gemma3":
        block += 2 * d + 2 * hd  # post-attention and post-MLP norms; query and key norms
    embeddings = cfg.vocab * d * (1 if cfg.tied else 2)
    return embeddings + cfg.layers * block + d
