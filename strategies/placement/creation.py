"""Laying out NNX models as they are built inside ``strategy.scope()``: the one patch of Flax.

Flax has no public hook that runs when a Variable or a Module is created
(``nnx.use_eager_sharding`` places only annotated Variables; see
JAX-NOTES), so this module owns the single place where the library wraps a
Flax internal: the NNX Pytree metaclass's ``__call__``, while at least one
thread is inside a scope. When the *outermost* Module or Optimizer
construction returns, its variables are placed by the strategy's policies
(with their paths, so path rules apply). Objects built under a JAX trace
(``nnx.eval_shape``, ``jax.jit``) are left alone.

Checked again on flax 0.12.12 (the newest release in the tested range), none of
its hooks serves: ``nnx.use_eager_sharding`` places a Variable only when it
carries ``out_sharding`` metadata; ``nnx.var_defaults`` sets only ``hijax`` and
``ref``; the per-Variable ``on_create_value`` hooks are deprecated (Flax warns
at every use), must be passed to each Variable by the layer that creates it
(``nnx.Linear`` passes none), and run before the Variable has a path, so the
strategy's path rules could not apply there either. Layout needs the finished
module tree, which only the end of the outermost construction gives.

The patch is thread-safe and re-entrant (a count under a lock; each thread
sees only its own strategy, other threads call straight through), it
restores exactly what it found, and :func:`check_flax_supported` (run by the
test suite) fails loudly if a Flax upgrade moves what it relies on.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import jax.core
from flax import nnx
from flax.nnx import pytreelib

from strategies.boundary import explicit_axes_error

if TYPE_CHECKING:
    from strategies.base import Strategy

_local = threading.local()
_lock = threading.Lock()
_found: Any = None  # what PytreeMeta.__call__ was when the patch went in
_installed = 0


def check_flax_supported() -> None:
    """Raise if this Flax no longer has what the patch relies on.

    ``flax.nnx.pytreelib.PytreeMeta`` must exist, be the metaclass of
    ``nnx.Module`` and ``nnx.Optimizer``, and define ``__call__``.
    """
    meta = getattr(pytreelib, "PytreeMeta", None)
    if meta is None or "__call__" not in vars(meta):
        raise RuntimeError(
            "strategies.placement.creation: flax.nnx.pytreelib.PytreeMeta.__call__ is gone in this Flax "
            "version, so models built in strategy.scope() cannot be laid out as they are built. "
            "Pin the Flax version the project is tested with, or build models with "
            "strategy.create(factory)."
        )
    for cls in (nnx.Module, nnx.Optimizer):
        if not isinstance(cls, meta):
            raise RuntimeError(
                f"strategies.placement.creation: {cls.__name__} is no longer built through PytreeMeta in "
                "this Flax version. Pin the tested Flax version or use strategy.create(factory)."
            )


def _wrapped_call(cls: Any, *args: Any, **kwargs: Any) -> Any:
    original = _found
    strategy = getattr(_local, "strategy", None)
    if strategy is None:
        return original(cls, *args, **kwargs)
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        obj = original(cls, *args, **kwargs)
    except ValueError as err:  # JAX's, from the constructor (a layer run at init, say)
        ours = explicit_axes_error(err, strategy, f"building {cls.__name__} in scope()")
        if ours is None or _local.depth > 1:  # reported once, by the outermost construction
            raise
        raise ours from None
    finally:
        _local.depth -= 1
    if (
        _local.depth == 0
        and isinstance(obj, nnx.Module | nnx.Optimizer)
        and not isinstance(obj, nnx.Rngs)
    ):
        leaves = jax.tree.leaves(nnx.state(obj))
        if leaves and not any(isinstance(v, jax.core.Tracer) for v in leaves):
            strategy.distribute_variables(obj)
            _as_built_outside(obj, _local.eager_default)
    return obj


def _as_built_outside(obj: Any, eager_sharding: bool) -> None:
    """Give ``obj``'s Variables the metadata they get outside a scope.

    The scope builds with its own ``nnx.use_eager_sharding`` setting, which
    Flax records on every Variable; a model built in scope must be the same
    pytree (same metadata) as one built outside, only laid out differently.
    """
    for _, node in nnx.iter_graph(obj):
        if isinstance(node, nnx.Variable) and node.get_metadata().get("eager_sharding") is not None:
            node.set_metadata("eager_sharding", eager_sharding)


@contextlib.contextmanager
def placing(strategy: Strategy) -> Iterator[None]:
    """While active (in this thread), outermost NNX constructions are laid out by ``strategy``."""
    global _installed, _found
    with _lock:
        if _installed == 0:
            check_flax_supported()
            _found = vars(pytreelib.PytreeMeta)["__call__"]
            pytreelib.PytreeMeta.__call__ = _wrapped_call  # type: ignore[method-assign]
        _installed += 1
    prev = getattr(_local, "strategy", None), getattr(_local, "eager_default", None)
    _local.eager_default = nnx.using_eager_sharding()
    _local.strategy = strategy
    try:
        with nnx.use_eager_sharding(strategy.honor_annotations):
            yield
    finally:
        _local.strategy, _local.eager_default = prev
        with _lock:
            _installed -= 1
            if _installed == 0:
                pytreelib.PytreeMeta.__call__ = _found  # type: ignore[method-assign]


def build_in_layouts(strategy: Strategy, factory: Any) -> Any:
    """:meth:`strategies.Strategy.create`: ``factory()``'s result built directly in its layouts.

    The factory runs abstractly first (``nnx.eval_shape``) to learn the
    variables, then under ``jax.jit`` with ``out_shardings`` from the
    strategy's storage layouts, so no variable is materialised whole on one
    device.
    """
    from dtensor import Layout, resolve_layouts
    from dtensor.core.tree import is_node

    with strategy.mesh, nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(factory)
        is_nnx = is_node(abstract)
        if is_nnx:
            strategy.observe(abstract)
        graphdef, abstract_state = nnx.split(abstract) if is_nnx else (None, abstract)
        layouts, _ = resolve_layouts(abstract_state, strategy.storage_layout_fn, mesh=strategy.mesh)
        shardings = jax.tree.map(
            lambda lay: lay.sharding, layouts, is_leaf=lambda v: isinstance(v, Layout)
        )

        def init() -> Any:
            made = factory()
            return nnx.split(made)[1] if is_nnx else made

    # Compile under the mesh the variables are stored on (CentralStorage keeps
    # them off the compute mesh; jit rejects a context mesh that differs).
    meshes = {lay.mesh for lay in jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout))}
    with meshes.pop() if len(meshes) == 1 else strategy.mesh, nnx.use_eager_sharding(False):
        state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state) if graphdef is not None else state
