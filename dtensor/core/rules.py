"""Layout rules for whole pytrees: `LayoutMap`, logical axes, and `distribute`.

A pytree leaf's *path* is its keys joined by ``/`` (``"layers/0/mlp/kernel"``);
for Flax NNX state the trailing ``value`` is dropped. Rules are regular
expressions searched (``re.search``) in that path, first match wins, as in
Keras 3's ``LayoutMap``. Optimizer state paths end with their parameter's path
(``"opt_state/0/mu/layers/0/mlp/kernel"``), so a rule for a parameter also lays
out its optimizer state.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dtensor.core.arrays import relayout
from dtensor.core.layout import UNSHARDED, DimSpec, Layout, LayoutError
from dtensor.core.mesh import Mesh, current_mesh
from dtensor.core.tree import (
    is_array,
    is_box,
    is_leaf,
    is_node,
    is_variable,
    leaf_value,
    path_str,
    replace_value,
)

__all__ = [
    "LayoutMap",
    "distribute",
    "resolve_layouts",
    "flax_annotation",
    "ResolvedLayout",
]


# ----------------------------------------------------------------- Flax metadata
def flax_annotation(leaf: Any) -> tuple[Any, ...] | None:
    """The sharding names Flax metadata attaches to a leaf, if any.

    Reads ``nnx.with_partitioning`` (Variable metadata ``out_sharding`` /
    ``sharding_names`` / ``sharding``) and Linen's ``nn.Partitioned`` /
    ``nn.LogicallyPartitioned`` boxes (their ``names``).
    """
    if is_variable(leaf):
        meta = leaf.get_metadata()
        for key in ("out_sharding", "sharding_names", "sharding"):
            names = meta.get(key)
            if names is not None:
                return tuple(names)
        return None
    if is_box(leaf):
        names = getattr(leaf, "names", None)
        return tuple(names) if names is not None else None
    return None


# --------------------------------------------------------------------- LayoutMap
class LayoutMap:
    """Ordered rules from pytree paths to sharding specs, over one mesh.

    Args:
        mesh: the mesh the specs refer to (default: the current mesh).
        rules: ``(regex, specs)`` pairs, first match wins; ``specs`` has one
            entry per dimension (a mesh axis, a tuple of axes, a logical axis
            name, or ``UNSHARDED``/``None``).
        logical_axis_rules: ``(logical_name, mesh_axes)`` pairs (Flax style:
            ``("embed", "fsdp")``, ``("mlp", "tensor")``, ``("batch", "data")``);
            a name mapped to ``None`` is replicated.
        honor_annotations: whether Flax partitioning metadata on a leaf wins
            over the rules (default ``True``).

    Unmatched leaves are replicated.

    Examples:
        >>> import dtensor
        >>> mesh = dtensor.create_mesh([("data", 4), ("model", 2)])
        >>> lm = dtensor.LayoutMap(mesh, logical_axis_rules=[("mlp", "model")])
        >>> lm["dense.*kernel"] = (None, "mlp")
        >>> lm["dense_0/kernel"]
        Layout([UNSHARDED, 'model'], mesh=Mesh(data=4, model=2))
        >>> lm["dense_0/bias"] is None
        True
    """

    def __init__(
        self,
        mesh: Mesh | None = None,
        rules: Sequence[tuple[str, Sequence[DimSpec]]] | Mapping[str, Sequence[DimSpec]] = (),
        *,
        logical_axis_rules: Sequence[tuple[str, DimSpec]] | Mapping[str, DimSpec] = (),
        honor_annotations: bool = True,
    ) -> None:
        mesh = mesh if mesh is not None else current_mesh()
        if mesh is None:
            raise ValueError(
                "LayoutMap needs a mesh: pass LayoutMap(mesh, ...) or build it inside `with mesh:`."
            )
        self.mesh = mesh
        self.honor_annotations = honor_annotations
        self._rules: list[tuple[str, re.Pattern[str], tuple[DimSpec, ...]]] = []
        items = rules.items() if isinstance(rules, Mapping) else rules
        for pattern, specs in items:
            self[pattern] = specs
        logical = (
            logical_axis_rules.items()
            if isinstance(logical_axis_rules, Mapping)
            else logical_axis_rules
        )
        self.logical_axis_rules: dict[str, DimSpec] = {}
        for name, axes in logical:
            for axis in (axes,) if isinstance(axes, str) or axes is None else axes:
                if axis is not None and axis != UNSHARDED and axis not in mesh.dim_names:
                    raise LayoutError(
                        f"logical axis rule {name!r} -> {axes!r} names mesh axis {axis!r}, but the "
                        f"mesh has axes {mesh.dim_names}. Use one of those."
                    )
            self.logical_axis_rules[name] = axes

    def __setitem__(self, pattern: str, specs: Sequence[DimSpec]) -> None:
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(
                f"LayoutMap rule {pattern!r} is not a valid regular expression: {e}."
            ) from None
        if isinstance(specs, str):
            raise TypeError(
                f"LayoutMap rule {pattern!r} got specs {specs!r}, a string; give one spec per "
                f"dimension, e.g. ({specs!r}, None) for a matrix split on its rows."
            )
        rule = (pattern, compiled, tuple(specs))
        for i, (existing, _, _) in enumerate(self._rules):
            if existing == pattern:  # like a dict: a rule set again keeps its place
                self._rules[i] = rule
                return
        self._rules.append(rule)

    def __getitem__(self, path: str) -> Layout | None:
        found = self.match(path)
        return None if found is None else self.to_layout(found[1], path=path, rule=found[0])

    @property
    def rules(self) -> list[tuple[str, tuple[DimSpec, ...]]]:
        """The ``(regex, specs)`` rules, in match order."""
        return [(p, s) for p, _, s in self._rules]

    def __iter__(self) -> Iterator[str]:
        return iter([r[0] for r in self._rules])

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        rules = ", ".join(f"{p!r}: {s}" for p, _, s in self._rules)
        return f"LayoutMap({self.mesh!r}, {{{rules}}})"

    def match(self, path: str) -> tuple[str, tuple[DimSpec, ...]] | None:
        """The first ``(pattern, specs)`` whose regex is found in ``path``."""
        for pattern, compiled, specs in self._rules:
            if compiled.search(path):
                return pattern, specs
        return None

    def resolve_axis(self, name: DimSpec) -> DimSpec:
        """A mesh axis (or axes) for a spec entry that may be a logical name."""
        if name is None or name == UNSHARDED:
            return UNSHARDED
        if isinstance(name, tuple | list):
            out: list[str] = []
            for n in name:
                r = self.resolve_axis(n)
                out.extend(() if r in (None, UNSHARDED) else (r,) if isinstance(r, str) else r)
            return tuple(out) if out else UNSHARDED
        if name in self.mesh.dim_names:
            return name
        if name in self.logical_axis_rules:
            return self.resolve_axis(self.logical_axis_rules[name])
        return name  # Layout's validation names it as unknown.

    def to_layout(self, specs: Sequence[DimSpec], *, path: str = "", rule: str = "") -> Layout:
        """Specs (possibly logical) to a :class:`Layout` on this map's mesh."""
        resolved = [self.resolve_axis(s) for s in specs]
        try:
            return Layout(resolved, self.mesh)
        except LayoutError as e:
            raise LayoutError(f"{path or 'leaf'} (rule {rule!r}): {e}") from None

    def layout_for(self, path: str, leaf: Any) -> ResolvedLayout:
        """The layout for one leaf: its Flax annotation, else the first rule, else replicated."""
        value = leaf_value(leaf)
        shape = tuple(np.shape(value))
        ann = flax_annotation(leaf) if self.honor_annotations else None
        if ann is not None:
            layout = self.to_layout(ann, path=path, rule="flax annotation")
            layout.check_shape(shape, path)
            return ResolvedLayout(layout, "flax annotation")
        found = self.match(path)
        if found is None:
            return ResolvedLayout(Layout.replicated(self.mesh, len(shape)), None)
        pattern, specs = found
        if len(specs) != len(shape):
            raise LayoutError(
                f"LayoutMap rule {pattern!r} matches {path!r}, which has rank {len(shape)} "
                f"(shape {shape}), but the rule's specs {specs} have rank {len(specs)}. Make "
                "the regex more specific or give one spec per dimension."
            )
        layout = self.to_layout(specs, path=path, rule=pattern)
        layout.check_shape(shape, path)
        return ResolvedLayout(layout, pattern)


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedLayout:
    """A leaf's layout and the rule that produced it (``None``: no rule matched)."""

    layout: Layout
    rule: str | None


