"""`Strategy`: the generic machinery every preset shares.

A preset is a :class:`dtensor.Mesh` plus two policies:
``variable_layout(path, leaf)`` and ``batch_layout(rank)``. Everything else —
scope, run, reduce, gather, datasets — is written once, here.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import dtensor
from dtensor import Layout, LayoutError, Mesh, ReduceOp
from dtensor.core.rules import ResolvedLayout

from . import _creation
from .values import InputContext, PerReplica, ReplicaContext, ValueContext

__all__ = ["Strategy", "get_strategy", "get_replica_context", "in_cross_replica_context"]

_state = threading.local()


def _strategy_stack() -> list[Strategy]:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def get_strategy() -> Strategy:
    """The strategy whose ``scope()`` is active, else a default one-device strategy.

    Examples:
        >>> import strategies
        >>> s = strategies.MirroredStrategy()
        >>> with s.scope():
        ...     strategies.get_strategy() is s
        True
        >>> type(strategies.get_strategy()).__name__
        'OneDeviceStrategy'
    """
    stack = _strategy_stack()
    if stack:
        return stack[-1]
    if not hasattr(_state, "default"):
        from .one_device import OneDeviceStrategy

        _state.default = OneDeviceStrategy()
    return _state.default


def get_replica_context() -> ReplicaContext | None:
    """The replica context inside a per-replica ``run``; ``None`` elsewhere."""
    return getattr(_state, "replica_context", None)


def in_cross_replica_context() -> bool:
    """Whether code runs outside any per-replica ``run`` (tf.distribute's name)."""
    return get_replica_context() is None


def _is_node(x: Any) -> bool:
    return isinstance(x, nnx.Module | nnx.Optimizer)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | jax.Array | np.generic)


