"""The ideal peak memory of a step: the ZeRO formula, with activations from the traced program.

XLA's peak (:attr:`dtensor.Report.peak_bytes_per_device`) is what the
compiled program needs: ``arguments + temporaries + outputs - aliased``. The
ideal (:attr:`dtensor.Report.ideal_peak_bytes_per_device`) is what the
layouts and the program's own data flow need at least, per device:

    ideal = state + gradients + gathered + activations + batch

- ``state``: the variables (parameters and optimizer state) in their storage
  layouts (``state / N`` for ZeRO-3, whole for data parallel);
- ``gradients``: one gradient per trainable variable in its layout (ZeRO
  keeps them sharded like the parameters);
- ``gathered``: the working set of a fully sharded preset, the **two**
  largest variables sharded over the data axes, whole, at the dtype they
  are gathered in (the one in use and the next, prefetched; a
  ``mixed_precision`` preset gathers ``param_dtype``); 0 when nothing is
  sharded over the data axes;
- ``activations``: the most bytes of batch-carrying values (arrays whose
  leading dimensions are the batch's) the step keeps live at once, per
  device, measured on the traced step (``jax.jit(...).trace``) by
  freeing every value after its last use and storing no elementwise result
  (XLA fuses those into their consumers). What a remat policy drops is not
  live, so this is "activations as remat leaves them": block inputs for the
  whole depth, plus one block's recomputed internals;
- ``batch``: the step's array arguments other than the state, per device.

The ideal is what the program's own data flow keeps, not a lower bound: the
TPU compiler rematerialises on its own to fit HBM, so XLA's plan can need
less (Gemma-2B shapes, batch 16 x 1024 on v5e:4x4: XLA's own FSDP plan
8.2 GiB per chip against an ideal of 11.5 GiB; the gather-at-read plan
16.5 GiB).

Strategies supply their own through ``Strategy.ideal_peak_bytes`` (the
default is :func:`ideal_peak_bytes` with the preset's gather dtype).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["PeakTerms", "activation_peak_bytes", "ideal_peak_bytes"]


@dataclasses.dataclass(frozen=True, slots=True)
class PeakTerms:
    """The inputs of the ideal-peak formula, per device (see the module docs).

    ``gathered`` lists the global bytes (storage dtype) of every variable
    sharded over the data axes, largest first.
    """

    state: int
    gradients: int
    gathered: tuple[int, ...]
    activations: int
    batch: int


def ideal_peak_bytes(
    terms: PeakTerms, *, gather_itemsize_ratio: float = 1.0, units: int = 2
) -> int:
    """``state + gradients + units largest gathered x ratio + activations + batch``.

    Args:
        terms: the figures (:class:`PeakTerms`).
        gather_itemsize_ratio: the gathered dtype's item size over the
            storage dtype's (0.5 for float32 variables gathered as bfloat16).
        units: how many gathered variables are live at once (2: the one in
            use and the prefetched next).

    Examples:
        >>> from dtensor.analysis.peak import PeakTerms, ideal_peak_bytes
        >>> t = PeakTerms(state=300, gradients=100, gathered=(800, 400, 200), activations=50, batch=10)
        >>> ideal_peak_bytes(t)
        1660
        >>> ideal_peak_bytes(t, gather_itemsize_ratio=0.5)
        1060
    """
    gathered = sum(sorted(terms.gathered, reverse=True)[:units]) * gather_itemsize_ratio
    return int(terms.state + terms.gradients + gathered + terms.activations + terms.batch)


def activation_peak_bytes(
    closed_jaxpr: Any, *, batch_prefixes: Sequence[tuple[int, ...]], replicas: int
) -> int:
    """Most bytes of batch-carrying values live at once in a traced step, per device.

    A value carries the batch when its shape starts with one of
    ``batch_prefixes`` (the batch arguments' leading dimensions), or has one
    right after a leading stacking dimension (``nnx.scan`` residuals). Its
    bytes per device are divided by the number of devices its traced
    sharding splits it over, else by ``replicas``. Values are freed after
    their last use; a call (``remat``, ``pjit``, ``scan``...) adds its own
    body's peak while it runs. Elementwise results (:data:`FUSED`) are never
    stored, as XLA fuses them into their consumers: their operands stay live
    until those consumers run instead.

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from dtensor.analysis.peak import activation_peak_bytes
        >>> layer = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w)
        >>> def peak(layer):
        ...     def loss(w, x):
        ...         for _ in range(8):
        ...             x = layer(w, x)
        ...         return (x**2).sum()
        ...     traced = jax.jit(jax.grad(loss)).trace(jnp.ones((8, 8)), jnp.ones((4, 8)))
        ...     return activation_peak_bytes(traced.jaxpr, batch_prefixes=[(4,)], replicas=1)
        >>> peak(layer), peak(jax.checkpoint(layer))   # remat keeps only each layer's input
        (2304, 1664)
    """
    prefixes = tuple({tuple(p) for p in batch_prefixes if p})

    def size(v: Any) -> int:
        aval = getattr(v, "aval", None)
        shape = tuple(getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        if not shape or dtype is None or not _carries(shape, prefixes):
            return 0
        try:
            itemsize = np.dtype(dtype).itemsize
        except TypeError:
            return 0
        return math.ceil(math.prod(shape) * itemsize / _split(aval, replicas))

    return _peak(closed_jaxpr.jaxpr, size)


def _carries(shape: tuple[int, ...], prefixes: tuple[tuple[int, ...], ...]) -> bool:
    for p in prefixes:
        if shape[: len(p)] == p or (len(shape) > len(p) + 1 and shape[1 : 1 + len(p)] == p):
            return True
    return False


def _split(aval: Any, replicas: int) -> int:
    """Devices a traced value is split over: its Explicit sharding's, else ``replicas``."""
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is not None and mesh is not None:
        sizes = dict(getattr(mesh, "shape", {}) or {})
        parts = tuple(getattr(spec, "partitions", ()) or ())
        axes = [a for s in parts if s is not None for a in (s if isinstance(s, tuple) else (s,))]
        n = math.prod(int(sizes.get(a, 1)) for a in axes)
        if n > 1:
            return n
    return max(replicas, 1)


