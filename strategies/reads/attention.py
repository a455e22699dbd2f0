"""Flax's attention under a ``context`` mesh axis, with the model unchanged.

Inside a step HybridStrategy(context=C) traces, calls of
``flax.nnx.dot_product_attention`` (a model's own, or ``nnx.MultiHeadAttention``'s
default ``attention_fn``) go to :func:`dtensor.context_attention`, which computes
each device's queries against keys and values gathered over ``context`` (or
passed round a ring). Calls it cannot serve — an attention ``bias``, dropout,
``sow_weights`` (``module=``), inputs other than ``[batch, length, heads,
head_dim]`` — stay Flax's own, which XLA's partitioner runs on the split
sequence as it is (gathering the keys and values it needs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import flax.nnx as nnx
import flax.nnx.nn.attention as flax_attention
from flax.nnx.nn.dtypes import promote_dtype as _promote_dtype

import dtensor

__all__ = ["flax_context_attention", "routed_flax_attention"]

_FLAX = flax_attention.dot_product_attention


def flax_context_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Callable[..., Any] = _promote_dtype,
    is_causal: bool = False,
) -> Any:
    """``flax.nnx.dot_product_attention``'s signature, computed by :func:`dtensor.context_attention`."""
    dropout = dropout_rate > 0.0 and not deterministic
    if bias is not None or dropout or module is not None or query.ndim != 4:
        return _FLAX(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            broadcast_dropout=broadcast_dropout,
            dropout_rng=dropout_rng,
            dropout_rate=dropout_rate,
            deterministic=deterministic,
            dtype=dtype,
            precision=precision,
            module=module,
            promote_dtype=promote_dtype,
            is_causal=is_causal,
        )
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    return dtensor.context_attention(query, key, value, causal=is_causal, mask=mask)


@contextlib.contextmanager
def routed_flax_attention() -> Iterator[None]:
    """Within the block, ``flax.nnx.dot_product_attention`` is :func:`flax_context_attention`."""
    saved = nnx.dot_product_attention, flax_attention.dot_product_attention
    nnx.dot_product_attention = flax_context_attention
    flax_attention.dot_product_attention = flax_context_attention
    try:
        yield
    finally:
        nnx.dot_product_attention, flax_attention.dot_product_attention = saved


def route_attention_fns(nodes: Any) -> None:
    """Point each ``nnx.MultiHeadAttention`` in ``nodes`` (objects merged inside a trace)
    whose ``attention_fn`` is Flax's default at :func:`flax_context_attention`."""
    for _, node in nnx.iter_graph(nodes):
        if isinstance(node, nnx.MultiHeadAttention) and node.attention_fn is _FLAX:
            node.attention_fn = flax_context_attention
