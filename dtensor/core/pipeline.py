"""Pipeline parallelism in one SPMD program: stacked layers over a ``stage`` mesh axis.

:func:`pipeline` runs ``L`` layers (a stack: every weight with a leading layer
dimension) on a batch cut into ``M`` microbatches. The layers are split over
the ``S`` devices of the ``stage`` axis in ``R`` rounds (``repeats``): layer
group ``r * S + s`` (``g = L / (R * S)`` consecutive layers) lives on stage
``s``. The program is one loop of ticks: each tick every stage applies one
layer to the microbatch it holds (``jax.vmap`` over the stage dimension,
partitioned over ``stage``); after a group's last layer the activations move
one stage on with a collective permute over ``stage`` (``jnp.roll`` of the
stage-split array, which XLA lowers to ICI or DCN). Microbatch ``m`` of round
``r`` enters stage ``s`` at tick ``(r * M + m + s) * g``; the loop runs
``(R * M + S - 1) * g`` ticks, of which each stage idles ``(S - 1) * g``: the
bubble fraction is ``(S - 1) / (R * M + S - 1)`` (:func:`bubble_fraction`).
Each tick reads its layer's weights from the stage's stack, so the backward
pass accumulates their gradients in place, in one buffer per weight.

Schedules (``repeats``):

- ``R = 1``: GPipe. Each stage holds ``L / S`` consecutive layers (the stored
  ``[L]`` stack split over ``stage``, reshaped: no weights move). The backward
  pass (JAX's transpose of the loop) runs every microbatch's backward after
  every forward, so the activations of all ``M`` microbatches are live at its
  start: what each tick's layer keeps (its input alone when the layer is
  rematerialised), ``(M + S - 1) * g`` ticks of it per device.
- ``R > 1``: circular (interleaved). Each stage holds ``R`` groups of layers
  ``S`` groups apart, and a microbatch goes round the ring ``R`` times; the
  bubble shrinks ``R``-fold for ``R`` times the permutes. It needs
  ``M >= S`` (a microbatch comes back to stage 0 after its last round's
  stage ``S - 1``, and waits there for ``(M - S) * g + 1`` ticks); a stored
  ``[L]`` stack is re-stacked by stage for it (an all-to-all over ``stage``).

Stages that idle compute on stale values whose results are never used, so
their FLOPs are in the compiled program (a step-time floor from it includes
the bubble) and their gradients are zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

__all__ = ["PIPELINE_SCOPE", "bubble_fraction", "pipeline"]

#: The name scope of the pipeline's loop (``explain`` finds its permutes by it).
PIPELINE_SCOPE = "pipeline_stages"

_U = P.UNCONSTRAINED


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle fraction of a pipelined step: ``(S - 1) / (R * M + S - 1)``.

    Examples:
        >>> from dtensor.core.pipeline import bubble_fraction
        >>> bubble_fraction(4, 8), bubble_fraction(4, 8, repeats=2), bubble_fraction(1, 8)
        (0.2727272727272727, 0.15789473684210525, 0.0)
    """
    if stages <= 1:
        return 0.0
    return (stages - 1) / (repeats * microbatches + stages - 1)


