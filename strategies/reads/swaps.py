"""Per-instance class swaps on the NNX objects merged inside a traced step.

Flax NNX has no hook that runs when a module is called, and its Variable
read hooks are deprecated. Inside a step the compiler merges *fresh* module
objects from the user's state; this module changes the class of some of
them (never the user's objects, never a class of Flax's) to a cached
subclass:

- :func:`read_through` gives a Variable a subclass whose ``get_value`` sends
  each read through a function (FSDP's gather, a mixed-precision cast);
- :func:`swap_call` gives a module a subclass whose ``__call__`` is
  rematerialised (``nnx.remat``) and/or lays an embedding lookup out like
  its batch-split inputs.

NNX records the runtime type in its graph definitions, and every subclass of
a graph node is registered as one, so the swapped types survive the user's
own ``nnx.value_and_grad``/``nnx.remat`` inside the step. :func:`strip`
turns swapped Variables back into their own types before anything leaves
the step.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.nnx import variablelib
from jax.sharding import PartitionSpec

__all__ = [
    "check_remat",
    "check_remat_classes",
    "read_through",
    "remat_policy",
    "READ",
    "strip",
    "swap_call",
    "take_read",
    "swap_entry",
    "swapped_base",
]

_READ = "dtensor_read"
READ = _READ  # the metadata key of a Variable's read function
_BASE = "_dtensor_base"


def swapped_base(cls: type) -> type:
    """The class a swapped class was made from (``cls`` itself when it was not swapped)."""
    return cls.__dict__.get(_BASE, cls)


# ---------------------------------------------------------------- Variables
@functools.cache
def _read_class(base: type) -> type:
    def get_value(self: Any, *, index: Any = variablelib.MISSING) -> Any:
        value = base.get_value(self)
        read = self._var_metadata.get(_READ)
        if read is not None:
            value = read(value)
        if index is variablelib.MISSING or index is ...:
            return value
        return value[index]

    return type(base.__name__, (base,), {"get_value": get_value, _BASE: base, "__slots__": ()})


def read_through(var: nnx.Variable, read: Callable[[Any], Any]) -> None:
    """Make every read of ``var`` (an object merged inside a trace) return ``read(value)``.

    Indexed reads (``var[i]``) index the result of ``read`` on the whole value.
    """
    base = swapped_base(type(var))
    var.__class__ = _read_class(base)
    var.set_metadata(_READ, read)


def take_read(var: nnx.Variable) -> Callable[[Any], Any] | None:
    """Remove ``var``'s read function from its metadata and return it (``None``: it had none)."""
    meta = var.get_metadata()
    if _READ not in meta:
        return None
    read = meta[_READ]
    var.set_metadata({k: v for k, v in meta.items() if k != _READ})
    return read


