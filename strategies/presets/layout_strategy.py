"""`LayoutStrategy`: the general preset — any mesh, a `LayoutMap`, the model's own annotations."""

from __future__ import annotations

from typing import Any

from dtensor import Layout, LayoutMap, Mesh
from strategies.base import Strategy
from strategies.reads.mixed_precision import MixedPrecision

__all__ = ["LayoutStrategy"]


class LayoutStrategy(Strategy):
    """Variables by the model's Flax annotations, then the map's rules, else replicated.

    Args:
        mesh: the mesh (Explicit axes for models whose layers pass
            ``out_sharding=``; see :func:`dtensor.create_mesh`).
        layout_map: the rules (default: none — annotations only).
        batch_dim_name: the mesh axis the batch is split over (default: the first).

    Examples:
        >>> import dtensor, strategies, jax.numpy as jnp
        >>> mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
        >>> s = strategies.LayoutStrategy(mesh, dtensor.LayoutMap(mesh, [("kernel", (None, "model"))]))
        >>> s.variable_layout("dense/kernel", jnp.zeros((8, 4)))
        Layout([UNSHARDED, 'model'], mesh=Mesh(batch=4, model=2))
        >>> s.batch_layout(2)
        Layout(['batch', UNSHARDED], mesh=Mesh(batch=4, model=2))
    """

    name = "layout"

    def __init__(
        self,
        mesh: Mesh,
        layout_map: LayoutMap | None = None,
        batch_dim_name: str | None = None,
        *,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        batch_dim_name = batch_dim_name if batch_dim_name is not None else mesh.dim_names[0]
        mesh.check_axis(batch_dim_name, "batch_dim_name")
        self.layout_map = layout_map if layout_map is not None else LayoutMap(mesh)
        if self.layout_map.mesh != mesh:
            raise ValueError(
                f"the LayoutMap is over {self.layout_map.mesh!r} but the strategy's mesh is {mesh!r}; "
                "build the LayoutMap on the same mesh."
            )
        super().__init__(
            mesh,
            batch_axes=(batch_dim_name,),
            honor_annotations=True,
            mixed_precision=mixed_precision,
        )

    def variable_layout(self, path: str, leaf: Any) -> Layout:
        return self.layout_map.layout_for(path, leaf).layout

    def rule_name(self, path: str, leaf: Any) -> str | None:
        found = self.layout_map.match(path)
        return found[0] if found else None

    def _annotation_layout(self, path: str, leaf: Any, names: tuple[Any, ...]) -> Layout:
        return self.layout_map.layout_for(path, leaf).layout