class Strategy:
    """The base of every preset: a mesh, a variable policy and a batch policy.

    Subclasses set the mesh and override :meth:`variable_layout` (and
    :meth:`batch_layout` when the batch is not simply split on dimension 0
    over ``batch_axes``).

    Args:
        mesh: the mesh.
        batch_axes: the mesh axes the batch is split over (the replicas).
        honor_annotations: whether Flax partitioning annotations on a model
            decide its variables' layouts (presets that shard by rules do).
        max_steps_in_flight: how many ``run`` calls may be queued before the
            oldest is waited on (bounds XLA's queue; ``None``: no bound).
    """

    name: str = "strategy"
    shards_variables: bool = (
        False  # whether the preset means to split variables (explain warns otherwise)
    )
    gradient_reduction: Any = (
        None  # explicit cross-device ops (None: XLA's all-reduce of the global step)
    )

    def __init__(
        self,
        mesh: Mesh,
        *,
        batch_axes: tuple[str, ...],
        honor_annotations: bool = False,
        max_steps_in_flight: int | None = 8,
    ) -> None:
        self._mesh = mesh
        self.batch_axes = tuple(batch_axes)
        self.honor_annotations = honor_annotations
        self.max_steps_in_flight = max_steps_in_flight
        self._in_flight: collections.deque[Any] = collections.deque()
        self._compiled: dict[Any, Any] = {}
        self._layout_cache: dict[Any, Any] = {}
        self._graph_cache: dict[tuple[int, ...], _GraphCache] = {}

    # ----------------------------------------------------------------- basics
    @property
    def mesh(self) -> Mesh:
        """The strategy's :class:`dtensor.Mesh`."""
        return self._mesh

    @property
    def num_replicas_in_sync(self) -> int:
        """How many data-parallel replicas a global batch is split over."""
        return self.mesh.axis_size(self.batch_axes)

    # --------------------------------------------------------------- policies
    def variable_layout(self, path: str, leaf: Any) -> Layout:
        """The layout of one variable (parameter or optimizer state); replicated here."""
        return Layout.replicated(self.mesh, np.ndim(_value(leaf)))

    def batch_layout(self, rank: int) -> Layout:
        """The layout of a rank-``rank`` batch array: dimension 0 split over the replicas."""
        if rank == 0 or not self.batch_axes:
            return Layout.replicated(self.mesh, rank)
        axes = self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes
        return Layout.batch_sharded(self.mesh, axes, rank)

    def storage_layout(self, path: str, leaf: Any) -> Layout:
        """Where a variable is kept between steps (the compute layout, unless a preset says otherwise)."""
        return self.variable_layout(path, leaf)

    def _resolved(self, path: str, leaf: Any) -> ResolvedLayout:
        ann = dtensor.core.rules.flax_annotation(leaf) if self.honor_annotations else None
        if ann is not None:
            return ResolvedLayout(self._annotation_layout(path, leaf, ann), "flax annotation")
        return ResolvedLayout(self.variable_layout(path, leaf), self.rule_name(path, leaf))

    def _annotation_layout(self, path: str, leaf: Any, names: tuple[Any, ...]) -> Layout:
        layout = Layout(list(names), self.mesh)
        layout.check_shape(np.shape(_value(leaf)), path)
        return layout

    def rule_name(self, path: str, leaf: Any) -> str | None:
        """A short description of the rule behind a variable's layout (for reports)."""
        return self.name

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
        stack = _strategy_stack()
        if stack and stack[-1] is not self:
            raise ValueError(
                f"cannot enter the scope of {self!r} inside the scope of {stack[-1]!r}: one "
                "strategy at a time. Leave the outer `with strategy.scope():` block first."
            )
        stack.append(self)
        try:
            with self.mesh, nnx.use_eager_sharding(self.honor_annotations), _creation.placing(self):
                yield self
        finally:
            stack.pop()

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
        """The layouts and rule names this strategy gives every leaf of ``tree``."""
        if _is_node(tree):
            tree = nnx.state(tree)
        return dtensor.resolve_layouts(tree, self._resolved, mesh=self.mesh)

    def storage_layout_fn(self, path: str, leaf: Any) -> ResolvedLayout:
        ann = dtensor.core.rules.flax_annotation(leaf) if self.honor_annotations else None
        if ann is not None:
            return ResolvedLayout(self._annotation_layout(path, leaf, ann), "flax annotation")
        return ResolvedLayout(self.storage_layout(path, leaf), self.rule_name(path, leaf))

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
        with self.mesh, nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(factory)
            is_nnx = _is_node(abstract)
            graphdef, abstract_state = nnx.split(abstract) if is_nnx else (None, abstract)
            layouts, _ = dtensor.resolve_layouts(
                abstract_state, self.storage_layout_fn, mesh=self.mesh
            )
            shardings = jax.tree.map(
                lambda lay: lay.sharding, layouts, is_leaf=lambda v: isinstance(v, Layout)
            )

            def init() -> Any:
                made = factory()
                return nnx.split(made)[1] if is_nnx else made

        # Compile under the mesh the variables are stored on (CentralStorage keeps
        # them off the compute mesh; jit rejects a context mesh that differs).
        meshes = {
            lay.mesh for lay in jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout))
        }
        with meshes.pop() if len(meshes) == 1 else self.mesh, nnx.use_eager_sharding(False):
            state = jax.jit(init, out_shardings=shardings)()
        return nnx.merge(graphdef, state) if graphdef is not None else state

    # -------------------------------------------------------------------- run
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        per_replica: bool = False,
        cache_graph: bool = False,
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

        Examples:
            >>> import strategies, numpy as np, jax.numpy as jnp
            >>> s = strategies.MirroredStrategy()
            >>> float(s.run(lambda x: jnp.mean(x ** 2), args=(np.ones((16, 4)),)))
            1.0
        """
        kwargs = kwargs or {}
        prepared = self._prepare(fn, args, kwargs, per_replica=per_replica, cache_graph=cache_graph)
        compiled, state, leaves, nodes, cached = prepared
        with self.mesh:  # traced under the strategy's mesh, in scope() or not
            new_state, out = compiled(state, leaves)
        if nodes:
            stored = self._to_storage(new_state)
            if cached is None:
                nnx.update(tuple(nodes), stored)
            else:
                cached.write_back(stored)
        if per_replica:
            out = jax.tree.map(PerReplica, out)
        self._bound_in_flight(out if jax.tree.leaves(out) else new_state)
        return out

    def _bound_in_flight(self, result: Any) -> None:
        if self.max_steps_in_flight is None:
            return
        leaves = jax.tree.leaves(result)
        if not leaves:
            return
        self._in_flight.append(leaves[0])
        while len(self._in_flight) > self.max_steps_in_flight:
            oldest = self._in_flight.popleft()
            if not oldest.is_deleted():  # a donated state buffer: a later step waits on it
                oldest.block_until_ready()

    def _to_compute(self, state: Any, layouts: Any) -> Any:
        """Move stored variables to their compute layout (a no-op unless storage differs)."""
        return state

    def _to_storage(self, state: Any) -> Any:
        """Move updated variables back to their storage layout."""
        return state

    def _prepare(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        per_replica: bool,
        cache_graph: bool = False,
    ) -> tuple[Any, Any, list[Any], list[Any], _GraphCache | None]:
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(
            (tuple(args), kwargs), is_leaf=_is_node
        )
        flat = [v for _, v in with_paths]
        nodes = [v for v in flat if _is_node(v)]
        cached = None
        if nodes and cache_graph:
            cached = self._graph_cache.get(tuple(map(id, nodes)))
            if cached is None:
                cached = self._graph_cache[tuple(map(id, nodes))] = _GraphCache(nodes)
            graphdef, state = cached.graphdef, cached.read()
        else:
            graphdef, state = nnx.split(tuple(nodes)) if nodes else (None, None)
        state_layouts = None
        if cached is not None:
            if cached.layouts is None:
                cached.layouts = self._state_layouts(graphdef, state)
            state_layouts = cached.layouts
            if not cached.unchanged():  # placed by us last step: nothing to check
                state = self._place_state(state, state_layouts)
        elif nodes:
            state_layouts = self._state_layouts(graphdef, state)
            state = self._place_state(state, state_layouts)
        kinds: list[Any] = []
        arrays: list[Any] = []
        for path, v in with_paths:
            if _is_node(v):
                kinds.append(_NODE)
            elif _is_array(v):
                placed = self._place_input(v, _arg_name(path))
                arrays.append(placed)
                kinds.append(_ARRAY)
            else:
                kinds.append(_Static(v))
        sig = tuple((a.shape, a.dtype, a.sharding) for a in arrays)
        graph_key = cached.key if cached is not None else graphdef
        key = (fn, per_replica, treedef, graph_key, tuple(kinds), sig)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(
                fn, treedef, graphdef, kinds, state_layouts, arrays, per_replica
            )
            self._compiled[key] = compiled
        if nodes:
            state = self._to_compute(state, state_layouts)
        return compiled, state, arrays, nodes, cached

    def _state_layouts(self, graphdef: Any, state: Any) -> Any:
        key = graphdef
        cached = self._layout_cache.get(key)
        if cached is None:
            # Paths are relative to each node (the tuple index dropped), so rules
            # see the same paths as in scope() and distribute_variables().
            cached, _ = dtensor.resolve_layouts(state, self._node_relative, mesh=self.mesh)
            self._layout_cache[key] = cached
        return cached

    def _place_state(self, state: Any, layouts: Any) -> Any:
        def place(var: Any, layout: Layout | None) -> Any:
            if layout is None:
                return var
            value = _value(var)
            if isinstance(value, jax.Array):
                have, want = value.sharding, layout.sharding
                # A jit's outputs say P() where the layout says P(None, None): same placement.
                if have == want or have.is_equivalent_to(want, value.ndim):
                    return var
            return _replace(var, dtensor.relayout(value, layout))

        return jax.tree.map(place, state, layouts, is_leaf=_var_or_layout)

    def _place_input(self, v: Any, name: str) -> Any:
        if isinstance(v, jax.Array):
            mesh = dtensor.core.arrays.mesh_of(v)
            if mesh is not None and mesh != self.mesh:
                adopted = self._adopt(v, mesh)
                if adopted is not None:
                    return adopted
                raise LayoutError(
                    f"argument {name} of run() is laid out on {mesh!r}, but {self!r} runs on "
                    f"{self.mesh!r}. Move it with dtensor.relayout(x, strategy.batch_layout(x.ndim)) "
                    "or pass host (numpy) data and let the strategy place it."
                )
            if mesh is not None:
                return v
        layout = self.batch_layout(np.ndim(v))
        if np.ndim(v) and np.shape(v)[0] % max(layout.num_shards(0), 1):
            raise LayoutError(
                f"the global batch (argument {name}, shape {np.shape(v)}) has {np.shape(v)[0]} "
                f"rows, which does not divide over the {self.num_replicas_in_sync} replicas of "
                f"{self!r}. Use a global batch that is a multiple of {self.num_replicas_in_sync}, or "
                "distribute the dataset with pad=True."
            )
        return dtensor.copy_to_mesh(np.asarray(v) if not isinstance(v, jax.Array) else v, layout)

    def _adopt(self, x: jax.Array, mesh: Mesh) -> jax.Array | None:
        """An argument on another mesh this preset knows how to move (``None``: it does not)."""
        return None

    def _compile(
        self,
        fn: Callable[..., Any],
        treedef: Any,
        graphdef: Any,
        kinds: list[Any],
        state_layouts: Any,
        arrays: list[Any],
        per_replica: bool,
    ) -> Callable[[Any, list[Any]], Any]:
        strategy = self
        reduction = None if per_replica else self.gradient_reduction
        if reduction is not None:  # explicit cross-device ops (strategies.cross_device_ops)
            fn = reduction.wrap_step(fn)

        def call(state: Any, arrays: list[Any]) -> Any:
            nodes = iter(nnx.merge(graphdef, state) if graphdef is not None else ())
            values = iter(arrays)
            flat = [
                next(nodes) if k is _NODE else next(values) if k is _ARRAY else k.value
                for k in kinds
            ]
            args, kwargs = jax.tree.unflatten(treedef, flat)
            out = fn(*args, **kwargs)
            new_state = (
                nnx.state(tuple(v for v, k in zip(flat, kinds, strict=True) if k is _NODE))
                if graphdef is not None
                else None
            )
            return new_state, out

        if reduction is not None:
            return reduction.compile_step(self, call, arrays, has_state=graphdef is not None)
        if not per_replica:
            shardings = [getattr(a, "sharding", None) for a in arrays]

            def pure(state: Any, arrays: list[Any]) -> Any:
                new_state, out = strategy._trace_step(call, state, arrays, state_layouts, shardings)
                if new_state is not None:
                    _check_same_structure(state, new_state)
                    new_state = strategy._constrain(new_state, state_layouts)
                return new_state, out

            return jax.jit(pure, donate_argnums=(0,) if graphdef is not None else ())
        return self._per_replica(call, state_layouts, arrays, graphdef is not None)

    def _trace_step(
        self,
        call: Callable[[Any, list[Any]], Any],
        state: Any,
        arrays: list[Any],
        layouts: Any,
        shardings: list[Any],
    ) -> Any:
        """Trace one global-mode step: ``call(state, arrays) -> (new_state, out)``.

        ``layouts`` are the variables' (``None`` without NNX nodes), ``shardings``
        the array arguments' input shardings.

        A hook for presets that must shape the compiled step beyond layouts
        (FullyShardedStrategy gathers parameters at each read).
        """
        return call(state, arrays)

    def _constrain(self, state: Any, layouts: Any) -> Any:
        def constrain(var: Any, layout: Layout | None) -> Any:
            if layout is None:
                return var
            return _replace(var, dtensor.relayout(_value(var), self._compute_layout(layout)))

        return jax.tree.map(constrain, state, layouts, is_leaf=_var_or_layout)

    def _compute_layout(self, storage: Layout) -> Layout:
        return storage

    def _per_replica(
        self, call: Any, state_layouts: Any, leaves: list[Any], has_state: bool
    ) -> Any:
        if not self.batch_axes:
            axes: tuple[str, ...] = ()
        else:
            axes = self.batch_axes
        if state_layouts is not None:
            for layout in jax.tree.leaves(state_layouts, is_leaf=lambda v: isinstance(v, Layout)):
                if any(a in axes for d in range(layout.rank) for a in layout.axes(d)):
                    raise LayoutError(
                        f"per-replica run needs variables whole on every replica, but {self!r} "
                        f"splits one over the replica axes ({layout!r}). Use run() without "
                        "per_replica=True (global mode) for sharded-variable presets."
                    )
        spec_axes = axes[0] if len(axes) == 1 else axes
        batch_spec = jax.sharding.PartitionSpec(spec_axes) if axes else jax.sharding.PartitionSpec()
        leaf_specs = [
            batch_spec if np.ndim(v) > 0 else jax.sharding.PartitionSpec() for v in leaves
        ]
        n = self.num_replicas_in_sync
        strategy = self

        def body(state: Any, leaves: list[Any]) -> Any:
            prev = getattr(_state, "replica_context", None)
            _state.replica_context = ReplicaContext(strategy, axes, n)
            try:
                new_state, out = call(state, leaves)
            finally:
                _state.replica_context = prev
            return new_state, jax.tree.map(lambda o: jnp.expand_dims(o, 0), out)

        def pure(state: Any, leaves: list[Any]) -> Any:
            state_specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
            out_specs = (state_specs, batch_spec)  # a prefix: every output is per-replica
            new_state, out = jax.shard_map(
                body,
                mesh=strategy.mesh.jax_mesh,
                in_specs=(state_specs, leaf_specs),
                out_specs=out_specs,
                check_vma=False,
            )(state, leaves)
            if has_state:  # back to the variables' own layouts (e.g. split on `tensor`)
                new_state = strategy._constrain(new_state, state_layouts)
            return new_state, out

        return jax.jit(pure, donate_argnums=(0,) if has_state else ())

    # --------------------------------------------------------------- explain
    def explain(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The :func:`dtensor.explain` report of what :meth:`run` compiles for these arguments.

        Arguments may be abstract (``jax.ShapeDtypeStruct`` trees, or models
        from ``nnx.eval_shape``); nothing runs.
        """
        from dtensor.analysis.explain import explain

        kwargs = kwargs or {}
        flat, treedef = jax.tree.flatten((tuple(args), kwargs), is_leaf=_is_node)
        nodes = [v for v in flat if _is_node(v)]
        graphdef, state = nnx.split(tuple(nodes)) if nodes else (None, None)
        layouts = rules = None
        if nodes:
            layouts = self._state_layouts(graphdef, state)
            _, rules = dtensor.resolve_layouts(state, self._node_relative, mesh=self.mesh)
            state = jax.tree.map(
                lambda var, lay: (
                    var
                    if lay is None
                    else _replace(var, _abstract(_value(var), self._compute_layout(lay)))
                ),
                state,
                layouts,
                is_leaf=_var_or_layout,
            )
        kinds: list[Any] = []
        arrays: list[Any] = []
        for v in flat:
            if _is_node(v):
                kinds.append(_NODE)
            elif _is_array(v) or isinstance(v, jax.ShapeDtypeStruct):
                sharding = getattr(v, "sharding", None)
                on_mesh = isinstance(sharding, jax.sharding.NamedSharding) and isinstance(
                    v, jax.ShapeDtypeStruct | jax.Array
                )
                arrays.append(v if on_mesh else _abstract(v, self.batch_layout(len(np.shape(v)))))
                kinds.append(_ARRAY)
            else:
                kinds.append(_Static(v))
        compiled = self._compile(fn, treedef, graphdef, kinds, layouts, arrays, False)
        with self.mesh:
            return explain(
                compiled,
                state,
                arrays,
                variables=state,
                rules=rules,
                data_axes=self.batch_axes,
                expect_sharded=self.shards_variables,
                activation_bytes_min=self.activation_bytes_min(state, rules, arrays),
            )

    def activation_bytes_min(self, state: Any, rules: Any, batch: list[Any]) -> float:
        """Bytes per device of activations the layouts must move in one step (0: none)."""
        return 0.0

    def _node_relative(self, path: str, leaf: Any) -> ResolvedLayout:
        return self.storage_layout_fn(path.split("/", 1)[1] if "/" in path else path, leaf)

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
        op = ReduceOp.parse(op)
        fns = {
            ReduceOp.SUM: jnp.sum,
            ReduceOp.MEAN: jnp.mean,
            ReduceOp.MAX: jnp.max,
            ReduceOp.MIN: jnp.min,
        }
        reducer = fns[op]

        def one(v: Any) -> Any:
            if isinstance(v, PerReplica):
                axes = (0,) if axis is None else (0, axis + 1)
                return _jit_reduce(reducer, axes)(v.value)
            if axis is None:
                return v
            return _jit_reduce(reducer, (axis,))(v)

        return jax.tree.map(one, value, is_leaf=lambda v: isinstance(v, PerReplica))

    def gather(self, value: Any, axis: int = 0) -> Any:
        """All replicas' values concatenated along ``axis``, whole on every device.

        Examples:
            >>> import strategies, numpy as np
            >>> s = strategies.MirroredStrategy()
            >>> x = s.experimental_distribute_values_from_function(lambda ctx: np.full((2,), ctx.replica_id_in_sync_group))
            >>> s.gather(x, axis=0).tolist()
            [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
        """

        def one(v: Any) -> Any:
            if isinstance(v, PerReplica):
                stacked = v.value
                moved = jnp.moveaxis(stacked, 0, axis)
                merged = moved.reshape(*moved.shape[:axis], -1, *moved.shape[axis + 2 :])
                return dtensor.relayout(merged, Layout.replicated(self.mesh, merged.ndim))
            return dtensor.relayout(v, Layout.replicated(self.mesh, np.ndim(v)))

        return jax.tree.map(one, value, is_leaf=lambda v: isinstance(v, PerReplica))

    # ---------------------------------------------------------------- values
    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], Any]
    ) -> Any:
        """Call ``value_fn`` once per replica and hold the results as :class:`PerReplica` values."""
        n = self.num_replicas_in_sync
        per = [value_fn(ValueContext(i, n)) for i in range(n)]
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *per)
        layout_of = lambda x: self.batch_layout(x.ndim)  # noqa: E731
        return jax.tree.map(lambda x: PerReplica(dtensor.copy_to_mesh(x, layout_of(x))), stacked)

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
        return dtensor.DTensorDataset(
            dataset, self.mesh, batch_dim=self._batch_dim, prefetch=prefetch, pad=pad
        )

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        *,
        pad: bool = False,
        prefetch: int = 2,
    ) -> dtensor.DTensorDataset:
        """``dataset_fn(InputContext)`` gives this process's share; shares are stitched into global arrays."""
        ctx = self.input_context()
        source = dataset_fn(ctx)
        global_batch_size = ctx._global_batch_sizes[-1] if ctx._global_batch_sizes else None
        if global_batch_size is not None:  # the function told us the global batch: check its shares
            source = _CheckedShares(source, ctx, global_batch_size, pad=pad)
        return dtensor.DTensorDataset(
            source,
            self.mesh,
            global_batch_size=global_batch_size,
            batch_dim=self._batch_dim,
            process_local=True,
            prefetch=prefetch,
            pad=pad,
        )

    def input_context(self) -> InputContext:
        """This process's :class:`InputContext`."""
        return InputContext(
            num_input_pipelines=jax.process_count(),
            input_pipeline_id=jax.process_index(),
            num_replicas_in_sync=self.num_replicas_in_sync,
        )

    @property
    def _batch_dim(self) -> str | tuple[str, ...]:
        if not self.batch_axes:
            return self.mesh.dim_names[0]  # a size-1 axis: the batch stays whole
        return self.batch_axes[0] if len(self.batch_axes) == 1 else self.batch_axes

    # ---------------------------------------------------------------- reports
    def describe(self, tree: Any = None) -> str:
        """The mesh, and (given a model or pytree) the layout of each variable, as text."""
        from dtensor.core.text import layouts_table, render

        parts = [repr(self)]
        if tree is not None:
            parts.append(render(layouts_table(tree, *self.variable_layouts(tree))))
        return "\n".join(parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mesh={self.mesh!r}, replicas={self.num_replicas_in_sync})"


