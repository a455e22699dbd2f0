"""The blocks a model repeats, pipelined over ``stage`` with the model unchanged.

HybridStrategy(stage=S, pipeline=(Block,)) runs the calls of the named block
class through :func:`dtensor.core.pipeline.pipeline` inside the steps it
traces, in either way a Flax model repeats its blocks:

- **a scanned stack** (one module whose variables have a leading layer
  dimension, built by ``nnx.vmap`` and run by ``nnx.scan``): inside the step,
  a call of ``flax.nnx.scan(f, in_axes=..., out_axes=nnx.Carry)`` whose
  arguments hold such a module at an ``in_axes=0`` position runs ``f`` in
  stages: each stage's slice of the stack (and of the other ``in_axes=0``
  arguments) goes through ``nnx.scan(f)`` itself, the ``nnx.Carry``
  argument is cut into microbatches.
- **a list of blocks** (``[Block(...) for _ in range(L)]``, as Flax's Gemma
  is written): the first block's call runs all ``L`` blocks in stages (their
  variables stacked) and returns the last one's output; each later call
  checks that it got the previous call's output and returns it unchanged.

In both, a block's first argument (the carry) and every other argument array
of rank 2 or more whose leading dimension is the batch's are cut into
microbatches; other arguments (positions, say) are given to every layer as
they are. Scalars the layers add to — in a scanned stack's carry, or returned
by a listed block beside its output as ``(output, loss)``, as an MoE block's
load-balancing loss — are accumulated per microbatch and averaged over the
microbatches (:func:`dtensor.core.pipeline.pipeline`); a list's first call
returns their total over the blocks and each later call zeros, so a model
that adds them up gets the total once. What pipelining needs from the model: the blocks called one after
another, each one's output the next one's input and nothing in between;
blocks whose calls change no variables (no batch statistics, no dropout
RNG); a listed block returns its output, or a tuple of it, ``None`` entries
(Flax's Gemma returns ``(cache, x)`` without a cache) and scalars; listed
blocks may differ in static attributes in a repeating pattern (Gemma 3's local
and global attention layers), pipelined as groups of one period; ``nnx.scan`` looked up as ``nnx.scan`` when the step runs (not bound
at import) with ``out_axes=nnx.Carry``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
from collections.abc import Iterator
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
from flax.nnx.transforms import iteration as _iteration

from dtensor.core.pipeline import pipeline
from strategies.reads import swaps

__all__ = [
    "PipelineError",
    "PipelinePlan",
    "find_stacks",
    "pipelined",
    "prepare_lists",
]

_ORIGINAL_SCAN = _iteration.scan
_TAG = "_dtensor_pipeline"
_local = threading.local()


class PipelineError(ValueError):
    """A model's blocks cannot be pipelined as they are called."""