#: Primitives XLA fuses into their consumers: their results are recomputed where used,
#: never stored (their operands stay live instead).
FUSED = frozenset(
    """abs add add_any and broadcast_in_dim ceil clamp convert_element_type copy copy_p cos
    div eq erf erf_inv exp exp2 expand_dims expm1 floor ge gt integer_pow iota is_finite le
    log log1p logistic lt max min mul ne neg not one_minus_square or pow reduce_precision rem
    reshape round rsqrt select_n sign sin sqrt square squeeze stop_gradient sub tan tanh xor""".split()
)


def _peak(jaxpr: Any, size: Any) -> int:
    from jax.extend import core as jcore

    def is_var(v: Any) -> bool:
        return isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar)

    eqns = jaxpr.eqns
    # A fused value stands for the stored values it is computed from (its roots).
    roots: dict[Any, frozenset[Any]] = {}

    def of(v: Any) -> frozenset[Any]:
        return roots.get(v, frozenset((v,))) if is_var(v) else frozenset()

    stored: set[Any] = set()
    last: dict[Any, int] = {}
    for i, eqn in enumerate(eqns):
        ins = frozenset().union(*(of(v) for v in eqn.invars))
        for r in ins:
            last[r] = i
        for v in eqn.outvars:
            if not is_var(v):
                continue
            if eqn.primitive.name in FUSED:
                roots[v] = ins
            else:
                stored.add(v)
    for v in jaxpr.outvars:
        for r in of(v):
            last[r] = len(eqns)
    live = sum(size(v) for v in (*jaxpr.invars, *jaxpr.constvars))
    peak = live
    for i, eqn in enumerate(eqns):
        inner = 0
        for sub in jcore.jaxprs_in_params(eqn.params):
            body = getattr(sub, "jaxpr", sub)
            inner = max(inner, _peak(body, size) - sum(size(v) for v in body.invars))
        out = sum(size(v) for v in eqn.outvars if v in stored)
        peak = max(peak, live + max(inner, 0) + out)
        live += sum(size(v) for v in eqn.outvars if v in stored and last.get(v, -1) > i)
        for r in frozenset().union(*(of(v) for v in eqn.invars)):
            if last.get(r) == i:
                live -= size(r)
    return peak
