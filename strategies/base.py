"""`Strategy`: what every preset is — a mesh, two layout policies, and the user-facing methods.

A preset sets the mesh and overrides :meth:`Strategy.variable_layout` (and
:meth:`Strategy.batch_layout` when the batch is not simply split on dimension
0 over ``batch_axes``). Presets that keep variables somewhere other than
where they compute override :meth:`Strategy.storage_layout` and
:meth:`Strategy.compute_layout`; those that shape the compiled step itself
override :meth:`Strategy.trace_step`. The methods below are short: ``run``
and ``explain`` delegate to the step compiler (:mod:`strategies.step`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

import dtensor
from dtensor import Layout, Mesh, ReduceOp
from dtensor.core.rules import ResolvedLayout, flax_annotation
from dtensor.core.tree import is_node, leaf_value
from strategies import context, datasets, tf_compat
from strategies.boundary import explicit_axes_error
from strategies.placement import creation
from strategies.reads.mixed_precision import MixedPrecision, check_mixed_precision
from strategies.reads.param_reads import ReadOptions, trace_reads
from strategies.replica import cross_replica
from strategies.replica.values import InputContext, ValueContext
from strategies.step.compiler import StepCompiler

__all__ = ["Strategy"]


class Strategy:
    """The base of every preset: a mesh, a variable policy and a batch policy.

    Args:
        mesh: the mesh.
        batch_axes: the mesh axes the batch is split over (the replicas).
        honor_annotations: whether Flax partitioning annotations on a model
            decide its variables' layouts (presets that shard by rules do).
        max_steps_in_flight: how many ``run`` calls may be queued before the
            oldest is waited on (bounds XLA's queue; ``None``: no bound).
        mixed_precision: a :class:`strategies.MixedPrecision` (every preset
            takes it): floating ``nnx.Param`` reads cast to its
            ``param_dtype`` inside NNX steps, variables kept in their dtype.
    """

    name: str = "strategy"
    #: whether the preset means to split variables (explain warns otherwise)
    shards_variables: bool = False
    #: explicit cross-device ops (None: XLA's all-reduce of the global step)
    gradient_reduction: Any = None

    def __init__(
        self,
        mesh: Mesh,
        *,
        batch_axes: tuple[str, ...],
        honor_annotations: bool = False,
        max_steps_in_flight: int | None = 8,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        self.mixed_precision = check_mixed_precision(mixed_precision)
        self._mesh = mesh
        self.batch_axes = tuple(batch_axes)
        self.honor_annotations = honor_annotations
        self.max_steps_in_flight = max_steps_in_flight
        self._steps = StepCompiler(self)

    # ----------------------------------------------------------------- basics
    @property
    def mesh(self) -> Mesh:
        """The strategy's :class:`dtensor.Mesh`."""
        return self._mesh

    @property
    def num_replicas_in_sync(self) -> int:
        """How many data-parallel replicas a global batch is split over."""
        return self.mesh.axis_size(self.batch_axes)

    # ------------------------------------------------- tf.distribute surface
    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's replicas' values as a tuple; a plain value gives ``(value,)``.

        See :func:`strategies.tf_compat.local_results`.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> out = s.run(lambda x: x.sum(), args=(np.ones((16, 2), "f4"),), per_replica=True)
            >>> [float(v) for v in s.experimental_local_results(out)]
            [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]
        """
        return tf_compat.local_results(value)

    @functools.cached_property
    def extended(self) -> tf_compat.StrategyExtended:
        """tf.distribute's ``strategy.extended``: devices, checkpoint/summary roles,
        ``variable_created_in_scope`` (see :class:`strategies.tf_compat.StrategyExtended`)."""
        return tf_compat.StrategyExtended(self)

    @property
    def cluster_resolver(self) -> tf_compat.ClusterResolver | None:
        """This process's place in a multi-process job, or ``None`` for one process
        (see :class:`strategies.tf_compat.ClusterResolver`)."""
        return tf_compat.cluster_resolver()

    # --------------------------------------------------------------- policies
    def variable_layout(self, path: str, leaf: Any) -> Layout:
        """The layout of one variable (parameter or optimizer state); replicated here."""
        return Layout.replicated(self.mesh, np.ndim(leaf_value(leaf)))

    def batch_layout(self, rank: int) -> Layout:
        """The layout of a rank-``rank`` batch array: dimension 0 split over the replicas."""
        if rank == 0 or not self.batch_axes:
            return Layout.replicated(self.mesh, rank)
        axes = self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes
        return Layout.batch_sharded(self.mesh, axes, rank)

    def storage_layout(self, path: str, leaf: Any) -> Layout:
        """Where a variable is kept between steps (the compute layout, unless a preset says otherwise)."""
        return self.variable_layout(path, leaf)

    def memory_kind(self, path: str, leaf: Any) -> str | None:
        """The memory a variable is kept in between steps (``None``: device memory)."""
        return None

    def compute_layout(self, storage: Layout) -> Layout:
        """Where a variable stored in ``storage`` is computed on (the same, unless a preset says otherwise)."""
        return storage

    def rule_name(self, path: str, leaf: Any) -> str | None:
        """A short description of the rule behind a variable's layout (for reports)."""
        return self.name

    def storage_layout_fn(self, path: str, leaf: Any) -> ResolvedLayout:
        """The storage layout of one variable and the rule that chose it (annotations first)."""
        ann = flax_annotation(leaf) if self.honor_annotations else None
        if ann is not None:
            layout = Layout(list(ann), self.mesh)
            layout.check_shape(np.shape(leaf_value(leaf)), path)
            return ResolvedLayout(layout, "flax annotation")
        return ResolvedLayout(self.storage_layout(path, leaf), self.rule_name(path, leaf))

    def layout_findings(self, path: str, leaf: Any) -> list[tuple[str, str]]:
        """``(kind, message)`` warnings about one variable's layout for :meth:`explain` (none here).

        A hook for presets whose rules can fall back silently (a Megatron rule
        on a dimension the tensor-parallel size does not divide).
        """
        return []

    def adopt(self, x: jax.Array, mesh: Mesh) -> jax.Array | None:
        """A ``run`` argument laid out on another mesh that this preset knows how to move (``None``: it does not)."""
        return None

    def trace_step(
        self,
        call: Callable[..., Any],
        state: Any,
        arrays: list[Any],
        layouts: Any,
        shardings: list[Any],
    ) -> Any:
        """Trace one global-mode step: ``call(state, arrays) -> (new_state, out)``.

        ``layouts`` are the variables' (``None`` without NNX nodes), ``shardings``
        the array arguments' input shardings. ``call`` also takes ``prepare=``,
        a function given the NNX objects merged inside the trace (to swap
        their classes, :mod:`strategies.reads.swaps`). The default shapes parameter
        reads and module calls by :meth:`read_options`
        (:func:`strategies.reads.param_reads.trace_reads`).
        """
        return trace_reads(call, state, arrays, layouts, shardings, self.mesh, self.read_options())

    def read_options(self) -> ReadOptions:
        """How this preset shapes parameter reads and module calls inside a step."""
        return ReadOptions(axes=self.batch_axes, mixed_precision=self.mixed_precision)

    def after_step(self, result: Any) -> None:
        """Called with each ``run``'s result once it is dispatched (a hook for watchdogs)."""

    def activation_bytes_min(self, state: Any, rules: Any, batch: list[Any]) -> float:
        """Bytes per device of activations the layouts must move in one step (0: none)."""
        return 0.0

    def ideal_peak_bytes(self, terms: Any) -> int:
        """The ideal peak bytes per device of a step (``Report.ideal_peak_bytes_per_device``).

        ``terms`` is a :class:`dtensor.analysis.peak.PeakTerms`. The default is
        the ZeRO formula of :func:`dtensor.analysis.peak.ideal_peak_bytes`:
        state and gradients in this preset's layouts, the two largest
        gathered variables at the dtype this preset gathers them in
        (``mixed_precision.param_dtype`` when set), activations as remat
        leaves them, and the batch.
        """
        from dtensor.analysis.peak import ideal_peak_bytes
        from strategies.step.memory_advice import gather_itemsize_ratio

        return ideal_peak_bytes(terms, gather_itemsize_ratio=gather_itemsize_ratio(self))

    def memory_advice(self) -> str:
        """What would help a step that does not fit, given this preset and its options."""
        from strategies.step.memory_advice import memory_advice

        return memory_advice(self)

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Make this the current strategy: its mesh is the default, and Flax NNX
        models and optimizers built inside come out laid out by its policies.

        Examples:
            >>> import strategies, dtensor
            >>> from flax import nnx
            >>> s = strategies.FullyShardedStrategy(min_shard_bytes=0)
            >>> with s.scope():
            ...     layer = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
            >>> dtensor.fetch_layout(layer.kernel.get_value())
            Layout(['fsdp', UNSHARDED], mesh=Mesh(fsdp=8))
        """
        with context.entered(self), self.mesh, creation.placing(self):
            yield self

    # --------------------------------------------------------------- variables
    def distribute_variables(self, tree: Any) -> Any:
        """Place a pytree of variables (or an NNX module/optimizer, in place) by the policy.

        Examples:
            >>> import strategies, dtensor, jax.numpy as jnp
            >>> s = strategies.MirroredStrategy()
            >>> params = s.distribute_variables({"w": jnp.ones((4, 4))})
            >>> dtensor.fetch_layout(params["w"]).is_fully_replicated()
            True
        """
        return dtensor.distribute(tree, self.storage_layout_fn, mesh=self.mesh)

    def variable_layouts(self, tree: Any) -> tuple[Any, Any]:
        """The compute layouts and rule names this strategy gives every leaf of ``tree``."""
        if is_node(tree):
            tree = nnx.state(tree)

        def resolved(path: str, leaf: Any) -> ResolvedLayout:
            stored = self.storage_layout_fn(path, leaf)
            return ResolvedLayout(self.compute_layout(stored.layout), stored.rule)

        return dtensor.resolve_layouts(tree, resolved, mesh=self.mesh)

    def create(self, factory: Callable[[], Any]) -> Any:
        """Build an NNX model (or any pytree) directly in this strategy's layouts.

        The factory runs abstractly first (``nnx.eval_shape``) to learn the
        variables, then under ``jax.jit`` with ``out_shardings`` from the
        policies, so no variable is ever materialised whole on one device.

        Examples:
            >>> import strategies, dtensor
            >>> from flax import nnx
            >>> s = strategies.FullyShardedStrategy(min_shard_bytes=0)
            >>> layer = s.create(lambda: nnx.Linear(32, 16, rngs=nnx.Rngs(0)))
            >>> dtensor.fetch_layout(layer.kernel.get_value()).sharding_specs
            ('fsdp', 'unsharded')
        """
        try:
            return creation.build_in_layouts(self, factory)
        except ValueError as err:  # JAX's, from the factory (a layer run at init, say)
            ours = explicit_axes_error(err, self, "create()")
            if ours is None:
                raise
            raise ours from None

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        per_replica: bool = False,
        cache_graph: bool = False,
        donate_argnums: int | Sequence[int] = (),
    ) -> Any:
        """Run single-device code on the global batch, compiled for this strategy.

        ``fn`` is an ordinary step: an NNX step that mutates its model and
        optimizer in place, or a pure function of ``(params, opt_state,
        batch)``. NNX modules and optimizers among the arguments are laid out
        by the variable policy (and their buffers donated); host arrays get the
        batch layout; arrays already on this mesh keep theirs. One compile per
        input signature.

        With ``per_replica=True`` the code runs once per replica on its slice of
        the batch (``jax.shard_map``), tf.distribute style: inside,
        :func:`get_replica_context` gives ``replica_id_in_sync_group`` and
        ``all_reduce``; outputs come back as :class:`PerReplica` values.

        With ``cache_graph=True`` the NNX graph of the model and optimizer
        arguments is walked once and remembered (as ``nnx.cached_partial``
        does), so a step costs no Python traversal; their structure must then
        not change between calls (replacing a submodule, say).

        Args:
            fn: the step, called as ``fn(*args, **kwargs)``.
            args: its positional arguments: NNX modules and optimizers, pytrees
                of arrays (parameters, optimizer state, the batch), and other
                values (static: part of the compile key).
            kwargs: its keyword arguments, sorted the same way.
            per_replica: run once per replica on its slice of the batch.
            cache_graph: remember the NNX graph of the model arguments.
            donate_argnums: positions in ``args`` whose arrays are donated, as
                ``jax.jit(fn, donate_argnums=...)`` donates them: the step
                may write its outputs into their buffers (a functional step's
                new parameters and optimizer state into the old ones, so the
                program does not hold both), and afterwards the caller's
                donated ``jax.Array`` s are deleted. Donation applies to arrays
                already on this strategy's mesh (the outputs of a previous
                ``run``, or :meth:`distribute_variables`); host (numpy) arrays
                and arrays elsewhere are copied onto the mesh first and the
                copy is donated, the caller's stay valid. NNX modules and
                optimizers are donated always (naming them changes nothing).

        Examples:
            >>> import strategies, numpy as np, jax.numpy as jnp
            >>> s = strategies.MirroredStrategy()
            >>> float(s.run(lambda x: jnp.mean(x ** 2), args=(np.ones((16, 4)),)))
            1.0

            A functional step that donates its parameters and optimizer state:

            >>> import jax, optax
            >>> tx = optax.sgd(0.1)
            >>> def step(w, opt_state, x):
            ...     loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(w)
            ...     updates, opt_state = tx.update(g, opt_state, w)
            ...     return optax.apply_updates(w, updates), opt_state, loss
            >>> w = s.distribute_variables(jnp.ones((4, 2)))
            >>> opt_state = s.distribute_variables(tx.init(w))
            >>> x = np.ones((16, 4), "f4")
            >>> w2, opt_state, loss = s.run(step, args=(w, opt_state, x), donate_argnums=(0, 1))
            >>> w.is_deleted(), float(loss)
            (True, 16.0)
        """
        return self._steps.run(
            fn,
            args,
            kwargs,
            per_replica=per_replica,
            cache_graph=cache_graph,
            donate_argnums=donate_argnums,
        )

    # --------------------------------------------------------------- explain
    def explain(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        donate_argnums: int | Sequence[int] = (),
    ) -> Any:
        """The :func:`dtensor.explain` report of what :meth:`run` compiles for these arguments.

        Arguments may be abstract (``jax.ShapeDtypeStruct`` trees, or models
        from ``nnx.eval_shape``); nothing runs. ``donate_argnums`` is
        :meth:`run`'s: pass the same to see the program ``run`` compiles,
        with the donated arguments' buffers reused for the outputs
        (``Report.alias_bytes_per_device``, a lower
        ``peak_bytes_per_device``). Nothing is donated or deleted here.

        In a functional step (``step(params, opt_state, batch)``, no NNX
        modules) the donated arguments are the report's variables, named by
        the step's parameters (``params/...``, ``opt_state/...``; those under
        ``opt_state`` receive no gradient), which gives the minimum
        communication and the ideal peak; without donation the report has no
        variables. Abstract Linen/optax state in its layouts comes from
        ``distribute_variables(jax.eval_shape(...))``.
        """
        return self._steps.explain(fn, args, kwargs, donate_argnums=donate_argnums)

    # ---------------------------------------------------------- reduce/gather
    def reduce(self, op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce a value across replicas (and along ``axis`` of each replica's value).

        A :class:`PerReplica` value (from ``run(..., per_replica=True)``) is
        combined over its replicas; a global array is already one value, so
        ``axis`` reduces along that dimension of the global array (the batch
        dimension spans all replicas).

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group))
            >>> float(s.reduce("sum", x)), float(s.reduce("max", x))
            (28.0, 7.0)
        """
        return cross_replica.reduce(op, value, axis)

    def gather(self, value: Any, axis: int = 0) -> Any:
        """All replicas' values concatenated along ``axis``, whole on every device.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.full((2,), ctx.replica_id_in_sync_group))
            >>> s.gather(x, axis=0).tolist()
            [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
        """

        return cross_replica.gather(self.mesh, value, axis)

    # ---------------------------------------------------------------- values
    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Call ``value_fn`` once per replica and hold the results as :class:`PerReplica` values."""
        return cross_replica.values_from_function(self, value_fn)

    # --------------------------------------------------------------- datasets
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], *, pad: bool = False, prefetch: int = 2
    ) -> dtensor.DTensorDataset:
        """Each element (a pytree of host arrays: the *global* batch) as global arrays in the batch layout.

        With ``pad=True`` a batch whose rows do not divide over the replicas is
        padded and each element becomes ``(batch, weights)``: per-row weights
        (1 real, 0 padding) that keep means exact.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> batches = [{"x": np.ones((16, 3))}] * 2
            >>> [b["x"].shape for b in s.experimental_distribute_dataset(batches)]
            [(16, 3), (16, 3)]
        """
        return datasets.distribute_dataset(self, dataset, pad=pad, prefetch=prefetch)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        *,
        pad: bool = False,
        prefetch: int = 2,
    ) -> dtensor.DTensorDataset:
        """``dataset_fn(InputContext)`` gives this process's share; shares are stitched into global arrays."""
        return datasets.datasets_from_function(self, dataset_fn, pad=pad, prefetch=prefetch)

    def input_context(self) -> InputContext:
        """This process's :class:`InputContext`."""
        return datasets.input_context(self)

    # ---------------------------------------------------------------- reports
    def describe(self, tree: Any = None) -> str:
        """The mesh, and (given a model or pytree) the layout of each variable, as text."""
        from dtensor.core.text import layouts_table, render

        parts = [repr(self)]
        if tree is not None:
            parts.append(render(layouts_table(tree, *self.variable_layouts(tree), width=110)))
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh!r}, replicas={self.num_replicas_in_sync})"
