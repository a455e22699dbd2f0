"""The step's variables in an ``explain`` report: their table, minimum and ideal peak.

Each variable leaf (parameters and optimizer state) becomes a
:class:`~dtensor.analysis.report.VariableInfo` row with its layout, the rule behind it and
its share of the minimum communication (:func:`min_comm_bytes`, the ring-model ZeRO
reference documented in :mod:`dtensor.analysis.explain`), with warnings for leaves no rule
matched and large ones left replicated; :func:`peak_terms` gathers the figures of the
ideal-peak formula (:mod:`dtensor.analysis.peak`) from those rows and the batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dtensor.analysis.findings import layout_of, sharding_of
from dtensor.analysis.minimum import layout_axes
from dtensor.analysis.minimum import split_over_data as _split_over_data
from dtensor.analysis.peak import PeakTerms, activation_peak_bytes
from dtensor.analysis.report import Finding, VariableInfo, layout_text
from dtensor.core.layout import Layout
from dtensor.core.mesh import Mesh
from dtensor.core.text import human_bytes
from dtensor.core.tree import is_array, path_str

__all__ = ["min_comm_bytes", "peak_terms", "variable_rows"]


def _default_trainable(path: str, dtype: Any) -> bool:
    floating = jax.numpy.issubdtype(dtype, jax.numpy.inexact)
    return "opt_state" not in path.split("/") and bool(floating)


def _rule_list(rules: Any, paths: list[str]) -> list[str | None] | None:
    if rules is None:
        return None
    if (
        isinstance(rules, Mapping)
        and rules
        and all(isinstance(k, str) and k in paths for k in rules)
    ):
        return [rules.get(p) for p in paths]
    leaves = jax.tree.leaves(rules, is_leaf=lambda x: x is None)
    if len(leaves) != len(paths):
        raise ValueError(
            f"rules= has {len(leaves)} leaves but variables has {len(paths)} array leaves "
            f"({paths[:3]}...); rules must be a pytree shaped like variables (one rule string or "
            "None per leaf, as dtensor.resolve_layouts returns) or a dict from leaf path to rule."
        )
    return [None if r is None else str(r) for r in leaves]


def _axes(layout: Layout | None) -> set[str]:
    if layout is None:
        return set()
    return {a for d in range(layout.rank) for a in layout.axes(d)}


def min_comm_bytes(global_bytes: int, layout: Layout | None, data_axes: Sequence[str]) -> float:
    """The ring-model minimum for one gradient-carrying leaf (see the module docs).

    Examples:
        >>> import dtensor
        >>> from dtensor.analysis.explain import min_comm_bytes
        >>> mesh = dtensor.create_mesh([("x", 8)])
        >>> min_comm_bytes(800, dtensor.Layout([None], mesh), ["x"])   # all-reduce
        1400.0
        >>> min_comm_bytes(800, dtensor.Layout(["x"], mesh), ["x"])    # 2 gathers + scatter
        2100.0
    """
    if layout is None:
        return 0.0
    sizes = layout.mesh.shape
    used = _axes(layout)
    data = [a for a in data_axes if a in sizes]
    k = math.prod(sizes[a] for a in data if a in used)
    r = math.prod(sizes[a] for a in data if a not in used)
    s = global_bytes / math.prod(sizes[a] for a in used if a not in data)
    out = 3.0 * (k - 1) / k * s if k > 1 else 0.0
    if r > 1:
        out += 2.0 * (r - 1) / r * s / k
    return out


def variable_rows(
    all_leaves: list[tuple[Any, Any]],
    compiled_of: dict[int, Any],
    rules: Any,
    grad_paths: Callable[[str], bool] | None,
    data: tuple[str, ...],
    expect_sharded: bool,
    warn_bytes: int,
    kept_axes: Callable[[str], tuple[str, ...]] | None = None,
) -> tuple[list[tuple[VariableInfo, float]], list[Finding]]:
    """The table rows (each with its minimum communication) and their warnings."""
    leaves = [
        (i, path_str(p) or "variables", x) for i, (p, x) in enumerate(all_leaves) if is_array(x)
    ]
    rule_of = _rule_list(rules, [p for _, p, _ in leaves])
    rows: list[tuple[VariableInfo, float]] = []
    findings: list[Finding] = []
    for k, (i, p, leaf) in enumerate(leaves):
        shape = tuple(int(d) for d in leaf.shape)
        dtype = np.dtype(leaf.dtype)
        sharding = sharding_of(leaf) or compiled_of.get(i)
        if sharding is None:
            raise TypeError(
                f"variable {p!r} (shape {shape}) has no sharding and is not one of explain's "
                "arguments, so its layout is unknown; give it one (jax.ShapeDtypeStruct(..., "
                "sharding=layout.sharding)) or pass the state as one of the arguments."
            )
        nbytes = math.prod(shape) * dtype.itemsize
        local = math.prod(sharding.shard_shape(shape)) * dtype.itemsize
        lay = layout_of(sharding, len(shape))
        text = layout_text(lay, sharding)
        trainable = bool(grad_paths(p)) if grad_paths else _default_trainable(p, dtype)
        rule = rule_of[k] if rule_of is not None else None
        info = VariableInfo(p, shape, str(dtype), text, rule, local, nbytes, trainable)
        own = tuple(a for a in data if a not in (kept_axes(p) if kept_axes else ()))
        rows.append((info, min_comm_bytes(nbytes, lay, own) if trainable else 0.0))
        if rule_of is not None and rule is None:
            msg = (
                f"{p} {list(shape)} matched no layout rule, so it is laid out {text}; add a "
                "rule for it (a LayoutMap regex on its path) or ignore this if that is intended."
            )
            findings.append(Finding("unmatched", p, msg))
        if (
            lay is None
            or not lay.is_fully_replicated()
            or lay.mesh.size == 1
            or nbytes <= warn_bytes
        ):
            continue
        off_data = math.prod(n for a, n in lay.mesh.shape.items() if a not in data)
        if expect_sharded or off_data > 1:
            msg = (
                f"{p} {list(shape)} {dtype} ({human_bytes(nbytes)}) is replicated on all "
                f"{lay.mesh.size} devices of {lay.mesh!r} though a sharded layout was expected; "
                "shard one of its dimensions (one divisible by the axis size, or pad it) or add "
                "a rule for it."
            )
            findings.append(Finding("replicated", p, msg))
    return rows, findings


def peak_terms(
    jaxpr: Any,
    args: tuple[Any, ...],
    in_shardings: Any,
    var_arg: int | None,
    infos: list[tuple[VariableInfo, float]],
    data: tuple[str, ...],
    mesh: Mesh | None,
    kept_axes: Callable[[str], tuple[str, ...]] | None = None,
) -> PeakTerms:
    """The figures of the ideal-peak formula (:mod:`dtensor.analysis.peak`)."""
    sizes = mesh.shape if mesh is not None else {}
    replicas = math.prod(sizes.get(a, 1) for a in data)
    gathered = []
    for v, _ in infos:  # trainable variables split over a data axis are gathered (ZeRO-3)
        kept = tuple(kept_axes(v.path)) if kept_axes else ()
        own = tuple(a for a in data if a not in kept)
        if v.trainable and _split_over_data(v, own):
            # ... whole but for the axes it keeps (an expert stack: its own experts).
            stays = math.prod(sizes.get(a, 1) for a in kept if a in layout_axes(v))
            gathered.append(v.global_bytes // stays)
    batch = 0
    prefixes: list[tuple[int, ...]] = []
    for i, arg in enumerate(args):
        if i == var_arg:
            continue
        got = jax.tree.leaves(in_shardings[i]) if i < len(in_shardings) else []
        leaves = [x for x in jax.tree.leaves(arg) if is_array(x)]
        for k, leaf in enumerate(leaves):
            shape = tuple(int(d) for d in np.shape(leaf))
            s = got[k] if len(got) == len(leaves) else None
            local = s.shard_shape(shape) if s is not None else shape
            batch += math.prod(local) * np.dtype(leaf.dtype).itemsize
            if shape:
                prefixes.append(shape[:1])
    return PeakTerms(
        state=sum(v.bytes_per_device for v, _ in infos),
        gradients=sum(v.bytes_per_device for v, _ in infos if v.trainable),
        gathered=tuple(sorted(gathered, reverse=True)),
        activations=(
            0
            if jaxpr is None
            else activation_peak_bytes(jaxpr, batch_prefixes=prefixes, replicas=replicas)
        ),
        batch=batch,
    )
