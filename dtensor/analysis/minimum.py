"""A second reference for the communication minimum: per matmul, the cheaper of moving
the weight or moving the activations.

The ZeRO reference (:func:`dtensor.analysis.explain.min_comm_bytes`) assumes
every weight split over the data axes is gathered where it is read. A
compiler may instead keep the weight where it is and move the (batch-split)
activations to it -- an all-to-all of an activation costs each device only
its own share, ``|x| / n`` -- which for large weights and a small batch per
device moves far less. So the minimum for those weights is not a lower bound
unless it also allows that plan.

:func:`matmul_reference` walks the step's jaxpr (forward and backward pass,
rematerialised recomputations and scanned layers counted once per iteration)
and, for every ``dot_general`` one of whose operands is read from a weight
split over the data axes (through casts, reshapes, slices of a scanned stack,
nested calls), takes the cheapest of

- gathering the weight: ``(k-1)/k * |w|`` (``k``: the weight's shards over
  the data axes),
- moving the other operand, or the result: ``(n-1)/n * min(|x|, |y|) / n``
  (``n``: the product of the data axes' sizes; an all-to-all or a
  reduce-scatter of a batch-split activation),

with ``|.|`` the bytes of the operand as the matmul reads it (bfloat16 under
mixed precision). Gradient reductions are left out (a plan that moves
activations computes each weight's gradient where the weight lives), as are
matmuls whose weight operand the walk cannot follow (inside ``shard_map``,
``cond``, ``while``): the reference errs low, never high.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from dtensor.analysis.report import VariableInfo
from dtensor.core.mesh import Mesh
from dtensor.core.tree import is_array

__all__ = [
    "REFERENCE_NAMES",
    "dispatch_minimum",
    "layout_axes",
    "matmul_reference",
    "minimum_for",
    "split_over_data",
]

#: The names of the two references in ``Report.min_comm_references``.
REFERENCE_NAMES = ("weights gathered (ZeRO)", "per matmul: cheaper of weight or activations")

# Primitives whose output is the (recast, reshaped, sliced) weight they read.
_SAME_WEIGHT = {
    "convert_element_type",
    "reshape",
    "transpose",
    "broadcast_in_dim",
    "squeeze",
    "expand_dims",
    "copy",
    "copy_p",
    "slice",
    "dynamic_slice",
    "reshard",
    "sharding_constraint",
    "mesh_cast",
    "optimization_barrier",
    "reduce_precision",
    "to_bfloat16",  # MixedPrecision's in-loop cast of a scanned layer, by the bits
}
# Custom-derivative calls of a weight returning one array of its shape: the weight recast.
_CAST_CALLS = {"custom_vjp_call", "custom_vjp_call_jaxpr", "custom_jvp_call"}
# Calls whose body is skipped: their avals are per device, or they run a data-dependent
# number of times.
_OPAQUE = {"shard_map", "cond", "while", "custom_partitioning"}


def _bytes(aval: Any) -> float:
    shape = getattr(aval, "shape", ())
    return float(math.prod(int(d) for d in shape) * np.dtype(aval.dtype).itemsize)


def _subjaxpr(eqn: Any) -> Any:
    """The body of a call-like equation whose inputs map one to one onto its own."""
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and len(inner.invars) == len(eqn.invars):
            return inner
    return None


def matmul_reference(jaxpr: Any, weight_shards: Mapping[int, int], replicas: int) -> float:
    """Bytes per device of the per-matmul reference (see the module docs).

    Args:
        jaxpr: the step's (closed) jaxpr, its inputs the flattened arguments.
        weight_shards: input position -> shards ``k`` over the data axes, for
            each trainable variable split over them.
        replicas: ``n``, the product of the data axes' sizes.

    Returns:
        The reference's bytes per device.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dtensor.analysis.minimum import matmul_reference
        >>> w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)   # 4 MiB, split 8 ways
        >>> x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)     # 256 KiB, split 8 ways
        >>> j = jax.make_jaxpr(lambda w, x: x @ w.astype(jnp.bfloat16).astype(jnp.float32))(w, x)
        >>> matmul_reference(j, {0: 8}, 8)   # moving x's share: 7/8 * 256 KiB / 8
        28672.0
    """
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    taint = {inner.invars[i]: k for i, k in weight_shards.items() if i < len(inner.invars)}
    return _walk(inner, taint, max(int(replicas), 1), 1)


def _walk(jaxpr: Any, taint: dict[Any, int], n: int, mult: int) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins = [taint.get(v) if not _literal(v) else None for v in eqn.invars]
        if name == "dot_general":
            k = ins[0] or ins[1]
            if k:
                w = eqn.invars[0] if ins[0] else eqn.invars[1]
                x = eqn.invars[1] if ins[0] else eqn.invars[0]
                gather = (k - 1) / k * _bytes(w.aval)
                move = (n - 1) / n * min(_bytes(x.aval), _bytes(eqn.outvars[0].aval)) / n
                total += mult * min(gather, move)
            continue
        if name in _SAME_WEIGHT:
            k = next((s for s in ins if s), None)
            if k:
                for v in eqn.outvars:
                    taint[v] = k
            continue
        if name in _OPAQUE or not any(ins):
            continue
        body = _subjaxpr(eqn)
        if body is None:
            continue
        times = int(eqn.params.get("length", 1)) if name == "scan" else 1
        inner_taint = {b: k for b, k in zip(body.invars, ins, strict=True) if k}
        total += _walk(body, inner_taint, n, mult * times)
        if name != "scan":  # a call's results are its body's (a scan's are stacked or carried)
            for outer, out in zip(eqn.outvars, body.outvars, strict=False):
                if not _literal(out) and out in inner_taint:
                    taint[outer] = inner_taint[out]
        if name in _CAST_CALLS and len(eqn.outvars) == 1:
            shape = getattr(eqn.outvars[0].aval, "shape", None)
            cast = (k for v, k in zip(eqn.invars, ins, strict=True) if k and v.aval.shape == shape)
            k = next(cast, None)
            if k:
                taint[eqn.outvars[0]] = k
    return total


def _literal(v: Any) -> bool:
    return type(v).__name__ == "Literal"


def minimum_for(
    jaxpr: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    var_arg: int | None,
    all_leaves: list[tuple[Any, Any]],
    infos: list[tuple[VariableInfo, float]],
    data: tuple[str, ...],
    mesh: Mesh | None,
    kept_axes: Any = None,
) -> tuple[float, dict[str, float] | None]:
    """The minimum over the variables (the ZeRO reference of those split over the data
    axes, or the per-matmul one where it is lower) and the two references by name
    (``None`` when no variable is split over the data axes or the jaxpr is unknown)."""
    sizes = mesh.shape if mesh is not None else {}

    def own(v: VariableInfo) -> tuple[str, ...]:  # the data axes a variable is gathered over
        kept = tuple(kept_axes(v.path)) if kept_axes else ()
        return tuple(a for a in data if a not in kept)

    split = [split_over_data(v, own(v)) and v.trainable for v, _ in infos]
    zero = sum(m for (_, m), s in zip(infos, split, strict=True) if s)
    rest = sum(m for (_, m), s in zip(infos, split, strict=True) if not s)
    n_inputs = len(jax.tree.leaves((args, kwargs)))
    if jaxpr is None or var_arg is None or not zero or len(jaxpr.jaxpr.invars) != n_inputs:
        return zero + rest, None
    offset = len(jax.tree.leaves(args[:var_arg]))
    shards: dict[int, int] = {}
    rows = iter(zip(infos, split, strict=True))
    for i, (_, leaf) in enumerate(all_leaves):
        if not is_array(leaf):
            continue
        (v, _), is_split = next(rows)
        if is_split:
            shards[offset + i] = math.prod(sizes.get(a, 1) for a in own(v) if a in layout_axes(v))
    replicas = math.prod(sizes.get(a, 1) for a in data)
    per_matmul = matmul_reference(jaxpr, shards, replicas)
    references = (rest + zero, rest + per_matmul)
    return min(references), dict(zip(REFERENCE_NAMES, references, strict=True))


def dispatch_minimum(jaxpr: Any, sizes: Mapping[str, int]) -> tuple[float, float | None]:
    """Bytes per device the step's MoE dispatches must move, and their receive buffers'
    capacity (rows held per row routed: ``n x min(experts / n, k) / k`` for dropless
    routing), ``None`` without any.

    Each ``ragged_all_to_all`` (forward, backward, recomputed; scanned layers once per
    iteration) sends the rows routed -- the smaller of its operand and result, the other
    being the dropless buffer -- of which ``(n-1)/n`` leave the device when the routing is
    balanced; an ``all_to_all`` of :func:`dtensor.expert_mlp`'s dense exchange (the CPU's,
    under its ``dense_k{k}_per{p}`` name scope) is its receive buffer, ``n x p`` rows
    for each token's ``k`` routed.

    Examples:
        >>> import jax, jax.numpy as jnp, dtensor
        >>> from dtensor.analysis.minimum import dispatch_minimum
        >>> mesh = dtensor.create_mesh([("expert", 4)])
        >>> x = jnp.ones((32, 8)); ids = jnp.zeros((32, 2), jnp.int32); w = jnp.ones((32, 2))
        >>> up = jnp.ones((4, 8, 16)); down = jnp.ones((4, 16, 8))
        >>> with mesh:
        ...     j = jax.make_jaxpr(lambda x: dtensor.expert_mlp(x, ids, w, None, up, down))(x)
        >>> dispatch_minimum(j, mesh.shape)  # 2 all-to-alls of 8 tokens x 2 rows x 8 floats
        (768.0, 2.0)
    """
    capacity: list[float | None] = [None]

    def walk(inner: Any, mult: int) -> float:
        out = 0.0
        for eqn in inner.eqns:
            name = eqn.primitive.name
            if name in ("ragged_all_to_all", "all_to_all"):
                axes = eqn.params.get("axis_name")
                axes = axes if isinstance(axes, tuple) else (axes,)
                n = math.prod(int(sizes.get(a, 1)) for a in axes)
                operand, result = eqn.invars[0].aval, eqn.outvars[0].aval
                if name == "ragged_all_to_all":
                    routed = min(_bytes(operand), _bytes(result))
                    held = max(_bytes(operand), _bytes(result))
                elif dense := re.search(r"dense_k(\d+)_per(\d+)", str(eqn.source_info.name_stack)):
                    k, per = int(dense.group(1)), int(dense.group(2))
                    routed, held = _bytes(operand) * k / (n * per), _bytes(operand)
                else:
                    continue
                if n > 1:
                    out += mult * routed * (n - 1) / n
                    capacity[0] = capacity[0] or held / routed
                continue
            times = int(eqn.params.get("length", 1)) if name == "scan" else 1
            for value in eqn.params.values():
                body = getattr(value, "jaxpr", value)
                if hasattr(body, "eqns"):
                    out += walk(body, mult * times)
        return out

    total = walk(getattr(jaxpr, "jaxpr", jaxpr), 1)
    return total, capacity[0]


def layout_axes(v: VariableInfo) -> set[str]:
    """The mesh axes named in ``v``'s layout text."""
    return set(v.layout.replace("(", ",").replace(")", ",").strip("[]").replace(" ", "").split(","))


def split_over_data(v: VariableInfo, data: tuple[str, ...]) -> bool:
    """Whether ``v`` is split (not only replicated) over one of the data axes."""
    return v.bytes_per_device < v.global_bytes and bool(layout_axes(v) & set(data))
