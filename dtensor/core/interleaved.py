"""One SPMD loop that runs a pipeline schedule's tick table, forward and backward interleaved.

:func:`run_schedule` computes a pipelined stack's loss and gradients by the
table of a :class:`dtensor.core.schedules.Schedule` (1F1B, interleaved 1F1B,
zero-bubble), not by JAX's transpose of a forward loop (which runs every
backward after every forward: GPipe). Each tick every stage (``jax.vmap`` over
the stage dimension, partitioned over the ``stage`` mesh axis) runs the
forward, backward and weight-gradient ops its row of the table names; the
forward's output moves one stage on (a collective permute over ``stage``), the
backward's input gradient one stage back (the reverse permute), both in the same
loop. The loss of a microbatch is taken the tick its last forward ends (the
caller's ``loss``: the layers after the stack and the loss, on that
microbatch), and its cotangent enters the last stage's backward next tick.

What a stage keeps (the stash) for the microbatches between their forward and
backward, as many as the schedule has in flight (:attr:`Schedule.in_flight`),
not ``M``: each layer's input (``keep="inputs"``: a backward recomputes its
layers, as ``remat`` does) or what JAX's vjp of each layer keeps, less the
values computed from the weights alone (``keep="residuals"``: nothing is
recomputed). Gradients accumulate in place, one buffer per weight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from dtensor.core.pipeline import PIPELINE_SCOPE
from dtensor.core.schedules import FROM_BATCH, FROM_LOSS, FROM_WIRE, Schedule

__all__ = ["reached_from", "run_schedule", "vjp_inexact"]

_U = P.UNCONSTRAINED


def _inexact(a: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def vjp_inexact(fn: Callable[..., Any], primals: tuple[Any, ...], wrt: Sequence[bool]) -> Any:
    """``jax.vjp`` of ``fn(*primals)`` with respect to the floating leaves of the
    arguments marked in ``wrt``: ``(out, pullback)``, ``pullback(ct)`` giving a tuple shaped
    like ``primals`` with ``None`` for every leaf not differentiated.

    Examples:
        >>> import jax.numpy as jnp
        >>> from dtensor.core.interleaved import vjp_inexact
        >>> primals = (jnp.float32(3.0), jnp.int32(2))
        >>> out, pull = vjp_inexact(lambda w, i: w * i, primals, (True, True))
        >>> dw, di = pull(jnp.float32(1.0))
        >>> float(dw), di
        (2.0, None)
    """
    flat, tree = jax.tree.flatten(primals)
    masks = [
        jax.tree.map(lambda a, w=w: bool(w) and _inexact(a), p)
        for p, w in zip(primals, wrt, strict=True)
    ]
    mask = jax.tree.leaves(masks)
    diff = [a for a, k in zip(flat, mask, strict=True) if k]

    def f(diff: list[Any]) -> Any:
        it = iter(diff)
        return fn(
            *jax.tree.unflatten(
                tree, [next(it) if k else a for a, k in zip(flat, mask, strict=True)]
            )
        )

    out, pull = jax.vjp(f, diff)

    def pullback(ct: Any) -> tuple[Any, ...]:
        (d,) = pull(ct)
        it = iter(d)
        return jax.tree.unflatten(tree, [next(it) if k else None for k in mask])

    return out, pullback


def reached_from(jaxpr: Any, marked_in: list[bool]) -> list[bool]:
    """Which of ``jaxpr``'s outputs depend on the inputs marked ``marked_in`` (an equation's
    outputs all do once any of its inputs does).

    Examples:
        >>> import jax
        >>> from dtensor.core.interleaved import reached_from
        >>> jaxpr = jax.make_jaxpr(lambda a, b: (a + 1, b * 2))(1.0, 2.0).jaxpr
        >>> reached_from(jaxpr, [True, False])
        [True, False]
    """
    tainted = {v for v, m in zip(jaxpr.invars, marked_in, strict=True) if m}
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in tainted for v in eqn.invars):
            tainted.update(eqn.outvars)
    return [not isinstance(v, Literal) and v in tainted for v in jaxpr.outvars]


def _acc_zeros(tree: Any, lead: tuple[int, ...]) -> Any:
    """Zeros ``lead + shape`` for each floating leaf (an accumulator), ``None`` elsewhere."""
    return jax.tree.map(
        lambda a: jnp.zeros(lead + np.shape(a), jnp.result_type(a)) if _inexact(a) else None, tree
    )


def _add(acc: Any, d: Any, on: Any) -> Any:
    """``acc + d`` where ``on`` (``d`` is ``None`` where ``acc`` is)."""
    return jax.tree.map(
        lambda a, x: a + jnp.where(on, x, jnp.zeros_like(x)).astype(a.dtype), acc, d
    )


def _pick(k: Any, options: list[tuple[int | None, Any]], default: Any) -> Any:
    """The option whose key is ``k`` (``None`` key: ``k >= 0``, a buffer slot)."""
    out = default
    for key, value in options:
        if value is None:
            continue
        hit = (k >= 0) if key is None else (k == key)
        out = jax.tree.map(lambda v, o, hit=hit: jnp.where(hit, v, o), value, out)
    return out


def _put(buf: Any, k: Any, value: Any, on: Any = True) -> Any:
    """``buf[k] = value`` where ``k >= 0`` (and ``on``)."""
    if buf is None:
        return None
    i = jnp.maximum(k, 0)
    ok = (k >= 0) & on
    return jax.tree.map(
        lambda b, v: b.at[i].set(jnp.where(ok, v.astype(b.dtype), b[i])), buf, value
    )


def _take(buf: Any, k: Any) -> Any:
    return None if buf is None else jax.tree.map(lambda b: b[jnp.maximum(k, 0)], buf)


def run_schedule(
    layer_fn: Callable[..., Any],
    weights: Any,
    shared: Any,
    inputs: Any,
    side: Any,
    loss: Callable[[Any, Any, Any], tuple[Any, Any]],
    loss_init: Any,
    *,
    schedule: Schedule,
    axis: str = "stage",
    batch_axes: Sequence[str] = (),
    keep: str = "inputs",
) -> tuple[Any, Any, Any, Any, Any]:
    """A pipelined stack's forward and backward by ``schedule``'s tick table.

    Args:
        layer_fn: ``layer_fn(w, shared, x, side) -> x``: one layer (``weights`` at one
            index of their leading dimension) on one microbatch.
        weights: the stack, every leaf ``[L, ...]``; layer group ``r * S + s`` (``g = L /
            (R S)`` layers) lives on stage ``s`` (the circular layout; ``R = 1``: the
            stored ``[L]`` split over ``axis``).
        shared: what every layer reads beside its weights (a rotary table, say); its
            gradients are summed over the layers.
        inputs: the stack's input, ``[B, ...]`` leaves (floating), cut into ``M``
            microbatches (rows ``m, m + M, ...``); scalars among them are per-microbatch
            accumulators (an MoE loss the layers add to).
        side: ``[B, ...]`` arrays the layers read for their microbatch (a mask).
        loss: ``loss(y, m, acc) -> (dy, acc)``: the stack's output ``y`` for microbatch
            ``m`` (traced; replicated over ``axis``) to its cotangent, accumulating what
            the caller keeps (the loss, the gradients of the layers after the stack) in
            ``acc``.
        loss_init: ``acc``'s initial value.
        schedule: the tick table (:func:`dtensor.core.schedules.make_schedule`).
        axis: the mesh axis of the stages.
        batch_axes: mesh axes the microbatch rows are split over.
        keep: what a stage keeps of each layer between a microbatch's forward and its
            backward: ``"inputs"`` (the layer's input; the backward recomputes the layer, as
            ``remat`` does) or ``"residuals"`` (what JAX's vjp of the layer keeps, less the
            values computed from the weights alone, which the backward recomputes: no
            recomputation of the layer, more memory).

    Returns:
        ``(acc, d_weights, d_shared, d_inputs, d_side)``, each gradient shaped like its
        argument (``None`` at leaves that are not floating).

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> from dtensor.core.interleaved import run_schedule
        >>> from dtensor.core.schedules import make_schedule
        >>> w, x = jnp.full((4,), 2.0), jnp.ones((8, 3))  # 4 layers, each multiplies by 2
        >>> def loss(y, m, total):  # each microbatch's mean, averaged over the 4
        ...     return jnp.full_like(y, 1 / (4 * y.size)), total + y.mean() / 4
        >>> def grads(w, x):
        ...     return run_schedule(lambda w, sh, x, sd: x * w, w, None, x, None, loss,
        ...                         jnp.zeros(()), schedule=make_schedule("1f1b", 2, 4))
        >>> with dtensor.create_mesh([("stage", 2), ("data", 4)]):
        ...     total, dw, _, dx, _ = jax.jit(grads)(w, x)
        >>> float(total), dw.tolist(), round(float(dx[0, 0]), 4)  # 2**4; 2**3 each; 16/24
        (16.0, [8.0, 8.0, 8.0, 8.0], 0.6667)
    """
    S, M, R = schedule.stages, schedule.microbatches, schedule.rounds
    layers = {int(np.shape(a)[0]) for a in jax.tree.leaves(weights)}
    rows = {int(np.shape(a)[0]) for a in jax.tree.leaves((inputs, side)) if np.ndim(a)}
    if len(layers) != 1 or len(rows) != 1:
        raise ValueError(
            f"run_schedule: the weights' leading (layer) dimensions {sorted(layers)} and the "
            f"inputs' leading (batch) dimensions {sorted(rows)} must each be one size."
        )
    if not all(_inexact(a) for a in jax.tree.leaves(inputs)):
        raise ValueError(
            "run_schedule: a pipelined stack's carry must be floating arrays (activations and "
            f"float accumulators); got {jax.tree.map(jnp.result_type, inputs)}."
        )
    (L,), (B,) = layers, rows
    if L % (S * R) or B % M:
        raise ValueError(
            f"run_schedule: {L} layers must divide into {R} round(s) of {S} stages and a "
            f"batch of {B} into {M} microbatches."
        )
    g = L // (S * R)
    batch = tuple(batch_axes)
    batch_entry = None if not batch else batch[0] if len(batch) == 1 else batch

    def constrain(x: Any, lead: tuple[Any, ...]) -> Any:
        lead = lead[: np.ndim(x)]
        return jax.lax.with_sharding_constraint(x, P(*lead, *([_U] * (np.ndim(x) - len(lead)))))

    def staged(tree: Any, lead: int) -> Any:
        return jax.tree.map(lambda x: constrain(x, (axis,) + (None,) * lead + (batch_entry,)), tree)

    def by_stage(w: Any) -> Any:
        if R == 1:
            return constrain(jnp.reshape(w, (S, 1, g) + np.shape(w)[1:]), (axis,))
        w = jnp.reshape(w, (R, S, g) + np.shape(w)[1:])
        return constrain(jnp.swapaxes(w, 0, 1), (axis,))

    def from_stage(d: Any) -> Any:
        if R > 1:
            d = jnp.swapaxes(d, 0, 1)
        return jnp.reshape(d, (L,) + np.shape(d)[3:])

    def to_micro(x: Any) -> Any:
        if not np.ndim(x):
            return jnp.broadcast_to(x, (M,))
        x = jnp.reshape(x, (B // M, M) + np.shape(x)[1:])
        return constrain(jnp.swapaxes(x, 0, 1), (None, batch_entry))

    def from_micro(x: Any) -> Any:
        if np.ndim(x) == 1:  # a scalar's M copies: the broadcast's transpose
            return jnp.sum(x, axis=0)
        return jnp.reshape(jnp.swapaxes(x, 0, 1), (B,) + np.shape(x)[2:])

    stacked = jax.tree.map(by_stage, weights)
    micro = jax.tree.map(to_micro, inputs)
    micro_side = jax.tree.map(to_micro, side)
    one = jax.tree.map(lambda a: jnp.zeros(np.shape(a)[1:], a.dtype), micro)  # a microbatch

    side1 = jax.tree.map(lambda a: a[0], micro_side)
    w1 = jax.tree.map(lambda w: w[0, 0, 0], stacked)

    def whole_vjp(w: Any, x: Any, sd: Any) -> Any:
        return jax.vjp(lambda w, sh, x, sd: layer_fn(w, sh, x, sd), w, shared, x, sd)

    if keep == "residuals":
        # Which of the vjp's residuals depend on the microbatch (kept) and which on the
        # weights alone (recomputed in the backward tick, never stored per microbatch),
        # traced as the tick traces them (over the stages, so shapes are the loop's).
        def res_leaves(w: Any, x: Any, sd: Any) -> list[Any]:
            return jax.tree.leaves(whole_vjp(w, x, sd)[1])

        by_stage_args = jax.tree.map(
            lambda a: jnp.broadcast_to(a, (S,) + np.shape(a)), (w1, one, side1)
        )
        staged_res = jax.vmap(res_leaves, spmd_axis_name=axis)
        closed = jax.make_jaxpr(staged_res)(*by_stage_args)
        n_w = len(jax.tree.leaves(w1))
        n_x = len(jax.tree.leaves((one, side1)))
        per_micro = reached_from(closed.jaxpr, [False] * n_w + [True] * n_x)
        shapes = [v.aval for v in closed.jaxpr.outvars]
        kept_template = [
            jnp.zeros(a.shape[1:], a.dtype) for a, p in zip(shapes, per_micro, strict=True) if p
        ]
    elif keep == "inputs":
        kept_template = one
    else:
        raise ValueError(f"run_schedule(keep={keep!r}): keep 'inputs' or 'residuals'.")

    def save(w: Any, x: Any, sd: Any) -> tuple[Any, Any]:
        """One layer's forward: its output and what the stage keeps for its backward."""
        if keep == "inputs":
            return layer_fn(w, shared, x, sd), x
        y, f = whole_vjp(w, x, sd)
        return y, [v for v, p in zip(jax.tree.leaves(f), per_micro, strict=True) if p]

    def pullback(w: Any, kept: Any, sd: Any, wrt: tuple[bool, bool, bool, bool]) -> Any:
        """``dy -> (dw, dshared, dx, dside)`` of one layer from what was kept (``None`` where
        not floating or not asked for)."""
        if keep == "inputs":  # the layer recomputed from its input
            _, pull = vjp_inexact(layer_fn, (w, shared, kept, sd), wrt)
            return pull
        _, again = whole_vjp(w, jax.tree.map(jnp.zeros_like, one), sd)  # the weights' part
        it = iter(kept)
        leaves = [
            next(it) if p else v for v, p in zip(jax.tree.leaves(again), per_micro, strict=True)
        ]
        f = jax.tree.unflatten(jax.tree.structure(again), leaves)  # this trace's pullback

        def pull(dy: Any) -> Any:
            cts = f(dy)
            return tuple(
                jax.tree.map(lambda c, a, on=on: c if on and _inexact(a) else None, ct, primal)
                for ct, primal, on in zip(cts, (w, shared, one, sd), wrt, strict=True)
            )

        return pull

    def buffer(lead: tuple[int, ...], k: int) -> Any:
        if not k:
            return None
        return staged(
            jax.tree.map(lambda a: jnp.zeros((S,) + lead + np.shape(a), a.dtype), one), len(lead)
        )

    split = schedule.name == "zero-bubble"
    slots = schedule.slots
    carry0 = dict(
        got=buffer((), 1),
        dgot=buffer((), 1),
        post_dy=one,
        fin=buffer((slots["forward"],), slots["forward"]),
        bin=buffer((slots["backward"],), slots["backward"]),
        stash=jax.tree.map(
            lambda a: constrain(
                jnp.zeros((S, max(1, slots["stash"]), g) + np.shape(a), a.dtype),
                (axis, None, None, batch_entry) if keep == "inputs" else (axis,),
            ),
            kept_template,
        ),
        cot=buffer((slots["cotangent"], g), slots["cotangent"]) if split else None,
        dW=_acc_zeros(jax.tree.map(lambda w: w[0, 0, 0], stacked), (S, R, g)),
        dsh=_acc_zeros(shared, (S,)),
        dside=_acc_zeros(jax.tree.map(lambda a: a[0], micro_side), (S, M)),
        d_in=_acc_zeros(one, (S, M)),
        acc=loss_init,
    )

    def forward(
        group: Any, fin: Any, got: Any, stash: Any, on: Any, m: Any, r: Any, src: Any, st: Any
    ) -> Any:
        m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
        x = _pick(
            src, [(FROM_BATCH, _take(micro, m)), (FROM_WIRE, got), (None, _take(fin, src))], got
        )
        sd = _take(micro_side, m)
        slot = jnp.where(on, st, -1)
        i = jnp.maximum(slot, 0)

        def body(carry: Any, j_w: Any) -> Any:
            # What the layer's backward needs, straight into the stash (no [g, ...] copy).
            x, stash = carry
            j, w = j_w
            y, kept = save(w, x, sd)
            stash = jax.tree.map(
                lambda b, v: b.at[i, j].set(jnp.where(slot >= 0, v, b[i, j])), stash, kept
            )
            return (y, stash), None

        (y, stash), _ = jax.lax.scan(body, (x, stash), (jnp.arange(g), _take(group, r)))
        return y, stash

    def add_at(acc: Any, r: Any, j: Any, d: Any, on: Any) -> Any:
        """``acc[r, j] += d`` where ``on``: in place, one layer's gradient at a time."""
        return jax.tree.map(
            lambda a, x: a.at[r, j].add(jnp.where(on, x, jnp.zeros_like(x)).astype(a.dtype)), acc, d
        )

    def backward(
        group: Any, bin: Any, dgot: Any, post_dy: Any, stash: Any, cot: Any, dW: Any, dsh: Any,
        dside: Any, d_in: Any, on: Any, m: Any, r: Any, src: Any, st: Any, first: Any, bcot: Any,
    ) -> Any:  # fmt: skip
        m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
        dy = _pick(src, [(FROM_WIRE, dgot), (FROM_LOSS, post_dy), (None, _take(bin, src))], dgot)
        sd = _take(micro_side, m)
        xs = _take(stash, st)
        slot = jnp.where(on, bcot, -1)
        i = jnp.maximum(slot, 0)

        def body(carry: Any, j_w: Any) -> Any:
            dy, dW, a_sh, a_sd, cot = carry
            j, w = j_w
            kept = jax.tree.map(lambda b: b[j], xs)
            # The layer's vjp from what was kept (its forward recomputed from its input, or
            # its residuals): with respect to the input alone under zero-bubble (the
            # weights' later, in W).
            dw, d_sh, dx, d_sd = pullback(w, kept, sd, (not split, not split, True, True))(dy)
            if split:  # the layer's output cotangent, kept for its weight gradient
                cot = jax.tree.map(
                    lambda b, v: b.at[i, j].set(jnp.where(slot >= 0, v, b[i, j])), cot, dy
                )
            else:
                dW = add_at(dW, r, j, dw, on)
                a_sh = jax.tree.map(jnp.add, a_sh, d_sh)
            return (dx, dW, a_sh, jax.tree.map(jnp.add, a_sd, d_sd), cot), (dy if split else None)

        carry = (dy, dW, _acc_zeros(shared, ()), _acc_zeros(sd, ()), cot)
        (dx, dW, d_sh, d_sd, cot), now = jax.lax.scan(
            body, carry, (jnp.arange(g), _take(group, r)), reverse=True
        )
        if not split:
            dsh = _add(dsh, d_sh, on)
        dside = jax.tree.map(
            lambda a, d: a.at[m].add(jnp.where(on, d, jnp.zeros_like(d))), dside, d_sd
        )
        d_in = _put(d_in, jnp.where(first == 1, m, -1), dx, on)
        return dx, dW, dsh, dside, d_in, cot, now

    def wgrad(
        group: Any,
        stash: Any,
        cot: Any,
        now: Any,
        dW: Any,
        dsh: Any,
        on: Any,
        m: Any,
        r: Any,
        st: Any,
        src: Any,
    ) -> Any:
        m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
        sd = _take(micro_side, m)
        xs = _take(stash, st)
        dys = _pick(src, [(FROM_WIRE, now), (None, _take(cot, src))], now)

        def body(carry: Any, j_w: Any) -> Any:
            dW, a_sh = carry
            j, w = j_w
            kept, dy = jax.tree.map(lambda b: b[j], xs), jax.tree.map(lambda b: b[j], dys)
            dw, d_sh, _, _ = pullback(w, kept, sd, (True, True, False, False))(dy)
            return (add_at(dW, r, j, dw, on), jax.tree.map(jnp.add, a_sh, d_sh)), None

        (dW, d_sh), _ = jax.lax.scan(
            body, (dW, _acc_zeros(shared, ())), (jnp.arange(g), _take(group, r))
        )
        return dW, _add(dsh, d_sh, on)

    vmap = functools.partial(jax.vmap, spmd_axis_name=axis)

    def store(buf: Any, value: Any, k: Any, shared_value: bool = False) -> Any:
        if buf is None:
            return None
        return vmap(_put, in_axes=(0, 0, None if shared_value else 0))(buf, k, value)

    def tick(kinds: tuple[bool, bool, bool, bool], c: dict[str, Any], row: dict[str, Any]) -> Any:
        has_f, has_b, has_w, has_loss = kinds
        c = dict(c)
        c["fin"] = store(c["fin"], c["got"], row["fa_slot"])
        c["bin"] = store(c["bin"], c["dgot"], row["ba_slot"])
        c["bin"] = store(c["bin"], c["post_dy"], row["pa_slot"], shared_value=True)
        out = dx = None
        if has_f:
            out, c["stash"] = vmap(forward)(
                stacked, c["fin"], c["got"], c["stash"],
                row["f_on"], row["f_m"], row["f_r"], row["f_src"], row["f_stash"],
            )  # fmt: skip
        new_dy = c["post_dy"]
        if has_loss:  # the last stage's output (of the last round) to the loss
            last = jax.tree.map(lambda o: o[S - 1], out)
            new_dy, c["acc"] = loss(last, row["loss_m"], c["acc"])
        now = None
        if has_b:
            backward_v = vmap(backward, in_axes=(0, 0, 0, None) + (0,) * 13)
            dx, c["dW"], c["dsh"], c["dside"], c["d_in"], cot, now = backward_v(
                stacked, c["bin"], c["dgot"], c["post_dy"], c["stash"], c["cot"], c["dW"],
                c["dsh"], c["dside"], c["d_in"], row["b_on"], row["b_m"], row["b_r"],
                row["b_src"], row["b_stash"], row["b_first"], row["b_cot"],
            )  # fmt: skip
            if split:
                c["cot"] = cot
        if has_w:
            c["dW"], c["dsh"] = vmap(wgrad)(
                stacked, c["stash"], c["cot"], now, c["dW"], c["dsh"],
                row["w_on"], row["w_m"], row["w_r"], row["w_stash"], row["w_cot"],
            )  # fmt: skip
        # Activations one stage on, input gradients one stage back (permutes over ``axis``).
        if has_f:
            c["got"] = staged(jax.tree.map(lambda y: jnp.roll(y, 1, axis=0), out), 0)
        if has_b:
            c["dgot"] = staged(jax.tree.map(lambda d: jnp.roll(d, -1, axis=0), dx), 0)
        c["post_dy"] = new_dy  # enters the last stage's backward next tick
        return c, None

    tables = {k: jnp.asarray(v) for k, v in schedule.tables.items()}
    tables["loss_m"] = jnp.asarray(schedule.loss_m)
    carry = carry0
    with jax.named_scope(PIPELINE_SCOPE):
        for start, stop, kinds in schedule.phases():
            rows_ = {k: v[start:stop] for k, v in tables.items()}
            carry, _ = jax.lax.scan(functools.partial(tick, kinds), carry, rows_)
    d_weights = jax.tree.map(from_stage, carry["dW"])
    d_shared = jax.tree.map(lambda d: jnp.sum(d, axis=0), carry["dsh"])
    d_inputs = jax.tree.map(lambda d: from_micro(jnp.sum(d, axis=0)), carry["d_in"])
    d_side = jax.tree.map(lambda d: from_micro(jnp.sum(d, axis=0)), carry["dside"])
    return carry["acc"], d_weights, d_shared, d_inputs, d_side
