"""FSDP building blocks: gather a parameter for compute, reduce-scatter its gradient.

XLA's SPMD partitioner on CPU never forms a ``reduce-scatter``: a gradient
that must come out sharded is all-reduced at full size and then sliced. JAX
can say what is meant — on **Explicit** mesh axes a parameter gathered into
the ``reduced`` state gets an ``unreduced`` cotangent (per-device partial
sums) — and :func:`gather_for_compute` turns that into real collectives: an
``all-gather`` forward and, in its custom VJP, ``jax.lax.psum_scatter``
inside ``jax.shard_map`` backward (one ``reduce-scatter``, no full-size
gradient). :func:`explicit_region` runs a function on Explicit axes inside
a step traced on Auto axes, so the rest of a program is unaffected.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

__all__ = ["explicit_region", "gather_for_compute", "matmul_only_reads", "sharded_axes", "tag_read"]


def sharded_axes(spec: PartitionSpec, axes: Sequence[str]) -> tuple[int, tuple[str, ...]] | None:
    """The one dimension of ``spec`` split over some of ``axes``, and those axes.

    ``None`` when no dimension is split over ``axes``. Several such dimensions
    are not supported (a preset splits one dimension per parameter).

    Examples:
        >>> from jax.sharding import PartitionSpec as P
        >>> sharded_axes(P(None, "fsdp"), ["fsdp"])
        (1, ('fsdp',))
        >>> sharded_axes(P("tensor", None), ["fsdp"]) is None
        True
    """
    found = []
    for d, entry in enumerate(spec):
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        hit = tuple(a for a in names if a in axes)
        if hit:
            if hit != names:
                raise ValueError(
                    f"dimension {d} of {spec} mixes data axes {hit} with other axes {names}; "
                    "gather_for_compute splits a dimension over data axes only. Shard that "
                    "dimension over the data axes alone."
                )
            found.append((d, hit))
    if len(found) > 1:
        raise ValueError(
            f"{spec} splits {len(found)} dimensions over the data axes {tuple(axes)}; "
            "gather_for_compute handles one. Split a single dimension over the data axes."
        )
    return found[0] if found else None


def gather_for_compute(
    x: jax.Array,
    spec: PartitionSpec,
    axes: Sequence[str],
    *,
    reduced: bool = True,
    compute_dtype: Any = None,
    reduce_dtype: Any = None,
) -> jax.Array:
    """``x`` (laid out as ``spec``) whole on every device, its gradient reduce-scattered.

    Call inside :func:`explicit_region` (every mesh axis Explicit: JAX types
    ``reduced`` and ``unreduced`` values only then). ``axes`` are the data
    axes (those the batch is split over). The value is unchanged; only the
    collectives differ: forward an ``all-gather`` over the axes of ``axes``
    that split ``x`` into JAX's ``reduced`` state, backward a
    ``reduce-scatter`` of the per-device partial gradient over those axes
    back to ``spec``, then an all-reduce of that shard over the data axes
    ``x`` is replicated over (HybridStrategy's ``data``). Dimensions split
    over other mesh axes stay as they are.
    With ``compute_dtype`` the local shard is cast before it is gathered (the
    all-gather moves that dtype); with ``reduce_dtype`` the gradient is cast
    to it before the reduce-scatter (then to ``x``'s dtype).

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from jax.sharding import PartitionSpec as P, NamedSharding, AxisType
        >>> from strategies.reads.fsdp_ops import explicit_region, gather_for_compute
        >>> mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(AxisType.Auto,))
        >>> w = jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P("fsdp", None)))
        >>> x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("fsdp", None)))
        >>> def loss(w, x):
        ...     return jnp.mean(x @ gather_for_compute(w, P("fsdp", None), ["fsdp"]))
        >>> def grad(w, x):
        ...     return explicit_region(jax.grad(loss), ["fsdp"], (P("fsdp", None), P("fsdp", None)))(w, x)
        >>> with jax.set_mesh(mesh):
        ...     compiled = jax.jit(grad).lower(w, x).compile()
        >>> "reduce-scatter" in compiled.as_text(), float(compiled(w, x).sum())
        (True, 16.0)
    """
    found = sharded_axes(spec, axes)
    if found is None:
        return x if compute_dtype is None else x.astype(compute_dtype)
    dim, names = found
    if not reduced:
        x = x if compute_dtype is None else x.astype(compute_dtype)
        return jax.sharding.reshard(
            x, PartitionSpec(*[None if d == dim else e for d, e in enumerate(spec)])
        )
    dtypes = (
        None if compute_dtype is None else jax.numpy.dtype(compute_dtype),
        None if reduce_dtype is None else jax.numpy.dtype(reduce_dtype),
        jax.numpy.dtype(x.dtype),
    )
    return _gather(x, spec, dim, names, tuple(axes), dtypes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _gather(
    x: jax.Array,
    spec: PartitionSpec,
    dim: int,
    names: tuple[str, ...],
    axes: tuple[str, ...],
    dtypes: Any,
) -> jax.Array:
    return _gather_fwd(x, spec, dim, names, axes, dtypes)[0]


def _gather_fwd(
    x: jax.Array,
    spec: PartitionSpec,
    dim: int,
    names: tuple[str, ...],
    axes: tuple[str, ...],
    dtypes: Any,
) -> tuple[jax.Array, None]:
    # ``reduced`` over every data axis (also those ``x`` is only replicated over,
    # HybridStrategy's ``data``): the batch is split over all of them, so the
    # cotangent comes back as per-device partial sums over all of them.
    whole = PartitionSpec(
        *[None if d == dim else s for d, s in enumerate(spec)], reduced=frozenset(axes)
    )
    if dtypes[0] is not None:
        x = x.astype(dtypes[0])  # cast the local shard: the all-gather moves compute_dtype
    return jax.sharding.reshard(x, whole), None


def _gather_bwd(
    spec: PartitionSpec,
    dim: int,
    names: tuple[str, ...],
    axes: tuple[str, ...],
    dtypes: Any,
    _: None,
    ct: jax.Array,
) -> tuple[jax.Array]:
    others = [None if d == dim else s for d, s in enumerate(spec)]
    unreduced = frozenset(jax.typeof(ct).sharding.spec.unreduced)
    axis = names[0] if len(names) == 1 else names
    # Data axes the variable is replicated over (HybridStrategy's ``data``): the
    # scattered shard is all-reduced over them (1/|names| of the full size).
    rest = tuple(a for a in axes if a in unreduced and a not in names)
    reduce_dtype, master = dtypes[1], dtypes[2]

    def reduce(c: jax.Array) -> jax.Array:
        c = c if reduce_dtype is None else c.astype(reduce_dtype)
        c = jax.lax.psum_scatter(c, axis, scatter_dimension=dim, tiled=True)
        if rest:
            c = jax.lax.psum(c, rest)
        return c.astype(master)

    if unreduced >= set(names):  # per-device partial sums: one reduce-scatter
        scatter = jax.shard_map(
            reduce,
            in_specs=PartitionSpec(*others, unreduced=unreduced),
            out_specs=PartitionSpec(
                *[s if d != dim else axis for d, s in enumerate(spec)],
                unreduced=unreduced - frozenset(names) - frozenset(rest),
            ),
        )  # manual over every mesh axis: JAX takes unreduced specs in full manual mode only
        return (scatter(ct),)
    # already reduced (no batch split): a slice
    return (jax.sharding.reshard(ct.astype(master), spec),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def explicit_region(
    fn: Callable[..., Any], axes: Sequence[str], in_specs: Any
) -> Callable[..., Any]:
    """``fn`` traced with the mesh axes ``axes`` Explicit, its arguments resharded to ``in_specs``.

    For use inside ``jax.jit`` under a context mesh (``jax.set_mesh``) with
    Auto axes: the arguments enter with the given partition specs (a pytree
    prefix of the arguments; nothing moves when they match the arguments'
    layouts) and the outputs leave on Auto axes again. A thin name over
    ``jax.sharding.explicit_axes``.
    """
    return jax.sharding.explicit_axes(fn, axes=tuple(axes), in_sharding=in_specs)


# ------------------------------------------------------------ read analysis
# JAX types a gathered ``reduced`` value strictly: a matmul (dot_general)
# takes it, but an elementwise op with a batch-split operand (a bias add, a
# norm's scale) or an embedding lookup (gather) raise. So only parameters that
# feed matmuls alone are gathered ``reduced`` (gradient reduce-scattered); the
# rest are gathered plainly (gradient all-reduced, then sliced). A probe
# trace with each read tagged tells which is which.

_TAG = "dtensor_fsdp_read_"

# Ops that only move or relabel a value: what consumes their output decides.
_TRANSPARENT = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "copy",
        "copy_p",
        "name",
    }
)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _tag(x: jax.Array, key: int) -> jax.Array:
    from jax.ad_checkpoint import checkpoint_name

    return checkpoint_name(x, f"{_TAG}{key}")


@_tag.defjvp
def _tag_jvp(
    key: int, primals: tuple[jax.Array], tangents: tuple[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    return _tag(primals[0], key), tangents[0]  # tag the primal only


def tag_read(x: jax.Array, key: int) -> jax.Array:
    """``x`` unchanged, marked in a traced program as read number ``key`` (for :func:`matmul_only_reads`)."""
    return _tag(x, key)


def matmul_only_reads(jaxpr: Any) -> dict[int, bool]:
    """For each :func:`tag_read` key in ``jaxpr``: whether every use of the read is a matmul.

    Uses are followed through ops that only reshape or relabel a value and
    into nested jaxprs (``jit``, custom derivatives, remat); a use under
    control flow (``scan``, ``while``, ``cond``) or as an output counts as
    not a matmul.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from strategies.reads.fsdp_ops import matmul_only_reads, tag_read
        >>> def f(w, b, x):
        ...     return jnp.tanh(x @ tag_read(w, 0).T + tag_read(b, 1))
        >>> matmul_only_reads(jax.make_jaxpr(jax.grad(lambda *a: f(*a).sum()))(jnp.ones((3, 2)), jnp.ones(3), jnp.ones((4, 2))))
        {0: True, 1: False}
    """
    ok: dict[int, bool] = {}
    top = getattr(jaxpr, "jaxpr", jaxpr)
    env = _walk(top, {}, ok)
    for v in top.outvars:  # returned as is: not a matmul use
        for t in env.get(v, frozenset()) if not hasattr(v, "val") else ():
            ok[t] = False
    return ok


def _sub_jaxprs(eqn: Any) -> list[Any]:
    subs = []
    for value in eqn.params.values():
        inner = getattr(value, "jaxpr", value)
        if hasattr(inner, "eqns") and hasattr(inner, "invars"):
            subs.append(inner)
    return subs


def _walk(
    jaxpr: Any, env: dict[Any, frozenset[int]], ok: dict[int, bool]
) -> dict[Any, frozenset[int]]:
    def tags_of(v: Any) -> frozenset[int]:
        return env.get(v, frozenset()) if not hasattr(v, "val") else frozenset()

    def bad(tags: frozenset[int]) -> None:
        for t in tags:
            ok[t] = False

    for eqn in jaxpr.eqns:
        name = eqn.params.get("name") if eqn.primitive.name == "name" else None
        if isinstance(name, str) and name.startswith(_TAG):
            key = int(name[len(_TAG) :])
            ok.setdefault(key, True)
            env[eqn.outvars[0]] = tags_of(eqn.invars[0]) | {key}
            continue
        tags = frozenset().union(*(tags_of(v) for v in eqn.invars))
        subs = _sub_jaxprs(eqn)
        prim = eqn.primitive.name
        if prim == "dot_general":
            continue
        if prim in _TRANSPARENT:
            for out in eqn.outvars:
                env[out] = tags
            continue
        if subs and prim not in ("scan", "while", "cond"):
            inner = subs[0]
            if len(inner.invars) == len(eqn.invars):
                inner_env = {
                    iv: tags_of(ov) for iv, ov in zip(inner.invars, eqn.invars, strict=True)
                }
                inner_env = _walk(inner, inner_env, ok)
                for sub in subs[1:]:  # e.g. a custom rule's jaxpr: same inputs
                    if len(sub.invars) == len(eqn.invars):
                        _walk(
                            sub,
                            {
                                iv: tags_of(ov)
                                for iv, ov in zip(sub.invars, eqn.invars, strict=True)
                            },
                            ok,
                        )
                if len(inner.outvars) == len(eqn.outvars):
                    for out, iout in zip(eqn.outvars, inner.outvars, strict=True):
                        env[out] = (
                            inner_env.get(iout, frozenset())
                            if not hasattr(iout, "val")
                            else frozenset()
                        )
                    continue
        if subs:  # control flow, or a nesting we cannot map: reads inside count as non-matmul
            for sub in subs:
                inner_ok: dict[int, bool] = {}
                _walk(sub, {}, inner_ok)
                bad(frozenset(inner_ok))
        bad(tags)
        for out in eqn.outvars:
            env[out] = frozenset()
    return env