@dataclasses.dataclass
class PipelinePlan:
    """What the traced step pipelines, and how."""

    classes: tuple[type, ...]
    stages: int
    microbatches: int
    #: rounds of the ring (``None``: one layer per stage per round, known from the stack)
    repeats: int | None = 1
    axis: str = "stage"
    batch_axes: tuple[str, ...] = ()
    remat: bool = False
    policy: Any = None
    preset: str = "HybridStrategy"
    #: how many stacks and lists were pipelined in this trace (explain reports it)
    runs: int = 0
    #: each list's next block due, the previous block's output and how its later calls
    #: return their input (``None``: the blocks return their output alone; else the
    #: blocks' return form, the zero scalars, and the function building the return)
    chains: dict[str, tuple[int, Any, Any]] = dataclasses.field(default_factory=dict)
    #: the schedule: "gpipe"/"circular" run by :func:`dtensor.core.pipeline.pipeline`; the
    #: interleaved ones by :mod:`strategies.reads.pipeline_grad` where a step differentiates
    #: the blocks' loss (a forward alone runs as GPipe, or circular with rounds)
    schedule: str = "gpipe"
    #: set by :mod:`strategies.reads.pipeline_grad` while it traces a loss: ``"capture"``
    #: (record the blocks' call, stand in for them with their input) or ``"inject"`` (hand
    #: back ``injected`` as their output)
    mode: str | None = None
    #: what runs in place of the blocks in those modes (pipeline_grad's ``stand_in``)
    stand_in: Any = None
    injected: Any = None
    captured: list[Any] = dataclasses.field(default_factory=list)

    def matches(self, node: Any) -> bool:
        base = swaps.swapped_base(type(node))
        return isinstance(base, type) and issubclass(base, self.classes)

    def run(self, layer_fn: Any, weights: Any, carry: Any, side: Any) -> Any:
        if self.mode is not None:  # a loss traced by strategies.reads.pipeline_grad
            return self.stand_in(self, layer_fn, weights, carry, side)
        self.runs += 1
        repeats = self.repeats
        if repeats is None:
            layers = int(np.shape(jax.tree.leaves(weights)[0])[0])
            repeats = max(1, layers // self.stages)
        return pipeline(
            layer_fn,
            weights,
            carry,
            stages=self.stages,
            microbatches=self.microbatches,
            repeats=repeats,
            axis=self.axis,
            batch_axes=self.batch_axes,
            remat=self.remat,
            policy=self.policy,
            side=side,
        )


def _layer_call(plan: PipelinePlan) -> Any:
    """Around one layer's call in a tick: the tick is rematerialised whole (``plan.remat``),
    so the blocks' own ``remat=`` is skipped inside it."""
    return swaps.already_rematerialised() if plan.remat else contextlib.nullcontext()


def _active() -> PipelinePlan | None:
    return getattr(_local, "plan", None)


@contextlib.contextmanager
def pipelined(plan: PipelinePlan) -> Iterator[PipelinePlan]:
    """Within the block, ``nnx.scan`` over a stack of ``plan.classes`` runs in stages."""
    saved = _active(), nnx.scan
    _local.plan = plan
    nnx.scan = _scan
    try:
        yield plan
    finally:
        _local.plan, nnx.scan = saved


# ------------------------------------------------------------------ arguments
def _rows(tree: Any) -> int | None:
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "shape") and np.ndim(x) >= 1]
    return int(np.shape(leaves[0])[0]) if leaves else None


def _check_carry(carry: Any, plan: PipelinePlan, what: str) -> int:
    leaves = jax.tree.leaves(carry)
    shapes = [np.shape(x) for x in leaves]
    rows = {s[0] for s in shapes if len(s)}
    if len(rows) != 1:
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}): {what} carries {shapes}, but a pipelined "
            "carry must be arrays with the same leading (batch) dimension, cut into "
            f"{plan.microbatches} microbatches, and scalars the layers add to (an MoE "
            "load-balancing loss, say: accumulated per microbatch and averaged). Carry the "
            "batch's activations with one leading dimension, or run this model without stage=."
        )
    (b,) = rows
    if b % plan.microbatches and plan.mode != "inject":  # (inject: one microbatch's rows)
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}, microbatches={plan.microbatches}): {what} "
            f"carries a batch of {b} rows, which does not divide into "
            f"{plan.microbatches} microbatches. Choose microbatches dividing {b}."
        )
    return b


def _split_side(tree: Any, rows: int) -> tuple[Any, list[bool], list[Any], list[Any]]:
    """``tree``'s arrays of rank >= 2 with ``rows`` leading rows (cut into microbatches),
    and the rest (given to every layer as they are), as two trees with ``None`` holes."""
    leaves, treedef = jax.tree.flatten(tree)
    batched = [
        isinstance(x, jax.Array | np.ndarray) and np.ndim(x) >= 2 and np.shape(x)[0] == rows
        for x in leaves
    ]
    side = [x if b else None for x, b in zip(leaves, batched, strict=True)]
    rest = [None if b else x for x, b in zip(leaves, batched, strict=True)]
    return (treedef, batched, side, rest)


