"""`StepCompiler`: single-device step code into one ``jax.jit`` laid out by a strategy.

A strategy owns one compiler. For each ``run`` it sorts the arguments
(:mod:`strategies.step.args`), places NNX state by the variable policy and
arrays by the batch policy, compiles once per input signature (bounded and
weak on functions and models, :mod:`strategies.step.cache`), runs, writes the
new state back into the models, and bounds how many steps are in flight.

What it asks of the strategy are its public policies and preset hooks:
``mesh``, ``batch_axes``, ``batch_layout``, ``storage_layout_fn``,
``compute_layout``, ``memory_kind``, ``adopt``, ``trace_step``, ``after_step``,
``gradient_reduction``, ``max_steps_in_flight``, ``activation_bytes_min`` and
``shards_variables``.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.core import Tracer

import dtensor
from dtensor import Layout, LayoutError
from dtensor.core.arrays import mesh_of
from dtensor.core.text import sizes_text
from dtensor.core.tree import is_variable, leaf_value, path_str, replace_value
from strategies import context
from strategies.boundary import explicit_axes_error
from strategies.reads import offload
from strategies.replica.values import PerReplica, ReplicaContext
from strategies.step import args as argkinds
from strategies.step import donation
from strategies.step.args import abstract_value, var_or_layout
from strategies.step.cache import FunctionKey, GraphCache, GraphCaches, LRUCache, RecompileMonitor

if TYPE_CHECKING:
    from strategies.base import Strategy

__all__ = ["StepCompiler"]


class StepCompiler:
    """Compiles and runs steps for one strategy; see the module docstring."""

    def __init__(self, strategy: Strategy, *, max_compiled: int = 64) -> None:
        self.strategy = strategy
        self.compiled = LRUCache(max_compiled)
        self.layouts = LRUCache(max_compiled)
        self.kinds = LRUCache(max_compiled)
        self.graphs = GraphCaches()
        self.monitor = RecompileMonitor()
        self._in_flight: collections.deque[Any] = collections.deque()

    # ------------------------------------------------------------------- run
    def run(
        self,
        fn: Callable[..., Any],
        args: Any,
        kwargs: Any,
        *,
        per_replica: bool,
        cache_graph: bool,
        donate_argnums: Any = (),
    ) -> Any:
        s = self.strategy
        fn, with_paths, treedef, mask, flat, nodes = donation.prepare_call(
            s, fn, args, kwargs, donate_argnums, "run", explicit_reduction=not per_replica
        )
        cached = self.graphs.get(nodes) if nodes and cache_graph else None
        graphdef, state, layouts = self._node_state(nodes, cached)
        self._check_rows(with_paths)
        kinds: list[Any] = []
        arrays: list[Any] = []
        for path, v in with_paths:
            kind = argkinds.kind_of(v)
            if kind is argkinds.ARRAY:
                arrays.append(self._place_input(v, argkinds.arg_name(path)))
            kinds.append(kind)
        sig = tuple((a.shape, a.dtype, a.sharding) for a in arrays)
        graph_key = cached.key if cached is not None else graphdef
        memories = self.memory_kinds(graph_key, state) if nodes else None
        if memories is not None:
            state = self._in_memory(state, layouts, memories, device=False)
        fn_key = FunctionKey(fn)
        key = (fn_key, per_replica, treedef, graph_key, tuple(kinds), sig, mask)
        compiled = self.compiled.get(key)
        if compiled is None and cached is not None:  # explain() keys its step by the graph
            compiled = self.compiled.get((*key[:3], graphdef, *key[4:]))
            if compiled is not None:
                self.compiled.put((FunctionKey(fn, self._forget), *key[1:]), compiled)
        if compiled is None:
            fn_key = FunctionKey(fn, self._forget)  # the stored key watches the function
            key = (fn_key, *key[1:])
            compiled = self._compile(
                fn_key, treedef, graphdef, kinds, layouts, arrays, per_replica, memories, mask
            )
            self.compiled.put(key, compiled)
            self.monitor.compiled(fn)
        if nodes:
            state = self._relayout(state, layouts, compute=True, kinds=memories)
        with s.mesh:  # traced under the strategy's mesh, in scope() or not
            try:
                new_state, out = compiled(state, arrays)
            except ValueError as err:  # JAX's, from tracing the user's step
                ours = explicit_axes_error(err, s, "run()")
                if ours is None:
                    raise
                raise ours from None
        if nodes:
            stored = self._relayout(new_state, layouts, compute=False, kinds=memories)
            if cached is None:
                nnx.update(tuple(nodes), stored)
            else:
                cached.write_back(stored)
        if per_replica:
            out = jax.tree.map(PerReplica, out)
        result = out if jax.tree.leaves(out) else new_state
        self._bound_in_flight(result)
        s.after_step(result)
        return out

    def _forget(self, dead_ref: Any) -> None:
        """A step function died: drop its compiled steps."""
        self.compiled.discard_where(
            lambda k: (
                isinstance(k, tuple) and isinstance(k[0], FunctionKey) and k[0].holds(dead_ref)
            )
        )

    def _node_state(self, nodes: list[Any], cached: GraphCache | None) -> tuple[Any, Any, Any]:
        if not nodes:
            return None, None, None
        for node in nodes:
            self.strategy.observe(node)
        if cached is not None:
            graphdef, state = cached.graphdef, cached.read()
            if cached.layouts is None:
                cached.layouts = self.state_layouts(graphdef, state)
            if not cached.unchanged():  # placed by us last step: nothing to check
                state = self._place_state(state, cached.layouts)
            return graphdef, state, cached.layouts
        graphdef, state = nnx.split(tuple(nodes))
        layouts = self.state_layouts(graphdef, state)
        return graphdef, self._place_state(state, layouts), layouts

    def _bound_in_flight(self, result: Any) -> None:
        limit = self.strategy.max_steps_in_flight
        if limit is None:
            return
        leaves = jax.tree.leaves(result)
        if not leaves:
            return
        self._in_flight.append(leaves[0])
        while len(self._in_flight) > limit:
            oldest = self._in_flight.popleft()
            if not oldest.is_deleted():  # a donated state buffer: a later step waits on it
                oldest.block_until_ready()

    # -------------------------------------------------------------- layouts
    def state_layouts(self, graphdef: Any, state: Any) -> Any:
        """The storage layout of every Variable of the nodes' state (cached per graph)."""
        layouts = self.layouts.get(graphdef)
        if layouts is None:
            layouts, _ = self.resolve(state)
            self.layouts.put(graphdef, layouts)
        return layouts

    def resolve(self, state: Any) -> tuple[Any, Any]:
        """Layouts and rule names of the nodes' state, with paths relative to each node.

        The tuple index of the nodes is dropped, so rules see the same paths
        as in ``scope()`` and ``distribute_variables()``.
        """
        fn = self.strategy.storage_layout_fn
        return dtensor.resolve_layouts(
            state,
            lambda path, leaf: fn(path.split("/", 1)[1] if "/" in path else path, leaf),
            mesh=self.strategy.mesh,
        )

    def memory_kinds(self, key: Any, state: Any) -> Any:
        """Each variable's memory kind between steps (``Strategy.memory_kind``), or ``None`` for all-device."""
        found = self.kinds.get(key)
        if found is None:
            fn = self.strategy.memory_kind

            def kind(path: Any, var: Any) -> str | None:
                p = path_str(path)
                return fn(p.split("/", 1)[1] if "/" in p else p, var) or "device"

            tree = jax.tree_util.tree_map_with_path(kind, state, is_leaf=is_variable)
            found = (tree if any(k != "device" for k in jax.tree.leaves(tree)) else None,)
            self.kinds.put(key, found)
        return found[0]

    def _place_state(self, state: Any, layouts: Any) -> Any:
        def place(var: Any, layout: Layout | None) -> Any:
            if layout is None:
                return var
            value = leaf_value(var)
            if isinstance(value, jax.Array):
                have, want = value.sharding, layout.sharding
                if have.memory_kind not in (None, "device"):  # offloaded: moved by the step
                    have = have.with_memory_kind("device")
                # A jit's outputs say P() where the layout says P(None, None): same placement.
                if have == want or have.is_equivalent_to(want, value.ndim):
                    return var
            return replace_value(var, dtensor.relayout(value, layout))

        return jax.tree.map(place, state, layouts, is_leaf=var_or_layout)

    def _relayout(self, state: Any, layouts: Any, *, compute: bool, kinds: Any = None) -> Any:
        """Stored variables to their compute layout (``compute=True``) or back (a no-op unless they differ).

        Variables with a memory kind (``kinds``) stored on another mesh move
        between host memory (stored) and device memory (compute) here; those
        on the compute mesh are moved inside the compiled step
        (:meth:`_in_memory`).
        """
        s = self.strategy

        def move(var: Any, lay: Layout | None, kind: str | None = None) -> Any:
            if lay is None:
                return var
            target = s.compute_layout(lay)
            value = leaf_value(var)
            if kind not in (None, "device") and isinstance(value, jax.Array):
                if target == lay:
                    return var
                if compute:
                    return replace_value(var, offload.to_device(value, target.sharding))
                return replace_value(var, offload.to_host(value, lay.sharding))
            if target == lay:
                return var
            return replace_value(var, dtensor.relayout(value, target if compute else lay))

        if kinds is None:
            return jax.tree.map(move, state, layouts, is_leaf=var_or_layout)
        return jax.tree.map(move, state, layouts, kinds, is_leaf=var_or_layout)

    def _in_memory(self, state: Any, layouts: Any, memories: Any, *, device: bool) -> Any:
        """Offloaded variables kept on the compute mesh, in device memory or in their own.

        Eagerly (before a step) this places them in host memory; inside the
        compiled step it is XLA's transfer to device memory and back.
        """
        s = self.strategy

        def move(var: Any, lay: Layout | None, kind: str | None) -> Any:
            if lay is None or kind in (None, "device") or s.compute_layout(lay) != lay:
                return var
            value = leaf_value(var)
            if isinstance(value, jax.ShapeDtypeStruct):
                return replace_value(var, abstract_value(value, lay, memory_kind=kind))
            if not isinstance(value, jax.Array):
                return var
            if isinstance(value, Tracer):
                target = lay.sharding.with_memory_kind("device" if device else kind)
                return replace_value(var, jax.device_put(value, target))
            if value.sharding.memory_kind == kind:
                return var
            return replace_value(var, offload.to_host(value, lay.sharding))

        return jax.tree.map(move, state, layouts, memories, is_leaf=var_or_layout)

    def _constrain(self, state: Any, layouts: Any) -> Any:
        s = self.strategy

        def constrain(var: Any, layout: Layout | None) -> Any:
            if layout is None:
                return var
            return replace_value(var, dtensor.relayout(leaf_value(var), s.compute_layout(layout)))

        return jax.tree.map(constrain, state, layouts, is_leaf=var_or_layout)

    def _place_input(self, v: Any, name: str) -> Any:
        s = self.strategy
        if isinstance(v, jax.Array):
            mesh = mesh_of(v)
            if mesh is not None and mesh != s.mesh:
                adopted = s.adopt(v, mesh)
                if adopted is not None:
                    return adopted
                raise LayoutError(
                    f"argument {name} of run() is laid out on {mesh!r}, but {s!r} runs on "
                    f"{s.mesh!r}. Move it with dtensor.relayout(x, strategy.batch_layout(x.ndim)) "
                    "or pass host (numpy) data and let the strategy place it."
                )
            if mesh is not None:
                return v
        layout = s.batch_layout(np.ndim(v))
        return dtensor.copy_to_mesh(np.asarray(v) if not isinstance(v, jax.Array) else v, layout)

    def _check_rows(self, with_paths: list[tuple[Any, Any]]) -> None:
        """One error for batch arrays whose rows do not divide over the replicas.

        Arrays already on the mesh keep their layouts and are not checked here.
        A ragged batch (arrays of different leading sizes) is described by its
        distinct sizes, not leaf by leaf.
        """
        s = self.strategy
        rows: list[tuple[str, int]] = []
        bad: list[tuple[str, Any]] = []
        shards: dict[int, int] = {}  # rank -> shards of dimension 0 in the batch layout
        for path, v in with_paths:
            if (
                argkinds.kind_of(v) is not argkinds.ARRAY
                or not np.ndim(v)
                or mesh_of(v) is not None
            ):
                continue
            name, shape = argkinds.arg_name(path), np.shape(v)
            rows.append((name, shape[0]))
            if len(shape) not in shards:
                shards[len(shape)] = max(s.batch_layout(len(shape)).num_shards(0), 1)
            if shape[0] % shards[len(shape)]:
                bad.append((name, shape))
        if not bad:
            return
        n = s.num_replicas_in_sync
        if len({r for _, r in rows}) > 1:
            odd = sorted({shape[0] for _, shape in bad})
            raise LayoutError(
                f"the global batch's arrays have different leading sizes: {sizes_text(rows)}; "
                f"{' and '.join(map(str, odd))} {'does' if len(odd) == 1 else 'do'} not divide over "
                f"the {n} replicas of {s!r}. Every array of a batch needs the same number of rows, "
                f"a multiple of {n}: pad or trim the odd ones, or close over arrays that are not "
                "per-example data in the step instead of passing them."
            )
        name, shape = bad[0]
        raise LayoutError(
            f"the global batch (argument {name}, shape {shape}) has {shape[0]} rows, which does "
            f"not divide over the {n} replicas of {s!r}. Use a global batch that is a multiple of "
            f"{n}, or distribute the dataset with pad=True."
        )

    # --------------------------------------------------------------- compile
    def _compile(
        self,
        fn_key: FunctionKey,
        treedef: Any,
        graphdef: Any,
        kinds: list[Any],
        layouts: Any,
        arrays: list[Any],
        per_replica: bool,
        memories: Any = None,
        mask: tuple[bool, ...] = (),
    ) -> donation.Step:
        s = self.strategy
        reduction = None if per_replica else s.gradient_reduction

        def call(state: Any, arrays: list[Any], *, prepare: Any = None) -> Any:
            fn = fn_key.get()  # at trace time: the compiled step holds no strong reference
            if (
                reduction is not None
            ):  # explicit cross-device ops (strategies.replica.cross_device_ops)
                fn = reduction.wrap_step(fn)
            merged = nnx.merge(graphdef, state) if graphdef is not None else ()
            if prepare is not None and graphdef is not None:
                prepare(merged)  # the preset's swaps, on the objects merged in this trace
            nodes = iter(merged)
            values = iter(arrays)
            flat = [
                next(nodes)
                if k is argkinds.NODE
                else next(values)
                if k is argkinds.ARRAY
                else k.value
                for k in kinds
            ]
            args, kwargs = jax.tree.unflatten(treedef, flat)
            out = fn(*args, **kwargs)
            new_state = (
                nnx.state(tuple(v for v, k in zip(flat, kinds, strict=True) if k is argkinds.NODE))
                if graphdef is not None
                else None
            )
            return new_state, out

        has_state = graphdef is not None
        if reduction is not None:  # donates the state only (run checked the mask)
            return donation.Step(reduction.compile_step(s, call, arrays, has_state=has_state))
        if per_replica:
            pure_replicas = self._per_replica(call, layouts, arrays, has_state)
            return donation.jit_step(pure_replicas, has_state=has_state, mask=mask)
        shardings = [getattr(a, "sharding", None) for a in arrays]
        compiler = self

        def pure(state: Any, arrays: list[Any]) -> Any:
            if memories is not None:  # offloaded variables: host -> device for the step
                state = compiler._in_memory(state, layouts, memories, device=True)
            new_state, out = s.trace_step(call, state, arrays, layouts, shardings)
            if new_state is not None:
                check_same_structure(state, new_state)
                new_state = compiler._constrain(new_state, layouts)
                if memories is not None:  # and back to host memory
                    new_state = compiler._in_memory(new_state, layouts, memories, device=False)
            return new_state, out

        return donation.jit_step(pure, has_state=has_state, mask=mask)

    def _per_replica(
        self, call: Any, layouts: Any, leaves: list[Any], has_state: bool
    ) -> Callable[[Any, list[Any]], Any]:
        """The per-replica step (``jax.shard_map`` over the replica axes), to be jitted."""
        s = self.strategy
        axes: tuple[str, ...] = tuple(s.batch_axes)
        if layouts is not None:
            for layout in jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout)):
                if any(a in axes for d in range(layout.rank) for a in layout.axes(d)):
                    raise LayoutError(
                        f"per-replica run needs variables whole on every replica, but {s!r} "
                        f"splits one over the replica axes ({layout!r}). Use run() without "
                        "per_replica=True (global mode) for sharded-variable presets."
                    )
        spec_axes = axes[0] if len(axes) == 1 else axes
        batch_spec = jax.sharding.PartitionSpec(spec_axes) if axes else jax.sharding.PartitionSpec()
        leaf_specs = [
            batch_spec if np.ndim(v) > 0 else jax.sharding.PartitionSpec() for v in leaves
        ]
        n = s.num_replicas_in_sync
        compiler = self

        def body(state: Any, leaves: list[Any]) -> Any:
            with context.replica_context(ReplicaContext(s, axes, n)):
                new_state, out = call(state, leaves)
            return new_state, jax.tree.map(lambda o: jnp.expand_dims(o, 0), out)

        def pure(state: Any, leaves: list[Any]) -> Any:
            state_specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), state)
            out_specs = (state_specs, batch_spec)  # a prefix: every output is per-replica
            new_state, out = jax.shard_map(
                body,
                mesh=s.mesh.jax_mesh,
                in_specs=(state_specs, leaf_specs),
                out_specs=out_specs,
                check_vma=False,
            )(state, leaves)
            if has_state:  # back to the variables' own layouts (e.g. split on `tensor`)
                new_state = compiler._constrain(new_state, layouts)
            return new_state, out

        return pure

    # --------------------------------------------------------------- explain
    def explain(
        self, fn: Callable[..., Any], args: Any, kwargs: Any, *, donate_argnums: Any = ()
    ) -> Any:
        """The :func:`dtensor.explain` report of what :meth:`run` compiles for these arguments."""
        from strategies.step.explaining import explain_step

        return explain_step(self, fn, args, kwargs, donate_argnums=donate_argnums)


def check_same_structure(before: Any, after: Any) -> None:
    """Raise if a step added or removed Variables of its models."""
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
