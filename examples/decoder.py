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

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def _sibling(name: str) -> Any:
    """``examples/<name>.py``, whether this module is ``examples.decoder`` or loaded from its
    path (as ``examples/train.py`` and ``python -m dtensor.aot`` load it): one module a name."""
    if __package__:
        return importlib.import_module(f"{__package__}.{name}")
    key = f"_dtensor_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        assert spec is not None and spec.loader is not None
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


# The configuration and the layers, by role (examples/decoder_config.py, decoder_layers.py).
_config, _layers = _sibling("decoder_config"), _sibling("decoder_layers")
ATTENTION, BLOCKS, CONFIGS = _config.ATTENTION, _config.BLOCKS, _config.CONFIGS
DecoderConfig, param_count = _config.DecoderConfig, _config.param_count
MLP, Attention, Block, Experts = _layers.MLP, _layers.Attention, _layers.Block, _layers.Experts
MoE, RMSNorm, attention_kind, rope = (
    _layers.MoE,
    _layers.RMSNorm,
    _layers.attention_kind,
    _layers.rope,
)
init_param, read_param = _layers.init_param, _layers.read_param

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
        self.embed = init_param(rngs, (cfg.vocab, cfg.d_model), 1, cfg)
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
            self.head = init_param(rngs, (cfg.d_model, cfg.vocab), cfg.d_model, cfg)

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
        embed = read_param(self.embed, cfg.dtype)
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
        head = embed.T if cfg.tied else read_param(self.head, cfg.dtype)
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
        tiled = fused_cross_entropy if cfg.loss_tiling == "tokens" else chunked_cross_entropy
        loss = tiled(x, head, batch["y"], cfg.loss_chunks)
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


def fused_cross_entropy(
    x: jax.Array, head: jax.Array, targets: jax.Array, chunks: int
) -> jax.Array:
    """Mean cross-entropy of the logits ``x @ head`` against ``targets``, the tokens in
    ``chunks`` slices, each slice's gradients computed in the forward pass: one slice's
    float32 logits live at a time, and nothing is recomputed in the backward pass (where
    :func:`chunked_cross_entropy` recomputes the logits, ``2 x tokens x d x vocab`` FLOPs:
    75 ms of Llama 3.1 8B's 10.7 s step floor at 32 x 32768 tokens on v5p-64). The backward
    pass scales the input's and the head's gradients by the loss's cotangent. Slice ``j``
    holds tokens ``j, j + chunks, ...`` of each sequence, so a batch split over devices
    stays split, and a sequence split over them too (its length over ``chunks`` is what is
    split). The head's gradient is accumulated in float32.
    ``x`` ``(batch, seq, d)``, ``head`` ``(d, vocab)``, ``targets`` ``(batch, seq)``.

        >>> import jax, jax.numpy as jnp, optax
        >>> x = jax.random.normal(jax.random.key(0), (2, 8, 4))
        >>> head = jax.random.normal(jax.random.key(1), (4, 16))
        >>> y = jax.random.randint(jax.random.key(2), (2, 8), 0, 16)
        >>> whole = optax.softmax_cross_entropy_with_integer_labels(x @ head, y).mean()
        >>> bool(jnp.allclose(fused_cross_entropy(x, head, y, 4), whole, rtol=1e-6))
        True
    """
    *lead, seq, _ = x.shape
    if seq % chunks:
        raise ValueError(
            f"fused_cross_entropy: the sequence ({seq} tokens) does not divide into {chunks} "
            "chunks; choose loss_chunks dividing it."
        )
    count = math.prod(targets.shape)

    def split(a: jax.Array) -> jax.Array:  # (..., seq, *rest) -> (chunks, ..., seq/chunks, *rest)
        k = len(lead)
        a = a.reshape(*a.shape[:k], seq // chunks, chunks, *a.shape[k + 1 :])
        return jnp.moveaxis(a, k + 1, 0)

    def merge(a: jax.Array) -> jax.Array:
        a = jnp.moveaxis(a, 0, len(lead) + 1)
        return a.reshape(*lead, seq, *a.shape[len(lead) + 2 :])

    def forward(x: jax.Array, head: jax.Array, targets: jax.Array) -> Any:
        def body(carry: Any, piece: Any) -> Any:
            total, grad_head = carry
            xs, ys = piece
            logits = jnp.einsum("...d,dv->...v", xs, head).astype(jnp.float32)
            lse = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, ys[..., None], -1)[..., 0]
            probs = jnp.exp(logits - lse[..., None])
            onehot = jax.nn.one_hot(ys, logits.shape[-1], dtype=jnp.float32)
            g = ((probs - onehot) / count).astype(x.dtype)
            dxs = jnp.einsum("...v,dv->...d", g, head).astype(x.dtype)
            grad_head = grad_head + jnp.einsum(
                "...d,...v->dv", xs, g, preferred_element_type=jnp.float32
            )
            return (total + (lse - picked).sum(), grad_head), dxs

        init = (jnp.zeros((), jnp.float32), jnp.zeros(head.shape, jnp.float32))
        (total, grad_head), dx = jax.lax.scan(body, init, (split(x), split(targets)))
        return total / count, (merge(dx), grad_head.astype(head.dtype))

    @jax.custom_vjp
    def loss(x: jax.Array, head: jax.Array, targets: jax.Array) -> jax.Array:
        return forward(x, head, targets)[0]

    def loss_bwd(grads: Any, ct: jax.Array) -> Any:
        dx, dhead = grads
        return (ct * dx).astype(dx.dtype), (ct * dhead).astype(dhead.dtype), None

    loss.defvjp(forward, loss_bwd)
    return loss(x, head, targets)


# ---------------------------------------------------------- Hugging Face checkpoints
def _hf() -> Any:
    """``examples/hf.py``, whether this module is ``examples.decoder`` or loaded from its path."""
    return _sibling("hf")


def from_hf_config(path_or_dict: Any, **changes: Any) -> DecoderConfig:
    """A :class:`DecoderConfig` from a Hugging Face ``config.json`` (Llama, Mistral, Mixtral,
    Gemma, Gemma 3 text): see ``examples/hf.py``."""
    return _hf().from_hf_config(path_or_dict, config_cls=DecoderConfig, **changes)


def hf_mapping(cfg: DecoderConfig, **options: Any) -> Any:
    """The :class:`dtensor.checkpoint.Mapping` between ``cfg``'s Hugging Face tensor names and
    this decoder's paths (``load_dtype=``, ``save_dtype=``): see ``examples/hf.py``. Only
    lossless float widening (bfloat16/float16 -> float32) loads without ``load_dtype``."""
    return _hf().hf_mapping(cfg, **options)