def _join(split: Any, side: list[Any]) -> Any:
    treedef, batched, _, rest = split
    it = iter(side)
    return jax.tree.unflatten(
        treedef, [next(it) if b else x for x, b in zip(rest, batched, strict=True)]
    )


def _side_of(split: Any) -> list[Any]:
    _, batched, side, _ = split
    return [x for x, b in zip(side, batched, strict=True) if b]


# ------------------------------------------------------------------ scanned stacks
def _scan(f: Any = None, **kwargs: Any) -> Any:
    """``flax.nnx.scan`` inside a pipelined step (a decorator with or without arguments)."""
    if f is None:
        return functools.partial(_scan, **kwargs)
    plain = _ORIGINAL_SCAN(f, **kwargs)

    @functools.wraps(f)
    def call(*args: Any) -> Any:
        plan = _active()
        if plan is None:
            return plain(*args)
        in_axes = kwargs.get("in_axes", (nnx.Carry, 0))
        axes = tuple(in_axes) if isinstance(in_axes, tuple | list) else (in_axes,) * len(args)
        stacks = [
            i
            for i, (a, ax) in enumerate(zip(args, axes, strict=False))
            if ax == 0 and ax is not nnx.Carry and isinstance(a, nnx.Module) and plan.matches(a)
        ]
        if not stacks:
            return plain(*args)
        return _scan_stages(f, kwargs, args, axes, plan)

    return call


def _scan_stages(
    f: Any, kwargs: dict[str, Any], args: tuple[Any, ...], axes: Any, plan: Any
) -> Any:
    name = getattr(f, "__qualname__", repr(f))
    out_axes = kwargs.get("out_axes", (nnx.Carry, 0))
    if out_axes is not nnx.Carry:
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}): nnx.scan({name}) over a stack of "
            f"{plan.classes[0].__name__} has out_axes={out_axes!r}; a pipelined stack returns "
            "only its carry (out_axes=nnx.Carry), since the stages run the layers at different "
            "times. Return per-layer values through the carry, or drop pipeline=."
        )
    carries = [i for i, ax in enumerate(axes) if ax is nnx.Carry]
    if len(carries) != 1:
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}): nnx.scan({name}) has {len(carries)} "
            "nnx.Carry arguments; a pipelined stack takes exactly one (the hidden states)."
        )
    (ci,) = carries
    rows = _check_carry(args[ci], plan, f"nnx.scan({name})")
    per_layer = [i for i, ax in enumerate(axes) if ax == 0 and ax is not nnx.Carry]
    graphdefs: dict[int, Any] = {}
    weights: dict[int, Any] = {}
    for i in per_layer:
        if isinstance(args[i], nnx.Module):
            graphdefs[i], weights[i] = nnx.split(args[i])
        else:
            weights[i] = args[i]
    broadcast = {i: _split_side(args[i], rows) for i, ax in enumerate(axes) if ax is None}
    sides = {i: _side_of(s) for i, s in broadcast.items()}

    def layer_fn(layer: dict[int, Any], x: Any, side: dict[int, Any]) -> Any:
        # One layer: f as nnx.scan's body calls it, on this layer's slice of each
        # in_axes=0 argument (a stacked module merged from its layer's variables).
        new = list(args)
        for i, split in broadcast.items():
            new[i] = _join(split, side[i])
        for i, w in layer.items():
            new[i] = nnx.merge(graphdefs[i], w) if i in graphdefs else w
        new[ci] = x
        with _layer_call(plan):
            return f(*new)

    return plan.run(layer_fn, weights, args[ci], sides)


