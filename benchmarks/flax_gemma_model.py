"""Flax's own Gemma 3 (``examples/gemma`` of the flax sdist, unchanged) trained one step under a preset.

    python -m dtensor.aot --topology v5e:4x4 -- benchmarks/flax_gemma_model.py \\
        --strategy fully_sharded --model-size gemma3-12b --batch-size 16 --seq-len 1024 \\
        --mixed-precision bf16 --remat

A script for ``python -m dtensor.aot`` (its ``aot_step`` hook, and so for
``--fit``): it takes the flags of ``examples/train.py`` (``examples/options.py``),
builds Flax's ``transformer.Transformer`` abstractly (``nnx.eval_shape``) and
returns the preset with an AdamW next-token step. The code comes from the
cache :mod:`benchmarks.third_party` fills (``make third-party``). The remat
unit is Flax's ``modules.Block`` (``--remat-class`` picks another of its
classes, e.g. ``FeedForward``). ``--scan`` is not Flax's code: the model's
blocks are a Python list, so it is refused with the change it needs.

``--strategy hybrid --tensor T`` splits the weights over ``tensor`` as Flax's own
``ShardingConfig.fsdp_tp_sharding`` does (:func:`tensor_rules`), FSDP on the other
dimensions. The ``search_facts`` hook gives ``python -m dtensor.aot --search`` the
model's shapes and the flags this script takes (no scan, stages, context or experts:
Flax's blocks are a list and its attention is its own).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIZES = ("tiny", "gemma3-12b")


def flax_gemma() -> tuple[Any, Any, Any]:
    """Flax's ``transformer``, ``modules`` and ``transformer_cfg`` modules, from the cache."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.third_party import gemma_dir

    folder = str(gemma_dir())
    if folder not in sys.path:
        sys.path.insert(0, folder)  # its modules import each other as top-level names
    names = ("transformer", "modules", "transformer_cfg")
    return tuple(importlib.import_module(n) for n in names)  # type: ignore[return-value]


def config(size: str, **override: Any) -> Any:
    """Flax's ``TransformerConfig``: ``gemma3_12b`` as published, or a tiny one of the same kind."""
    _, _, cfg = flax_gemma()
    if size == "gemma3-12b":
        return cfg.TransformerConfig.gemma3_12b(**override)
    if size != "tiny":
        raise ValueError(f"--model-size {size!r} is not one of {SIZES}; pass one of those.")
    layers = override.pop("num_layers", 2)
    pattern = (cfg.AttentionType.LOCAL_SLIDING, cfg.AttentionType.GLOBAL)
    tiny = dict(
        num_layers=layers,
        num_embed=128,
        embed_dim=64,
        hidden_dim=128,
        num_heads=4,
        head_dim=16,
        num_kv_heads=2,
        sliding_window_size=8,
        attention_types=cfg.make_attention_layers_types(pattern, layers),
    )
    return cfg.TransformerConfig.gemma3_12b(**{**tiny, **override})


def tensor_rules(axis: str = "tensor") -> list[tuple[str, tuple[Any, ...]]]:
    """Flax's own tensor-parallel layouts of its Gemma's weights, as ``(regex, specs)``
    rules for ``HybridStrategy(rules=...)``: the ``tensor`` entries of
    ``ShardingConfig.fsdp_tp_sharding`` (heads, KV heads, MLP features, vocabulary), its
    ``fsdp`` entries left to the preset (which splits another dimension over ``fsdp``).
    Flax's config also splits the norms' scales over ``tensor``; they stay whole here."""
    _, _, cfg = flax_gemma()
    shd = cfg.ShardingConfig.fsdp_tp_sharding(tensor_parallel_axis_name=axis)

    def only_tensor(spec: Any) -> tuple[Any, ...]:
        return tuple(a if a == axis else None for a in spec)

    where = {  # the module a ShardingConfig entry annotates (modules.py), by its path
        r"embedder/embedding$": shd.emb_vd,  # ScaledEmbed, an nnx.Embed
        r"attn/q_einsum/kernel$": shd.q_weight_ndh,
        r"attn/kv_einsum/kernel$": shd.kv_weight_cndh,
        r"attn/qkv_einsum/kernel$": shd.qkv_weight_cndh,
        r"attn/attn_vec_einsum/kernel$": shd.o_weight_nhd,
        r"mlp/(gate_proj|up_proj)/kernel$": shd.ffw_weight_df,
        r"mlp/down_proj/kernel$": shd.ffw_weight_fd,
    }
    return [(path, only_tensor(spec)) for path, spec in where.items()]


def build(cfg: Any, *, seed: int = 0, lr: float = 1e-3, eps: float = 1e-8) -> tuple[Any, Any]:
    """Flax's ``Transformer`` and an AdamW ``nnx.Optimizer`` over its params (``eps``:
    AdamW's; the equality tests take 1e-3, so a gradient's scale shows in the update)."""
    import optax
    from flax import nnx

    transformer, _, _ = flax_gemma()
    model = transformer.Transformer(cfg, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(lr, eps=eps, weight_decay=0.01), wrt=nnx.Param)


