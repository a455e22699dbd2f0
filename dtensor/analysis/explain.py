"""`explain`: what a compiled step communicates and stores, against the minimum.

``explain(fn, *args)`` compiles ``fn`` (never runs it) and returns a
:class:`Report`: every collective XLA emitted (see :mod:`dtensor.analysis.hlo`), the
per-device memory from ``memory_analysis()``, a table of the step's variables
(parameters and optimizer state) with their layouts, the theoretical minimum
communication for those layouts, and warnings about layouts that went wrong.

The minimum (``min_comm_bytes_per_device``), per variable leaf that receives
a gradient, under the ring model. Let ``S`` be the leaf's global bytes,
``D`` the data axes (the axes the batch is split over), ``k`` the product of
the sizes of the data axes the leaf is sharded on (FSDP), ``r`` that of the
data axes it is replicated on, and ``t`` that of the non-data axes it is
sharded on (tensor parallel), ``S' = S / t``:

- replicated over the data axes (data parallel, ``k = 1``): one all-reduce of
  its gradient, ``2(r-1)/r * S'``;
- sharded over the data axes (FSDP, ``k > 1``): two all-gathers of the
  parameter (forward and backward) and one reduce-scatter of its gradient,
  ``3(k-1)/k * S'``, plus, when also replicated over other data axes
  (hybrid), an all-reduce of the scattered gradient ``2(r-1)/r * S'/k``.

For the leaves split over the data axes that figure is the ZeRO reference;
where the per-matmul reference of :mod:`dtensor.analysis.minimum` (each
matmul that reads such a weight: the cheaper of gathering the weight and
moving its batch-split activations) is lower, the minimum takes it, so it is
a lower bound on XLA's plan whichever it chose. ``Report.min_comm_references``
gives both, by name.

Leaves that do not receive a gradient cost nothing: by default those whose
path has an ``opt_state`` component (optax and ``nnx.Optimizer`` state) and
those of non-float dtype (step counters, RNG keys); ``grad_paths`` overrides
this. Activations that a tensor-parallel plan must move (Megatron's per-layer
all-reduces) depend on the model, so the caller adds them as
``activation_bytes_min``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dtensor.analysis.findings import (
    check_outputs,
    fmt_path,
    full_size_reductions,
    layout_of,
    mismatch,
    sharding_of,
    silent,
)
from dtensor.analysis.floor import floor_for
from dtensor.analysis.hlo import Collective, parse_collectives
from dtensor.analysis.host_link import host_transfers
from dtensor.analysis.minimum import dispatch_minimum, minimum_for
from dtensor.analysis.peak import PeakTerms, ideal_peak_bytes
from dtensor.analysis.report import Finding, Report
from dtensor.analysis.variables import min_comm_bytes, peak_terms, variable_rows
from dtensor.core.attention import CONTEXT_SCOPE
from dtensor.core.mesh import Mesh

__all__ = ["explain", "min_comm_bytes"]


# --------------------------------------------------------------------- helpers
def _program_mesh(compiled: Any) -> Mesh | None:
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    for s in shardings:
        if isinstance(s, jax.sharding.NamedSharding) and isinstance(s.mesh, jax.sharding.Mesh):
            return Mesh(s.mesh)
    return None


def _same_leaves(arg: Any, variables: Any) -> bool:
    """``arg`` is ``variables``, or holds the same leaf objects in the same order."""
    if arg is variables:
        return True
    if variables is None or arg is None:
        return False
    mine, theirs = jax.tree.leaves(arg), jax.tree.leaves(variables)
    return (
        bool(mine)
        and len(mine) == len(theirs)
        and all(a is b for a, b in zip(mine, theirs, strict=True))
    )


# --------------------------------------------------------------------- explain
def explain(
    fn: Callable[..., Any],
    *args: Any,
    variables: Any = None,
    data_axes: str | Sequence[str] | None = None,
    rules: Any = None,
    grad_paths: Callable[[str], bool] | None = None,
    activation_bytes_min: float = 0.0,
    expect_sharded: bool = False,
    replicated_warn_bytes: int = 1 << 20,
    ideal_peak: Callable[[PeakTerms], int] | None = None,
    advice: str | None = None,
    model_flops: float | None = None,
    kept_axes: Callable[[str], tuple[str, ...]] | None = None,
    **kwargs: Any,
) -> Report:
    """Compile ``fn(*args, **kwargs)`` (never run it) and report its cost.

    Args:
        fn: a function, or a ``jax.jit``-wrapped one (its ``in_shardings`` /
            ``out_shardings`` are kept).
        *args: concrete arrays or ``jax.ShapeDtypeStruct``s (with
            ``sharding=``), as ``fn`` takes them.
        variables: the step's state (parameters and optimizer state), arrays
            or ``ShapeDtypeStruct``s; default ``args[0]``. Leaves without a
            sharding take the compiled one when ``variables`` is one of
            ``args``, or holds the very leaves of one of them, in order (a
            re-labelled tree: its paths name the variables in the report).
        data_axes: the mesh axes the batch is split over; default: the axes
            splitting dimension 0 of the arguments other than ``variables``.
        rules: the rule behind each variable's layout: a pytree like
            ``variables`` (a string, or ``None`` for "no rule matched"), or a
            dict from leaf path to rule.
        grad_paths: ``path -> bool``, whether a variable receives a gradient
            (default: not under ``opt_state`` and of float dtype).
        activation_bytes_min: bytes per device of activations the layouts
            must move (tensor parallel), added to the minimum.
        expect_sharded: warn about every large replicated variable (else
            only when the mesh has more than one device off the data axes).
        replicated_warn_bytes: the size above which a replicated variable is
            "large".
        ideal_peak: ``PeakTerms -> bytes``, the ideal peak per device (see
            :mod:`dtensor.analysis.peak`); default
            :func:`dtensor.analysis.peak.ideal_peak_bytes`. Strategies pass
            their ``ideal_peak_bytes``.
        advice: what would lower the memory, for the verdict of a program
            that does not fit (default: shard the variables, shrink the
            batch, use more chips). Strategies pass their own.
        model_flops: the model FLOPs of one call (``6 x parameters x
            tokens`` plus attention), for ``Report.mfu_ceiling``; also
            settable later with ``Report.with_model_flops``.
        kept_axes: ``path -> axes``: data axes a variable stays split over
            where it is computed, never gathered (HybridStrategy's expert
            stacks keep ``expert``: the tokens come to them); for that
            variable they count as model axes in the minimum and the ideal
            peak.
        **kwargs: keyword arguments of ``fn`` (any but the names above).

    Returns:
        A :class:`Report`.

    Examples:
        >>> import dtensor, jax, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=dtensor.Layout.replicated(mesh, 2).sharding)
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32, sharding=dtensor.Layout(["x", None], mesh).sharding)
        >>> grad = jax.grad(lambda w, x: ((x @ w) ** 2).sum())
        >>> report = dtensor.explain(grad, w, x)
        >>> [(c.kind, c.mesh_axes, c.bytes_per_device) for c in report.collectives]
        [('all-reduce', ('x',), 28672.0)]
        >>> report.min_comm_bytes_per_device, report.data_axes
        (28672.0, ('x',))
    """
    if not callable(fn):
        raise TypeError(
            f"explain's first argument must be the function to compile, got a "
            f"{type(fn).__name__}; call dtensor.explain(step, *args)."
        )
    if variables is None:
        if not args:
            raise TypeError(
                "explain got no arguments and no variables=; pass the step's arguments "
                "(dtensor.explain(step, state, batch)) or variables= explicitly."
            )
        variables = args[0]
    var_arg = next((i for i, a in enumerate(args) if _same_leaves(a, variables)), None)
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    # Trace once: the jaxpr gives the activations of the ideal peak, then lower it.
    traced = jitted.trace(*args, **kwargs) if hasattr(jitted, "trace") else None
    try:
        lowered = traced.lower() if traced is not None else jitted.lower(*args, **kwargs)
        compiled = lowered.compile()
    except Exception as err:  # the TPU compiler refuses programs larger than HBM
        from dtensor.analysis.memory import out_of_memory

        oom = out_of_memory(err, advice=advice)
        if oom is None:
            raise
        raise oom from None
    mesh = _program_mesh(compiled)
    mesh_shape = list(mesh.shape.items()) if mesh is not None else None
    slices, hosts = _slices(mesh), _hosts(mesh)
    hlo_text = compiled.as_text() or ""
    collectives = tuple(parse_collectives(hlo_text, mesh_shape, slices=slices, hosts=hosts))
    in_shardings = compiled.input_shardings[0]
    findings, batch_axes = _check_args(args, in_shardings, var_arg)
    data = _data_axes(data_axes, batch_axes, mesh)

    all_leaves = jax.tree_util.tree_flatten_with_path(variables)[0]
    compiled_var = jax.tree.leaves(in_shardings[var_arg]) if var_arg is not None else []
    compiled_of = dict(enumerate(compiled_var)) if len(compiled_var) == len(all_leaves) else {}
    infos, var_findings = variable_rows(
        all_leaves,
        compiled_of,
        rules,
        grad_paths,
        data,
        expect_sharded,
        replicated_warn_bytes,
        kept_axes,
    )
    findings += var_findings
    findings += full_size_reductions(infos, collectives, data)
    findings += check_outputs(compiled.output_shardings, variables, all_leaves, compiled_of)
    mem = compiled.memory_analysis()
    n_devices = mesh.size if mesh is not None else 1
    jaxpr = traced.jaxpr if traced is not None else None
    terms = peak_terms(jaxpr, args, in_shardings, var_arg, infos, data, mesh, kept_axes)
    ideal = (ideal_peak or ideal_peak_bytes)(terms)
    moved = host_transfers(hlo_text)
    floor = floor_for(
        jaxpr,
        collectives,
        _network_bytes(collectives, "dcn", slices),
        mesh,
        host_bytes=max(moved.to_host_bytes, moved.from_host_bytes),
        hlo_text=hlo_text,
    )
    minimum, references = minimum_for(
        jaxpr, args, kwargs, var_arg, all_leaves, infos, data, mesh, kept_axes
    )
    dispatch, capacity = (
        dispatch_minimum(jaxpr, mesh.shape if mesh is not None else {})
        if jaxpr is not None
        else (0.0, None)
    )
    dispatched = sum(
        c.total_bytes_per_device
        for c in collectives
        if c.kind == "all-to-all" and "expert" in c.mesh_axes
    )
    context = sum(c.total_bytes_per_device for c in _context_exchange(collectives))
    permutes = [c for c in collectives if c.kind == "collective-permute" and "stage" in c.mesh_axes]
    by_network: dict[str, float] = {}
    for c in permutes:
        if c.network:
            by_network[c.network] = by_network.get(c.network, 0.0) + c.total_bytes_per_device
    return Report(
        collectives=collectives,
        comm_bytes_per_device=float(sum(c.total_bytes_per_device for c in collectives)),
        min_comm_bytes_per_device=float(activation_bytes_min) + minimum + dispatch,
        min_comm_references=references,
        argument_bytes_per_device=_mem(mem, "argument_size_in_bytes"),
        output_bytes_per_device=_mem(mem, "output_size_in_bytes"),
        temp_bytes_per_device=_mem(mem, "temp_size_in_bytes"),
        alias_bytes_per_device=_mem(mem, "alias_size_in_bytes"),
        state_bytes_per_device=sum(v.bytes_per_device for v, _ in infos),
        ideal_state_bytes_per_device=sum(math.ceil(v.global_bytes / n_devices) for v, _ in infos),
        variables=tuple(v for v, _ in infos),
        warnings=tuple(findings),
        mesh=repr(mesh) if mesh is not None else "",
        data_axes=data,
        compiled=compiled,
        ici_bytes_per_device=_network_bytes(collectives, "ici", slices),
        dcn_bytes_per_device=_network_bytes(collectives, "dcn", slices),
        nvlink_bytes_per_device=_network_bytes(collectives, "nvlink", hosts),
        ib_bytes_per_device=_network_bytes(collectives, "ib", hosts),
        memory_fit=_memory_fit(mem, mesh, advice),
        peak_bytes_per_device=_peak(mem),
        ideal_peak_bytes_per_device=ideal,
        ideal_peak_terms=terms,
        step_floor=floor,
        model_flops=model_flops,
        dispatch_bytes_per_device=float(dispatched) if capacity is not None else 0.0,
        dispatch_min_bytes_per_device=dispatch,
        dispatch_capacity=capacity,
        context_bytes_per_device=float(context),
        stage_bytes_per_device=float(sum(c.total_bytes_per_device for c in permutes)),
        stage_bytes_by_network=tuple(sorted(by_network.items())),
    )


def _peak(mem: Any) -> int | None:
    """XLA's peak per device: arguments + temporaries + outputs - aliased."""
    fields = [_mem(mem, f"{f}_size_in_bytes") for f in ("argument", "temp", "output", "alias")]
    if any(f is None for f in fields):
        return None
    arg, temp, out, alias = (int(f or 0) for f in fields)
    return arg + temp + out - alias