def strip(tree: Any) -> Any:
    """``tree`` with every swapped Variable back to its own class, its read function removed."""

    def one(var: Any) -> Any:
        if not isinstance(var, nnx.Variable) or _BASE not in type(var).__dict__:
            return var
        meta = {k: v for k, v in var.get_metadata().items() if k != _READ}
        new = var.replace(var.get_raw_value())
        new.__class__ = swapped_base(type(var))
        new.set_metadata(meta)
        return new

    return jax.tree.map(one, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


# ------------------------------------------------------------------ modules
_POLICIES = (
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
)


def remat_policy(policy: Any) -> Any:
    """A ``jax.checkpoint`` policy from ``remat_policy=``: a ``jax.checkpoint_policies`` name
    or callable, a per-tensor plan (:mod:`strategies.reads.remat_plan`: MaxText's policy
    names, ``"name=device|offload|remat,..."``, a mapping, a ``RematPolicy``), or ``None``.

    Examples:
        >>> import jax
        >>> from strategies.reads.swaps import remat_policy
        >>> remat_policy("dots_saveable") is jax.checkpoint_policies.dots_saveable
        True
        >>> remat_policy(None) is None, remat_policy("full") is None
        (True, True)
        >>> remat_policy("qkv_proj_offloaded").plan.offload
        ('query_proj', 'key_proj', 'value_proj')
    """
    from strategies.reads.remat_plan import RematPolicy, parse

    policy = parse(policy)
    if isinstance(policy, RematPolicy):
        return policy.jax_policy
    if policy is None:
        return None
    name = policy if isinstance(policy, str) else getattr(policy, "__qualname__", "")
    if "save_anything_except_these_names" in name:
        raise ValueError(
            "remat_policy='save_anything_except_these_names' is not supported: in this JAX it "
            "saves everything (a stub), and a gathered weight is also saved under an unnamed "
            "output, so excluding names cannot free it. Name what to save instead: "
            "jax.checkpoint_policies.save_only_these_names(...), 'dots_saveable', or None "
            "(save only the block's inputs)."
        )
    if callable(policy) and not isinstance(policy, str):
        return policy
    if isinstance(policy, str) and policy in _POLICIES:
        return getattr(jax.checkpoint_policies, policy)
    raise ValueError(
        f"remat_policy={policy!r} is not a checkpoint policy; valid names are {_POLICIES} "
        f"(JAX's), {tuple(_presets())} (MaxText's), 'name=device|offload|remat,...' (per "
        "tensor), a callable from jax.checkpoint_policies, or None to save only each block's "
        "inputs."
    )


def _presets() -> Any:
    from strategies.reads.remat_plan import PRESETS

    return PRESETS


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _embed_call(self: Any, inputs: Any, out_sharding: Any = None, **kw: Any) -> Any:
    """``nnx.Embed.__call__``, its lookup laid out like batch-split ``inputs`` (Explicit axes)."""
    if out_sharding is None and isinstance(inputs, jax.Array):
        spec = jax.typeof(inputs).sharding.spec
        if any(entry is not None for entry in spec):
            out_sharding = PartitionSpec(*spec, None)
    return nnx.Embed.__call__(self, inputs, out_sharding=out_sharding, **kw)


class _EmbedLookup(nnx.Embed):
    """Placed after an ``nnx.Embed`` subclass with its own ``__call__`` (Flax Gemma's
    ``ScaledEmbed``) in the swapped class's MRO, so its ``super().__call__`` is
    :func:`_embed_call`."""

    __call__ = _embed_call


def spec_entry(names: tuple[str, ...]) -> Any:
    """A ``PartitionSpec`` entry for mesh axes ``names``: ``None``, one name, or a tuple."""
    return None if not names else names[0] if len(names) == 1 else tuple(names)


def _batch_split(
    tree: Any, axes: tuple[str, ...], rows: int | None, sequence: tuple[str, ...] = ()
) -> Any:
    """``tree`` with each array of ``rows`` leading rows (rank >= 2) constrained to
    ``PartitionSpec(axes)`` along dimension 0 (and, rank >= 3, ``sequence`` along 1)."""
    if not axes or rows is None:
        return tree
    spec = PartitionSpec(spec_entry(axes))
    spec3 = PartitionSpec(spec_entry(axes), spec_entry(sequence)) if sequence else spec

    def one(x: Any) -> Any:
        if _is_array(x) and np.ndim(x) >= 2 and np.shape(x)[0] == rows:
            return jax.lax.with_sharding_constraint(x, spec3 if np.ndim(x) >= 3 else spec)
        return x

    return jax.tree.map(one, tree)


def _first_shape(module: Any) -> tuple[int, ...] | None:
    """The shape of the first Variable in ``module``'s graph (``None``: it has none)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            return tuple(np.shape(node.get_raw_value()))
    return None


def owns_variables(module: Any) -> bool:
    """Whether ``module``'s graph holds a Variable."""
    return _first_shape(module) is not None


@functools.cache
def _call_class(
    base: type,
    remat: bool,
    policy: Any,
    prevent_cse: bool,
    embed: bool,
    batch_axes: tuple[str, ...] = (),
    stacked: tuple[int, ...] | None = None,
    sequence_axes: tuple[str, ...] = (),
    layer_sequence_axes: tuple[str, ...] | None = None,
    tags: tuple[str | None, str | None] = (None, None),
) -> type:
    own = embed and base.__call__ is not nnx.Embed.__call__  # a subclass's own __call__
    inner = _embed_call if embed and not own else base.__call__
    bases = (base, _EmbedLookup) if own else (base,)
    if tags != (None, None):
        inner = _tagged(inner, *tags)

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not remat and batch_axes and stacked and not getattr(_local, "layer", False):
            return _layer_call(self, inner, stacked, batch_axes, sequence_axes, args, kwargs)
        if not remat or getattr(_local, "rematerialised", False):
            return inner(self, *args, **kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        first = next((x for x in leaves if _is_array(x) and np.ndim(x) >= 2), None)
        rows = None if first is None else int(np.shape(first)[0])
        # One layer of a stacked module (inside a scan): its first Variable lost the
        # leading (layer) dimension it had when the module was swapped.
        split = bool(stacked) and _first_shape(self) == stacked[1:]
        if split:
            leaves = list(_batch_split(leaves, batch_axes, rows, sequence_axes))
        arrays = [x for x in leaves if _is_array(x)]

        def body(module: Any, *arrays: Any) -> Any:
            it = iter(arrays)
            a, kw = jax.tree.unflatten(treedef, [next(it) if _is_array(x) else x for x in leaves])
            if not (split and layer_sequence_axes not in (None, sequence_axes)):
                return inner(module, *a, **kw)
            # Megatron's sequence parallelism: the kept input is split along the sequence, and
            # each sublayer (the layer's child modules, swapped by ``swap_entry``) takes its
            # input whole over the other axes, gathered where it starts (so recomputed too).
            saved = getattr(_local, "entry", None)
            _local.entry = (batch_axes, rows, layer_sequence_axes, sequence_axes)
            try:
                return inner(module, *a, **kw)
            finally:
                _local.entry = saved

        out = nnx.remat(body, prevent_cse=prevent_cse, policy=policy)(self, *arrays)
        if split:
            out = _batch_split(out, batch_axes, rows, sequence_axes)
        return out

    return type(base.__name__, bases, {"__call__": __call__, _BASE: base})


def _tagged(inner: Callable[..., Any], before: str | None, after: str | None) -> Any:
    """``inner`` with its first array argument named ``before`` and its array outputs named
    ``after`` (``checkpoint_name``: what a per-tensor ``remat_policy`` keeps or offloads)."""
    from jax.ad_checkpoint import checkpoint_name

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if before is not None:
            at = next((i for i, x in enumerate(args) if _is_array(x)), None)
            if at is not None:
                args = (*args[:at], checkpoint_name(args[at], before), *args[at + 1 :])
        out = inner(self, *args, **kwargs)
        if after is None:
            return out
        return jax.tree.map(lambda x: checkpoint_name(x, after) if _is_array(x) else x, out)

    return call


_local = threading.local()


def _layer_call(
    module: Any,
    inner: Callable[..., Any],
    stacked: tuple[int, ...],
    batch_axes: tuple[str, ...],
    sequence_axes: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """A call of a module swapped without remat: as the module's own, but where it is one
    layer of a stacked module (inside a scan) its batch-shaped inputs and outputs stay split
    over ``batch_axes`` (and the sequence over ``sequence_axes``), its own submodules left
    alone. Without it the scan's carry took the layout the embedding lookup left (a scanned
    Gemma 2B under FullyShardedStrategy without remat on v5e:4x4: each chip computed every
    layer for the whole batch, 24.4 GiB a chip kept for the backward pass)."""
    if _first_shape(module) != stacked[1:]:
        return inner(module, *args, **kwargs)
    leaves = jax.tree.leaves((args, kwargs))
    first = next((x for x in leaves if _is_array(x) and np.ndim(x) >= 2), None)
    rows = None if first is None else int(np.shape(first)[0])
    args, kwargs = _batch_split((args, kwargs), batch_axes, rows, sequence_axes)
    saved = getattr(_local, "layer", False)
    _local.layer = True  # its submodules (sliced too) are not layers of their own
    try:
        out = inner(module, *args, **kwargs)
    finally:
        _local.layer = saved
    return _batch_split(out, batch_axes, rows, sequence_axes)


@functools.cache
def _entry_class(base: type) -> type:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        entry = getattr(_local, "entry", None)
        if entry is None:
            return base.__call__(self, *args, **kwargs)
        batch_axes, rows, axes, split = entry
        args, kwargs = _batch_split((args, kwargs), batch_axes, rows, axes)
        _local.entry = None  # its own children take what it gives them
        try:
            out = base.__call__(self, *args, **kwargs)
        finally:
            _local.entry = entry
        return _sequence_scatter(out, batch_axes, rows, axes, split)

    return type(base.__name__, (base,), {"__call__": __call__, _BASE: base})


def _sequence_scatter(
    tree: Any,
    batch_axes: tuple[str, ...],
    rows: int,
    whole: tuple[str, ...],
    split: tuple[str, ...],
) -> Any:
    """``tree``'s batch-shaped arrays (rank >= 3) split along the sequence over ``split`` (the
    row-parallel matmul's partial sums reduce-scattered), their cotangents whole over
    ``whole`` (gathered), as Megatron's sequence parallelism: a plain constraint would give
    its cotangent the split too, and XLA then gathered the weights over ``tensor`` in the
    backward pass instead of the cotangent."""
    to_split = PartitionSpec(spec_entry(batch_axes), spec_entry(split))
    to_whole = PartitionSpec(spec_entry(batch_axes), spec_entry(whole))

    @jax.custom_vjp
    def scatter(x: Any) -> Any:
        return jax.lax.with_sharding_constraint(x, to_split)

    def forward(x: Any) -> tuple[Any, None]:
        return scatter(x), None

    def backward(_: None, ct: Any) -> tuple[Any]:
        return (jax.lax.with_sharding_constraint(ct, to_whole),)

    scatter.defvjp(forward, backward)

    def one(x: Any) -> Any:
        if _is_array(x) and np.ndim(x) >= 3 and np.shape(x)[0] == rows:
            return scatter(x)
        return x

    return jax.tree.map(one, tree)


def swap_entry(module: nnx.Module) -> None:
    """Give ``module`` (a child of a swapped layer with ``layer_sequence_axes``) a cached
    subclass whose calls, inside such a layer of a scanned stack, constrain their batch-shaped
    inputs (rank >= 3) to the layer's batch split, the sequence split over only
    ``layer_sequence_axes``: the sublayer computes on the sequence gathered over the other
    ``sequence_axes`` (``tensor``), as Megatron's sequence parallelism gathers it before each
    column-parallel matmul, and its outputs are split again (reduce-scattered; in the
    backward pass their cotangents gathered). Left to XLA, the sequence stayed split and
    each weight was gathered over ``tensor`` instead (llama2-70b, tensor=4 on v5p:4x4x4:
    every MLP kernel whole on each chip, bf16[8192, 28672])."""
    module.__class__ = _entry_class(swapped_base(type(module)))


@contextlib.contextmanager
def already_rematerialised() -> Iterator[None]:
    """Within the block (a trace), calls of swapped modules skip their own ``nnx.remat``:
    the caller recomputes the whole computation already (a pipeline's tick)."""
    saved = getattr(_local, "rematerialised", False)
    _local.rematerialised = True
    try:
        yield
    finally:
        _local.rematerialised = saved


def swap_call(
    module: nnx.Module,
    *,
    remat: bool,
    policy: Any = None,
    prevent_cse: bool = True,
    embed: bool = False,
    batch_axes: tuple[str, ...] = (),
    sequence_axes: tuple[str, ...] = (),
    layer_sequence_axes: tuple[str, ...] | None = None,
    tags: tuple[str | None, str | None] = (None, None),
) -> None:
    """Give ``module`` (an object merged inside a trace) a cached subclass with a wrapped ``__call__``.

    ``remat``: its calls are recomputed in the backward pass (``nnx.remat``
    with ``policy``), so what they read — gathered weights — is not kept.
    ``embed``: an ``nnx.Embed`` lookup takes the layout of batch-split inputs.
    ``batch_axes``: where ``module`` is a stack of layers run one layer at a
    time (``nnx.scan``), each layer's array inputs and outputs shaped like the
    batch (the first one's leading dimension, rank 2 or more) stay split along
    dimension 0 over these mesh axes (a sharding constraint; Auto axes). Calls
    of the whole module (unrolled layers) are left to XLA: there the
    constraint made it gather weights rather than move activations (unrolled
    7b, v5e:4x4: all-gathers 75 -> 229 GiB per chip). ``sequence_axes``: those
    inputs and outputs of rank 3 or more also split along dimension 1 (the
    sequence) over these axes, so the layer inputs kept for the backward pass
    are not copied on each of them (Megatron's sequence parallelism).
    ``layer_sequence_axes``: the axes of ``sequence_axes`` the layer's own
    computation keeps the sequence split over; its sublayers swapped by
    :func:`swap_entry` gather the rest (``None``: keeps all).
    ``tags``: ``checkpoint_name``\\ s given to the call's first array input and its array
    outputs (a per-tensor ``remat_policy`` naming a module class's input or output).
    """
    base = swapped_base(type(module))
    stacked = _first_shape(module) if batch_axes else None
    module.__class__ = _call_class(
        base,
        remat,
        policy,
        prevent_cse,
        embed,
        tuple(batch_axes),
        stacked,
        tuple(sequence_axes),
        None if layer_sequence_axes is None else tuple(layer_sequence_axes),
        tuple(tags),
    )


def check_remat_classes(remat: Iterable[type], nodes: Any) -> None:
    """Raise if a class named in ``remat=`` occurs nowhere in ``nodes``."""
    present = {swapped_base(type(node)) for _, node in nnx.iter_graph(nodes)}
    for cls in remat:
        if not any(issubclass(p, cls) for p in present if isinstance(p, type)):
            names = sorted({p.__name__ for p in present if issubclass(p, nnx.Module)})
            raise ValueError(
                f"remat=({cls.__name__}, ...) names a module class the step's models never "
                f"contain; their module classes are {names}. Name one of those (the class of "
                "each block to recompute), or drop it from remat=."
            )


def check_remat(remat: Any) -> tuple[type, ...]:
    """``remat=`` as given to a preset, checked: ``None`` or module classes, as a tuple."""
    if remat is None:
        return ()
    items = (remat,) if isinstance(remat, type) else tuple(remat)
    for cls in items:
        if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
            raise TypeError(
                f"remat={remat!r} holds {cls!r}, which is not a Flax NNX module class; valid is "
                "a tuple of nnx.Module subclasses whose calls are recomputed in the backward "
                "pass (e.g. remat=(Block,)). Pass the classes themselves, not instances."
            )
    return items