LayoutSource = LayoutMap | Callable[[str, Any], Any] | Layout | Any


def resolve_layouts(
    tree: Any, layouts: LayoutSource = None, *, mesh: Mesh | None = None
) -> tuple[Any, Any]:
    """The layout (and the rule behind it) for every array leaf of ``tree``.

    ``layouts`` is a :class:`LayoutMap`, a function ``(path, leaf) -> Layout``
    (returning ``None`` means replicated), a pytree of layouts matching ``tree``,
    or ``None`` (Flax annotations, else replicated, on ``mesh``).

    Returns:
        Two pytrees shaped like ``tree`` (NNX Variables and Linen boxes count
        as leaves; non-array leaves map to ``None``): the layouts and the rule
        descriptions.
    """
    _, treedef, out_layouts, out_rules = _resolve_flat(tree, layouts, mesh)
    return treedef.unflatten(out_layouts), treedef.unflatten(out_rules)


def _resolve_flat(
    tree: Any, layouts: LayoutSource, mesh: Mesh | None
) -> tuple[list[Any], Any, list[Any], list[Any]]:
    if layouts is None:
        mesh = mesh if mesh is not None else current_mesh()
        if mesh is None:
            raise ValueError("resolve_layouts needs layouts= or a mesh (mesh= or `with mesh:`).")
        layouts = LayoutMap(mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
    if not isinstance(layouts, LayoutMap | Layout) and not callable(layouts):
        lay_leaves = jax.tree.leaves(layouts, is_leaf=lambda v: isinstance(v, Layout) or v is None)
        if len(lay_leaves) != len(leaves):
            raise LayoutError(
                f"the layout tree has {len(lay_leaves)} leaves but the tree to distribute has "
                f"{len(leaves)}; give a tree of layouts with the same structure."
            )
    else:
        lay_leaves = [None] * len(leaves)
    out_layouts: list[Layout | None] = []
    out_rules: list[str | None] = []
    for (path, leaf), given in zip(leaves, lay_leaves, strict=True):
        p = path_str(path)
        value = leaf_value(leaf)
        if not is_array(value):
            out_layouts.append(None)
            out_rules.append(None)
            continue
        shape = tuple(np.shape(value))
        if isinstance(layouts, LayoutMap):
            r = layouts.layout_for(p, leaf)
            layout, rule = r.layout, r.rule
        elif isinstance(layouts, Layout):
            layout, rule = layouts, "given"
        elif callable(layouts):
            got = layouts(p, leaf)
            if isinstance(got, ResolvedLayout):
                layout, rule = got.layout, got.rule
            elif got is None:
                if mesh is None:
                    raise LayoutError(
                        f"the layout function returned None for {p!r} and no mesh= was given "
                        "to replicate it on; return a Layout or pass mesh=."
                    )
                layout, rule = Layout.replicated(mesh, len(shape)), None
            else:
                layout, rule = got, "function"
        else:
            layout, rule = given, "given"
            if layout is None:
                out_layouts.append(None)
                out_rules.append(None)
                continue
        if not isinstance(layout, Layout):
            raise TypeError(
                f"the layout for {p!r} is a {type(layout).__name__}, not a dtensor.Layout."
            )
        layout.check_shape(shape, p)
        out_layouts.append(layout)
        out_rules.append(rule)
    return leaves, treedef, out_layouts, out_rules


def distribute(tree: Any, layouts: LayoutSource = None, *, mesh: Mesh | None = None) -> Any:
    """Place every array of a pytree in its layout.

    ``tree`` may be a plain dict, Flax NNX state, a Flax NNX module or
    optimizer (updated in place and returned), Linen params (boxed or not) or
    an optax state. ``layouts`` is as in :func:`resolve_layouts`.

    Examples:
        >>> import dtensor, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("data", 4), ("model", 2)])
        >>> params = {"dense": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros((4,))}}
        >>> lm = dtensor.LayoutMap(mesh, [("kernel", (None, "model"))])
        >>> out = dtensor.distribute(params, lm)
        >>> dtensor.fetch_layout(out["dense"]["kernel"]).sharding_specs
        ('unsharded', 'model')
        >>> dtensor.fetch_layout(out["dense"]["bias"]).is_fully_replicated()
        True
    """
    if is_node(tree):
        from flax import nnx

        state = nnx.state(tree)
        nnx.update(tree, distribute(state, layouts, mesh=mesh))
        return tree
    leaves, treedef, lay, _ = _resolve_flat(tree, layouts, mesh)
    out = []
    for (path, leaf), layout in zip(leaves, lay, strict=True):
        if layout is None:
            out.append(leaf)
            continue
        out.append(replace_value(leaf, relayout(leaf_value(leaf), layout, name=path_str(path))))
    return treedef.unflatten(out)
