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

Heads are split over ``tensor`` (when it divides the key/value heads) and the
batch over the batch axes (``data``, ``fsdp``, ``expert``), so attention needs
no other communication. ``mask`` (``True``: attend, broadcastable to ``[batch,
heads, q, k]``) works in both modes; with it the ring runs whole blocks.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = [
    "CONTEXT_SCOPE",
    "IMPLEMENTATIONS",
    "MODES",
    "best_implementation",
    "context_attention",
    "context_mode",
    "trace_platform",
]

#: The name scope of the context-axis exchange (``explain`` finds its collectives by it).
CONTEXT_SCOPE = "context_attention"

#: The modes of :func:`context_attention` under a ``context`` axis.
MODES = ("gather", "ring")
#: The values of :func:`context_attention`'s ``implementation``.
IMPLEMENTATIONS = ("xla", "splash", "cudnn", "auto")
#: The dtypes cuDNN's fused attention takes.
_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

_BATCH_AXES = ("data", "fsdp", "expert")
_mode: list[str] = ["gather"]
_NEG = -0.7 * float(np.finfo(np.float32).max)


@contextlib.contextmanager
def context_mode(mode: str) -> Iterator[None]:
    """Within the block, :func:`context_attention` defaults to ``mode`` (HybridStrategy
    sets its ``context_mode`` around each step it traces)."""
    if mode not in MODES:
        raise ValueError(f"context_mode({mode!r}): valid modes are {MODES}.")
    _mode.append(mode)
    try:
        yield
    finally:
        _mode.pop()


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
        mode: ``"gather"`` or ``"ring"`` under a ``context`` axis (default: the
            innermost :func:`context_mode`, else ``"gather"``).
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
    mode = _mode[-1] if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"dtensor.context_attention(mode={mode!r}): valid modes are {MODES}.")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    mesh = _mesh()
    c = mesh.shape[axis] if mesh is not None and axis in mesh.axis_names else 1
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"dtensor.context_attention(implementation={implementation!r}): valid are "
            f"{', '.join(map(repr, IMPLEMENTATIONS))}."
        )
    if implementation == "auto":
        implementation = best_implementation(query, key, causal, mask, window, mode, mesh, c)
    if implementation == "cudnn":
        return _cudnn(query, key, value, causal, mask, window, scale, mesh, c)
    if mask is not None:  # [batch | 1, heads | 1, q_len, kv_len], as both paths take it
        mask = jnp.asarray(mask)
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = jnp.broadcast_to(mask, mask.shape[:2] + (query.shape[1], key.shape[1]))
    if (mesh is None or c == 1) and implementation == "splash":
        spec = _specs(mesh, query, key, batch_axes, head_axis, None)
        return _splash(query, key, value, causal, mask, window, scale, "gather", mesh, axis, spec)
    if mesh is None or c == 1:
        qpos = jnp.arange(query.shape[1])
        kpos = jnp.arange(key.shape[1])
        return _attend(query, key, value, qpos, kpos, causal, window, mask, scale)
    s = query.shape[1]
    balanced = mode == "ring" and causal and mask is None
    chunks = 2 * c if balanced else c
    if s % chunks or key.shape[1] % c:
        raise ValueError(
            f"dtensor.context_attention: the sequence ({s} queries, {key.shape[1]} keys) does "
            f"not divide into {chunks} chunks over the mesh axis {axis!r} of size {c} ("
            f"{_mesh_text(mesh)}; load-balanced causal ring attention cuts it into 2 x {c}). "
            "Make the sequence length a multiple of it, or choose another context size."
        )
    spec = _specs(mesh, query, key, batch_axes, head_axis, axis)
    batch_axes, heads = spec[0] or (), spec[2]
    in_specs: list[Any] = [spec, spec, spec]
    args: list[Any] = [query, key, value]
    if mask is not None:
        m = mask
        mb = batch_axes if m.shape[0] == query.shape[0] and batch_axes else None
        mh = heads if m.shape[1] == query.shape[2] else None
        in_specs.append(P(mb, mh, axis, None))
        args.append(m)
    if window is not None:
        in_specs.append(P())
        args.append(jnp.asarray(window))

    if implementation == "splash":
        return _splash(query, key, value, causal, mask, window, scale, mode, mesh, axis, spec)

    def per_device(q, k, v, *rest):
        it = iter(rest)
        m = next(it) if mask is not None else None
        w = next(it) if window is not None else None
        me = jax.lax.axis_index(axis)
        if mode == "gather":
            k_all, v_all = _gather_sequence(k, axis), _gather_sequence(v, axis)
            qpos = me * q.shape[1] + jnp.arange(q.shape[1])
            kpos = jnp.arange(k_all.shape[1])
            return _attend(q, k_all, v_all, qpos, kpos, causal, w, m, scale)
        return _ring(q, k, v, m, w, me, c, axis, causal, balanced, scale)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=tuple(in_specs),
        out_specs=spec,
        check_vma=False,
    )(*args)


