"""`FullyShardedStrategy`: ZeRO-3 / FSDP — every large variable split over all devices."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import dtensor
from dtensor import Layout
from strategies.fsdp_ops import explicit_region, gather_for_compute, matmul_only_reads, tag_read

from .base import Strategy, _value, _var_or_layout

__all__ = ["FullyShardedStrategy", "shard_largest_dim"]


def shard_largest_dim(specs: list[Any], shape: Sequence[int], axis: str, size: int) -> list[Any]:
    """Put ``axis`` (of ``size``) on the largest still-unsharded dimension it divides.

    Ties go to the earlier dimension; ``specs`` is returned unchanged when no
    dimension divides.

    Examples:
        >>> from strategies.fsdp import shard_largest_dim
        >>> shard_largest_dim([None, None], (6, 16), "fsdp", 8)
        [None, 'fsdp']
        >>> shard_largest_dim([None], (6,), "fsdp", 8)
        [None]
    """
    candidates = [
        d
        for d in range(len(shape))
        if specs[d] is None and shape[d] % size == 0 and shape[d] >= size
    ]
    if not candidates or size <= 1:
        return specs
    best = max(candidates, key=lambda d: (shape[d], -d))
    out = list(specs)
    out[best] = axis
    return out


def nbytes(leaf: Any) -> int:
    """The bytes of an array (or abstract array) leaf."""
    value = _value(leaf)
    return math.prod(np.shape(value)) * np.dtype(value.dtype).itemsize


class FullyShardedStrategy(Strategy):
    """Each variable (and its optimizer state) split on its largest divisible dimension.

    Variables smaller than ``min_shard_bytes`` stay replicated. The batch is
    split over the same ``fsdp`` axis. In a step on Flax NNX modules each
    read of a sharded variable is all-gathered for compute (activations stay
    split by batch) and its gradient is reduce-scattered, whatever XLA's own
    propagation would pick: the step is traced with the ``fsdp`` axis
    Explicit and every such read goes through
    :func:`strategies.fsdp_ops.gather_for_compute`. Pass
    ``gather_at_read=False`` to leave the plan to XLA (it then all-reduces
    full-size gradients, or gathers activations for small batches). Steps on
    plain pytrees (Linen, pure JAX) always leave it to XLA: their parameter
    reads cannot be intercepted.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.FullyShardedStrategy(min_shard_bytes=1024)
        >>> s.variable_layout("dense/kernel", jnp.zeros((64, 256)))
        Layout([UNSHARDED, 'fsdp'], mesh=Mesh(fsdp=8))
        >>> s.variable_layout("dense/bias", jnp.zeros((64,))).is_fully_replicated()
        True
    """

    name = "fully_sharded"
    shards_variables = True

    def __init__(
        self,
        devices: Sequence[Any] | None = None,
        *,
        min_shard_bytes: int = 16 << 10,
        gather_at_read: bool = True,
    ) -> None:
        if min_shard_bytes < 0:
            raise ValueError(
                f"min_shard_bytes={min_shard_bytes} is negative; use 0 to shard every variable."
            )
        self.min_shard_bytes = min_shard_bytes
        self.gather_at_read = gather_at_read
        devices = list(devices) if devices is not None else jax.devices()
        super().__init__(
            dtensor.create_mesh([("fsdp", len(devices))], devices=devices), batch_axes=("fsdp",)
        )

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        shape = np.shape(_value(leaf))
        specs: list[Any] = [None] * len(shape)
        if nbytes(leaf) >= self.min_shard_bytes:
            specs = shard_largest_dim(specs, shape, "fsdp", self.mesh.shape["fsdp"])
        return Layout(specs, self.mesh)

    def _trace_step(
        self,
        call: Callable[[Any, list[Any]], Any],
        state: Any,
        arrays: list[Any],
        layouts: Any,
        shardings: list[Any],
    ) -> Any:
        specs = self._explicit_specs(state, layouts, shardings) if self.gather_at_read else None
        if specs is None:
            return call(state, arrays)
        axes = self.batch_axes
        with (
            warnings.catch_warnings(),
            jax.sharding.use_abstract_mesh(self.mesh.jax_mesh.abstract_mesh),
        ):
            warnings.filterwarnings("ignore", message="Variable hooks are deprecated")
            # Probe: which reads feed matmuls only (those can be gathered `reduced`).
            probe = _with_hooks(call, layouts, axes, lambda key, value, spec: tag_read(value, key))
            matmul_only = matmul_only_reads(jax.make_jaxpr(probe)(state, arrays))

            def gather(key: int, value: Any, spec: PartitionSpec) -> Any:
                return gather_for_compute(value, spec, axes, reduced=matmul_only.get(key, False))

            try:
                with _embed_lookups_follow_batch():
                    return explicit_region(_with_hooks(call, layouts, axes, gather), axes, specs)(
                        state, arrays
                    )
            except Exception as err:  # noqa: BLE001 - user code that Explicit axes reject: XLA's plan
                _log.info(
                    "FullyShardedStrategy: gather-at-read plan failed (%s); leaving it to XLA.", err
                )
        return call(state, arrays)

    def _explicit_specs(self, state: Any, layouts: Any, shardings: list[Any]) -> Any:
        """Partition specs of the step's inputs, or ``None`` where the gather-at-read plan does not apply.

        It applies to steps on NNX modules whose array arguments are batches
        (split on dimension 0 over the batch axes) or replicated.
        """
        if state is None:
            return None
        array_specs = []
        for sharding in shardings:
            if not isinstance(sharding, NamedSharding) or sharding.mesh != self.mesh.jax_mesh:
                return None
            spec = tuple(sharding.spec)
            if any(entry is not None for entry in spec[1:]) or (
                spec and spec[0] not in (None, *self.batch_axes)
            ):
                return None
            array_specs.append(sharding.spec)
        found = jax.tree.leaves(
            jax.tree.map(
                lambda _, lay: isinstance(lay, Layout), state, layouts, is_leaf=_var_or_layout
            )
        )
        if not all(found):
            return None
        state_specs = jax.tree.map(
            lambda _, lay: lay.partition_spec, state, layouts, is_leaf=_var_or_layout
        )
        return state_specs, array_specs


_HOOK = "on_get_value"
_log = logging.getLogger(__name__)
_EMBED_CALL = nnx.Embed.__call__


def _embed_call(self: nnx.Embed, inputs: Any, out_sharding: Any = None) -> Any:
    """``nnx.Embed.__call__``, its lookup laid out like a batch-split ``inputs`` (Explicit axes)."""
    if out_sharding is None and isinstance(inputs, jax.Array):
        spec = jax.typeof(inputs).sharding.spec
        if any(entry is not None for entry in spec):
            out_sharding = PartitionSpec(*spec, None)
    return _EMBED_CALL(self, inputs, out_sharding=out_sharding)


@contextlib.contextmanager
def _embed_lookups_follow_batch() -> Iterator[None]:
    """Let Flax's ``nnx.Embed`` run on Explicit axes while the step is traced.

    On Explicit axes ``jnp.take`` of a table with batch-split token ids needs an
    ``out_sharding``, which ``nnx.Embed`` accepts but a user's model does not
    pass; this supplies the batch's own layout. Inputs on Auto axes (anyone
    else's trace meanwhile) carry no sharding in their type: for them nothing
    changes.
    """
    nnx.Embed.__call__ = _embed_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        nnx.Embed.__call__ = _EMBED_CALL  # type: ignore[method-assign]


def _with_hooks(
    call: Callable[[Any, list[Any]], Any],
    layouts: Any,
    axes: tuple[str, ...],
    gather: Callable[[int, Any, PartitionSpec], Any],
) -> Callable[[Any, list[Any]], Any]:
    """``call`` with every variable split over ``axes`` read through ``gather(key, value, spec)``.

    The read hooks live only inside the traced step: they are removed from
    the variables (and any returned ones) before they leave it.
    """

    def step(state: Any, arrays: list[Any]) -> Any:
        counter = iter(range(1 << 62))
        state = jax.tree.map(
            lambda var, lay: _attach(var, lay, next(counter), axes, gather),
            state,
            layouts,
            is_leaf=_var_or_layout,
        )
        new_state, out = call(state, arrays)
        return _without_hook(new_state), _without_hook(out)

    return step


def _attach(
    var: Any,
    layout: Any,
    key: int,
    axes: tuple[str, ...],
    gather: Callable[[int, Any, PartitionSpec], Any],
) -> Any:
    if not isinstance(var, nnx.Variable) or not isinstance(layout, Layout):
        return var
    if not any(a in axes for d in range(layout.rank) for a in layout.axes(d)):
        return var
    spec = layout.partition_spec
    shape = np.shape(var.get_raw_value())

    def hook(_: Any, value: Any) -> Any:
        if np.shape(value) != shape:  # an indexed read (var[i]): leave it to XLA
            return value
        return gather(key, value, spec)

    var = var.replace(var.get_raw_value())
    var.set_metadata(_HOOK, hook)
    return var


def _without_hook(tree: Any) -> Any:
    def strip(var: Any) -> Any:
        if isinstance(var, nnx.Variable) and _HOOK in var.get_metadata():
            meta = {k: v for k, v in var.get_metadata().items() if k != _HOOK}
            var = var.replace(var.get_raw_value())
            var.set_metadata(meta)
        return var

    return jax.tree.map(strip, tree, is_leaf=lambda v: isinstance(v, nnx.Variable))
