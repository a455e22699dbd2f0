"""Mixture-of-experts feed-forward with expert parallelism: dropless routing, grouped matmuls.

:func:`expert_mlp` is the one call an MoE layer makes. Its experts are
*stacked* weights (``[experts, d_model, hidden]`` and ``[experts, hidden,
d_model]``); each token goes to the ``k`` experts its router chose and comes
back weighted. Inside it:

- each device sorts its own tokens by expert and runs every expert's matmul
  on its rows at once (``jax.lax.ragged_dot``, a grouped matmul: no token is
  dropped, no padding is computed);
- under a mesh with an ``expert`` axis of size ``n`` the experts are split
  over it (``n`` groups of ``experts / n``): each device sends each token row
  to the device holding its expert and gets the results back, two all-to-alls
  per call (``jax.lax.ragged_all_to_all`` on TPU and GPU, which moves only the
  rows routed; on CPU, whose XLA has no ragged all-to-all, a dense
  ``all_to_all`` of buffers padded to the dropless worst case, the same
  values); each device's receive buffer holds ``n x tokens x min(experts /
  n, k)`` rows, the most that can come to it (MaxText's size);
- the batch stays split over the token axes (``data``, ``fsdp``, ``expert``,
  ``context`` where the mesh has them: HybridStrategy's batch axes), so the
  routing, sorting and exchange are per device; everything else in the
  model stays data parallel over ``expert``;
- under a ``tensor`` axis each expert's hidden units are split over it
  (``w_gate``/``w_up`` by column, ``w_down`` by row, as Megatron splits an
  MLP): every device of it routes the same tokens, computes its part of the
  hidden units, and the parts are summed (one all-reduce over ``tensor``).

Without a mesh (or one device) it is plain single-device JAX, the same
values (float32: equal to rounding).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import sequential_vmap
from jax.sharding import PartitionSpec as P

__all__ = ["DISPATCH_SCOPE", "TOKEN_AXES", "expert_mlp", "routed_scope"]

#: The name scope of the dispatch (``explain`` finds its all-to-alls by it).
DISPATCH_SCOPE = "expert_dispatch"

#: The mesh axes a token batch is split over by default (those the mesh has, in this order).
TOKEN_AXES = ("data", "fsdp", "expert", "context")


def expert_mlp(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    w_gate: jax.Array | None,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    axis: str = "expert",
    token_axes: Sequence[str] | None = None,
    exchange: str | None = None,
    tensor_axis: str | None = "tensor",
) -> jax.Array:
    """Each token's routed experts' gated MLP outputs, weighted and summed.

    ``out[t] = sum_j expert_weights[t, j] * down_e(act(x[t] @ gate_e) * (x[t] @ up_e))``
    with ``e = expert_ids[t, j]`` (without ``w_gate``: ``down_e(act(x[t] @ up_e))``).

    Args:
        x: tokens, ``[..., d_model]``.
        expert_ids: the chosen experts, ``[..., k]`` integers (the router's top-k).
        expert_weights: their weights, ``[..., k]``.
        w_gate, w_up: ``[experts, d_model, hidden]`` (``w_gate`` ``None``: an ungated MLP).
        w_down: ``[experts, hidden, d_model]``.
        activation: applied to the gate (or up) projection.
        axis: the mesh axis the experts are split over (absent or size 1: each
            device runs every expert on its own tokens).
        token_axes: the mesh axes the tokens (all leading dimensions of ``x``,
            flattened) are split over; default: those of :data:`TOKEN_AXES` the
            current mesh has.
        exchange: ``"ragged"`` (``jax.lax.ragged_all_to_all``) or ``"dense"``
            (``jax.lax.all_to_all`` of buffers padded to the dropless worst
            case); default: dense on CPU, ragged elsewhere.
        tensor_axis: the mesh axis each expert's hidden dimension is split over
            (Megatron within the experts: ``w_gate``/``w_up`` by column, ``w_down``
            by row, the outputs summed over it, one all-reduce a call); absent,
            of size 1, ``None`` or not dividing the hidden size: every device of
            it computes whole experts.

    Returns:
        ``[..., d_model]`` in ``x``'s dtype.

    Raises:
        ValueError: shapes disagree, the experts do not divide over ``axis``,
            or the tokens do not divide over the token axes (the message names
            the sizes and the fix).

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> x = jnp.ones((2, 4, 8))
        >>> ids = jnp.zeros((2, 4, 2), jnp.int32).at[..., 1].set(3)  # experts 0 and 3
        >>> w = jnp.full((2, 4, 2), 0.5)
        >>> up = jnp.ones((4, 8, 16)); down = jnp.ones((4, 16, 8))
        >>> y = dtensor.expert_mlp(x, ids, w, None, up, down, activation=lambda h: h)
        >>> y.shape, float(y[0, 0, 0])        # 0.5 * 128 + 0.5 * 128
        ((2, 4, 8), 128.0)
    """
    _check_shapes(x, expert_ids, expert_weights, w_gate, w_up, w_down)
    lead, d = x.shape[:-1], x.shape[-1]
    k = expert_ids.shape[-1]
    tokens = x.reshape(-1, d)
    ids = expert_ids.reshape(-1, k).astype(jnp.int32)
    weights = expert_weights.reshape(-1, k)
    mesh = _mesh()
    names = () if mesh is None else tuple(mesh.axis_names)
    if token_axes is None:
        sizes = {} if mesh is None else dict(mesh.shape)
        token_axes = tuple(a for a in TOKEN_AXES if sizes.get(a, 1) > 1)
    token_axes = tuple(token_axes)
    n = mesh.shape[axis] if mesh is not None and axis in names else 1
    t = mesh.shape[tensor_axis] if mesh is not None and tensor_axis in names else 1
    t = t if w_up.shape[-1] % t == 0 else 1
    if mesh is None or (n == 1 and t == 1 and not token_axes):
        return _local(tokens, ids, weights, w_gate, w_up, w_down, activation).reshape(*lead, d)
    experts = w_up.shape[0]
    if experts % n:
        raise ValueError(
            f"dtensor.expert_mlp: {experts} experts (w_up {tuple(w_up.shape)}) do not divide over "
            f"the mesh axis {axis!r} of size {n} ({_mesh_text(mesh)}). Choose an expert-parallel "
            f"size that divides {experts}."
        )
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if tokens.shape[0] % shards:
        raise ValueError(
            f"dtensor.expert_mlp: {tokens.shape[0]} tokens (x {tuple(x.shape)}) do not divide "
            f"over the token axes {token_axes} ({shards} shards, {_mesh_text(mesh)}). Make the "
            "batch (times the sequence) a multiple of it, or pass token_axes=."
        )
    if exchange is None:
        exchange = "dense" if _platform(mesh) == "cpu" else "ragged"
    if exchange not in ("ragged", "dense"):
        raise ValueError(f"dtensor.expert_mlp(exchange={exchange!r}): valid are 'ragged', 'dense'.")
    tok = P(token_axes or None)
    ex = axis if n > 1 else None
    ta = tensor_axis if t > 1 else None
    column, row = P(ex, None, ta), P(ex, ta, None)
    gate_spec = None if w_gate is None else column

    def per_device(tokens, ids, weights, w_gate, w_up, w_down):
        if n == 1:
            out = _local(tokens, ids, weights, w_gate, w_up, w_down, activation)
        else:
            out = _parallel(tokens, ids, weights, w_gate, w_up, w_down, activation, axis, exchange)
        return out if t == 1 else out[None]  # over tensor: this device's part of the sum

    run = jax.shard_map(
        jax.named_scope(DISPATCH_SCOPE)(per_device),
        mesh=mesh,
        in_specs=(tok, tok, tok, gate_spec, column, row),
        out_specs=tok if t == 1 else P(ta, *tok),
        check_vma=False,
    )
    out = run(tokens, ids, weights, w_gate, w_up, w_down)
    # The hidden dimension's parts summed (an all-reduce over tensor, as a row-parallel layer's).
    return (out if t == 1 else out.sum(0)).reshape(*lead, d)


# ------------------------------------------------------------------------------- per device


def _ffn(xs, sizes, w_gate, w_up, w_down, activation, scope=None):
    dot = _grouped(scope)
    up = dot(xs, w_up, sizes)
    h = activation(up) if w_gate is None else activation(dot(xs, w_gate, sizes)) * up
    return dot(h.astype(w_down.dtype), w_down, sizes)


@functools.cache
def _grouped(scope: str | None) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``jax.lax.ragged_dot`` whose batching is a loop, forward and backward.

    libtpu's ragged dot takes no batch dimension, and a pipeline's map over its stages
    (``jax.vmap`` in :func:`dtensor.pipeline`) would give every grouped matmul one: "number of
    batch dimensions should be 0, got 1". Under ``vmap`` these run one batch element at a
    time (``jax.custom_batching.sequential_vmap``; a stage's device holds one, so the loop
    runs once); the gradients are their own grouped matmuls, looped alike (a ``custom_vjp``:
    ``custom_vmap`` has no reverse mode). ``scope`` names the matmuls for the floor's count
    (:func:`routed_scope`); a nested trace starts its own name stack, so it is set inside.
    """

    def named():
        return jax.named_scope(scope) if scope else contextlib.nullcontext()

    def dot(x, w, sizes):
        with named():
            return jax.lax.ragged_dot(x, w, sizes)

    def grads(x, w, sizes, g):  # the transposes alone (a vjp would recompute the product)
        with named():
            (dx,) = jax.linear_transpose(lambda a: jax.lax.ragged_dot(a, w, sizes), x)(g)
            (dw,) = jax.linear_transpose(lambda b: jax.lax.ragged_dot(x, b, sizes), w)(g)
        return dx, dw

    looped, looped_grads = sequential_vmap(dot), sequential_vmap(grads)
    grouped = jax.custom_vjp(looped)
    grouped.defvjp(
        lambda x, w, sizes: (looped(x, w, sizes), (x, w, sizes)),
        lambda res, g: (*looped_grads(*res, g), None),
    )
    return grouped


def _combine(rows, order, weights, dtype):
    """Rows back in token order (``order`` sorted them), weighted and summed over ``k``."""
    t, k = weights.shape
    y = jnp.zeros_like(rows).at[order].set(rows).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype)).astype(dtype)


