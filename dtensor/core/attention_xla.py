"""Attention as einsums (XLA), split over a ``context`` mesh axis: the per-device math.

Each device attends its queries in one of :data:`MODES` (the innermost :func:`context_mode`
by default): ``"gather"`` (keys and values all-gathered over the axis, :func:`gather_sequence`,
then :func:`attend`), ``"ring"`` (:func:`ring_attend`: ``C - 1`` collective permutes, one
block of scores a step folded into a running softmax; causal attention load-balanced) or
``"ulysses"`` (:func:`ulysses_attend`: all-to-alls from a sequence split to a head split and
back, the whole sequence attended per head group; key/value heads repeated where fewer
than the axis) or ``"usp"`` (:func:`usp_attend`: Ulysses within groups of devices, a ring
across them). Every
exchange runs under the :data:`CONTEXT_SCOPE` name scope, by which ``explain`` counts it.
These run inside :func:`jax.shard_map`; :func:`dtensor.context_attention` is the entry point.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import cast

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "CONTEXT_SCOPE",
    "MODES",
    "attend",
    "context_mode",
    "current_mode",
    "gather_sequence",
    "ring_attend",
    "ulysses_attend",
    "ulysses_heads",
    "ulysses_repeats",
    "ulysses_rows",
    "usp_attend",
    "usp_factors",
]

#: The name scope of the context-axis exchange (``explain`` finds its collectives by it).
CONTEXT_SCOPE = "context_attention"

#: The modes of :func:`dtensor.context_attention` under a ``context`` axis.
MODES = ("gather", "ring", "ulysses", "usp")

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


def current_mode() -> str:
    """The mode :func:`dtensor.context_attention` takes by default: the innermost
    :func:`context_mode`'s, else ``"gather"``."""
    return _mode[-1]


def gather_sequence(x: jax.Array, axis: str) -> jax.Array:
    """``x``'s sequence (dimension 1) all-gathered over ``axis``; its gradient reduce-scattered
    back (a ``psum_scatter``, under the name scope too)."""
    return cast(jax.Array, _gather_sequence_vjp(x, axis))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_sequence_vjp(x: jax.Array, axis: str) -> jax.Array:
    with jax.named_scope(CONTEXT_SCOPE):
        return jax.lax.all_gather(x, axis, axis=1, tiled=True)