def _slices(mesh: Mesh | None) -> list[int] | None:
    """Each device's TPU slice, in mesh order (``None`` off TPU: no ICI/DCN split)."""
    if mesh is None or mesh.platform != "tpu":
        return None
    return [int(getattr(d, "slice_index", 0)) for d in mesh.device_list]


def _hosts(mesh: Mesh | None) -> list[int] | None:
    """Each device's host (process), in mesh order, on GPU (``None`` elsewhere)."""
    if mesh is None or mesh.platform != "gpu":
        return None
    return [int(d.process_index) for d in mesh.device_list]


def _network_bytes(collectives: Sequence[Collective], network: str, slices: Any) -> float | None:
    if slices is None:
        return None
    return float(sum(c.total_bytes_per_device for c in collectives if c.network == network))


def _memory_fit(mem: Any, mesh: Mesh | None, advice: str | None) -> Any:
    if mem is None or mesh is None or mesh.platform not in ("tpu", "gpu"):
        return None
    from dtensor.analysis.memory import memory_fit

    return memory_fit(mem, mesh.device_list, advice=advice)


def _check_args(
    args: tuple[Any, ...], in_shardings: Any, var_arg: int | None
) -> tuple[list[Finding], list[str]]:
    """Silent relayouts of the arguments, and the axes splitting dimension 0 of the non-state ones."""
    findings: list[Finding] = []
    batch_axes: list[str] = []
    for i, arg in enumerate(args):
        leaves = jax.tree_util.tree_flatten_with_path(arg)[0]
        got = jax.tree.leaves(in_shardings[i]) if i < len(in_shardings) else []
        if len(got) != len(leaves):
            continue
        for (path, leaf), s in zip(leaves, got, strict=True):
            asked = sharding_of(leaf)
            rank = len(getattr(leaf, "shape", ()))
            if asked is not None and mismatch(asked, s, rank):
                p = fmt_path(f"args[{i}]", path)
                findings.append(silent(p, asked, s, rank, "the compiled program takes it as"))
            lay = layout_of(s, rank) if i != var_arg and rank else None
            if lay is not None:
                batch_axes += [a for a in lay.axes(0) if a not in batch_axes]
    return findings, batch_axes