def loss_fn(model: Any, batch: dict[str, Any]) -> Any:
    """Mean next-token cross-entropy of ``batch["y"]`` given ``batch["x"]`` (causal, no padding)."""
    import jax.numpy as jnp
    import optax

    transformer, _, _ = flax_gemma()
    tokens = batch["x"]
    mask = jnp.ones(tokens.shape, dtype=jnp.bool_)
    positions = transformer.build_positions_from_mask(mask)
    logits, _ = model(tokens, positions, None, transformer.make_causal_attn_mask(mask))
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def train_step(model: Any, optimizer: Any, batch: dict[str, Any]) -> Any:
    """One AdamW step on :func:`loss_fn`; returns the loss."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def _options() -> Any:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import options  # pyright: ignore[reportMissingImports]
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return options


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``examples/train.py``'s flags (``--model-size`` here: tiny, gemma3-12b) plus ``--remat-class``."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--model-size", default="tiny", choices=SIZES)
    p.add_argument("--remat-class", default="Block", help="the Flax class to remat (modules.X)")
    ours, rest = p.parse_known_args(argv)
    args = _options().parse_args(rest)
    args.model_size, args.remat_class = ours.model_size, ours.remat_class
    return args


def aot_step(argv: list[str], *, devices: Any) -> tuple[Any, Any, tuple[Any, ...]]:
    """For ``python -m dtensor.aot``: the preset over ``devices``, the step, abstract args."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    args = parse_args(argv)
    if args.scan:
        raise ValueError(
            "--scan: Flax's Gemma keeps its blocks in a Python list (Transformer.layers) and "
            "calls them in a loop; it has no scanned form, and its blocks differ (5 local : 1 "
            "global attention). Drop --scan."
        )
    _, modules, _ = flax_gemma()
    block = getattr(modules, args.remat_class)
    strategy, _, applied = _options().build_strategy(args, devices, block, rules=tensor_rules())
    for option, how in applied.items():
        print(f"{option}: {how}")
    cfg = config(args.model_size)
    seq = args.seq_len or 1024
    model, optimizer = nnx.eval_shape(lambda: build(cfg, seed=args.seed, lr=args.lr))
    batch = {k: jax.ShapeDtypeStruct((args.batch_size, seq), jnp.int32) for k in ("x", "y")}
    return strategy, train_step, (model, optimizer, batch)


def model_flops(argv: list[str]) -> float:
    """One training step's model FLOPs, counted as ``examples/decoder.py``'s ``model_flops``
    (PaLM's: ``6 x matmul parameters x tokens`` plus ``12 x layers x heads x head_dim x seq x
    tokens``; the sliding window not discounted), so the two models' MFU ceilings compare."""
    args = parse_args(argv)
    c = config(args.model_size)
    seq = args.seq_len or 1024
    tokens = args.batch_size * seq
    d, h, k, hd = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim
    matmul = c.num_layers * (2 * d * h * hd + 2 * d * k * hd + 3 * d * c.hidden_dim)
    matmul += c.num_embed * d  # the tied head
    return 6.0 * matmul * tokens + 12.0 * c.num_layers * h * hd * seq * tokens


#: The flags the search may set (``examples/options.py``'s): the presets' axes and memory
#: rungs. No ``--scan``, ``--stage``, ``--context`` or ``--expert``: Flax's blocks are a
#: Python list, its attention its own, and it has no experts.
SEARCH_FLAGS = (
    "--strategy",
    "--data",
    "--tensor",
    "--mixed-precision",
    "--remat",
    "--remat-policy",
    "--offload-optimizer",
)


def search_facts(argv: list[str]) -> dict[str, Any]:
    """For ``python -m dtensor.aot --search``: the model's shapes (its parameters counted
    from the abstract model), one step's model FLOPs and the flags this script takes.
    The precisions searched are float32 and ``bf16-compute``: Flax's modules pin
    ``dtype=float32``, so plain ``bf16`` (reads only) leaves float32 arithmetic."""
    import math

    import jax
    from flax import nnx

    args = parse_args(argv)
    c = config(args.model_size)
    model = nnx.eval_shape(lambda: build(c)[0])
    params = sum(math.prod(v.shape) for v in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {
        "params": params,
        "layers": c.num_layers,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden": c.embed_dim,
        "ffn": c.hidden_dim,
        "vocab": c.num_embed,
        "tied": True,
        "batch": args.batch_size,
        "seq": args.seq_len or 1024,
        "attention": "xla",
        "block": "flax-gemma3",
        "model_flops": model_flops(argv),
        "flags": list(SEARCH_FLAGS),
        "precisions": ["none", "bf16-compute"],
    }