def _gather_sequence_fwd(x: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return gather_sequence(x, axis), None


def _gather_sequence_bwd(axis: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    with jax.named_scope(CONTEXT_SCOPE):
        return (jax.lax.psum_scatter(g, axis, scatter_dimension=1, tiled=True),)


_gather_sequence_vjp.defvjp(_gather_sequence_fwd, _gather_sequence_bwd)


def attend(q, k, v, qpos, kpos, causal, window, mask, scale):
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


def ring_attend(q, k, v, mask, window, me, c, axis, causal, balanced, scale, ring=None):
    """Ring attention of this device's queries (device ``me`` of ``c`` over ``axis``): the keys
    and values passed round the ring, one block folded in a step (recomputed in the backward
    pass); ``balanced``: causal, the rows re-laid so every step is half a block everywhere.
    ``ring``: the permute's ``(source, destination)`` pairs over ``axis`` (default: ``i`` to
    ``i + 1``), for a ring of groups (``usp``: ``me`` and ``c`` count groups then)."""
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
    ring = ring if ring is not None else [(i, (i + 1) % c) for i in range(c)]

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


def ulysses_repeats(kv_heads: int, c: int) -> int:
    """How many times :func:`ulysses_attend` repeats each key/value head so that the heads
    divide over ``c`` devices: ``c / gcd(kv_heads, c)`` (1 when they already divide). The
    copies cost ``r x`` the K/V bytes of the all-to-alls and of attention's key reads."""
    return c // math.gcd(kv_heads, c)


def ulysses_heads(q, k, v, c, axis):
    """Ulysses' first exchange: ``q``, ``k``, ``v`` of this device's rows (``S / c`` of them,
    every local head) to all ``S`` rows of ``1 / c`` of the heads, by all-to-alls over
    ``axis``; key/value heads repeated first where they do not divide over ``c``."""
    r = ulysses_repeats(k.shape[2], c)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    with jax.named_scope(CONTEXT_SCOPE):
        return tuple(jax.lax.all_to_all(x, axis, 2, 1, tiled=True) for x in (q, k, v))


def ulysses_rows(out, axis):
    """Ulysses' second exchange: the output of all rows of this device's heads back to its
    own rows of every head."""
    with jax.named_scope(CONTEXT_SCOPE):
        return jax.lax.all_to_all(out, axis, 1, 2, tiled=True)


def ulysses_attend(q, k, v, mask, window, me, c, axis, causal, scale):
    """Ulysses attention of this device's rows (device ``me`` of ``c`` over ``axis``): an
    all-to-all turns the sequence split into a head split (each device all ``S`` rows of
    ``heads / c`` heads), plain attention runs on them, and an all-to-all turns the output
    back. Key/value heads fewer than ``c`` (or not dividing over it) are repeated first
    (:func:`ulysses_repeats`), so grouped-query attention keeps each query head with its
    own key/value head. ``mask``: the whole ``[b, heads | 1, S, S]``."""
    h = q.shape[2]
    q, k, v = ulysses_heads(q, k, v, c, axis)
    pos = jnp.arange(q.shape[1])
    if mask is not None and mask.shape[1] == h:  # per head: this device's heads
        mask = jax.lax.dynamic_slice_in_dim(mask, me * (h // c), h // c, axis=1)
    return ulysses_rows(attend(q, k, v, pos, pos, causal, window, mask, scale), axis)


def usp_factors(c: int, heads: int) -> tuple[int, int]:
    """``(U, R)`` of ``usp`` over ``c`` devices with ``heads`` query heads a device: the
    largest Ulysses part ``U`` that divides both (all-to-alls within groups of ``U``
    consecutive devices), the ring over the ``R = c / U`` groups."""
    u = math.gcd(c, heads)
    return u, c // u


def _group_exchange(x, u, size, n, axis, src_axis, dst_axis):
    """Within groups of ``size`` consecutive devices of the ``n`` over ``axis`` (this device
    member ``u`` of its group):
    ``x`` cut along ``src_axis`` into ``size`` blocks, block ``m`` sent to member ``m``, the
    blocks received joined along ``dst_axis`` in member order (an all-to-all within each
    group, as ``size - 1`` collective permutes)."""
    width = x.shape[src_axis] // size
    received = [jax.lax.dynamic_slice_in_dim(x, u * width, width, axis=src_axis)]
    for j in range(1, size):
        block = jax.lax.dynamic_slice_in_dim(x, ((u + j) % size) * width, width, axis=src_axis)
        pairs = [(d, (d // size) * size + (d % size + j) % size) for d in range(n)]
        with jax.named_scope(CONTEXT_SCOPE):
            received.append(jax.lax.ppermute(block, axis, pairs))  # from member u - j
    stacked = jnp.stack(received)  # [j]: from member (u - j) % size
    order = (u - jnp.arange(size)) % size  # member m's block is at j = (u - m) % size
    blocks = jnp.take(stacked, order, axis=0)
    return jnp.concatenate([blocks[m] for m in range(size)], axis=dst_axis)


def usp_attend(q, k, v, mask, window, me, c, axis, causal, scale):
    """Ulysses x ring (USP) attention of this device's rows: ``c`` devices over ``axis`` in
    ``R`` groups of ``U`` consecutive ones (:func:`usp_factors`). Within each group the
    sequence split becomes a head split (each device the group's ``U`` row blocks of
    ``heads / U`` heads; key/value heads repeated where they do not divide over ``U``);
    across the groups, ring attention passes those keys and values round ``R`` steps; the
    output's head split goes back to rows within the group. ``mask``: the whole
    ``[b, heads | 1, S, S]``."""
    h = q.shape[2]
    u_size, r_size = usp_factors(c, h)
    if u_size == 1:
        return ring_attend(q, k, v, None if mask is None else _rows(mask, me, q.shape[1]),
                           window, me, c, axis, causal, False, scale)  # fmt: skip
    if r_size == 1:
        return ulysses_attend(q, k, v, mask, window, me, c, axis, causal, scale)
    u, g = me % u_size, me // u_size
    r = ulysses_repeats(k.shape[2], u_size)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    q, k, v = (_group_exchange(x, u, u_size, c, axis, 2, 1) for x in (q, k, v))
    rows = q.shape[1]  # the group's rows
    if mask is not None:
        if mask.shape[1] == h:
            mask = jax.lax.dynamic_slice_in_dim(mask, u * (h // u_size), h // u_size, axis=1)
        mask = _rows(mask, g, rows)
    ring = [(d, (d + u_size) % c) for d in range(c)]
    out = ring_attend(q, k, v, mask, window, g, r_size, axis, causal, False, scale, ring=ring)
    return _group_exchange(out, u, u_size, c, axis, 1, 2)


def _rows(mask, i, n):
    """Query rows ``[i n, (i + 1) n)`` of a whole ``[b, h, S, S]`` mask."""
    return jax.lax.dynamic_slice_in_dim(mask, i * n, n, axis=2)