# ------------------------------------------------------------------ lists of blocks
def find_stacks(root: Any, classes: tuple[type, ...]) -> dict[tuple[Any, ...], str]:
    """The paths (from ``root``) of the modules of ``classes`` to pipeline: ``"list"``
    for each block of a group of two or more siblings, ``"stack"`` for a lone one whose
    variables all share one leading dimension (a stack built by ``nnx.vmap``)."""
    found = [
        (tuple(path), node)
        for path, node in nnx.iter_graph(root)
        if isinstance(node, nnx.Module)
        and isinstance(swaps.swapped_base(type(node)), type)
        and issubclass(swaps.swapped_base(type(node)), classes)
    ]
    inside = [p for p, _ in found]
    # Only the outermost instances (a block class nested in itself is one block).
    found = [(p, n) for p, n in found if not any(q != p and p[: len(q)] == q for q in inside)]
    by_parent: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
    for path, _ in found:
        by_parent.setdefault(path[:-1], []).append(path)
    out: dict[tuple[Any, ...], str] = {}
    nodes = dict(found)
    for paths in by_parent.values():
        if len(paths) > 1:
            out.update({p: "list" for p in paths})
            continue
        (path,) = paths
        leads = {
            np.shape(v.get_raw_value())[:1]
            for _, v in nnx.iter_graph(nodes[path])
            if isinstance(v, nnx.Variable)
        }
        if len(leads) == 1 and next(iter(leads)):
            out[path] = "stack"
    return out


@functools.cache
def _pipeline_class(cls: type) -> type:
    inner = cls.__call__

    def __call__(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        plan = _active()
        tag = getattr(self, _TAG, None)
        if plan is None or tag is None:
            return inner(self, x, *args, **kwargs)
        key, index, count = tag
        if index == 0:
            blocks = _siblings(self, key, count, plan)
            out, later = _run_list(blocks, inner, x, args, kwargs, plan)
            y = (
                out
                if later is None
                else next(e for e, kind in zip(out, later[0], strict=True) if kind == "out")
            )
            plan.chains[key] = (1, y, later)
            return out
        want, last, zeros = plan.chains.get(key, (0, None, None))
        if want != index or not _same(x, last):
            plan.chains.pop(key, None)
            raise PipelineError(
                f"{plan.preset}(stage={plan.stages}): the blocks at {key} are pipelined as one "
                f"stack (the first one's call runs all {count}), so each block's input must be "
                f"the previous block's output, unchanged, in order; block {index} was called "
                + (
                    "with something else as its input"
                    if want == index
                    else f"out of order (block {want} was due)"
                )
                + ". Call the blocks one after another with nothing in between, or leave "
                "them out of pipeline=."
            )
        plan.chains[key] = (index + 1, x, zeros)
        if index + 1 == count:
            plan.chains.pop(key, None)
        # (the first call returned every block's scalars, added up: zeros here)
        if zeros is None:
            return x
        _, nothing, assemble = zeros
        return assemble(x, nothing)

    return type(cls.__name__, (cls,), {"__call__": __call__, swaps._BASE: swaps.swapped_base(cls)})


def _same(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb, strict=True))


def prepare_lists(nodes: Any, plan: PipelinePlan) -> None:
    """Tag the blocks of each list of ``plan.classes`` in ``nodes`` (merged inside the
    trace) and give them the pipelined ``__call__`` (over whatever class they have)."""
    for path, kind in find_stacks(nodes, plan.classes).items():
        if kind != "list":
            continue
        node = _at(nodes, path)
        key = "/".join(str(p) for p in path[:-1])
        siblings = [p for p, k in find_stacks(nodes, plan.classes).items() if p[:-1] == path[:-1]]
        index = sorted(siblings, key=_order).index(path)
        setattr(node, _TAG, (key, index, len(siblings)))
        node.__class__ = _pipeline_class(type(node))


def _order(path: tuple[Any, ...]) -> Any:
    last = path[-1]
    return (0, last, "") if isinstance(last, int) else (1, 0, str(last))


def _at(root: Any, path: tuple[Any, ...]) -> Any:
    for _, (p, node) in enumerate(nnx.iter_graph(root)):
        if tuple(p) == path:
            return node
    raise KeyError(path)