def trace_platform(mesh: Any = None) -> str:
    """The platform (``"cpu"``, ``"gpu"``, ``"tpu"``) a traced step is compiled for: that of
    ``mesh`` (default: the trace's mesh, dtensor's ``with mesh:`` or JAX's abstract mesh,
    which keeps its devices' platform), else JAX's default backend. Ahead-of-time compiles
    for a TPU or GPU topology trace on a CPU machine: the mesh, not the backend, says which.

    Examples:
        >>> import dtensor
        >>> from dtensor.core.attention import trace_platform
        >>> trace_platform(dtensor.create_mesh([("x", 8)]))
        'cpu'
        >>> trace_platform(dtensor.create_mesh([("x", 8)], devices=dtensor.tpu_topology("v5e:2x4")))
        'tpu'
    """
    from dtensor.core.experts import _platform

    return _platform(_mesh() if mesh is None else mesh)


def best_implementation(
    query: Any,
    key: Any,
    causal: bool = True,
    mask: Any = None,
    window: Any = None,
    mode: str | None = None,
    mesh: Any = None,
    context: int | None = None,
) -> str:
    """The :func:`context_attention` implementation ``"auto"`` stands for: ``"splash"`` on TPU
    when the kernel takes the call (no ``mask`` or ``window``; ``"gather"`` mode under a
    ``context`` axis; each device's queries and all the keys in whole blocks of 128),
    ``"cudnn"`` on NVIDIA GPUs when cuDNN's fused attention takes it (bfloat16 or float16, no
    ``context`` axis, no ``mask`` or ``window``, a head dimension that is a multiple of 8 and
    at most 128), else ``"xla"``. ``examples/decoder.py``'s ``attention="auto"`` is this choice.

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> from dtensor.core.attention import best_implementation
        >>> q = jax.ShapeDtypeStruct((8, 1024, 4, 128), jnp.bfloat16)
        >>> tpu = dtensor.create_mesh([("data", 8)], devices=dtensor.tpu_topology("v5e:2x4"))
        >>> best_implementation(q, q, causal=True, mesh=tpu)
        'splash'
        >>> gpu = dtensor.create_mesh([("data", 8)], devices=dtensor.gpu_topology("h100:1x8"))
        >>> best_implementation(q, q, causal=True, mesh=gpu)
        'cudnn'
        >>> best_implementation(q, q, causal=True, mesh=dtensor.create_mesh([("data", 8)]))
        'xla'
    """
    mesh = _mesh() if mesh is None else mesh
    if context is None:
        context = int(mesh.shape.get("context", 1)) if mesh is not None else 1
    mode = _mode[-1] if mode is None else mode
    q_len, kv_len, c = query.shape[1], key.shape[1], int(context)
    platform = trace_platform(mesh)
    if platform == "tpu":
        fits = q_len % (128 * c) == 0 and kv_len % 128 == 0 and (q_len == kv_len or not causal)
        takes = mask is None and window is None and (c == 1 or mode == "gather")
        return "splash" if fits and takes else "xla"
    if platform in ("gpu", "cuda") and _cudnn_problem(query, mask, window, c) is None:
        return "cudnn"
    return "xla"


