"""`Strategy`: what every preset is — a mesh, two layout policies, and the user-facing methods.

A preset sets the mesh and overrides the hooks of
:class:`strategies.hooks.PresetHooks`: :meth:`Strategy.variable_layout` (and
:meth:`Strategy.batch_layout` when the batch is not simply split on dimension
0 over ``batch_axes``); presets that keep variables somewhere other than
where they compute override :meth:`Strategy.storage_layout` and
:meth:`Strategy.compute_layout`; those that shape the compiled step itself
override :meth:`Strategy.trace_step`. tf.distribute's cross-replica methods
(``reduce``, ``gather``, datasets, ...) come from
:class:`strategies.surface.DistributeMethods`. The methods here are short:
``run`` and ``explain`` delegate to the step compiler (:mod:`strategies.step`),
``create`` to :mod:`strategies.placement.creation`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from flax import nnx

import dtensor
from dtensor import Mesh
from dtensor.core.rules import ResolvedLayout
from dtensor.core.tree import is_node
from strategies import context
from strategies.boundary import explicit_axes_error
from strategies.hooks import PresetHooks
from strategies.placement import creation
from strategies.reads.mixed_precision import MixedPrecision, check_mixed_precision
from strategies.step.compiler import StepCompiler
from strategies.surface import DistributeMethods

__all__ = ["Strategy"]


class Strategy(PresetHooks, DistributeMethods):
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
        if is_node(tree):
            self.observe(tree)
        return dtensor.distribute(tree, self.storage_layout_fn, mesh=self.mesh)

    def variable_layouts(self, tree: Any) -> tuple[Any, Any]:
        """The compute layouts and rule names this strategy gives every leaf of ``tree``."""
        if is_node(tree):
            self.observe(tree)
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
