"""`PresetHooks`: what a preset overrides — where variables live, where the batch goes,
how the step is traced.

:class:`strategies.Strategy` inherits these defaults (replicated variables, the
batch split on dimension 0 over ``batch_axes``, storage = compute, parameter
reads shaped by :meth:`PresetHooks.read_options`); each preset overrides the
few that make it what it is. Nothing here compiles or runs: the step compiler
(:mod:`strategies.step`) and the reports call these hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from dtensor import Layout, Mesh
from dtensor.core.rules import ResolvedLayout, flax_annotation
from dtensor.core.tree import leaf_value
from strategies.reads.mixed_precision import MixedPrecision
from strategies.reads.param_reads import ReadOptions, trace_reads

__all__ = ["PresetHooks"]


class PresetHooks:
    """The defaults of every layout policy and step hook (see the module docstring).

    Examples:
        >>> import strategies, numpy as np
        >>> s = strategies.MirroredStrategy()   # inherits these defaults but its name
        >>> s.variable_layout("w", np.ones((4, 4))).is_fully_replicated(), s.batch_layout(2).sharding_specs
        (True, ('replica', 'unsharded'))
    """

    name: str
    mesh: Mesh
    batch_axes: tuple[str, ...]
    honor_annotations: bool
    mixed_precision: MixedPrecision | None

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

    def observe(self, node: Any) -> None:
        """Called with each NNX module (or optimizer) whose variables this strategy lays out,
        before their layouts are chosen (a hook for presets whose rules depend on module
        classes, as HybridStrategy's ``pipeline=``); paths in ``storage_layout`` are
        relative to ``node``."""

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