def _cudnn_problem(query: Any, mask: Any, window: Any, context: int) -> str | None:
    """Why cuDNN's fused attention cannot take the call (``None``: it can)."""
    head_dim = query.shape[-1]
    if jnp.dtype(query.dtype) not in _CUDNN_DTYPES:
        return f"it takes bfloat16 or float16, not {jnp.dtype(query.dtype).name}"
    if context > 1:
        return f"it has no per-shard path under a context axis (of size {context})"
    if mask is not None or window is not None:
        return "its path here takes no mask= or window="
    if head_dim % 8 or head_dim > 128:
        return f"its head dimension must be a multiple of 8 and at most 128, not {head_dim}"
    return None


def _cudnn(query, key, value, causal, mask, window, scale, mesh, c):
    """cuDNN's fused attention on the arrays as they are laid out (no ``context`` axis)."""
    problem = _cudnn_problem(query, mask, window, c)
    if problem is not None:
        where = _mesh_text(mesh) if mesh is not None else "no mesh"
        raise ValueError(
            f"dtensor.context_attention(implementation='cudnn') on {where}: {problem}. Use "
            "implementation='auto' (cuDNN where it takes the call, else XLA) or 'xla'."
        )
    return jax.nn.dot_product_attention(
        query, key, value, scale=scale, is_causal=causal, implementation="cudnn"
    )


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


