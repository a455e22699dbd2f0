"""1F1B, interleaved 1F1B and zero-bubble for a user's unchanged train step.

Under ``HybridStrategy(stage=S, schedule="1f1b" | "interleaved-1f1b" | "zero-bubble")``
the step's ``jax.value_and_grad`` and ``jax.grad`` (so ``nnx.value_and_grad`` and
``nnx.grad``, built on them) of a loss whose model runs the ``pipeline=`` blocks are
computed by one loop interleaving the forward and backward passes of different
microbatches (:func:`dtensor.core.interleaved.run_schedule`). The step is written as
for one device; within its trace:

1. **before the blocks.** The loss runs once on the whole batch with the blocks stood
   in by their input (they are recorded, not run): what comes before them (the
   embedding), differentiated by ``jax.vjp``, gives the blocks' input, their stacked
   weights, side inputs (a mask) and what the layer reads beside them.
2. **the blocks and after them.** The loop runs the blocks' layers by the schedule's
   tick table; the tick a microbatch's last forward ends, the loss runs again on that
   microbatch (rows ``m, m + M, ...`` of every batch argument) with the blocks'
   output handed in, so what comes after them (final norm, head, the loss itself) runs
   on that microbatch alone and its cotangent starts the microbatch's backward the next
   tick. The gradients of what comes after the blocks accumulate over the microbatches.
3. **back before the blocks.** The gradient of the blocks' input (and weights) flows
   back through (1)'s ``vjp``.

The value is the mean of the microbatches' losses, as under gradient accumulation: the
whole batch's loss for a loss that is a mean over rows (an MoE load-balancing loss is
each microbatch's, averaged, as in the GPipe schedule). What this needs from the step:
``jax.value_and_grad``/``jax.grad`` (or ``nnx``'s) looked up when the step runs (not
bound at import), the loss a scalar, the blocks run once by the loss. A differentiated
function that does not run the blocks is left to JAX; the blocks run outside a gradient
(an evaluation step) run as GPipe (circular for ``interleaved-1f1b``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun

from dtensor.core.interleaved import reached_from, run_schedule
from dtensor.core.schedules import INTERLEAVED_SCHEDULES, make_schedule
from strategies.reads.pipeline import PipelineError, PipelinePlan

__all__ = ["scheduled_grads", "stand_in"]

_ORIGINAL = {"value_and_grad": jax.value_and_grad, "grad": jax.grad}
_local = threading.local()


@dataclasses.dataclass
class _Captured:
    """The blocks' call as the capture run saw it."""

    jaxpr: Any  # one layer: (consts..., w, x, side) -> x
    consts: list[Any]
    out_tree: Any
    weights: Any
    carry: Any
    side: Any


class _NotPipelined(Exception):
    """The differentiated function runs no pipelined blocks."""


def _micro_struct(tree: Any, rows: int) -> Any:
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(
            (rows,) + np.shape(a)[1:] if np.ndim(a) else (), jnp.result_type(a)
        ),
        tree,
    )