# ------------------------------------------------------------------- helpers
def _arg_name(path: Any) -> str:
    """A ``run`` argument's pytree path as the user wrote it: ``args[2]['x']``, ``kwargs['batch']``."""
    head, *rest = path
    return ("args" if head.idx == 0 else "kwargs") + jax.tree_util.keystr(tuple(rest))


def _value(leaf: Any) -> Any:
    if isinstance(leaf, nnx.Variable):
        return leaf.get_value()
    return leaf


def _replace(var: Any, value: Any) -> Any:
    if isinstance(var, nnx.Variable):
        return var.replace(value)
    return value


def _var_or_layout(x: Any) -> bool:
    return isinstance(x, nnx.Variable | Layout)


def _abstract(value: Any, layout: Layout | None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        np.shape(value), value.dtype, sharding=None if layout is None else layout.sharding
    )


class _CheckedShares:
    """An input function's batches, each checked to hold this pipeline's share of the global batch."""

    def __init__(
        self, source: Iterable[Any], ctx: InputContext, global_batch_size: int, *, pad: bool
    ) -> None:
        self.source = source
        self.ctx = ctx
        self.global_batch_size = global_batch_size
        self.pad = pad

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        ctx, n = self.ctx, self.global_batch_size
        share = n // ctx.num_input_pipelines
        for i, batch in enumerate(self.source):
            rows = {int(np.shape(x)[0]) for x in jax.tree.leaves(batch) if np.ndim(x) > 0}
            if rows and (rows != {share} if not self.pad else max(rows) > share):
                raise LayoutError(
                    f"the dataset function's batch {i} has {sorted(rows)[-1]} rows, but this input "
                    f"pipeline's share of the global batch {n} is {share} rows ({n} / "
                    f"{ctx.num_input_pipelines} input pipelines). distribute_datasets_from_function "
                    "wants each pipeline's share, not one replica's: batch by "
                    f"ctx.get_per_pipeline_batch_size({n})"
                    + (" (or pass pad=True for a short last batch)." if not self.pad else ".")
                )
            yield batch


