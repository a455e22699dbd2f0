"""Reads of NNX parameters shaped inside a traced step: FSDP's gather, casts, remat.

:func:`trace_reads` traces a step on Flax NNX modules after changing, on
the objects merged inside the trace (:mod:`strategies.reads.swaps`), how
parameters are read and how modules are called:

- a variable split over the data axes is gathered at each read with
  :mod:`strategies.reads.fsdp_ops` (all-gather forward, reduce-scatter of its
  gradient), where ``ReadOptions.gather`` is set (FullyShardedStrategy,
  HybridStrategy);
- a floating ``nnx.Param`` is cast to the mixed-precision ``param_dtype``
  (before it is gathered);
- each module that directly owns a sharded variable is rematerialised
  (``reshard_after_forward``: its weight is gathered again in the backward
  pass rather than kept), as are the calls of the classes named in
  ``remat=``, with their descendants left alone.

Nothing returned from the step carries the swapped classes.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dtensor import Layout, Mesh
from dtensor.core.tree import is_variable
from strategies.reads import swaps
from strategies.reads.fsdp_ops import (
    explicit_region,
    gather_for_compute,
    matmul_only_reads,
    tag_read,
)
from strategies.reads.mixed_precision import MixedPrecision

__all__ = ["ReadOptions", "explicit_specs", "trace_reads"]


def _var_or_layout(x: Any) -> bool:
    return is_variable(x) or isinstance(x, Layout)


class RematClassError(ValueError):
    """``remat=`` names a module class the step's models do not contain."""


@dataclasses.dataclass(frozen=True)
class ReadOptions:
    """How a step's parameter reads and module calls are shaped (see the module docstring)."""

    axes: tuple[str, ...] = ()
    gather: bool = False
    # Mesh axes Explicit while gathering at reads (default: ``axes``). JAX types
    # ``reduced``/``unreduced`` values only when every mesh axis is Explicit.
    explicit_axes: tuple[str, ...] = ()
    reshard_after_forward: bool = False
    remat: tuple[type, ...] = ()
    remat_policy: Callable[..., bool] | None = None
    mixed_precision: MixedPrecision | None = None
    preset: str = "FullyShardedStrategy"  # named in the fallback warning
    # Under XLA's plan: the inputs and outputs of each ``remat=`` block stay split over
    # these axes along dimension 0 (the batch), as the step's batch is. Inside a scan over
    # stacked layers XLA's propagation otherwise lets go of the batch split (measured on a
    # scanned 7b decoder, v5e:4x4: every chip computed attention for the whole batch).
    batch_axes: tuple[str, ...] = ()
    # Under XLA's plan with ``remat=``: a read of one layer of a scanned stack is constrained
    # whole over ``batch_axes`` after its cast, so each layer's weights are gathered inside the
    # loop body (and recomputed with the block); see ``_layer_gathered`` (HybridStrategy).
    layer_gather: bool = False
    # Under XLA's plan: those ``remat=`` block inputs and outputs (rank >= 3) also split along
    # the sequence over these axes (HybridStrategy's ``tensor``): sequence parallelism.
    sequence_axes: tuple[str, ...] = ()
    # ... and of those, the axes a layer's computation keeps the sequence split over: its
    # sublayers holding weights split over the rest gather the sequence over them (inside
    # the recomputation) and split their outputs again (``swaps.swap_entry``); ``None``: all.
    layer_sequence_axes: tuple[str, ...] | None = None
    # Under XLA's plan without ``remat=``: every module (with variables) is swapped so that a
    # call of one layer of a stacked module (inside a scan) keeps its batch-shaped inputs and
    # outputs split over ``batch_axes`` (the sequence over ``layer_sequence_axes``), as the
    # ``remat=`` blocks' are (``swaps._layer_call``).
    layer_batch_split: bool = False
    # Under ``layer_gather``: the mesh axes a variable's layer reads keep split, by its path
    # (``"a/b/c"``); HybridStrategy's expert stacks keep ``expert``.
    kept_axes: Callable[[str], tuple[str, ...]] | None = None
    # Under ``layer_gather``: more axes a layer's read is gathered over besides ``batch_axes``
    # (HybridStrategy's ``context``, which splits the weights with ``fsdp`` but the sequence,
    # not the batch, of the activations).
    layer_gather_axes: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        """Whether anything changes in the trace."""
        return bool(
            self.gather
            or self.reshard_after_forward
            or self.remat
            or self.mixed_precision
            or self.layer_batch_split
        )