def _siblings(block: Any, key: str, count: int, plan: PipelinePlan) -> list[Any]:
    """The ``count`` blocks tagged ``key`` that ``block`` (the first) belongs with: those of
    the innermost calling frame holding a module whose graph has all of them, ``block``
    itself first (the same objects the step's own trace merged)."""
    frame = sys._getframe(2)
    seen: set[int] = set()
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if not isinstance(value, nnx.Module) or value is block or id(value) in seen:
                continue
            seen.add(id(value))
            found: dict[int, Any] = {}
            for _, node in nnx.iter_graph(value):
                tag = getattr(node, _TAG, None) if isinstance(node, nnx.Module) else None
                if tag is not None and tag[0] == key:
                    found[tag[1]] = node
            if len(found) == count and found.get(0) is block:
                return [found[i] for i in range(count)]
        frame = frame.f_back
    raise PipelineError(
        f"{plan.preset}(stage={plan.stages}): the first block at {key} was called, but no "
        f"calling function holds the module that owns all {count} blocks (as a method's "
        "self or a local), so they cannot be run in stages. Call the blocks from a method "
        "of the module that holds them, as `for block in self.blocks: x = block(x)`."
    )


def _period(graphdefs: list[Any], count: int) -> int:
    """The fewest consecutive blocks that repeat: 1 for identical blocks, 2 for Gemma 3's
    alternating local and global attention (a static attribute of each block), ``count``
    for blocks that never repeat."""
    for p in range(1, count + 1):
        if count % p == 0 and all(graphdefs[i] == graphdefs[i % p] for i in range(count)):
            return p
    return count


def _without_reads(blocks: list[Any], tag: Any) -> list[Any]:
    """The blocks' graph definitions with one tag and their Variables' read functions
    (a strategy's cast or gather, one closure a Variable) left out: what tells whether
    the blocks differ in their own static attributes."""
    graphdefs = []
    for b in blocks:
        variables = [v for _, v in nnx.iter_graph(b) if isinstance(v, nnx.Variable)]
        reads = [swaps.take_read(v) for v in variables]
        old = getattr(b, _TAG)
        try:
            setattr(b, _TAG, tag)
            graphdefs.append(nnx.graphdef(b))
        finally:
            setattr(b, _TAG, old)
            for v, read in zip(variables, reads, strict=True):
                if read is not None:
                    v.set_metadata(swaps.READ, read)
    return graphdefs