def _check_same_structure(before: Any, after: Any) -> None:
    paths_before = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(before)}
    paths_after = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(after)}
    if paths_before != paths_after:
        added = sorted(paths_after - paths_before)[:3]
        removed = sorted(paths_before - paths_after)[:3]
        raise ValueError(
            f"the step changed its models' structure (added {added}, removed {removed}); a step "
            "run by a strategy updates existing variables only. Create new variables before "
            "calling run (or in scope())."
        )


class _GraphCache:
    """The NNX graph of some nodes, walked once: their graphdef and live Variables.

    ``read()`` gives a state to pass to the compiled step and ``write_back``
    stores its result in the same Variables, with no graph traversal.
    """

    def __init__(self, nodes: list[Any]) -> None:
        self.nodes = tuple(nodes)  # kept alive so their ids stay theirs
        self.graphdef, state = nnx.split(self.nodes)
        self.variables = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, nnx.Variable))
        self.treedef = jax.tree.structure(state)
        if self.treedef.num_leaves != len(self.variables):
            raise ValueError(
                "run(..., cache_graph=True) needs every Variable of the models to hold one array; "
                "some hold none or several. Call run without cache_graph."
            )
        self.key = _CachedGraphKey(self.graphdef)
        self.layouts: Any = None
        self._values: list[Any] = []
        self._written: list[Any] = []

    def read(self) -> Any:
        self._values = [v.get_value() for v in self.variables]
        return self.treedef.unflatten(self._values)

    def unchanged(self) -> bool:
        """Whether every Variable still holds what the last step wrote."""
        return len(self._written) == len(self._values) and all(
            a is b for a, b in zip(self._values, self._written, strict=True)
        )

    def write_back(self, state: Any) -> None:
        new = jax.tree.leaves(state)
        if len(new) != len(self.variables):
            raise ValueError(
                f"the step changed its models' structure ({len(self.variables)} variables before, "
                f"{len(new)} after), which run(..., cache_graph=True) cannot follow; call run "
                "without cache_graph."
            )
        for var, value in zip(self.variables, new, strict=True):
            var.set_value(value)
        self._written = new


class _CachedGraphKey:
    """A compile-cache key for a cached graph: hashed once (graphdefs hash slowly)."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: Any) -> None:
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _CachedGraphKey) and self.graphdef == other.graphdef
        )


_NODE = "node"
_ARRAY = "array"


class _Static:
    """A non-array argument: part of the compile key, closed over by the compiled step."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and _static_key(self.value) == _static_key(other.value)

    def __hash__(self) -> int:
        return hash(_static_key(self.value))


def _static_key(v: Any) -> Any:
    try:
        hash(v)
    except TypeError:
        return ("id", id(v))
    return ("value", type(v), v)


_REDUCERS: dict[Any, Any] = {}


def _jit_reduce(reducer: Any, axes: tuple[int, ...]) -> Any:
    key = (reducer, axes)
    if key not in _REDUCERS:
        _REDUCERS[key] = jax.jit(lambda x: reducer(x, axis=axes))
    return _REDUCERS[key]