def trace_reads(
    call: Callable[..., Any],
    state: Any,
    arrays: list[Any],
    layouts: Any,
    shardings: list[Any],
    mesh: Mesh,
    options: ReadOptions,
) -> Any:
    """Trace ``call(state, arrays, prepare=...)`` with reads and calls shaped by ``options``.

    With ``options.gather`` each read of a variable split over
    ``options.axes`` goes through :func:`strategies.reads.fsdp_ops.gather_for_compute`
    on Explicit axes. Where that plan does not apply (arguments that are not
    batches) the step is traced with the other options only; where user
    code fails on Explicit axes, a warning says so and XLA's own plan runs.
    """
    if state is None and (options.mixed_precision or options.remat):
        warnings.warn(
            "mixed_precision= and remat= apply to steps on Flax NNX modules; this step takes "
            "plain pytrees (Linen/optax), whose parameter reads and module calls cannot be "
            "intercepted, so it runs in the variables' dtype without remat. Cast inside the "
            "model (Linen's dtype=) or wrap blocks in nn.remat yourself.",
            RuntimeWarning,
            stacklevel=3,
        )
    if state is None or not options.active:
        return call(state, arrays)
    specs = (
        explicit_specs(state, layouts, shardings, mesh, options.axes) if options.gather else None
    )
    if specs is None:
        return _traced(call, layouts, options, None)(state, arrays)
    with jax.sharding.use_abstract_mesh(mesh.jax_mesh.abstract_mesh):
        try:
            # Probe: which reads feed matmuls only (those can be gathered `reduced`).
            probe = _traced(call, layouts, options, lambda key, spec, mp: _tagger(key))
            matmul_only = matmul_only_reads(jax.make_jaxpr(probe)(state, arrays))

            def gather(key: int, spec: PartitionSpec, mp: MixedPrecision | None) -> Any:
                return lambda value: gather_for_compute(
                    value,
                    spec,
                    options.axes,
                    reduced=matmul_only.get(key, False),
                    compute_dtype=None if mp is None else mp.param_dtype,
                    reduce_dtype=None if mp is None else mp.reduce_dtype,
                )

            step = _traced(call, layouts, options, gather)
            explicit = options.explicit_axes or options.axes
            return explicit_region(step, explicit, specs)(state, arrays)
        except RematClassError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever user code raises on Explicit axes
            fallback = err
    warnings.warn(
        f"{options.preset}: the step does not trace with parameters gathered at their "
        f"reads on Explicit mesh axes ({type(fallback).__name__}: {str(fallback)[:300]}); "
        "running XLA's own plan instead (it all-reduces full-size gradients). Pass "
        "gather_at_read=False to choose that plan and silence this warning.",
        RuntimeWarning,
        stacklevel=2,
    )
    return _traced(call, layouts, options, None)(state, arrays)


def _tagger(key: int) -> Callable[[Any], Any]:
    return lambda value: tag_read(value, key)


def _traced(
    call: Callable[..., Any],
    layouts: Any,
    options: ReadOptions,
    gather: Callable[[int, PartitionSpec, MixedPrecision | None], Callable[[Any], Any]] | None,
) -> Callable[[Any, list[Any]], Any]:
    """``call`` with the merged objects swapped by ``options``; ``gather`` makes sharded reads."""
    flat_layouts = dict(nnx.to_flat_state(layouts))

    def prepare(nodes: Any) -> None:
        if options.remat:
            try:
                swaps.check_remat_classes(options.remat, nodes)
            except ValueError as err:
                raise RematClassError(str(err)) from None
        modules: dict[tuple[Any, ...], Any] = {}
        owners: set[tuple[Any, ...]] = set()
        # the modules holding weights split over the axes a layer gathers the sequence over
        split_by: set[tuple[Any, ...]] = set()
        kept = options.layer_sequence_axes
        gathered_sequence = (
            () if kept is None else tuple(a for a in options.sequence_axes if a not in kept)
        )
        key = 0
        found = list(nnx.iter_graph(nodes))
        for path, node in found:
            if isinstance(node, nnx.Module):
                modules[tuple(path)] = node
                if options.mixed_precision is not None:
                    options.mixed_precision.set_module_dtype(node)
        for path, node in sorted(found, key=lambda item: _sort_key(item[0])):
            if not isinstance(node, nnx.Variable):
                continue
            layout = flat_layouts.get(tuple(path))
            mp = options.mixed_precision if isinstance(node, nnx.Param) else None
            sharded = isinstance(layout, Layout) and _split_over(layout, options.axes)
            if isinstance(layout, Layout) and _split_over(layout, gathered_sequence):
                split_by.update(tuple(path[:i]) for i in range(len(path)))
            if sharded:
                owners.add(_owner(tuple(path), modules))
            read = None
            if sharded and gather is not None and isinstance(layout, Layout):
                read = _whole_or_layer_reads(gather, key, layout.partition_spec, node, mp)
                key += 1
            elif sharded and options.layer_gather and isinstance(layout, Layout):
                axes = options.batch_axes + options.layer_gather_axes
                if options.kept_axes is not None:
                    kept = options.kept_axes("/".join(str(p) for p in path))
                    axes = tuple(a for a in axes if a not in kept)
                read = _layer_gathered(layout, node, axes, mp)
            elif mp is not None:
                read = _cast_reads(node, mp)
            if read is not None:
                swaps.read_through(node, read)
        _swap_modules(modules, owners, options, split_by)

    def step(state: Any, arrays: list[Any]) -> Any:
        named: Any = options.remat_policy if options.remat else None
        named = named if hasattr(named, "check") else None
        if named is not None:
            named.reset()
        new_state, out = call(state, arrays, prepare=prepare)
        if named is not None:
            try:
                named.check()
            except ValueError as err:
                raise RematClassError(str(err)) from None
        return swaps.strip(new_state), swaps.strip(out)

    return step


