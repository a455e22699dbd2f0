"""Each HybridStrategy axis's signature in a compiled program, read from explain()'s collectives.

A replicated computation gives the same numbers as a split one, so the
equality tests cannot tell whether an axis is used; the compiled program can.
Each ``assert_*`` takes the collectives of one compiled training step
(``Report.collectives``, or :func:`dtensor.analysis.hlo.parse_collectives` of
its HLO text) and checks what only that axis's plan puts there:

- ``tensor``: all-reduces of activations (``[rows, seq, d_model]`` a device)
  over ``tensor``, forward and backward, two a layer at least (attention out,
  MLP down: Megatron's row-parallel matmuls);
- ``tensor`` with sequence parallelism (scanned layers, ``remat=``): all-gathers of the
  sequence over ``tensor`` before attention and the MLP, and no weight gathered over it;
- ``stage``: collective-permutes of a microbatch's activations over ``stage``,
  once a pipeline tick, forward and backward;
- ``context`` gather: all-gathers of the whole sequence's K and V over
  ``context`` under :func:`dtensor.context_attention`'s name scope;
- ``context`` ring: collective-permutes of K/V chunks over ``context`` under
  that scope, and no all-gather there nor any all-gather of the whole
  sequence's K/V anywhere;
- ``expert``: all-to-alls over ``expert`` under :func:`dtensor.expert_mlp`'s
  dispatch scope, out and back, forward and backward;
- ``fsdp``: all-gathers of the weights over ``fsdp``, and their gradients
  reduce-scattered over ``fsdp`` (the gather-at-read plan) or, in XLA's own
  plan on CPU, all-reduced over axes that include ``fsdp`` (XLA:CPU never
  forms a reduce-scatter; JAX-NOTES.md).

Forward and backward are told apart by JAX's name stack: a collective of the
backward pass has ``transpose(`` in its ``op_name``.

:func:`assert_splits` checks the other half: the per-device argument bytes of
the compiled program fall by the axis's size for exactly the variables the
axis splits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from dtensor.analysis.hlo import Collective
from dtensor.core.attention import CONTEXT_SCOPE
from dtensor.core.experts import DISPATCH_SCOPE


def over(
    collectives: Iterable[Collective], kind: str, axis: str, scope: str | None = None
) -> list[Collective]:
    """The collectives of ``kind`` over exactly the mesh axis ``axis`` (under ``scope``)."""
    return [
        c
        for c in collectives
        if c.kind == kind and c.mesh_axes == (axis,) and (scope is None or scope in c.op_name)
    ]


def backward(c: Collective) -> bool:
    """Whether ``c`` belongs to the backward pass (JAX's name stack says ``transpose(``)."""
    return "transpose(" in c.op_name


def count(collectives: Iterable[Collective]) -> int:
    """Executions per step (loop trip counts included)."""
    return sum(c.count for c in collectives)


def _squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(shape)
    while shape[:1] == (1,):
        shape = shape[1:]
    return shape


def shaped(c: Collective, shape: Sequence[int]) -> bool:
    """Whether ``c``'s per-device result is ``shape`` (leading dimensions of 1 aside: a
    pipeline's stage dimension, a microbatch of one row)."""
    return _squeezed(c.shape) == _squeezed(shape)


def _both_passes(found: Sequence[Collective], at_least: int, what: str) -> None:
    fwd = count(c for c in found if not backward(c))
    bwd = count(c for c in found if backward(c))
    assert fwd >= at_least and bwd >= at_least, (
        f"{what}: {fwd} forward and {bwd} backward, want {at_least} each at least"
    )


def assert_tensor(
    collectives: Sequence[Collective],
    *,
    rows: int,
    seq: int,
    d_model: int,
    layers: int,
    per_layer: int = 2,
) -> None:
    """Activation all-reduces over ``tensor``: ``rows x seq x d_model`` a device, ``per_layer``
    a layer (2: attention out and MLP down, or the mixture of experts' sum over its
    tensor-split hidden units)."""
    found = [
        c for c in over(collectives, "all-reduce", "tensor") if shaped(c, (rows, seq, d_model))
    ]
    _both_passes(found, per_layer * layers, "activation all-reduces over tensor")


def assert_sequence_parallel(
    collectives: Sequence[Collective],
    *,
    rows: int,
    seq: int,
    d_model: int,
    layers: int,
    weights: Iterable[Sequence[int]],
) -> None:
    """Megatron's sequence parallelism over ``tensor``: the sequence all-gathered
    (``rows x seq x d_model`` a device) before attention and the MLP, forward and backward,
    and no collective over ``tensor`` shaped like one of ``weights`` whole (a layer's weights
    gathered instead of the activations)."""
    whole = {_squeezed(w) for w in weights}
    tensor = [c for c in collectives if c.mesh_axes == ("tensor",)]
    gathered_weights = [c for c in tensor if _squeezed(c.shape) in whole]
    assert not gathered_weights, gathered_weights
    found = [c for c in over(tensor, "all-gather", "tensor") if shaped(c, (rows, seq, d_model))]
    _both_passes(found, 2 * layers, "sequence all-gathers over tensor")


def assert_stage(
    collectives: Sequence[Collective],
    *,
    rows: int,
    seq: int,
    d_model: int,
    ticks: int,
    bubble: float,
    stages: int,
) -> None:
    """A microbatch's activations (``rows x seq x d_model`` a device) permuted over ``stage``
    once a tick (``ticks = R M + S - 1``) each way; the schedule's bubble ``(S - 1) / ticks``."""
    found = [
        c
        for c in over(collectives, "collective-permute", "stage")
        if shaped(c, (rows, seq, d_model))
    ]
    _both_passes(found, ticks, "activation permutes over stage")
    assert bubble == (stages - 1) / ticks > 0, bubble


def assert_context_gather(
    collectives: Sequence[Collective], *, kv: Sequence[int], layers: int
) -> None:
    """K and V all-gathered over ``context`` (the whole sequence: ``kv``, ``[rows, seq,
    kv_heads, head_dim]`` a device) in each layer's forward pass; no ring permutes."""
    found = [
        c
        for c in over(collectives, "all-gather", "context", CONTEXT_SCOPE)
        if shaped(c, kv) and not backward(c)
    ]
    assert count(found) >= 2 * layers, f"{count(found)} K/V all-gathers, want 2 x {layers}"
    assert not over(collectives, "collective-permute", "context", CONTEXT_SCOPE)


def assert_context_ring(
    collectives: Sequence[Collective], *, kv: Sequence[int], layers: int, context: int
) -> None:
    """K/V chunks passed round a ring over ``context``: ``C - 1`` steps of K and V a layer,
    forward and backward; no all-gather under the attention's scope, and no forward pass
    (nor its recomputation under remat) all-gathers the whole sequence's K or V (``kv``, as
    for :func:`assert_context_gather`) anywhere. (The backward pass may all-gather a
    gradient of that shape for a weight's gradient, XLA's plan for weights split over
    ``context``: seen for dK in the scanned decoder under fsdp x tensor x context.)"""
    found = over(collectives, "collective-permute", "context", CONTEXT_SCOPE)
    _both_passes(found, 2 * (context - 1) * layers, "K/V permutes over context")
    assert not [c for c in collectives if c.kind == "all-gather" and CONTEXT_SCOPE in c.op_name]
    whole = [
        c
        for c in collectives
        if c.kind == "all-gather"
        and "context" in c.mesh_axes
        and shaped(c, kv)
        and (not backward(c) or "rematted_computation" in c.op_name)
    ]
    assert not whole, f"the whole sequence's K/V all-gathered: {whole}"


def assert_context_ulysses(collectives: Sequence[Collective], *, layers: int) -> None:
    """All-to-alls over ``context`` under attention's scope: q, k and v to a head split and
    the output back, each layer, forward and backward; no K/V gather or ring permute there."""
    found = over(collectives, "all-to-all", "context", CONTEXT_SCOPE)
    _both_passes(found, 4 * layers, "q/k/v/out all-to-alls over context")
    for kind in ("all-gather", "collective-permute"):
        assert not [c for c in collectives if c.kind == kind and CONTEXT_SCOPE in c.op_name], kind


def assert_expert(collectives: Sequence[Collective], *, layers: int, named: bool = True) -> None:
    """Tokens dispatched by all-to-alls over ``expert``: out and back, each MoE layer, both
    passes. ``named=False`` for XLA:GPU, whose asynchronous ragged all-to-alls carry no
    ``op_name`` (no scope, no pass): the token rows' all-to-alls over ``expert`` (not the
    integer sizes') counted together, out and back in each layer at least twice."""
    if named:
        found = over(collectives, "all-to-all", "expert", DISPATCH_SCOPE)
        _both_passes(found, 2 * layers, "dispatch all-to-alls over expert")
        return
    rows = [c for c in over(collectives, "all-to-all", "expert") if c.dtype[0] in "fb"]
    assert count(rows) >= 2 * 2 * layers, rows


def assert_fsdp(
    collectives: Sequence[Collective],
    weights: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] | None,
    *,
    reduce_scatter: bool,
) -> None:
    """Every weight of ``weights`` (path -> (gathered shape, shard shape)) all-gathered over
    ``fsdp`` and its gradient reduce-scattered over ``fsdp`` to its shard, or (XLA's plan on
    CPU, ``reduce_scatter=False``) all-reduced whole. ``fsdp`` may come with other axes the
    weights are split over too (HybridStrategy FSDP-splits over ``fsdp`` and ``context`` /
    ``expert`` together). ``weights=None``: only that both kinds are there, the gathers in
    both passes (each layer's weights gathered for its forward and again for its backward)."""
    with_fsdp = [c for c in collectives if "fsdp" in c.mesh_axes]
    gathers = [c for c in with_fsdp if c.kind == "all-gather"]
    kind = "reduce-scatter" if reduce_scatter else "all-reduce"
    reductions = [c for c in with_fsdp if c.kind == kind and backward(c)]
    if weights is None:
        _both_passes(gathers, 1, "weight all-gathers over fsdp")
        assert reductions, f"no gradient {kind} over fsdp"
        return
    gathered = {c.shape for c in gathers}
    reduced = {c.shape for c in reductions}
    for path, (whole, shard) in weights.items():
        assert whole in gathered, f"{path} {whole} not all-gathered over fsdp"
        want = shard if reduce_scatter else whole
        assert want in reduced, f"{path}'s gradient {want} in no {kind} over fsdp"