def _gather_sequence(x: jax.Array, axis: str) -> jax.Array:
    """``x``'s sequence (dimension 1) all-gathered over ``axis``; its gradient reduce-scattered
    back (a ``psum_scatter``, under the name scope too)."""
    return cast(jax.Array, _gather_sequence_vjp(x, axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_sequence_vjp(x: jax.Array, axis: str) -> jax.Array:
    with jax.named_scope(CONTEXT_SCOPE):
        return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_sequence_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return _gather_sequence(x, axis), None


def _gather_sequence_bwd(axis: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    with jax.named_scope(CONTEXT_SCOPE):
        return (jax.lax.psum_scatter(g, axis, scatter_dimension=1, tiled=True),)


_gather_sequence_vjp.defvjp(_gather_sequence_fwd, _gather_sequence_bwd)


def _splash(q, k, v, causal, mask, window, scale, mode, mesh, axis, spec):
    """The splash kernel on each device's queries against all keys (gathered over ``axis``
    under a context axis; the device's own otherwise)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    from jax.sharding import NamedSharding

    c = mesh.shape[axis] if mesh is not None and axis in mesh.axis_names else 1
    if (c > 1 and mode != "gather") or mask is not None or window is not None:
        raise ValueError(
            "dtensor.context_attention(implementation='splash') takes mode='gather' without "
            f"mask= or window= (got mode={mode!r}, mask {'given' if mask is not None else 'None'}, "
            f"window {'given' if window is not None else 'None'}); use implementation='xla'."
        )
    b, s, h, d = q.shape
    kvh = k.shape[2]
    block_q, block_kv = min(512, s // c), min(512, s)
    sizes = sk.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
        # Separate dq and dk/dv kernels: the fused backward writes a partial dq per key block
        # (kv_len / block_kv copies of q: 16 GiB a chip for llama3.1-8b at 32768 tokens).
        use_fused_bwd_kernel=False,
    )
    one = sm.CausalMask((s, s)) if causal else sm.FullMask((s, s))
    kernel = sk.make_splash_mqa(
        sm.MultiHeadMask([one] * (h // kvh)), block_sizes=sizes, head_shards=1, q_seq_shards=c
    )

    def per_device(kernel, q, k, v):
        if c > 1:
            k, v = _gather_sequence(k, axis), _gather_sequence(v, axis)
        bl, n = q.shape[:2]
        hl = q.shape[2] // (h // kvh)
        qh = (q * jnp.asarray(scale, q.dtype)).reshape(bl, n, hl, h // kvh, d)
        qh = qh.transpose(0, 2, 3, 1, 4)  # (batch, kv_heads, group, n, d)
        kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

        def call(kernel, q, k, v):
            return kernel(q, k, v)

        out = jax.vmap(jax.vmap(call, (None, 0, 0, 0)), (None, 0, 0, 0))(kernel, qh, kh, vh)
        return out.transpose(0, 3, 1, 2, 4).reshape(bl, n, q.shape[2], d)

    if mesh is None or mesh.size == 1:
        return per_device(kernel, q, k, v)
    kernel_spec = kernel.manual_sharding_spec(NamedSharding(mesh, P(None, axis if c > 1 else None)))
    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(kernel_spec, spec, spec, spec),
        out_specs=spec,
        check_vma=False,
    )(kernel, q, k, v)


def _attend(q, k, v, qpos, kpos, causal, window, mask, scale):
    """Plain attention (float32 scores and softmax) of ``q`` at ``qpos`` to ``k``/``v`` at ``kpos``."""
    o, mx, total = _block(q, k, v, qpos, kpos, causal, window, mask, scale)
    out = o / jnp.maximum(total, 1e-30)[..., None]
    return _merge_heads(out, q)


def _block(q, k, v, qpos, kpos, causal, window, mask, scale):
    """One block's unnormalised output ``[b, kvh, g, q, d]`` (float32), row maxima and sums."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, sq, kvh, h // kvh, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k, preferred_element_type=jnp.float32)
    scores = scores * scale
    allow = _allowed(qpos, kpos, causal, window)
    if mask is not None:
        mk = mask.reshape(mask.shape[0], -1, 1, sq, k.shape[1])  # (b, heads|1, 1, q, k)
        if mk.shape[1] == h:
            mk = mask.reshape(mask.shape[0], kvh, h // kvh, sq, k.shape[1])
        allow = mk if allow is None else allow & mk
    if allow is not None:
        scores = jnp.where(allow, scores, _NEG)
    mx = scores.max(-1)
    p = jnp.exp(scores - mx[..., None])
    if allow is not None:
        p = jnp.where(allow, p, 0.0)
    total = p.sum(-1)
    o = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, mx, total


def _allowed(qpos, kpos, causal, window):
    if not causal:
        return None
    diff = qpos[:, None] - kpos[None, :]
    allow = diff >= 0
    if window is not None:
        allow = allow & (diff < window)
    return allow


def _merge_heads(o, q):
    """``[b, kvh, g, q, d]`` -> ``[b, q, heads, d]`` in ``q``'s dtype."""
    b, kvh, g, sq, d = o.shape
    return o.transpose(0, 3, 1, 2, 4).reshape(b, sq, kvh * g, d).astype(q.dtype)


def _fold(acc, new):
    """Fold one block's ``(o, max, sum)`` into the running softmax ``acc``."""
    o, mx, total = acc
    o2, mx2, total2 = new
    m = jnp.maximum(mx, mx2)
    a, b = jnp.exp(mx - m), jnp.exp(mx2 - m)
    return o * a[..., None] + o2 * b[..., None], m, total * a + total2 * b


def _ring(q, k, v, mask, window, me, c, axis, causal, balanced, scale):
    n = q.shape[1]  # this device's rows
    if balanced:
        q, k, v = (_to_balanced(x, me, c, axis) for x in (q, k, v))
        half = n // 2
        front = me * half + jnp.arange(half)
        qpos = jnp.concatenate([front, (2 * c - 1 - me) * half + jnp.arange(half)])
    else:
        qpos = me * n + jnp.arange(n)
    b, _, h, d = q.shape
    kvh = k.shape[2]
    shape = (b, kvh, h // kvh, n)
    acc = (jnp.zeros((*shape, d), jnp.float32), jnp.full(shape, _NEG), jnp.zeros(shape))
    ring = [(i, (i + 1) % c) for i in range(c)]

    @jax.checkpoint
    def step(acc, k, v, src):
        kn = k.shape[1]
        if balanced:
            half = n // 2
            kpos = jnp.concatenate(
                [src * half + jnp.arange(half), (2 * c - 1 - src) * half + jnp.arange(half)]
            )
            return _balanced_step(acc, q, k, v, qpos, kpos, src, me, window, scale, half)
        kpos = src * kn + jnp.arange(kn)
        m = None if mask is None else jax.lax.dynamic_slice_in_dim(mask, src * kn, kn, axis=3)
        new = _block(q, k, v, qpos, kpos, causal, window, m, scale)
        if causal:  # a block wholly after this device's queries adds nothing: skipped
            return jax.lax.cond(src <= me, lambda: _fold(acc, new), lambda: acc)
        return _fold(acc, new)

    for i in range(c):
        src = (me - i) % c
        if i + 1 < c:
            with jax.named_scope(CONTEXT_SCOPE):
                k_next = jax.lax.ppermute(k, axis, ring)
                v_next = jax.lax.ppermute(v, axis, ring)
        acc = step(acc, k, v, src)
        if i + 1 < c:
            k, v = k_next, v_next
    o, _, total = acc
    out = _merge_heads(o / jnp.maximum(total, 1e-30)[..., None], q)
    return _from_balanced(out, me, c, axis) if balanced else out


def _balanced_step(acc, q, k, v, qpos, kpos, src, me, window, scale, half):
    """One load-balanced causal ring step: half a block of work on every device.

    This device holds query chunks ``(me, 2C-1-me)``, the keys chunks ``(src,
    2C-1-src)``. ``src < me``: both query chunks see the front key chunk
    whole, the back one not at all; ``src > me``: the back query chunk sees
    both key chunks whole, the front one neither; ``src == me``: the diagonal
    block, causal.
    """

    def earlier():
        new = _block(q, k[:, :half], v[:, :half], qpos, kpos[:half], True, window, None, scale)
        return _fold(acc, new)

    def later():
        o, mx, total = acc
        sl = (slice(None),) * 3 + (slice(half, None),)
        new = _block(q[:, half:], k, v, qpos[half:], kpos, True, window, None, scale)
        o2, mx2, t2 = _fold((o[sl], mx[sl], total[sl]), new)
        return o.at[sl].set(o2), mx.at[sl].set(mx2), total.at[sl].set(t2)

    def diagonal():
        return _fold(acc, _block(q, k, v, qpos, kpos, True, window, None, scale))

    branch = jnp.where(src < me, 0, jnp.where(src > me, 1, 2))
    return jax.lax.switch(branch, (earlier, later, diagonal))


def _dest(j, c):
    """The device that holds chunk ``j`` of ``2c`` in the load-balanced layout."""
    return j if j < c else 2 * c - 1 - j


def _to_balanced(x, me, c, axis):
    """Contiguous rows (chunks ``2me``, ``2me+1``) -> load-balanced (``me``, ``2c-1-me``)."""
    half = x.shape[1] // 2
    with jax.named_scope(CONTEXT_SCOPE):
        even = jax.lax.ppermute(x[:, :half], axis, [(s, _dest(2 * s, c)) for s in range(c)])
        odd = jax.lax.ppermute(x[:, half:], axis, [(s, _dest(2 * s + 1, c)) for s in range(c)])
    # Front chunk ``me`` came with the even halves when ``me`` is even; the back chunk
    # ``2c-1-me`` has the other parity.
    first = me % 2 == 0
    return jnp.concatenate([jnp.where(first, even, odd), jnp.where(first, odd, even)], axis=1)


def _from_balanced(x, me, c, axis):
    """The inverse of :func:`_to_balanced`."""
    half = x.shape[1] // 2
    first = me % 2 == 0
    front, back = x[:, :half], x[:, half:]
    even, odd = jnp.where(first, front, back), jnp.where(first, back, front)
    with jax.named_scope(CONTEXT_SCOPE):
        even = jax.lax.ppermute(even, axis, [(_dest(2 * s, c), s) for s in range(c)])
        odd = jax.lax.ppermute(odd, axis, [(_dest(2 * s + 1, c), s) for s in range(c)])
    return jnp.concatenate([even, odd], axis=1)


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


def _mesh() -> Any:
    from dtensor.core.experts import _mesh as mesh

    return mesh()


def _mesh_text(mesh: Any) -> str:
    return "mesh " + ", ".join(f"{a}={s}" for a, s in mesh.shape.items())
