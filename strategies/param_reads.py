"""Reads of NNX variables intercepted inside a traced step: FSDP's gather at each read.

:func:`gather_at_reads` traces a step so that every read of a variable split
over the data axes is gathered for compute (and its gradient
reduce-scattered) with :mod:`strategies.fsdp_ops`; the presets that shard
variables over data axes (FullyShardedStrategy, HybridStrategy's ``fsdp``
axis) use it as their ``trace_step``. The interception lives only inside
the trace: nothing returned from the step carries it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dtensor import Layout, Mesh
from dtensor.core.tree import is_variable
from strategies.fsdp_ops import explicit_region, gather_for_compute, matmul_only_reads, tag_read

__all__ = ["explicit_specs", "gather_at_reads"]


def _var_or_layout(x: Any) -> bool:
    return is_variable(x) or isinstance(x, Layout)


def gather_at_reads(
    call: Callable[[Any, list[Any]], Any],
    state: Any,
    arrays: list[Any],
    layouts: Any,
    shardings: list[Any],
    mesh: Mesh,
    axes: tuple[str, ...],
) -> Any:
    """Trace ``call(state, arrays)`` with every read of a variable split over ``axes`` gathered.

    Each read goes through :func:`strategies.fsdp_ops.gather_for_compute`
    (all-gather forward, reduce-scatter of the gradient) on Explicit axes.
    Where the plan does not apply (arguments that are not batches) the step
    is traced as is; where user code fails on Explicit axes, a warning says
    so and XLA's own plan runs instead.
    """
    specs = explicit_specs(state, layouts, shardings, mesh, axes)
    if specs is None:
        return call(state, arrays)
    with (
        warnings.catch_warnings(),
        jax.sharding.use_abstract_mesh(mesh.jax_mesh.abstract_mesh),
    ):
        warnings.filterwarnings("ignore", message="Variable hooks are deprecated")
        # Probe: which reads feed matmuls only (those can be gathered `reduced`).
        probe = _with_hooks(call, layouts, axes, lambda key, value, spec: tag_read(value, key))
        matmul_only = matmul_only_reads(jax.make_jaxpr(probe)(state, arrays))

        def gather(key: int, value: Any, spec: PartitionSpec) -> Any:
            return gather_for_compute(value, spec, axes, reduced=matmul_only.get(key, False))

        try:
            with _embed_lookups_follow_batch():
                return explicit_region(_with_hooks(call, layouts, axes, gather), axes, specs)(
                    state, arrays
                )
        except Exception as err:  # noqa: BLE001 - whatever user code raises on Explicit axes
            fallback = err
    warnings.warn(
        "FullyShardedStrategy: the step does not trace with parameters gathered at their "
        f"reads on Explicit mesh axes ({type(fallback).__name__}: {str(fallback)[:300]}); "
        "running XLA's own plan instead (it all-reduces full-size gradients). Pass "
        "gather_at_read=False to choose that plan and silence this warning.",
        RuntimeWarning,
        stacklevel=2,
    )
    return call(state, arrays)


def explicit_specs(
    state: Any, layouts: Any, shardings: list[Any], mesh: Mesh, axes: tuple[str, ...]
) -> Any:
    """Partition specs of the step's inputs, or ``None`` where the gather-at-read plan does not apply.

    It applies to steps on NNX modules whose array arguments are batches
    (split on dimension 0 over the batch axes) or replicated.
    """
    if state is None:
        return None
    array_specs = []
    for sharding in shardings:
        if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh.jax_mesh:
            return None
        spec = tuple(sharding.spec)
        if any(entry is not None for entry in spec[1:]) or (spec and spec[0] not in (None, *axes)):
            return None
        array_specs.append(sharding.spec)
    found = jax.tree.leaves(
        jax.tree.map(lambda _, lay: isinstance(lay, Layout), state, layouts, is_leaf=_var_or_layout)
    )
    if not all(found):
        return None
    state_specs = jax.tree.map(
        lambda _, lay: lay.partition_spec, state, layouts, is_leaf=_var_or_layout
    )
    return state_specs, array_specs


_HOOK = "on_get_value"
_EMBED_CALL = nnx.Embed.__call__


def _embed_call(self: nnx.Embed, inputs: Any, out_sharding: Any = None) -> Any:
    """``nnx.Embed.__call__``, its lookup laid out like a batch-split ``inputs`` (Explicit axes)."""
    if out_sharding is None and isinstance(inputs, jax.Array):
        spec = jax.typeof(inputs).sharding.spec
        if any(entry is not None for entry in spec):
            out_sharding = PartitionSpec(*spec, None)
    return _EMBED_CALL(self, inputs, out_sharding=out_sharding)


@contextlib.contextmanager
def _embed_lookups_follow_batch() -> Iterator[None]:
    """Let Flax's ``nnx.Embed`` run on Explicit axes while the step is traced.

    On Explicit axes ``jnp.take`` of a table with batch-split token ids needs an
    ``out_sharding``, which ``nnx.Embed`` accepts but a user's model does not
    pass; this supplies the batch's own layout. Inputs on Auto axes (anyone
    else's trace meanwhile) carry no sharding in their type: for them nothing
    changes.
    """
    nnx.Embed.__call__ = _embed_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        nnx.Embed.__call__ = _EMBED_CALL  # type: ignore[method-assign]


def _with_hooks(
    call: Callable[[Any, list[Any]], Any],
    layouts: Any,
    axes: tuple[str, ...],
    gather: Callable[[int, Any, PartitionSpec], Any],
) -> Callable[[Any, list[Any]], Any]:
    """``call`` with every variable split over ``axes`` read through ``gather(key, value, spec)``.

    The read hooks live only inside the traced step: they are removed from
    the variables (and any returned ones) before they leave it.
    """

    def step(state: Any, arrays: list[Any]) -> Any:
        counter = iter(range(1 << 62))
        state = jax.tree.map(
            lambda var, lay: _attach(var, lay, next(counter), axes, gather),
            state,
            layouts,
            is_leaf=_var_or_layout,
        )
        new_state, out = call(state, arrays)
        return _without_hook(new_state), _without_hook(out)

    return step


def _attach(
    var: Any,
    layout: Any,
    key: int,
    axes: tuple[str, ...],
    gather: Callable[[int, Any, PartitionSpec], Any],
) -> Any:
    if not isinstance(var, nnx.Variable) or not isinstance(layout, Layout):
        return var
    if not any(a in axes for d in range(layout.rank) for a in layout.axes(d)):
        return var
    spec = layout.partition_spec
    shape = np.shape(var.get_raw_value())

    def hook(_: Any, value: Any) -> Any:
        if np.shape(value) != shape:  # an indexed read (var[i]): leave it to XLA
            return value
        return gather(key, value, spec)

    var = var.replace(var.get_raw_value())
    var.set_metadata(_HOOK, hook)
    return var


def _without_hook(tree: Any) -> Any:
    def strip(var: Any) -> Any:
        if isinstance(var, nnx.Variable) and _HOOK in var.get_metadata():
            meta = {k: v for k, v in var.get_metadata().items() if k != _HOOK}
            var = var.replace(var.get_raw_value())
            var.set_metadata(meta)
        return var

    return jax.tree.map(strip, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
