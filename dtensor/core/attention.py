"""Attention with the sequence split over a ``context`` mesh axis (context parallelism).

:func:`context_attention` is the one call a hand-written attention makes
(``flax.nnx.dot_product_attention``'s arguments, plus ``causal=`` and
``window=``). Without a ``context`` axis in the mesh it is plain attention
(float32 scores and softmax). Under a mesh whose ``context`` axis has size
``C`` the query, key and value arrive split along the sequence (each device a
contiguous ``1/C`` of it, as HybridStrategy(context=C) lays activations out)
and each device computes the attention of its own queries, in one of two modes:

- ``"gather"`` (MaxText's default): the keys and values are all-gathered over
  ``context`` (``2 x (C - 1) / C`` of the K/V bytes in, per device) and each
  device attends its ``S / C`` queries to all ``S`` keys: scores
  ``[S / C, S]`` per head.
- ``"ring"`` (ring attention, as PyTorch's ``context_parallel``): the keys and
  values go round a ring of ``C - 1`` collective permutes over ``context``
  (each one overlapping the attention of the block before it); each device
  folds one ``[S / C, S / C]`` block of scores a step into a running softmax
  (float32 maximum, sum and output), recomputed in the backward pass
  (``jax.checkpoint``). Causal attention is load-balanced: the queries, keys
  and values are first re-laid so that device ``i`` holds the ``i``-th and the
  ``(2C - 1 - i)``-th of ``2C`` chunks (two collective permutes, the output
  back by two more), and every ring step computes half a block on every device
  (the masked half is skipped), where the contiguous layout makes the last
  device compute a whole block at every step while the first skips all but one.
- ``"ulysses"`` (DeepSpeed-Ulysses, MaxText's ``context_parallel_strategy:
  ulysses``): an all-to-all over ``context`` turns the sequence split of the
  query, key and value into a head split (each device the whole sequence of
  ``heads / C`` heads), each device attends its heads over the whole sequence
  (no exchange inside attention), and an all-to-all turns the output back:
  ``4 x (C - 1) / C`` of a device's q/k/v/out bytes move, whatever ``C``. The
  heads (after ``tensor``) must divide over ``C``; key/value heads that do not
  (grouped-query attention with fewer KV heads than ``C``, where MaxText's
  Ulysses stops) are repeated ``C / gcd(kv_heads, C)`` times first, which
  multiplies their share of the exchange and of attention's key reads by that.
- ``"usp"`` (Ulysses x ring, "unified sequence parallelism"): for any head
  count. The ``C`` devices form ``R`` groups of ``U = gcd(C, heads)``
  consecutive ones (:func:`~dtensor.core.attention_xla.usp_factors`); within
  a group the sequence split becomes a head split as in ``"ulysses"`` (as
  ``U - 1`` collective permutes a tensor), the groups pass their keys and
  values round a ring of ``R - 1`` steps as in ``"ring"`` (not
  load-balanced), and the output goes back within the group. ``U = C`` is
  ``"ulysses"``, ``U = 1`` the ring.

Heads are split over ``tensor`` (when it divides the key/value heads) and the
batch over the batch axes (``data``, ``fsdp``, ``expert``), so attention needs
no other communication. ``mask`` (``True``: attend, broadcastable to ``[batch,
heads, q, k]``) works in every mode; with it the ring runs whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dtensor.core.attention_kernels import (
    best_implementation,
    cudnn_attention,
    mesh_text,
    splash_attention,
    trace_mesh,
    trace_platform,
)
from dtensor.core.attention_xla import (
    CONTEXT_SCOPE,
    MODES,
    attend,
    context_mode,
    current_mode,
    gather_sequence,
    ring_attend,
    ulysses_attend,
    usp_attend,
)

__all__ = [
    "CONTEXT_SCOPE",
    "IMPLEMENTATIONS",
    "MODES",
    "best_implementation",
    "context_attention",
    "context_mode",
    "trace_platform",
]

#: The values of :func:`context_attention`'s ``implementation``.
IMPLEMENTATIONS = ("xla", "splash", "cudnn", "auto")

_BATCH_AXES = ("data", "fsdp", "expert")


def context_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = False,
    mask: jax.Array | None = None,
    window: Any = None,
    scale: float | None = None,
    mode: str | None = None,
    axis: str = "context",
    batch_axes: Sequence[str] | None = None,
    head_axis: str = "tensor",
    implementation: str = "xla",
) -> jax.Array:
    """Multi-head (or grouped-query) attention, split over a ``context`` mesh axis.

    ``out[b, q, h] = sum_k softmax_k(scale * query[b, q, h] . key[b, k, h']) value[b, k, h']``
    with ``h' = h // (heads / kv_heads)``, over the keys ``mask`` and ``causal``
    allow.

    Args:
        query: ``[batch, q_len, heads, head_dim]``.
        key, value: ``[batch, kv_len, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
        causal: each query attends the keys at or before its position
            (``q_len == kv_len``).
        mask: ``True`` where a query may attend a key, broadcastable to
            ``[batch, heads, q_len, kv_len]`` (``flax.nnx.dot_product_attention``'s
            convention), or ``None``.
        window: with ``causal``, only the last ``window`` positions (a sliding
            window, Gemma 3's local layers; may be traced); ``None``: all.
        scale: the scores' factor (default ``head_dim ** -0.5``).
        mode: ``"gather"``, ``"ring"``, ``"ulysses"`` or ``"usp"`` under a ``context`` axis
            (default: the innermost :func:`context_mode`, else ``"gather"``).
        axis: the mesh axis the sequence is split over.
        batch_axes: the mesh axes the batch is split over (default: those of
            ``data``, ``fsdp``, ``expert`` the mesh has).
        head_axis: the mesh axis the heads are split over where it divides them.
        implementation: ``"xla"`` (einsums, float32 scores of each device's
            queries against the keys of a block) or ``"splash"`` (TPU only:
            the Pallas splash kernel on each device's queries against all the
            keys, gathered in ``"gather"`` mode under a ``context`` axis, its
            mask split over ``context`` with ``q_seq_shards``; separate dq and
            dk/dv kernels in the backward pass; no scores kept; causal or
            full, no ``mask``/``window``). Without a ``context`` axis it is
            the kernel on each device's batch (and heads) as they are split.
            ``"cudnn"`` (NVIDIA GPUs, bfloat16 or float16, no ``context`` axis,
            no ``mask``/``window``): cuDNN's fused attention,
            ``jax.nn.dot_product_attention(..., implementation="cudnn")``; no
            scores kept. ``"auto"``: splash where it takes the call on TPU,
            cuDNN where it does on GPU, else XLA (:func:`best_implementation`,
            the choice ``examples/decoder.py``'s ``attention="auto"`` makes).

    Returns:
        ``[batch, q_len, heads, head_dim]`` in ``query``'s dtype.

    Raises:
        ValueError: the shapes disagree, the sequence does not divide over
            ``axis`` (twice its size for load-balanced causal ring attention),
            or ``"cudnn"`` is asked for a call it cannot take.

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> q = k = v = jnp.ones((1, 4, 2, 8))
        >>> out = dtensor.context_attention(q, k, v, causal=True)
        >>> out.shape, float(out[0, 3, 1, 0])
        ((1, 4, 2, 8), 1.0)
    """
    _check(query, key, value, causal)
    mode = current_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"dtensor.context_attention(mode={mode!r}): valid modes are {MODES}.")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    mesh = trace_mesh()
    c = mesh.shape[axis] if mesh is not None and axis in mesh.axis_names else 1
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dtensor.context_attention(implementation={implementation!r}): valid are "
            f"{', '.join(map(repr, IMPLEMENTATIONS))}."
        )
    if implementation == "auto":
        implementation = best_implementation(query, key, causal, mask, window, mode, mesh, c)
    if implementation == "cudnn":
        return cudnn_attention(query, key, value, causal, mask, window, scale, mesh, c)
    if mask is not None:  # [batch | 1, heads | 1, q_len, kv_len], as both paths take it
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, mask.shape[:2] + (query.shape[1], key.shape[1]))
    if (mesh is None or c == 1) and implementation == "splash":
        spec = _specs(mesh, query, key, batch_axes, head_axis, None)
        return splash_attention(
            query, key, value, causal, mask, window, scale, "gather", mesh, axis, spec
        )
    if mesh is None or c == 1:
        qpos = jnp.arange(query.shape[1])
        kpos = jnp.arange(key.shape[1])
        return attend(query, key, value, qpos, kpos, causal, window, mask, scale)
    s = query.shape[1]
    balanced = mode == "ring" and causal and mask is None
    chunks = 2 * c if balanced else c
    if s % chunks or key.shape[1] % c:
        raise ValueError(
            f"dtensor.context_attention: the sequence ({s} queries, {key.shape[1]} keys) does "
            f"not divide into {chunks} chunks over the mesh axis {axis!r} of size {c} ("
            f"{mesh_text(mesh)}; load-balanced causal ring attention cuts it into 2 x {c}). "
            "Make the sequence length a multiple of it, or choose another context size."
        )
    spec = _specs(mesh, query, key, batch_axes, head_axis, axis)
    batch_axes, heads = spec[0] or (), spec[2]
    if mode == "ulysses":
        local = query.shape[2] // (mesh.shape[heads] if heads else 1)
        if local % c:
            raise ValueError(
                f"dtensor.context_attention(mode='ulysses'): the {local} query heads a device "
                f"holds{f' (of {query.shape[2]}, split over {heads!r})' if heads else ''} do not "
                f"divide over the mesh axis {axis!r} of size {c} ({mesh_text(mesh)}): Ulysses "
                "gives each device whole heads. Use a context size that divides them, or "
                "mode='gather' or 'ring'."
            )
    in_specs: list[Any] = [spec, spec, spec]
    args: list[Any] = [query, key, value]
    if mask is not None:
        m = mask
        mb = batch_axes if m.shape[0] == query.shape[0] and batch_axes else None
        mh = heads if m.shape[1] == query.shape[2] else None
        in_specs.append(P(mb, mh, None if mode in ("ulysses", "usp") else axis, None))
        args.append(m)
    if window is not None:
        in_specs.append(P())
        args.append(jnp.asarray(window))

    if implementation == "splash":
        return splash_attention(
            query, key, value, causal, mask, window, scale, mode, mesh, axis, spec
        )

    def per_device(q, k, v, *rest):
        it = iter(rest)
        m = next(it) if mask is not None else None
        w = next(it) if window is not None else None
        me = jax.lax.axis_index(axis)
        if mode == "gather":
            k_all, v_all = gather_sequence(k, axis), gather_sequence(v, axis)
            qpos = me * q.shape[1] + jnp.arange(q.shape[1])
            kpos = jnp.arange(k_all.shape[1])
            return attend(q, k_all, v_all, qpos, kpos, causal, w, m, scale)
        if mode == "ulysses":
            return ulysses_attend(q, k, v, m, w, me, c, axis, causal, scale)
        if mode == "usp":
            return usp_attend(q, k, v, m, w, me, c, axis, causal, scale)
        return ring_attend(q, k, v, m, w, me, c, axis, causal, balanced, scale)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=spec,
        check_vma=False,
    )(*args)


def _specs(
    mesh: Any, query: jax.Array, key: jax.Array, batch_axes: Any, head_axis: str, axis: Any
) -> P:
    """The ``[batch, seq, heads, head_dim]`` spec of each device's part: the batch over
    ``batch_axes`` (default: those of ``data``, ``fsdp``, ``expert`` the mesh has; none
    where they do not divide it), the sequence over ``axis``, the heads over ``head_axis``
    where it divides the KV heads."""
    if mesh is None:
        return P(None, axis, None)
    sizes = dict(mesh.shape)
    if batch_axes is None:
        batch_axes = tuple(a for a in _BATCH_AXES if sizes.get(a, 1) > 1)
    batch_axes = tuple(a for a in batch_axes if a != axis)
    shards = math.prod(sizes[a] for a in batch_axes)
    if batch_axes and query.shape[0] % shards:
        batch_axes = ()  # a batch that does not divide stays whole on each device
    t = sizes.get(head_axis, 1)
    heads = head_axis if t > 1 and key.shape[2] % t == 0 else None
    return P(batch_axes or None, axis, heads)


def _check(query, key, value, causal) -> None:
    problems = []
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        problems.append("query, key and value must be [batch, length, heads, head_dim]")
    elif key.shape != value.shape:
        problems.append(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match")
    elif query.shape[0] != key.shape[0] or query.shape[3] != key.shape[3]:
        problems.append("query and key must agree on batch and head_dim")
    elif query.shape[2] % key.shape[2]:
        problems.append(
            f"the key/value heads ({key.shape[2]}) must divide the heads ({query.shape[2]})"
        )
    elif causal and query.shape[1] != key.shape[1]:
        problems.append("causal attention needs as many queries as keys")
    if problems:
        raise ValueError(
            f"dtensor.context_attention: query {tuple(query.shape)}, key {tuple(key.shape)}, "
            f"value {tuple(value.shape)}: " + "; ".join(problems) + "."
        )