def _local(tokens, ids, weights, w_gate, w_up, w_down, activation):
    """Every expert on these tokens: sort the ``tokens x k`` rows by expert, grouped matmuls."""
    experts, k = w_up.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    rows = _ffn(tokens[order // k], sizes, w_gate, w_up, w_down, activation)
    return _combine(rows, order, weights, tokens.dtype)


def _parallel(tokens, ids, weights, w_gate, w_up, w_down, activation, axis, exchange):
    """This device's share of experts (``w_*`` hold ``experts / n``): rows out, compute, back."""
    local, k = w_up.shape[0], ids.shape[1]
    n, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
    rows_out, d = tokens.shape[0] * k, tokens.shape[1]
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # sorted by expert, hence by receiving device
    sent = tokens[order // k]
    sizes = jnp.bincount(flat, length=local * n).astype(jnp.int32)
    # Every device's counts: pair[i, j, e] rows device i sends to device j's local expert e.
    pair = jax.lax.all_gather(sizes, axis).reshape(n, n, local)
    per_dev = pair.sum(-1)  # [sender, receiver]
    send, recv = per_dev[me], per_dev[:, me]
    send_off = jnp.cumsum(send) - send
    # Dropless: a token sends at most min(local, k) rows to one device (its k experts are
    # distinct), so each sender's slot holds T x min(local, k) rows, every device n slots.
    per = min(local, k)
    slot_rows = tokens.shape[0] * per
    buffer = n * slot_rows
    if exchange == "ragged":
        land = (jnp.cumsum(per_dev, axis=0) - per_dev)[me]  # where mine land on each receiver
        got = jax.lax.ragged_all_to_all(
            sent, jnp.zeros((buffer, d), sent.dtype), send_off, send, land, recv, axis_name=axis
        )
        starts = jnp.cumsum(recv) - recv
    else:
        dest = jnp.repeat(jnp.arange(n), send, total_repeat_length=rows_out)
        slot = jnp.arange(rows_out) - send_off[dest]
        padded = jnp.zeros((n, slot_rows, d), sent.dtype).at[dest, slot].set(sent)
        with jax.named_scope(_dense_scope(k, per)):
            got = jax.lax.all_to_all(padded, axis, 0, 0, tiled=False).reshape(buffer, d)
        starts = jnp.arange(n) * slot_rows
    # The local expert of each received row (each sender's rows come sorted by expert,
    # then padding, marked ``local``), and the rows re-sorted by it for the grouped matmuls.
    mine = pair[:, me, :]  # [sender, local expert]
    gaps = jnp.diff(jnp.append(starts, buffer)) - recv
    counts = jnp.concatenate([mine, gaps[:, None]], axis=1).reshape(-1)
    labels = jnp.tile(jnp.arange(local + 1), n)
    which = jnp.repeat(labels, counts, total_repeat_length=buffer)
    regroup = jnp.argsort(which, stable=True)
    # The floor counts the rows routed only (their scope names the share).
    scope = routed_scope(k, n * per)
    done = _ffn(
        got[regroup], mine.sum(0).astype(jnp.int32), w_gate, w_up, w_down, activation, scope
    )
    done = jnp.zeros_like(done).at[regroup].set(done)
    if exchange == "ragged":
        home = (jnp.cumsum(per_dev, axis=1) - per_dev)[:, me]  # the senders' offsets for me
        back = jax.lax.ragged_all_to_all(
            done, jnp.zeros((rows_out, d), done.dtype), starts, recv, home, send, axis_name=axis
        )
    else:
        with jax.named_scope(_dense_scope(k, per)):
            back = jax.lax.all_to_all(done.reshape(n, slot_rows, d), axis, 0, 0, tiled=False)
        back = back[dest, slot]
    return _combine(back, order, weights, tokens.dtype)


# ------------------------------------------------------------------------------- helpers


def routed_scope(k: int, held: int) -> str:
    """The name scope of the grouped matmuls over a receive buffer of ``held`` rows a token
    for the ``k`` it routes: their FLOPs are ``k / held`` of the buffer's
    (:func:`dtensor.analysis.floor.matmul_flops`; the rest is padding, never computed)."""
    return f"grouped_k{k}_of{held}"


def _dense_scope(k: int, per: int) -> str:
    """The name scope of a dense exchange: its buffer holds ``n x per`` rows a token for the
    ``k`` it routes (``explain`` reads the ratio back)."""
    return f"dense_k{k}_per{per}"


def _mesh() -> Any:
    """The mesh of the trace: dtensor's ``with mesh:`` or ``jax.set_mesh``, else ``None``."""
    from dtensor.core.mesh import current_mesh

    ours = current_mesh()
    if ours is not None and ours.size > 1:
        return ours.jax_mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract is not None and not abstract.empty and math.prod(abstract.shape.values()) > 1:
        return abstract
    return None


def _platform(mesh: Any) -> str:
    """The platform of ``mesh``'s devices (an abstract mesh keeps it), else the backend's."""
    device = getattr(mesh, "abstract_device", None)  # (an abstract mesh has no devices)
    if device is not None:
        return str(device.platform)
    devices = (
        None if isinstance(mesh, jax.sharding.AbstractMesh) else getattr(mesh, "devices", None)
    )
    if isinstance(devices, np.ndarray) and devices.size:
        return str(devices.flat[0].platform)
    return jax.default_backend()


def _mesh_text(mesh: Any) -> str:
    return "mesh " + ", ".join(f"{a}={s}" for a, s in mesh.shape.items())


def _check_shapes(x, ids, weights, w_gate, w_up, w_down) -> None:
    d = x.shape[-1]
    problems = []
    if ids.shape != weights.shape or ids.shape[:-1] != x.shape[:-1]:
        problems.append(
            f"expert_ids {tuple(ids.shape)} and expert_weights {tuple(weights.shape)} must both "
            f"be x's leading shape {tuple(x.shape[:-1])} plus k"
        )
    if w_up.ndim != 3 or w_up.shape[1] != d:
        problems.append(f"w_up {tuple(w_up.shape)} must be [experts, {d}, hidden]")
    if w_gate is not None and w_gate.shape != w_up.shape:
        problems.append(f"w_gate {tuple(w_gate.shape)} must be w_up's shape {tuple(w_up.shape)}")
    if w_down.ndim != 3 or w_down.shape != (w_up.shape[0], w_up.shape[2], d):
        problems.append(
            f"w_down {tuple(w_down.shape)} must be [experts, hidden, d_model] = "
            f"{(w_up.shape[0], w_up.shape[-1], d)}"
        )
    if problems:
        raise ValueError(
            f"dtensor.expert_mlp: x {tuple(x.shape)}: " + "; ".join(problems) + ". Pass stacked "
            "expert weights [experts, in, out] and the router's top-k ids and weights."
        )