def _data_axes(data_axes: Any, batch_axes: list[str], mesh: Mesh | None) -> tuple[str, ...]:
    if data_axes is None:
        order = mesh.dim_names if mesh is not None else tuple(batch_axes)
        return tuple(a for a in order if a in batch_axes)
    data = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    if mesh is not None:
        bad = [a for a in data if a not in mesh.dim_names]
        if bad:
            raise ValueError(
                f"data_axes={data_axes!r} names {bad}, not axes of the program's mesh "
                f"{mesh!r} (axes {mesh.dim_names}); pass the mesh axes the batch is split over."
            )
    return data


def _mem(mem: Any, field: str) -> int | None:
    value = getattr(mem, field, None) if mem is not None else None
    return None if value is None else int(value)


def _context_exchange(collectives: Sequence[Collective]) -> list[Collective]:
    """What :func:`dtensor.context_attention` moves over ``context``: the collectives under
    its name scope, and the K/V gradients' exchange that libtpu lowers (the gathers'
    ``psum_scatter``) to an all-reduce of the gathered K/V over ``context`` alone, without
    the scope: found by the gathered shape."""
    scoped = [c for c in collectives if CONTEXT_SCOPE in c.op_name]
    gathered = {(tuple(c.shape), c.dtype) for c in scoped if c.kind == "all-gather"}
    unscoped = [
        c
        for c in collectives
        if CONTEXT_SCOPE not in c.op_name
        and c.kind == "all-reduce"
        and tuple(c.mesh_axes) == ("context",)
        and (tuple(c.shape), c.dtype) in gathered
    ]
    return scoped + unscoped
