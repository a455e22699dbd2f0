"""What :func:`dtensor.explain` flags in a compiled step: silently changed layouts, whole-size
gradient reductions of split variables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from dtensor.analysis.hlo import Collective
from dtensor.analysis.minimum import split_over_data
from dtensor.analysis.report import Finding, VariableInfo, layout_text
from dtensor.core.layout import Layout
from dtensor.core.text import human_bytes
from dtensor.core.tree import is_array, path_str

__all__ = [
    "check_outputs",
    "fmt_path",
    "full_size_reductions",
    "layout_of",
    "mismatch",
    "sharding_of",
    "silent",
]


def sharding_of(leaf: Any) -> jax.sharding.Sharding | None:
    """The sharding a leaf asks for (none for an uncommitted array: jit places it)."""
    if isinstance(leaf, jax.Array) and not getattr(leaf, "committed", True):
        return None
    s = getattr(leaf, "sharding", None)
    return s if isinstance(s, jax.sharding.Sharding) else None


def layout_of(sharding: jax.sharding.Sharding, rank: int) -> Layout | None:
    try:
        return Layout.from_sharding(sharding, rank)
    except (TypeError, ValueError):
        return None


def fmt_path(prefix: str, path: Any) -> str:
    p = path_str(path)
    return f"{prefix}/{p}" if p else prefix


def mismatch(asked: Any, got: Any, rank: int) -> bool:
    try:
        return not asked.is_equivalent_to(got, rank)
    except (TypeError, ValueError, AttributeError):
        return False


def full_size_reductions(
    infos: list[tuple[VariableInfo, float]],
    collectives: Sequence[Collective],
    data: tuple[str, ...],
    warn_bytes: int = 1 << 20,
) -> list[Finding]:
    """Trainable variables over ``warn_bytes``, split over the data axes, whose gradient is
    all-reduced whole.

    Each device then holds the whole gradient before it keeps its shard:
    twice the bytes of a reduce-scatter and a full-size buffer at the peak.
    Recognised by an all-reduce over data axes of exactly the variable's shape.
    """
    whole = {
        c.shape
        for c in collectives
        if c.kind == "all-reduce" and set(c.mesh_axes) & set(data) and len(c.shape) > 0
    }
    out = []
    for v, _ in infos:
        big = v.global_bytes > warn_bytes
        if big and v.trainable and split_over_data(v, data) and tuple(v.shape) in whole:
            out.append(
                Finding(
                    "full-size-reduction",
                    v.path,
                    f"{v.path} {list(v.shape)} is split over the data axes ({v.layout}) but its "
                    f"gradient is all-reduced whole ({human_bytes(v.global_bytes)} on every "
                    "device) rather than reduce-scattered to its shard: the compiler formed no "
                    "reduce-scatter (XLA's CPU compiler never does). Gather the parameter where "
                    "it is read and reduce-scatter its gradient yourself (FullyShardedStrategy "
                    "does for NNX steps), or compile for TPU/GPU, whose compilers form "
                    "reduce-scatters.",
                )
            )
    return out


def check_outputs(
    out: Any, variables: Any, all_leaves: list[tuple[Any, Any]], compiled_of: dict[int, Any]
) -> list[Finding]:
    """Outputs shaped like the variables whose layout is not the one the variables have."""
    struct = jax.tree.structure(variables)
    candidates = [("output", out)] if jax.tree.structure(out) == struct else []
    if not candidates and isinstance(out, tuple | list):
        candidates = [
            (f"output[{i}]", o) for i, o in enumerate(out) if jax.tree.structure(o) == struct
        ]
    findings = []
    for prefix, sub in candidates:
        for i, ((path, leaf), s) in enumerate(zip(all_leaves, jax.tree.leaves(sub), strict=True)):
            asked = sharding_of(leaf) or compiled_of.get(i)
            rank = len(getattr(leaf, "shape", ()))
            if asked is not None and is_array(leaf) and mismatch(asked, s, rank):
                findings.append(
                    silent(fmt_path(prefix, path), asked, s, rank, "the step returns it as")
                )
    return findings


def silent(path: str, asked: Any, got: Any, rank: int, verb: str) -> Finding:
    a, g = layout_text(layout_of(asked, rank), asked), layout_text(layout_of(got, rank), got)
    return Finding(
        "silent-replication",
        path,
        f"{path} was asked to be {a} but {verb} {g}: the layout was silently changed. Pin it "
        "(in_shardings/out_shardings, or dtensor.relayout inside the step) or fix its layout rule.",
    )