def _sort_key(path: Any) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def _split_over(layout: Layout, axes: tuple[str, ...]) -> bool:
    return any(a in axes for d in range(layout.rank) for a in layout.axes(d))


def _owner(path: tuple[Any, ...], modules: dict[tuple[Any, ...], Any]) -> tuple[Any, ...]:
    for n in range(len(path) - 1, -1, -1):
        if path[:n] in modules:
            return path[:n]
    return ()


def _cast_reads(var: nnx.Variable, mp: MixedPrecision) -> Callable[[Any], Any]:
    """Reads of ``var`` cast; a read of one layer of a stack (inside ``nnx.scan``) by
    :meth:`MixedPrecision.cast_layer`, which stays in the loop."""
    shape = np.shape(var.get_raw_value())

    def one(value: Any) -> Any:
        if len(shape) > 1 and np.shape(value) == shape[1:]:
            return mp.cast_layer(value)
        return mp.cast(value)

    return one


def _whole_or_layer_reads(
    gather: Callable[[int, PartitionSpec, MixedPrecision | None], Callable[[Any], Any]],
    key: int,
    spec: PartitionSpec,
    var: nnx.Variable,
    mp: MixedPrecision | None,
) -> Callable[[Any], Any]:
    """Reads of ``var`` gathered: its whole value, or one layer of a stack (``nnx.scan``).

    Inside a scan over stacked layers a read sees the value without its
    leading (layer) dimension; it is gathered with the rest of ``spec``.
    Other partial values are only cast.
    """
    shape = np.shape(var.get_raw_value())
    whole = gather(key, spec, mp)
    layer = (
        gather(key, PartitionSpec(*tuple(spec)[1:]), mp)
        if len(spec) == len(shape) and len(shape) > 1 and tuple(spec)[0] is None
        else None
    )

    def one(value: Any) -> Any:
        if np.shape(value) == shape:
            return whole(value)
        if layer is not None and np.shape(value) == shape[1:]:
            return layer(value)
        return value if mp is None else mp.cast(value)

    return one


def _layer_gathered(
    layout: Layout, var: nnx.Variable, axes: tuple[str, ...], mp: MixedPrecision | None
) -> Callable[[Any], Any]:
    """Reads of ``var`` cast; a read of one layer of a stack (inside ``nnx.scan``) also
    gathered whole over ``axes`` after its cast (a sharding constraint), its gradient
    constrained back to the layer's own split before it is cast to the variable's dtype.

    XLA then gathers each layer's weights in the loop body in ``param_dtype``,
    as MaxText's scanned layers are gathered. Measured on llama2-70b, v5p:4x4x4:
    under ``HybridStrategy(tensor=4)`` the same peak with 164 GiB of ICI
    traffic per chip instead of 199; under FullyShardedStrategy 24.0 GiB per
    chip instead of 25.9 (no whole bf16 copies of the stacked kernels cast
    ahead of the loop), but on a scanned 7b (v5e:4x4) XLA then gathered the
    MLP kernels more often (all-gathers 48 -> 108 GiB per chip, step floor
    0.41 -> 0.74 s), so FullyShardedStrategy leaves it off.
    """
    shape = np.shape(var.get_raw_value())
    specs = tuple(layout.partition_spec) + (None,) * (len(shape) - len(layout.partition_spec))
    whole = NamedSharding(
        layout.mesh.jax_mesh, PartitionSpec(*(_without(entry, axes) for entry in specs[1:]))
    )
    layer = NamedSharding(layout.mesh.jax_mesh, PartitionSpec(*specs[1:]))
    stacked = len(shape) > 1 and specs[0] is None

    @jax.custom_vjp
    def gathered(value: Any) -> Any:
        value = value if mp is None else mp.cast_layer(value)
        return jax.lax.with_sharding_constraint(value, whole)

    dtype = np.dtype(var.get_raw_value().dtype)

    def forward(value: Any) -> tuple[Any, None]:
        return gathered(value), None

    def backward(_: None, ct: Any) -> tuple[Any]:
        # The gradient is reduced to the layer's own split (a reduce-scatter), not whole.
        return (jax.lax.with_sharding_constraint(ct, layer).astype(dtype),)

    gathered.defvjp(forward, backward)

    def one(value: Any) -> Any:
        if stacked and np.shape(value) == shape[1:]:
            return gathered(value)
        return value if mp is None else mp.cast(value)

    return one