def pipeline(
    layer_fn: Callable[..., Any],
    weights: Any,
    inputs: Any,
    *,
    stages: int,
    microbatches: int,
    repeats: int = 1,
    axis: str = "stage",
    batch_axes: Sequence[str] = (),
    remat: bool = False,
    policy: Any = None,
    side: Any = None,
) -> Any:
    """``inputs`` through ``L`` stacked layers, pipelined over the ``axis`` mesh axis.

    Args:
        layer_fn: ``layer_fn(layer, x) -> x`` (``layer_fn(layer, x, side)``
            with ``side``): one layer (``weights`` at one index of their
            leading dimension) applied to one microbatch ``x`` (a pytree
            shaped like ``inputs`` with ``B / M`` rows).
        weights: a pytree of arrays with a leading layer dimension ``L``
            (layer ``l`` at index ``l``); other arrays the layers take one of
            per layer (a rotary base per layer, say) may be part of it.
        inputs: a pytree of arrays with a leading batch dimension ``B``
            (a multiple of ``microbatches``); microbatch ``m`` is rows
            ``m, m + M, m + 2M, ...``, so each stays split over the batch
            axes as ``inputs`` are. Scalars among them are accumulators (a
            loss the layers add to, as an MoE block's load-balancing loss):
            each microbatch carries its own copy through the layers, and the
            result is their mean over the microbatches (floating) or
            microbatch 0's (others). For a sum of per-layer means over the
            batch's rows that is the whole batch's value; for a product of
            two such means (the load-balancing loss) it is the mean of each
            microbatch's, as under gradient accumulation.
        stages: ``S``, the size of the ``axis`` mesh axis.
        microbatches: ``M``.
        repeats: ``R`` rounds of the ring (1: GPipe; more: circular).
        axis: the mesh axis of the stages.
        batch_axes: mesh axes the microbatch rows are split over (constrained
            through the loop).
        remat: recompute each layer's forward in the backward pass
            (``jax.checkpoint`` with ``policy``), keeping its input alone.
        policy: a ``jax.checkpoint`` policy for ``remat``.
        side: a pytree of arrays with the leading batch dimension ``B`` that the
            layers read but do not change (an attention mask, segment ids):
            cut into the same microbatches, and given to each stage for the
            microbatch it runs (``layer_fn(layer, x, side)``) without moving
            between stages.

    Returns:
        ``inputs`` after the ``L`` layers, in their shape.

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> from dtensor.core.pipeline import pipeline
        >>> mesh = dtensor.create_mesh([("stage", 4), ("data", 2)])
        >>> w = jnp.arange(8.0)  # 8 layers, each adds its weight
        >>> x = jnp.zeros((16, 3))
        >>> add = lambda layer, x: x + layer
        >>> with mesh:
        ...     y = jax.jit(lambda w, x: pipeline(add, w, x, stages=4, microbatches=4))(w, x)
        >>> float(y[0, 0]), float(w.sum())
        (28.0, 28.0)
    """
    S, M, R = int(stages), int(microbatches), int(repeats)
    layers = {int(np.shape(a)[0]) for a in jax.tree.leaves(weights)}
    rows = {int(np.shape(a)[0]) for a in jax.tree.leaves((inputs, side)) if np.ndim(a)}
    if len(layers) != 1:
        raise ValueError(
            f"pipeline: the weights' leading (layer) dimensions differ ({sorted(layers)}); "
            "every weight of a stack has one entry per layer."
        )
    if len(rows) != 1:
        raise ValueError(
            f"pipeline: the inputs' leading (batch) dimensions differ ({sorted(rows)}); "
            "every input a layer carries has one row per example."
        )
    if not rows:
        raise ValueError(
            "pipeline: no input has a leading (batch) dimension to cut into microbatches "
            "(only scalars); pass the activations the layers carry."
        )
    (L,), (B,) = layers, rows
    if L % (S * R):
        raise ValueError(
            f"pipeline: {L} layers do not divide into {R} round(s) of {S} stages "
            f"({S * R} layer groups); choose stages x repeats dividing {L}."
        )
    if B % M:
        raise ValueError(
            f"pipeline: a batch of {B} does not divide into {M} microbatches; choose "
            f"microbatches dividing {B}."
        )
    if R > 1 and M < S:
        raise ValueError(
            f"pipeline: the circular schedule ({R} rounds) needs at least as many "
            f"microbatches as stages (got {M} microbatches, {S} stages): a microbatch "
            "comes back to stage 0 for its next round only after stage 0 has started "
            f"every microbatch of this one. Use microbatches >= {S}, or repeats=1 (GPipe)."
        )
    g = L // (S * R)
    batch = tuple(batch_axes)
    batch_entry = None if not batch else batch[0] if len(batch) == 1 else batch

    def constrain(x: Any, lead: tuple[Any, ...]) -> Any:
        lead = lead[: np.ndim(x)]  # (an accumulator has no batch dimension to split)
        spec = P(*lead, *([_U] * (np.ndim(x) - len(lead))))
        return jax.lax.with_sharding_constraint(x, spec)

    # Weights [L, ...] -> [S, R, g, ...], the stage dimension over ``axis``. Layer
    # l = (r * S + s) * g + j; with R = 1 this is the stored [L] split over ``axis``.
    def by_stage(w: Any) -> Any:
        if R == 1:  # a reshape of the stored [L] split over ``axis``: no data moves
            return constrain(jnp.reshape(w, (S, 1, g) + np.shape(w)[1:]), (axis,))
        w = jnp.reshape(w, (R, S, g) + np.shape(w)[1:])
        return constrain(jnp.swapaxes(w, 0, 1), (axis,))

    stacked = jax.tree.map(by_stage, weights)

    # Inputs [B, ...] -> [M, B / M, ...]: microbatch m = rows m, m + M, ...; an
    # accumulator (a scalar) -> [M], a copy for each microbatch.
    def to_micro(x: Any) -> Any:
        if not np.ndim(x):
            return jnp.broadcast_to(x, (M,))
        x = jnp.reshape(x, (B // M, M) + np.shape(x)[1:])
        return constrain(jnp.swapaxes(x, 0, 1), (None, batch_entry))

    def from_micro(x: Any) -> Any:
        if np.ndim(x) == 1:  # an accumulator's M copies
            if jnp.issubdtype(x.dtype, jnp.inexact):
                return jnp.mean(x, axis=0)
            return x[0]
        x = jnp.swapaxes(x, 0, 1)
        return jnp.reshape(x, (B,) + np.shape(x)[2:])

    # Each stage gets its own (stage-split) view of the microbatches, so the gradient of
    # what stage 0 reads is summed over ``axis`` once after the loop, not at every
    # tick (as a read of one array shared by the vmapped stages would be).
    def per_stage(x: Any) -> Any:
        x = to_micro(x)
        return constrain(jnp.broadcast_to(x, (S,) + np.shape(x)), (axis, None, batch_entry))

    micro = jax.tree.map(per_stage, inputs)
    micro_side = jax.tree.map(per_stage, side)

    def run(group: Any, r: Any, j: Any, m: Any, x: Any, micro_side: Any) -> Any:
        # The layer's weights and side inputs are read inside (so with ``remat`` a tick
        # keeps its input alone, not a copy of its layer's weights).
        layer = jax.tree.map(lambda w: w[r, j], group)
        if side is None:
            return layer_fn(layer, x)
        return layer_fn(layer, x, jax.tree.map(lambda a: a[m], micro_side))

    if remat:
        run = jax.checkpoint(run, policy=policy, prevent_cse=False)

    def blend(pairs: list[tuple[Any, Any]]) -> Any:
        # sum(w * x) with 0/1 weights, one of them 1: the chosen value exactly. A select
        # would do the same, but under vmap its backward keeps a full-size mask per tick.
        return sum(w.astype(x.dtype) * x for w, x in pairs)

    def store(buf: Any, got: Any, s: Any, t: Any) -> Any:
        # What came round from stage S - 1 to stage 0 (its output of tick t - 1, the last
        # layer of its item k = t - 1 - (S - 1) g) waits in stage 0's buffer until its
        # next round, or the end.
        k = t - 1 - (S - 1) * g
        keep = (s == 0) & (jnp.mod(t, g) == 0) & (k >= 0)
        m = jnp.mod(k // g, M)
        return jax.tree.map(lambda b, x: b.at[m].set(blend([(keep, x), (~keep, b[m])])), buf, got)

    def one_stage(
        group: Any, got: Any, buf: Any, micro: Any, micro_side: Any, s: Any, t: Any
    ) -> tuple[Any, Any]:
        # Stage s works through its items (round r, microbatch m), g layers each: item
        # k // g of k = t - s g, its layer j = k mod g (the same j on every stage).
        k = t - s * g
        item, j = k // g, jnp.mod(k, g)
        r = jnp.clip(item // M, 0, R - 1)
        m = jnp.mod(item, M)
        buf = store(buf, got, s, t)
        # Stage 0 starts an item on a microbatch of the batch (round 0) or on what came
        # round from stage S - 1 (later rounds); every other input is what it holds.
        starts = (s == 0) & (j == 0)
        x = jax.tree.map(
            lambda a, b, c: blend(
                [(starts & (r == 0), a[m]), (starts & (r > 0), b[m]), (~starts, c)]
            ),
            micro,
            buf,
            got,
        )
        return run(group, r, j, m, x, micro_side), buf

    vmapped = jax.vmap(one_stage, in_axes=(0, 0, 0, 0, 0, 0, None), spmd_axis_name=axis)
    ids = jnp.arange(S)

    def staged(x: Any, lead: int) -> Any:
        return constrain(x, (axis,) + (None,) * lead + (batch_entry,))

    zeros = jax.tree.map(lambda x: jnp.zeros((S,) + np.shape(x)[2:], x.dtype), micro)
    got0 = jax.tree.map(lambda x: staged(x, 0), zeros)
    buf0 = jax.tree.map(lambda x: staged(jnp.zeros(np.shape(x), x.dtype), 1), micro)

    def pass_on(out: Any) -> Any:
        return jax.tree.map(lambda y: staged(jnp.roll(y, 1, axis=0), 0), out)

    def tick(carry: Any, t: Any) -> tuple[Any, None]:
        got, buf = carry
        out, buf = vmapped(stacked, got, buf, micro, micro_side, ids, t)
        # After each item's last layer the activations move one stage on (a collective
        # permute over ``axis``); between a group's layers they stay where they are.
        if g == 1:
            got = pass_on(out)
        else:
            # (the scope tells explain the branch is taken one tick in g)
            with jax.named_scope(f"hand_off_1_in_{g}_ticks"):
                got = jax.lax.cond(jnp.mod(t, g) == g - 1, pass_on, lambda o: o, out)
        buf = jax.tree.map(lambda b: staged(b, 1), buf)
        return (got, buf), None

    steps = (R * M + S - 1) * g
    with jax.named_scope(PIPELINE_SCOPE):
        (got, buf), _ = jax.lax.scan(tick, (got0, buf0), jnp.arange(steps))
        buf = jax.vmap(store, in_axes=(0, 0, 0, None), spmd_axis_name=axis)(
            buf, got, ids, jnp.asarray(steps)
        )
    return jax.tree.map(lambda b: from_micro(b[0]), buf)