def stand_in(plan: PipelinePlan, layer_fn: Any, weights: Any, carry: Any, side: Any) -> Any:
    """``plan.run`` while a loss is traced here: record the blocks (capture) or hand back
    the output given (inject)."""
    if plan.mode == "inject":
        want = jax.tree.map(np.shape, carry)
        got = jax.tree.map(np.shape, plan.injected)
        if want != got:
            raise PipelineError(
                f"{plan.preset}(stage={plan.stages}, schedule={plan.schedule!r}): on one "
                f"microbatch the loss ran the pipelined blocks on {want}, not the microbatch's "
                f"{got}. Under this schedule the loss runs on one microbatch at a time in the "
                "last stage, so it must take the batch as an argument, not close over it: "
                "write nnx.value_and_grad(loss_fn)(model, batch) with "
                "loss_fn(model, batch), not nnx.value_and_grad(lambda m: loss_fn(m, batch))(model)."
            )
        return plan.injected
    rows = {int(np.shape(a)[0]) for a in jax.tree.leaves(carry) if np.ndim(a)}
    (b,) = rows
    m = plan.microbatches
    w0 = jax.tree.map(lambda w: jax.ShapeDtypeStruct(np.shape(w)[1:], jnp.result_type(w)), weights)
    closed, out = jax.make_jaxpr(layer_fn, return_shape=True)(
        w0, _micro_struct(carry, b // m), _micro_struct(side, b // m)
    )
    plan.captured.append(
        _Captured(closed.jaxpr, list(closed.consts), jax.tree.structure(out), weights, carry, side)
    )
    return carry


def _used_inputs(jaxpr: Any, used_out: list[bool]) -> list[bool]:
    """Which of ``jaxpr``'s inputs reach the outputs marked ``used_out`` (an equation's
    inputs all count once any of its outputs does)."""
    live = {
        v for v, u in zip(jaxpr.outvars, used_out, strict=True) if u and not isinstance(v, Literal)
    }
    for eqn in reversed(jaxpr.eqns):
        if any(v in live for v in eqn.outvars) or eqn.effects:
            live.update(v for v in eqn.invars if not isinstance(v, Literal))
    return [v in live for v in jaxpr.invars]


def _cotangent(value: Any, ct: Any) -> Any:
    if ct is not None:
        return ct
    if jnp.issubdtype(jnp.result_type(value), jnp.inexact):
        return jnp.zeros(np.shape(value), jnp.result_type(value))
    return np.zeros(np.shape(value), jax.dtypes.float0)


def _scheduled(
    fun: Any, args: tuple[Any, ...], argnums: Any, has_aux: bool, plan: PipelinePlan
) -> Any:
    """``((loss, aux), grads)`` of ``fun(*args)`` by the plan's schedule; ``None`` when
    ``fun`` runs no pipelined blocks."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    leaves, tree = jax.tree.flatten(args)
    diff = [i in nums for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    d_leaves = [v for v, d in zip(leaves, diff, strict=True) if d]

    # nnx's GradFn takes its non-differentiated states from a queue once a call; the loss
    # runs here once a trace (capture, per microbatch, dependencies): each gets them anew.
    queue = getattr(fun, "nondiff_states", None)
    queued = list(queue) if isinstance(queue, collections.deque) else None

    def call(values: list[Any]) -> tuple[Any, Any]:
        if queued is not None and queue is not None:
            queue.clear()
            queue.extend(queued)
        out = fun(*jax.tree.unflatten(tree, values))
        return out if has_aux else (out, None)

    def with_diff(d_vals: list[Any], base: list[Any]) -> list[Any]:
        it = iter(d_vals)
        return [next(it) if d else v for v, d in zip(base, diff, strict=True)]

    # 1. Before the blocks: the loss with the blocks recorded and stood in by their input.
    def before(d_vals: list[Any]) -> Any:
        plan.mode, plan.captured = "capture", []
        try:
            _, aux = call(with_diff(d_vals, leaves))
        finally:
            plan.mode = None
        if not plan.captured:
            raise _NotPipelined
        if len(plan.captured) > 1:
            raise PipelineError(
                f"{plan.preset}(stage={plan.stages}, schedule={plan.schedule!r}): the "
                f"differentiated loss runs the pipelined blocks {len(plan.captured)} times; "
                "an interleaved schedule pipelines one run of them per loss. Run them once, "
                "or use schedule='gpipe'."
            )
        cap = plan.captured[0]
        return (cap.carry, cap.weights, cap.side, cap.consts), aux

    _local.busy = True
    try:
        pre_out, pre_pull, aux_whole = jax.vjp(before, d_leaves, has_aux=True)
    except _NotPipelined:
        if queued is not None and queue is not None:  # the plain gradient's call takes it next
            queue.clear()
            queue.extend(queued)
        return None
    finally:
        _local.busy = False
    cap = plan.captured[0]
    carry, weights, side, consts = pre_out
    S, M = plan.stages, plan.microbatches
    R = 1
    if plan.schedule == "interleaved-1f1b":  # (default: one layer a stage a round)
        layers = int(np.shape(jax.tree.leaves(weights)[0])[0])
        R = plan.repeats if plan.repeats is not None else max(1, layers // S)
    (B,) = {int(np.shape(a)[0]) for a in jax.tree.leaves(carry) if np.ndim(a)}
    rows = B // M
    cut = [
        not d and np.ndim(v) >= 1 and np.shape(v)[0] == B for v, d in zip(leaves, diff, strict=True)
    ]

    def to_micro(x: Any) -> Any:
        return jnp.swapaxes(jnp.reshape(x, (rows, M) + np.shape(x)[1:]), 0, 1)

    cut_micro = [to_micro(v) for v, c in zip(leaves, cut, strict=True) if c]

    # 2. After the blocks, on one microbatch, with the blocks' output handed in.
    def after(d_vals: list[Any], y: Any, cut_vals: list[Any]) -> tuple[Any, Any]:
        it = iter(cut_vals)
        values = [next(it) if c else v for v, c in zip(with_diff(d_vals, leaves), cut, strict=True)]
        plan.mode, plan.injected = "inject", y
        try:
            loss, aux = call(values)
        finally:
            plan.mode, plan.injected = None, None
        if np.shape(loss) != ():
            raise PipelineError(
                f"{plan.preset}(stage={plan.stages}, schedule={plan.schedule!r}): the "
                f"differentiated function returns a value of shape {np.shape(loss)}; a "
                "loss must be a scalar (jax.grad's rule)."
            )
        return loss, aux

    y_struct = _micro_struct(carry, rows)
    cut_struct = [jax.ShapeDtypeStruct(np.shape(c)[1:], c.dtype) for c in cut_micro]
    d_struct = [jax.ShapeDtypeStruct(np.shape(v), jnp.result_type(v)) for v in d_leaves]
    _local.busy = True
    try:
        closed = jax.make_jaxpr(after)(d_struct, y_struct, cut_struct)
    finally:
        _local.busy = False
    jaxpr = closed.jaxpr
    n_d, n_y = len(d_leaves), len(jax.tree.leaves(y_struct))
    n_out = len(jaxpr.outvars)
    used = _used_inputs(jaxpr, [True] + [False] * (n_out - 1))[:n_d]
    live = [
        i
        for i, u in enumerate(used)
        if u and jnp.issubdtype(jnp.result_type(d_leaves[i]), jnp.inexact)
    ]
    aux_leaves, aux_tree = jax.tree.flatten(aux_whole)
    per_micro = reached_from(jaxpr, [False] * n_d + [True] * (n_y + len(cut_struct)))[1:]

    def loss_fn(y: Any, m: Any, acc: Any) -> tuple[Any, Any]:
        total, d_live, aux_buf = acc
        cut_m = [c[m] for c in cut_micro]

        def f(live_vals: list[Any], y: Any) -> Any:
            d_vals = list(d_leaves)
            for i, v in zip(live, live_vals, strict=True):
                d_vals[i] = v
            loss, aux = after(d_vals, y, cut_m)
            return loss, jax.tree.leaves(aux)

        loss, pull, aux = jax.vjp(f, [d_leaves[i] for i in live], y, has_aux=True)
        g_live, dy = pull(jnp.asarray(1.0 / M, jnp.result_type(loss)))
        aux_buf = [None if b is None else b.at[m].set(a) for b, a in zip(aux_buf, aux, strict=True)]
        d_live = [a + g for a, g in zip(d_live, g_live, strict=True)]
        return dy, (total + loss / M, d_live, aux_buf)

    loss_dtype = jaxpr.outvars[0].aval.dtype
    aux_avals = [v.aval for v in jaxpr.outvars[1:]]
    acc0 = (
        jnp.zeros((), loss_dtype),
        [jnp.zeros_like(d_leaves[i]) for i in live],
        [
            jnp.zeros((M,) + a.shape, a.dtype) if p else None
            for a, p in zip(aux_avals, per_micro, strict=True)
        ],
    )
    consts_in = list(consts)

    def layer(w: Any, shared: Any, x: Any, sd: Any) -> Any:
        flat = jax.tree.leaves((w, x, sd))
        return jax.tree.unflatten(cap.out_tree, jaxpr_as_fun(ClosedJaxpr(cap.jaxpr, shared))(*flat))

    schedule = make_schedule(plan.schedule, S, M, R)
    plan.runs += 1
    (total, d_live, aux_buf), d_w, d_consts, d_carry, d_side = run_schedule(
        layer, weights, consts_in, carry, side, loss_fn, acc0,
        schedule=schedule, axis=plan.axis, batch_axes=plan.batch_axes,
        keep="inputs" if plan.remat else "residuals",
    )  # fmt: skip

    # 3. Back before the blocks.
    cts = jax.tree.map(
        _cotangent,
        (carry, weights, side, consts_in),
        (d_carry, d_w, d_side, d_consts),
        is_leaf=lambda x: x is None,
    )
    (grads,) = pre_pull(cts)
    grads = list(grads)
    for i, g in zip(live, d_live, strict=True):
        grads[i] = grads[i] + g
    full = with_diff(grads, [None] * len(leaves))
    per_arg = jax.tree.unflatten(tree, full)
    out_grads = per_arg[argnums] if isinstance(argnums, int) else tuple(per_arg[i] for i in nums)

    def whole(a: Any, buf: Any) -> Any:
        if buf is None:  # the same for every microbatch: the capture run's
            return a
        if buf.ndim >= 2 and buf.shape[1] == rows:  # per row: the batch's rows in order
            return jnp.reshape(jnp.swapaxes(buf, 0, 1), (B,) + buf.shape[2:])
        if buf.ndim == 1 and jnp.issubdtype(buf.dtype, jnp.inexact):
            return jnp.mean(buf)
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}, schedule={plan.schedule!r}): the loss's aux "
            f"output of shape {buf.shape[1:]} depends on the batch but is neither per row "
            f"(a leading dimension of {rows} rows a microbatch) nor a float scalar; return "
            "per-row values or means."
        )

    aux = jax.tree.unflatten(
        aux_tree, [whole(a, b) for a, b in zip(aux_leaves, aux_buf, strict=True)]
    )
    return (total, aux), out_grads


def _transform(kind: str) -> Any:
    original = _ORIGINAL[kind]

    @functools.wraps(original)
    def transform(fun: Any, argnums: Any = 0, has_aux: bool = False, **kw: Any) -> Any:
        gradded = original(fun, argnums=argnums, has_aux=has_aux, **kw)
        plan = getattr(_local, "plan", None)
        if plan is None or getattr(_local, "busy", False) or kw.get("holomorphic"):
            return gradded

        @functools.wraps(fun)
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs or getattr(_local, "busy", False) or _local.plan is not plan:
                return gradded(*args, **kwargs)
            result = _scheduled(fun, args, argnums, has_aux, plan)
            if result is None:
                return gradded(*args)
            (loss, aux), grads = result
            if kind == "value_and_grad":
                return ((loss, aux) if has_aux else loss), grads
            return (grads, aux) if has_aux else grads

        return call

    return transform


@contextlib.contextmanager
def scheduled_grads(plan: PipelinePlan) -> Iterator[None]:
    """Within the block, ``jax.value_and_grad`` and ``jax.grad`` of a loss that runs
    ``plan``'s blocks run by its interleaved schedule (module docstring)."""
    if plan.schedule not in INTERLEAVED_SCHEDULES:
        yield
        return
    saved = getattr(_local, "plan", None), jax.value_and_grad, jax.grad
    _local.plan = plan
    plan.stand_in = stand_in
    jax.value_and_grad, jax.grad = _transform("value_and_grad"), _transform("grad")
    try:
        yield
    finally:
        _local.plan, jax.value_and_grad, jax.grad = saved