def _without(entry: Any, axes: tuple[str, ...]) -> Any:
    """A spec entry without the mesh axes ``axes`` (``None`` when none is left)."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return swaps.spec_entry(tuple(a for a in names if a not in axes))


def _swap_modules(
    modules: dict[tuple[Any, ...], Any],
    owners: set[tuple[Any, ...]],
    options: ReadOptions,
    split_by: set[tuple[Any, ...]],
) -> None:
    def is_named(path: tuple[Any, ...]) -> bool:
        base = swaps.swapped_base(type(modules[path]))
        return bool(options.remat) and issubclass(base, options.remat)

    plan_tags: tuple[tuple[type, str, str], ...] = (
        getattr(options.remat_policy, "tags", ()) if options.remat else ()
    )

    def tags_of(module: Any) -> tuple[str | None, str | None]:
        base = swaps.swapped_base(type(module))
        found = {w: n for c, w, n in reversed(plan_tags) if issubclass(base, c)}
        return found.get("input"), found.get("output")

    # A module rematerialised to re-gather its own weights, whose descendants are
    # rematerialised too (named, or owners of their own sharded weights), would wrap them all
    # in one checkpoint: the model's root owning the embedding would recompute the whole
    # forward pass and keep every layer's activations for the backward (FSDP-NOTES: never
    # one checkpoint around the loss). Its own weights stay gathered instead.
    units = {p for p in modules if is_named(p)} | set(owners)
    resharded = {o for o in owners if not any(len(u) > len(o) and u[: len(o)] == o for u in units)}
    rematted: list[tuple[Any, ...]] = []
    layers: set[tuple[Any, ...]] = set()  # the named ones: batch-split layers
    for path in sorted(modules, key=len):  # ancestors first
        module = modules[path]
        base = swaps.swapped_base(type(module))
        inside = any(path[: len(r)] == r for r in rematted)
        named = is_named(path) and not inside
        reshard = options.reshard_after_forward and path in resharded and not inside
        # An embedding lookup on Explicit axes (a subclass's own __call__ reaches it
        # through super(), as Flax Gemma's ScaledEmbed does).
        embed = options.gather and issubclass(base, nnx.Embed)
        if not (named or reshard or embed):
            continue
        swaps.swap_call(
            module,
            remat=named or reshard,
            policy=options.remat_policy if named else None,
            embed=embed,
            batch_axes=options.batch_axes if named and not options.gather else (),
            sequence_axes=options.sequence_axes if named and not options.gather else (),
            layer_sequence_axes=options.layer_sequence_axes,
            tags=tags_of(module),
        )
        if named or reshard:
            rematted.append(path)
        if named:
            layers.add(path)
    if options.layer_batch_split and options.batch_axes and not options.remat:
        sequence = tuple(options.layer_sequence_axes or ())
        for module in modules.values():
            if swaps.swapped_base(type(module)) is type(module) and swaps.owns_variables(module):
                swaps.swap_call(
                    module, remat=False, batch_axes=options.batch_axes, sequence_axes=sequence
                )
    # Sequence parallelism: each named layer's sublayers (its child modules) whose weights are
    # split over the sequence axes (a Megatron rule's ``tensor``) take their inputs gathered
    # along the sequence over those, and split their outputs again; the rest (the norms) run
    # on the split sequence. (``split_by`` is empty where no axis is gathered.)
    for path, module in modules.items():
        swapped = swaps.swapped_base(type(module)) is not type(module)
        if path and path[:-1] in layers and path in split_by and not swapped:
            swaps.swap_entry(module)
    # A per-tensor remat_policy naming module classes' inputs or outputs: the other calls of
    # those classes tagged (those swapped above were tagged with their swap).
    for module in modules.values() if plan_tags else ():
        tags = tags_of(module)
        if tags != (None, None) and swaps.swapped_base(type(module)) is type(module):
            swaps.swap_call(module, remat=False, tags=tags)


def _over(entry: Any, axes: tuple[str, ...]) -> bool:
    """Whether a spec entry is ``None`` or names only some of ``axes`` (one or a tuple)."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return all(a in axes for a in names)


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
        if any(entry is not None for entry in spec[1:]) or (spec and not _over(spec[0], axes)):
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
