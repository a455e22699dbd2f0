"""What ``python -m dtensor.aot --search`` needs to know about this script's model: its shapes
and the flags it accepts (``examples/train.py``'s ``search_facts`` hook).

The search (:mod:`dtensor.tpu.plans`) enumerates plans whose axis sizes divide the model's
dimensions and estimates each plan's memory and step time from these figures before it
compiles any; the flags listed are the knobs it may turn (a script that lists fewer gets a
smaller search).
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["DECODER_FLAGS", "MEMORY_FLAGS", "search_facts"]

#: The memory rungs this script takes for any model (``examples/options.py``).
MEMORY_FLAGS = (
    "--strategy",
    "--data",
    "--tensor",
    "--mixed-precision",
    "--no-reshard-after-forward",
    "--gather-layers",
    "--offload-optimizer",
)
#: ... and for the decoder (``examples/decoder.py``): remat, scan, and the axes its blocks take.
DECODER_FLAGS = (
    "--remat",
    "--remat-policy",
    "--scan",
    "--stage",
    "--microbatches",
    "--schedule",
    "--context",
    "--context-mode",
    "--expert",
    "--across-slices",
    "--loss-chunks",
    "--loss-tiling",
)


def search_facts(args: argparse.Namespace, decoder: Any, sizes: dict[str, tuple[int, ...]]) -> dict:
    """The model's shapes, one step's model FLOPs and the flags the script accepts.

    Args:
        args: the parsed command line (``examples/options.py``).
        decoder: ``examples/decoder.py`` (its ``CONFIGS``, ``param_count``, ``model_flops``).
        sizes: the character-level model's sizes (``examples/options.py``'s ``SIZES``).

    Returns:
        A dict with ``params``, ``layers``, ``heads``, ``kv_heads``, ``head_dim``, ``hidden``,
        ``ffn``, ``experts``, ``experts_per_token``, ``vocab``, ``tied``, ``batch``, ``seq``,
        ``attention``, ``block``, ``model_flops`` and ``flags``.
    """
    batch = args.batch_size
    if args.model_size in decoder.CONFIGS:
        cfg = decoder.CONFIGS[args.model_size]
        seq = args.seq_len or 1024
        return {
            "params": decoder.param_count(cfg),
            "layers": cfg.layers,
            "heads": cfg.heads,
            "kv_heads": cfg.kv_heads,
            "head_dim": cfg.head_dim,
            "hidden": cfg.d_model,
            "ffn": cfg.ffw,
            "experts": cfg.experts,
            "experts_per_token": cfg.experts_per_token if cfg.experts else 0,
            "vocab": cfg.vocab,
            "tied": cfg.tied,
            "batch": batch,
            "seq": seq,
            "attention": args.attention or ("xla" if cfg.block == "gemma3" else cfg.attention),
            "block": cfg.block,
            "model_flops": decoder.model_flops(cfg, batch, seq),
            "flags": [*MEMORY_FLAGS, *DECODER_FLAGS],
            # the per-tensor remat plans the search may try: the decoder names MaxText's tensors
            "remat_policies": ["qkv_proj_offloaded", "minimal_offloaded", "layer_input_offloaded"],
        }
    dim, layers, heads, mlp, seq = sizes[args.model_size]
    seq = args.seq_len or seq
    vocab = 128
    block = 4 * dim * dim + 2 * dim * mlp + mlp + 5 * dim  # attention, MLP, biases, 2 norms
    params = layers * block + vocab * dim + seq * dim + 2 * dim + dim * vocab + vocab
    matmul = layers * (4 * dim * dim + 2 * dim * mlp) + dim * vocab
    return {
        "params": params,
        "layers": layers,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": dim // heads,
        "hidden": dim,
        "ffn": mlp,
        "experts": 0,
        "experts_per_token": 0,
        "vocab": vocab,
        "tied": False,
        "batch": batch,
        "seq": seq,
        "attention": "xla",  # nnx.MultiHeadAttention: float32 scores
        "block": "char",
        "model_flops": 6.0 * matmul * batch * seq + 12.0 * layers * dim * seq * batch * seq,
        # The character model takes no remat (it has no Block class the preset can name).
        "flags": list(MEMORY_FLAGS),
    }