def _run_list(
    blocks: list[Any], inner: Any, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any], plan: Any
) -> tuple[Any, Any]:
    """All ``blocks`` in stages on ``x``: what the first block's call returns and what each
    later call returns beside its input (``None``: the blocks return their output alone).

    A block returns its output (what the next block takes), or a tuple holding it with
    ``None`` entries (Flax's Gemma returns ``(cache, x)`` with no cache) and scalars the
    model adds up (an MoE block's loss): the first call returns the tuple with the output
    of the last block and the scalars added up over the blocks, each later call the tuple
    with its input and zero scalars (so a model adding them up gets the total once).
    Blocks that differ in static attributes in a repeating pattern (Gemma 3's local and
    global attention layers) are pipelined as groups of one period."""
    key = "the list of blocks"
    rows = _check_carry(x, plan, f"{type(blocks[0]).__name__}'s call")
    # Split with one tag for all (a tag is a static attribute), so that graph definitions
    # differ only where the blocks' own attributes do.
    tags = [getattr(b, _TAG) for b in blocks]
    try:
        for b in blocks:
            setattr(b, _TAG, tags[0])
        splits = [nnx.split(b) for b in blocks]
    finally:
        for b, tag in zip(blocks, tags, strict=True):
            setattr(b, _TAG, tag)
    graphdefs = [g for g, _ in splits]
    period = _period(_without_reads(blocks, tags[0]), len(blocks))
    if period == len(blocks) and len(blocks) > 1:
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}): the {len(blocks)} blocks of {key} differ in "
            "their static attributes (or structure) with no repeating pattern; pipelined "
            "blocks must be identical but for their values, or repeat a pattern of them."
        )
    # Block k's Variables (their types and read functions) stand for every k-th one's:
    # the blocks of one position in the pattern are identical but for their values.
    firsts = [splits[k][1] for k in range(period)]
    paths = [[(q, np.shape(v)) for q, v in jax.tree_util.tree_leaves_with_path(f)] for f in firsts]
    values: list[list[list[Any]]] = [[] for _ in range(period)]
    for i, (_, state) in enumerate(splits):
        found = jax.tree_util.tree_leaves_with_path(state)
        if [(q, np.shape(v)) for q, v in found] != paths[i % period]:
            raise PipelineError(
                f"{plan.preset}(stage={plan.stages}): block {i} of {key} differs from block "
                f"{i % period} in its variables (names or shapes); pipelined blocks must be "
                "identical but for their values."
            )
        values[i % period].append([v for _, v in found])
    weights = tuple(
        jax.tree.unflatten(
            jax.tree.structure(firsts[k]), [jnp.stack(vs) for vs in zip(*values[k], strict=True)]
        )
        for k in range(period)
    )
    split = _split_side((args, kwargs), rows)
    sides = _side_of(split)
    want = jax.tree.structure(x)
    shapes = [np.shape(a) for a in jax.tree.leaves(x)]

    def like_x(e: Any) -> bool:
        return jax.tree.structure(e) == want and [np.shape(a) for a in jax.tree.leaves(e)] == shapes

    def form_of(out: Any) -> tuple[str, ...] | None:
        """Each entry of a block's return: ``"out"``, ``"none"`` or ``"scalar"``."""
        if like_x(out):
            return None
        if not isinstance(out, tuple):
            return ("bad",)
        kinds = tuple(
            "none" if e is None
            else "out" if like_x(e)
            else "scalar" if all(not np.ndim(a) for a in jax.tree.leaves(e))
            else "bad"
            for e in out
        )  # fmt: skip
        return kinds if kinds.count("out") == 1 and "bad" not in kinds else ("bad",)

    def one(k: int, layer: Any, x: Any, side: Any) -> Any:
        a, kw = _join(split, side)
        with _layer_call(plan):
            return inner(nnx.merge(graphdefs[k], layer), x, *a, **kw)

    shape = jax.eval_shape(
        lambda w, x, s: one(0, w, x, s), jax.tree.map(lambda w: w[0], weights[0]), x, sides
    )
    form = form_of(shape)
    if form == ("bad",):
        raise PipelineError(
            f"{plan.preset}(stage={plan.stages}): {type(blocks[0]).__name__}'s call returns "
            f"{jax.tree.map(lambda a: a.shape, shape)} for an input of "
            f"{jax.tree.map(np.shape, x)}; a pipelined block returns what the next block "
            "takes, or a tuple of that, None entries and scalars the model adds up (an MoE loss)."
        )
    if form is None:

        def plain(layer: Any, x: Any, side: Any) -> Any:
            for k in range(period):
                x = one(k, layer[k], x, side)
            return x

        return plan.run(plain, weights, x, sides), None
    scalars = [e for e, kind in zip(shape, form, strict=True) if kind == "scalar"]
    zeros = tuple(jax.tree.map(lambda e: jnp.zeros(e.shape, e.dtype), e) for e in scalars)

    def layer_fn(layer: Any, carry: Any, side: Any) -> Any:
        x, acc = carry
        for k in range(period):
            out = one(k, layer[k], x, side)
            x = next(e for e, kind in zip(out, form, strict=True) if kind == "out")
            more = tuple(e for e, kind in zip(out, form, strict=True) if kind == "scalar")
            acc = jax.tree.map(jnp.add, acc, more)
        return x, acc

    y, total = plan.run(layer_fn, weights, (x, zeros), sides)

    def assemble(out: Any, sums: tuple[Any, ...]) -> tuple[Any, ...]:
        it = iter(sums)
        return tuple(out if k == "out" else None if k == "none" else next(it) for k in form)

    return assemble(y, total), (form, zeros, assemble)
