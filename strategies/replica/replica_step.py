"""Running a data-parallel step once per replica, its gradients reduced by a cross-device op.

The mechanism behind a non-default ``cross_device_ops`` (see
:mod:`strategies.replica.cross_device_ops` for what each choice compiles to): the
unchanged step runs under ``jax.shard_map`` over the replica axes on its slice
of the batch, and every ``nnx.Optimizer`` passed to ``run`` gets, for that trace
only, an optax transformation in front of its own that averages the gradients
over the replicas with the chosen algorithm.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from strategies.replica.cross_device_ops import CrossDeviceOps

__all__ = ["CrossDeviceOpsError", "bound", "bound_mesh", "compile_step", "reducing", "wrap_step"]


class CrossDeviceOpsError(ValueError):
    """A cross-device ops choice that cannot be honoured here."""


class _Context(threading.local):
    axes: tuple[str, ...] | None = None
    mesh: Any = None


_context = _Context()


def bound_mesh() -> Any:
    """The dtensor mesh of the step being traced once per replica (``None`` outside)."""
    return _context.mesh


@contextlib.contextmanager
def bound(axes: tuple[str, ...] | None, mesh: Any = None) -> Iterator[None]:
    """Inside: the replica axes (and dtensor mesh) the step being traced runs over."""
    prev = (_context.axes, _context.mesh)
    _context.axes, _context.mesh = axes, mesh
    try:
        yield
    finally:
        _context.axes, _context.mesh = prev


def reducing(tx: Any, reduce: Callable[[Any], Any]) -> optax.GradientTransformationExtraArgs:
    """``tx`` with ``reduce`` applied to the gradients before its own update."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        return tx.update(reduce(updates), state, params, **extra)

    return optax.GradientTransformationExtraArgs(tx.init, update)


def wrap_step(ops: CrossDeviceOps, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with ``ops``' gradient reduction installed in front of its optimizers (for this trace)."""

    def step(*args: Any, **kwargs: Any) -> Any:
        axes = _context.axes
        optimizers = [
            v
            for v in jax.tree.leaves((args, kwargs), is_leaf=lambda v: isinstance(v, nnx.Optimizer))
            if isinstance(v, nnx.Optimizer)
        ]
        if not optimizers:
            raise CrossDeviceOpsError(
                f"cross_device_ops={ops!r} reduces gradients where an nnx.Optimizer applies "
                f"them, but {getattr(fn, '__name__', 'the step')} got none among its arguments "
                "(a functional (params, opt_state, batch) step reduces nothing the strategy "
                "can see). Pass the nnx.Optimizer to run(), or use the default cross_device_ops."
            )
        for opt in optimizers:
            opt.tx = reducing(opt.tx, lambda g: ops.all_mean(g, axes) if axes is not None else g)
        return fn(*args, **kwargs)

    return step


def compile_step(
    ops: CrossDeviceOps,
    strategy: Any,
    call: Callable[..., Any],
    arrays: list[Any],
    *,
    has_state: bool,
) -> Any:
    """``call(state, arrays)`` once per replica, as one ``jax.jit`` (the strategy's hook)."""
    axes = tuple(strategy.batch_axes)
    spec_axes = axes[0] if len(axes) == 1 else axes
    batch_spec = P(spec_axes)
    leaf_specs = [batch_spec if np.ndim(v) > 0 else P() for v in arrays]
    n = strategy.mesh.axis_size(axes)
    mesh = strategy.mesh.jax_mesh

    def local(v: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(np.shape(v))
        return jax.ShapeDtypeStruct((shape[0] // n, *shape[1:]) if shape else shape, v.dtype)

    def pure(state: Any, leaves: list[Any]) -> Any:
        with bound(None):  # learn the outputs' structure (no axes bound here)
            out_shape = jax.eval_shape(call, state, [local(v) for v in leaves])[1]
        out_specs = jax.tree.map(lambda o: P() if o.ndim == 0 else batch_spec, out_shape)

        def body(state: Any, leaves: list[Any]) -> Any:
            with bound(axes, strategy.mesh):
                new_state, out = call(state, leaves)
                scalars = jax.tree.map(lambda o: o if o.ndim == 0 else None, out)
                means = ops.all_mean(scalars, axes)
            out = jax.tree.map(
                lambda o, m: o if o.ndim else m, out, means, is_leaf=lambda v: v is None
            )
            return new_state, out

        state_specs = jax.tree.map(lambda _: P(), state)
        return jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(state_specs, leaf_specs),
            out_specs=(state_specs, out_specs),
            check_vma=False,
        )(state, leaves)

    return jax.jit(pure, donate_argnums=(0,) if has_state else ())
