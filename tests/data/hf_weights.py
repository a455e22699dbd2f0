"""Tiny Llama and Gemma weights under Hugging Face's names, from NumPy alone (no torch).

``make_hf.py`` (run once, in a scratch venv with ``transformers``) loads these
same weights into ``LlamaForCausalLM`` / ``GemmaForCausalLM`` and stores their
logits beside this file; the suite regenerates the weights here and checks its
own forward passes against those logits. ``numpy.random.default_rng`` streams
are stable across NumPy releases; ``checksum`` is stored with the logits so a
drift would show as a clear failure rather than a logit mismatch.
"""

from __future__ import annotations

import numpy as np

#: The tiny configurations, as ``config.json`` keys (float32, grouped KV heads, untied Llama head).
LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "float32",
}
GEMMA = {
    "model_type": "gemma",
    "architectures": ["GemmaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "float32",
}

#: Gemma 3's text decoder, shaped as benchmarks/flax_gemma_model.py's ``tiny`` Flax Gemma 3
#: (a sliding layer of 8 tokens, then a global one; RoPE bases 1e4 local, 1e6 global, the
#: global one scaled linearly by 8 as Gemma 3 12B's; query/key norms; four norms a layer).
GEMMA3 = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 16,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "torch_dtype": "float32",
}


def weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of the model, float32, named and shaped as ``transformers`` stores it."""
    rng = np.random.default_rng(seed)
    d, f, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h, k, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    gemma = config["model_type"].startswith("gemma")

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # Gemma stores w for (1 + w), Llama w itself
        return normal((n,), 0.1) + np.float32(0.0 if gemma else 1.0)

    out = {"model.embed_tokens.weight": normal((vocab, d), 1.0 if not gemma else 0.125)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = norm(d)
        out[p + "self_attn.q_proj.weight"] = normal((h * hd, d), d**-0.5)
        out[p + "self_attn.k_proj.weight"] = normal((k * hd, d), d**-0.5)
        out[p + "self_attn.v_proj.weight"] = normal((k * hd, d), d**-0.5)
        out[p + "self_attn.o_proj.weight"] = normal((d, h * hd), (h * hd) ** -0.5)
        out[p + "post_attention_layernorm.weight"] = norm(d)
        out[p + "mlp.gate_proj.weight"] = normal((f, d), d**-0.5)
        out[p + "mlp.up_proj.weight"] = normal((f, d), d**-0.5)
        out[p + "mlp.down_proj.weight"] = normal((d, f), f**-0.5)
        if config["model_type"] == "gemma3_text":  # query/key norms, norms after each part
            out[p + "self_attn.q_norm.weight"] = norm(hd)
            out[p + "self_attn.k_norm.weight"] = norm(hd)
            out[p + "pre_feedforward_layernorm.weight"] = norm(d)
            out[p + "post_feedforward_layernorm.weight"] = norm(d)
    out["model.norm.weight"] = norm(d)
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = normal((vocab, d), d**-0.5)
    return out


def tokens(config: dict, seed: int = 1, shape: tuple[int, int] = (2, 16)) -> np.ndarray:
    """The token batch the stored logits are for."""
    return np.random.default_rng(seed).integers(0, config["vocab_size"], shape).astype(np.int32)


def checksum(tensors: dict[str, np.ndarray]) -> float:
    """A number that changes when any weight does (stored with the logits)."""
    return float(sum(float(np.abs(v).astype(np.float64).sum()) for v in tensors.values()))
