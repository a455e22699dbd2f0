"""``Strategy.explain``: the :func:`dtensor.explain` report of the program ``run`` compiles.

The step is compiled exactly as :class:`strategies.step.compiler.StepCompiler`
compiles it for ``run`` (same layouts, memory kinds and donation), from
abstract values where the arguments are abstract, and never run. It is the
same step as ``run``'s for arguments of the same kinds, shapes and layouts
(one cache): after a ``run``, the program run compiled is the one reported,
and a ``run`` after ``explain`` runs the program explain compiled (nothing is
traced or compiled again either way).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from dtensor.analysis.explain import explain
from dtensor.analysis.report import Finding
from dtensor.core.tree import is_variable, leaf_value, path_str, replace_value
from strategies.boundary import explicit_axes_error
from strategies.step import args as argkinds
from strategies.step import donation
from strategies.step.args import abstract_value, var_or_layout
from strategies.step.cache import FunctionKey

__all__ = ["explain_step"]


def explain_step(
    compiler: Any,
    fn: Callable[..., Any],
    args: Any,
    kwargs: Any,
    *,
    donate_argnums: Any = (),
) -> Any:
    """The :func:`dtensor.explain` report of what ``compiler.run`` compiles for these arguments."""
    s = compiler.strategy
    fn, with_paths, treedef, mask, flat, nodes = donation.prepare_call(
        s, fn, args, kwargs, donate_argnums, "explain", explicit_reduction=True
    )
    for node in nodes or ():
        s.observe(node)
    graphdef, state = nnx.split(tuple(nodes)) if nodes else (None, None)
    layouts = rules = None
    if nodes:
        layouts, rules = compiler.resolve(state)
        state = jax.tree.map(
            lambda var, lay: (
                var
                if lay is None
                else replace_value(var, abstract_value(leaf_value(var), s.compute_layout(lay)))
            ),
            state,
            layouts,
            is_leaf=var_or_layout,
        )
    kinds: list[Any] = []
    arrays: list[Any] = []
    for v in flat:
        kind = argkinds.kind_of(v)
        if kind is argkinds.ARRAY:
            sharding = getattr(v, "sharding", None)
            on_mesh = isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
                v, jax.ShapeDtypeStruct | jax.Array
            )
            arrays.append(v if on_mesh else abstract_value(v, s.batch_layout(len(np.shape(v)))))
        kinds.append(kind)
    memories = compiler.memory_kinds(graphdef, state) if nodes else None
    if memories is not None:  # offloaded variables enter in host memory
        state = compiler._in_memory(state, layouts, memories, device=False)
    # One step for run() and explain() of the same arguments: whichever comes first compiles
    # it, and the other's jit call hands back that very program (traced, lowered, compiled).
    sig = tuple((a.shape, a.dtype, a.sharding) for a in arrays)
    key = (FunctionKey(fn), False, treedef, graphdef, tuple(kinds), sig, mask)
    compiled = compiler.compiled.get(key)
    if compiled is None:
        compiled = compiler._compile(
            FunctionKey(fn), treedef, graphdef, kinds, layouts, arrays, False, memories, mask
        )
        compiler.compiled.put((FunctionKey(fn, compiler._forget), *key[1:]), compiled)
    call_args = compiled.args(arrays)
    variables = state
    if not nodes and compiled.mask:  # a functional step: its donated arguments are its state
        variables = _named_donated(fn, with_paths, compiled.mask, call_args[0])
    with s.mesh:
        try:
            report = explain(
                compiled.jitted,
                state,
                *call_args,
                variables=variables,
                rules=rules,
                data_axes=s.batch_axes,
                expect_sharded=s.shards_variables,
                activation_bytes_min=s.activation_bytes_min(state, rules, arrays),
                ideal_peak=s.ideal_peak_bytes,
                advice=s.memory_advice(),
                kept_axes=getattr(s, "kept_axes", None),
            )
        except ValueError as err:  # JAX's, from tracing the user's step
            ours = explicit_axes_error(err, s, "explain()")
            if ours is None:
                raise
            raise ours from None
    extra = _layout_findings(compiler, state)
    if extra:
        report = dataclasses.replace(report, warnings=report.warnings + extra)
    describe = getattr(s, "pipeline_description", None)
    if describe is not None and describe():
        report = dataclasses.replace(
            report, pipeline_schedule=describe(), bubble_fraction=s.bubble_fraction
        )
    return report


def _named_donated(
    fn: Callable[..., Any],
    with_paths: list[tuple[Any, Any]],
    mask: tuple[bool, ...],
    donated: list[Any],
) -> dict[str, Any]:
    """The donated arrays of a functional step, named by the step's parameters.

    ``step(params, opt_state, batch)`` with ``donate_argnums=(0, 1)`` gives
    ``params/...`` and ``opt_state/...``: the report's variables, the latter
    receiving no gradient (as :func:`dtensor.explain` assumes of paths under
    ``opt_state``).
    """
    try:
        names = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # builtins, some callables
        names = []
    paths = [path for path, v in with_paths if argkinds.kind_of(v) is argkinds.ARRAY]
    out: dict[str, Any] = collections.OrderedDict()
    for path, leaf in zip([p for p, d in zip(paths, mask, strict=True) if d], donated, strict=True):
        i = path[1].idx
        head = names[i] if i < len(names) else f"args[{i}]"
        out["/".join(x for x in (head, path_str(path[2:])) if x)] = leaf
    return out


def _layout_findings(compiler: Any, state: Any) -> tuple[Any, ...]:
    """The strategy's own findings about its variables' layouts, with the report's paths."""
    if state is None:
        return ()
    out = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(state, is_leaf=is_variable):
        p = path_str(path)
        rel = p.split("/", 1)[1] if "/" in p else p  # the path rules see (node index dropped)
        out += [Finding(kind, p, msg) for kind, msg in compiler.strategy.layout_findings(rel, leaf)]
    return tuple(out)