# ------------------------------------------------------------------------- argument bytes
def _names(layout: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", layout)) - {"unsharded"}


def assert_splits(
    report,
    axes: Mapping[str, int],
    splits: Callable[[str], bool],
    *,
    batch_bytes: int,
) -> None:
    """The compiled program's per-device arguments: each variable ``splits(path)`` names is
    split over exactly the mesh axes ``axes`` (name -> size), every other one (and every
    scalar: the optimizer's step counts) is whole, and
    the argument bytes are exactly the variables' bytes with the split ones divided by the
    axes' sizes, plus ``batch_bytes`` (the batch's shard). The shard shapes are XLA's (its
    compiled input shardings); on CPU they are also ``memory_analysis``'s argument bytes (on
    TPU those are padded to tiles)."""
    n = math.prod(axes.values())
    want = batch_bytes
    split = []
    for v in report.variables:
        names = _names(v.layout)
        if v.shape and splits(v.path):
            assert names == set(axes), (v.path, v.layout)
            want += v.global_bytes // n
            split.append(v.path)
        else:
            assert not names, (v.path, v.layout)
            want += v.global_bytes
    assert split, f"nothing split over {tuple(axes)}"
    got = compiled_argument_bytes(report)
    assert got == want, (tuple(axes), got, want)
    if report.memory_fit is None:  # CPU (no chip): XLA's own figure
        assert report.argument_bytes_per_device == got


def compiled_argument_bytes(report) -> int:
    """Bytes of one device's shards of every argument, by the compiled input shardings."""
    import jax
    import numpy as np

    compiled = report.compiled
    avals = jax.tree.leaves(compiled.in_avals[0])
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    assert len(avals) == len(shardings)
    return sum(
        math.prod(s.shard_shape(a.shape)) * np.dtype(a.dtype).itemsize
        for a, s in zip(avals, shardings, strict=True)
    )
