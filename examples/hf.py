"""Hugging Face checkpoints <-> ``examples/decoder.py`` (and Flax's own Gemma example).

:func:`from_hf_config` reads a ``config.json`` (Llama, Mistral, Mixtral, Gemma, Gemma 3
text) into a :class:`~examples.decoder.DecoderConfig`; :func:`hf_mapping` gives the
:class:`dtensor.checkpoint.Mapping` between that architecture's Hugging Face tensor names
and the decoder's paths; :func:`to_hf_config` writes the ``config.json`` back;
:func:`flax_gemma_mapping` does the same for Flax's ``examples/gemma`` ``Transformer``.

    >>> from examples.hf import from_hf_config, hf_mapping
    >>> cfg = from_hf_config({"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    ...     "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...     "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu"})
    >>> cfg.block, cfg.head_dim, cfg.norm_eps
    ('llama', 16, 1e-05)
    >>> hf_mapping(cfg).source("blocks/1/attn/query").names
    ('model.layers.1.self_attn.q_proj.weight',)

Hugging Face stores a Linear's weight ``[out, in]``; the decoder keeps ``[in, out]``, with
attention weights split by head (``query [d, heads, head_dim]``, ``out [heads, head_dim,
d]``). Both rotate RoPE by halves (``rotate_half``), so no RoPE permutation is needed.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

from dtensor.checkpoint import Mapping, Rule, astype, split_dim, transpose

__all__ = ["flax_gemma_mapping", "from_hf_config", "hf_mapping", "save_hf_folder", "to_hf_config"]

ARCHITECTURES = ("llama", "mistral", "mixtral", "gemma", "gemma3_text")


def _read(path_or_dict: Any) -> dict[str, Any]:
    if isinstance(path_or_dict, dict):
        return dict(path_or_dict)
    from dtensor.checkpoint import storage

    p = storage.resolve(path_or_dict)
    if p.is_dir():
        p = p / "config.json"
    return json.loads(p.read_text())


def _unsupported(key: str, value: Any, what: str) -> ValueError:
    return ValueError(
        f"config.json has {key}={value!r}: {what}; examples/decoder.py cannot run this model "
        "as published. Use a checkpoint without it, or extend the decoder."
    )


def from_hf_config(path_or_dict: Any, *, config_cls: Any = None, **changes: Any) -> Any:
    """A ``DecoderConfig`` from a Hugging Face ``config.json`` (a path, a folder, or its dict).

    ``changes`` override fields (``scan=True``, ``dtype=jnp.bfloat16``, ``max_len=...``).
    Features the decoder does not implement are refused (biases, soft-capping), or warned
    about where only long contexts differ (RoPE scaling).
    """
    c = _read(path_or_dict)
    kind = c.get("model_type")
    if kind == "gemma3" and "text_config" in c:
        raise ValueError(
            "config.json is Gemma 3's multimodal model (model_type 'gemma3'); load its text "
            "decoder's checkpoint (model_type 'gemma3_text', e.g. google/gemma-3-1b-pt)."
        )
    if kind not in ARCHITECTURES:
        raise ValueError(
            f"config.json has model_type={kind!r}; from_hf_config reads {ARCHITECTURES}. Write "
            "a DecoderConfig and a dtensor.checkpoint.Mapping for it by hand."
        )
    if config_cls is None:
        from examples.decoder import DecoderConfig as config_cls
    heads = c["num_attention_heads"]
    rope = c.get("rope_parameters") or {}
    theta = c.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = c.get("rope_scaling") or (
        {} if rope.get("rope_type", "default") == "default" else rope
    )
    if scaling:
        warnings.warn(
            f"config.json asks for RoPE scaling {scaling}, which examples/decoder.py does not "
            "apply: logits differ from Hugging Face's (most at long positions).",
            stacklevel=2,
        )
    for key in ("attention_bias", "mlp_bias"):
        if c.get(key):
            raise _unsupported(key, c[key], "the decoder's projections have no bias")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if c.get(key) is not None:
            raise _unsupported(key, c[key], "the decoder does not soft-cap logits")
    fields: dict[str, Any] = dict(
        vocab=c["vocab_size"],
        d_model=c["hidden_size"],
        layers=c["num_hidden_layers"],
        heads=heads,
        kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        ffw=c["intermediate_size"],
        max_len=c.get("max_position_embeddings", 8192),
        rope_base=float(theta),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
    )
    act = c.get("hidden_activation") or c.get("hidden_act")
    if kind in ("llama", "mistral", "mixtral"):
        if act != "silu":
            raise _unsupported("hidden_act", act, "the Llama block's MLP is SwiGLU (silu)")
        if c.get("sliding_window") is not None:
            warnings.warn(
                f"config.json has sliding_window={c['sliding_window']}; the Llama block attends "
                "to the whole context (equal up to that many tokens).",
                stacklevel=2,
            )
        fields["block"] = "llama"
        if kind == "mixtral":
            fields["experts"] = c["num_local_experts"]
            fields["experts_per_token"] = c["num_experts_per_tok"]
    else:
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise _unsupported("hidden_activation", act, "Gemma's MLP is tanh-approximated GELU")
        if not c.get("tie_word_embeddings", True):
            raise _unsupported("tie_word_embeddings", False, "Gemma's head is its embedding")
        fields["block"] = "gemma" if kind == "gemma" else "gemma3"
    if kind == "gemma3_text":
        fields["rope_base"] = float(c.get("rope_local_base_freq", 10000.0))
        fields["global_rope_base"] = float(theta)
        fields["sliding_window"] = c.get("sliding_window") or 4096
        types = c.get("layer_types")
        every = c.get("sliding_window_pattern")
        if types and "full_attention" in types:
            every = types.index("full_attention") + 1
        fields["global_every"] = every or 6
        scalar = c.get("query_pre_attn_scalar", fields["head_dim"])
        if scalar != fields["head_dim"]:
            raise _unsupported("query_pre_attn_scalar", scalar, "the decoder scales by head_dim")
    cfg = config_cls(**fields)
    return cfg.replace(**changes) if changes else cfg


def _layer(cfg: Any) -> tuple[str, str]:
    """The checkpoint's per-layer name prefix and the decoder's (scanned: one stacked path)."""
    return "model.layers.{i}.", ("layers/" if cfg.scan else "blocks/{i}/")


def hf_mapping(cfg: Any, *, load_dtype: Any = None, save_dtype: Any = None) -> Mapping:
    """The Hugging Face names of ``cfg``'s architecture <-> :class:`Decoder` paths.

    Loading widens float tensors to the model's dtype where no value changes (a bfloat16 or
    float16 checkpoint into float32 master weights) and refuses any other dtype, naming the
    tensor, its file and both dtypes (an ``int32``, ``uint8`` or ``bool`` tensor is not a
    weight to read as float32; a float32 one into bfloat16 weights loses bits):
    ``load_dtype`` (e.g. ``"bfloat16"``) asks for the cast to it, whatever is stored.
    Saving writes the model's dtype, or ``save_dtype``. A Llama checkpoint without
    ``lm_head.weight`` (its ``config.json`` ties the head, as Llama 3.2 1B's) fills the
    decoder's own ``head`` from the embedding; a save writes ``lm_head.weight``.
    """
    ck, at = _layer(cfg)
    cast = astype(load_dtype, saved=save_dtype)
    h, k = cfg.heads, cfg.kv_heads
    rules: list[Any] = [
        Rule("model.embed_tokens.weight", "embed", cast),
        Rule("model.norm.weight", "final_norm/scale", cast),
        Rule(ck + "input_layernorm.weight", at + "attn_norm/scale", cast),
        Rule(
            ck + "self_attn.q_proj.weight",
            at + "attn/query",
            transpose(),
            split_dim(1, (h, -1)),
            cast,
        ),
        Rule(
            ck + "self_attn.k_proj.weight",
            at + "attn/key",
            transpose(),
            split_dim(1, (k, -1)),
            cast,
        ),
        Rule(
            ck + "self_attn.v_proj.weight",
            at + "attn/value",
            transpose(),
            split_dim(1, (k, -1)),
            cast,
        ),
        Rule(
            ck + "self_attn.o_proj.weight",
            at + "attn/out",
            transpose(),
            split_dim(0, (h, -1)),
            cast,
        ),
    ]
    if cfg.block == "gemma3":
        rules += [
            Rule(ck + "self_attn.q_norm.weight", at + "attn/query_norm/scale", cast),
            Rule(ck + "self_attn.k_norm.weight", at + "attn/key_norm/scale", cast),
            Rule(ck + "post_attention_layernorm.weight", at + "post_attn_norm/scale", cast),
            Rule(ck + "pre_feedforward_layernorm.weight", at + "mlp_norm/scale", cast),
            Rule(ck + "post_feedforward_layernorm.weight", at + "post_mlp_norm/scale", cast),
        ]
    else:
        rules.append(Rule(ck + "post_attention_layernorm.weight", at + "mlp_norm/scale", cast))
    if cfg.experts:  # Mixtral's names: w1 gate, w3 up, w2 down, each [out, in] per expert
        moe = ck + "block_sparse_moe."
        rules += [
            Rule(moe + "gate.weight", at + "moe/router", transpose(), cast),
            Rule(moe + "experts.{e}.w1.weight", at + "moe/experts/gate", transpose(), cast),
            Rule(moe + "experts.{e}.w3.weight", at + "moe/experts/up", transpose(), cast),
            Rule(moe + "experts.{e}.w2.weight", at + "moe/experts/down", transpose(), cast),
        ]
    else:
        rules += [
            Rule(ck + "mlp.gate_proj.weight", at + "mlp/gate", transpose(), cast),
            Rule(ck + "mlp.up_proj.weight", at + "mlp/up", transpose(), cast),
            Rule(ck + "mlp.down_proj.weight", at + "mlp/down", transpose(), cast),
        ]
    ignore = [r".*\.rotary_emb\.inv_freq"]
    if cfg.tied:
        ignore.append(r"lm_head\.weight")
    else:  # lm_head.weight, or (a tied checkpoint) the embedding: the first the file holds
        rules.append(Rule("lm_head.weight", "head", transpose(), cast))
        rules.append(Rule("model.embed_tokens.weight", "head", transpose(), cast, save=False))
    return Mapping(rules, ignore=ignore)


def to_hf_config(cfg: Any, *, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` as Hugging Face ``transformers`` reads it."""
    kind = {"llama": "mixtral" if cfg.experts else "llama", "gemma": "gemma"}.get(
        cfg.block, "gemma3_text"
    )
    arch = {
        "llama": "LlamaForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "gemma": "GemmaForCausalLM",
    }
    out: dict[str, Any] = {
        "architectures": [arch.get(kind, "Gemma3ForCausalLM")],
        "model_type": kind,
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffw,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_base,
        "tie_word_embeddings": cfg.tied,
        "torch_dtype": dtype,
    }
    if cfg.block == "llama":
        out.update(hidden_act="silu", attention_bias=False, mlp_bias=False)
        if cfg.experts:
            out.update(num_local_experts=cfg.experts, num_experts_per_tok=cfg.experts_per_token)
    else:
        out.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")
    if cfg.block == "gemma3":
        out.update(
            rope_theta=cfg.global_rope_base,
            rope_local_base_freq=cfg.rope_base,
            sliding_window=cfg.sliding_window,
            sliding_window_pattern=cfg.global_every,
            query_pre_attn_scalar=cfg.head_dim,
        )
    return out


def save_hf_folder(
    path: Any, model: Any, cfg: Any, *, like: Any = None, max_shard_size: int | str = "5GB"
) -> str:
    """Write ``model`` (a ``Decoder`` of ``cfg``, laid out in any way) as a Hugging Face model
    folder that ``transformers``' ``from_pretrained`` reads: ``config.json``, the safetensors
    files and their index; returns the index's (or the one file's) path.

    ``like``: the folder (or ``config.json``) the model was loaded from; its ``config.json``
    is written again with every field kept (token ids, RoPE scaling...), but the dtype the
    weights are saved in and the head untied where the decoder's is (a tied Llama's head is
    trained on its own here). Without it: :func:`to_hf_config`. Every process calls it (a
    collective: :func:`dtensor.checkpoint.save_safetensors`, which writes beside an existing
    folder and swaps the new one in whole, config and weights together).
    """
    import numpy as np

    from dtensor.checkpoint import save_safetensors

    dtype = np.dtype(cfg.param_dtype).name
    config = _read(like) if like is not None else to_hf_config(cfg, dtype=dtype)
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype"]
    config.update({k: dtype for k in keys}, tie_word_embeddings=bool(cfg.tied))
    return save_safetensors(
        path,
        model,
        mapping=hf_mapping(cfg),
        max_shard_size=max_shard_size,
        extra_files={"config.json": json.dumps(config, indent=2, sort_keys=True) + "\n"},
    )


def flax_gemma_mapping(config: Any, *, load_dtype: Any = None, save_dtype: Any = None) -> Mapping:
    """Hugging Face Gemma names <-> Flax's ``examples/gemma`` ``Transformer`` (its
    ``TransformerConfig``): ``q_einsum [heads, d, head_dim]``, ``kv_einsum [2, kv_heads, d,
    head_dim]`` (or ``qkv_einsum [3, ...]`` when the head counts are equal), ``attn_vec_einsum
    [heads, head_dim, d]``, ``nnx.Linear`` MLP kernels ``[in, out]``. Gemma 2/3's four norms
    a layer when ``use_post_attn_norm``, else Gemma 1's two. Dtypes as :func:`hf_mapping`'s."""
    h, k = config.num_heads, config.num_kv_heads
    ck, at = "model.layers.{i}.", "layers/{i}/"
    cast = astype(load_dtype, saved=save_dtype)
    heads = (split_dim(0, (h, -1)), transpose(0, 2, 1))  # [h*hd, d] -> [h, d, hd]
    kv = (split_dim(0, (k, -1)), transpose(0, 2, 1))
    rules: list[Any] = [
        Rule("model.embed_tokens.weight", "embedder/embedding", cast),
        Rule("model.norm.weight", "final_norm/scale", cast),
        Rule(ck + "input_layernorm.weight", at + "pre_attention_norm/scale", cast),
        Rule(ck + "self_attn.q_proj.weight", at + "attn/q_einsum/kernel", *heads, cast),
        Rule(
            ck + "self_attn.{kv}_proj.weight",
            at + "attn/kv_einsum/kernel",
            *kv,
            cast,
            stack={"kv": ("k", "v")},
        ),
        Rule(
            ck + "self_attn.{qkv}_proj.weight",
            at + "attn/qkv_einsum/kernel",
            *heads,
            cast,
            stack={"qkv": ("q", "k", "v")},
        ),
        Rule(
            ck + "self_attn.o_proj.weight",
            at + "attn/attn_vec_einsum/kernel",
            transpose(),
            split_dim(0, (h, -1)),
            cast,
        ),
        Rule(ck + "self_attn.q_norm.weight", at + "attn/_query_norm/scale", cast),
        Rule(ck + "self_attn.k_norm.weight", at + "attn/_key_norm/scale", cast),
        Rule(ck + "mlp.gate_proj.weight", at + "mlp/gate_proj/kernel", transpose(), cast),
        Rule(ck + "mlp.up_proj.weight", at + "mlp/up_proj/kernel", transpose(), cast),
        Rule(ck + "mlp.down_proj.weight", at + "mlp/down_proj/kernel", transpose(), cast),
    ]
    if config.use_post_attn_norm:
        rules += [
            Rule(ck + "post_attention_layernorm.weight", at + "post_attention_norm/scale", cast),
            Rule(ck + "pre_feedforward_layernorm.weight", at + "pre_ffw_norm/scale", cast),
            Rule(ck + "post_feedforward_layernorm.weight", at + "post_ffw_norm/scale", cast),
        ]
    else:
        rules.append(Rule(ck + "post_attention_layernorm.weight", at + "pre_ffw_norm/scale", cast))
    return Mapping(rules, ignore=[r"lm_head\.weight", r".*\.rotary_emb\.inv_freq"])
