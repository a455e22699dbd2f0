"""`TensorParallelStrategy`: Megatron column/row rules, a thin preset over `HybridStrategy`.

``HybridStrategy`` (:mod:`strategies.hybrid`), :func:`megatron_specs` and :func:`expert_dim`
are re-exported from here, where they were first defined.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dtensor import LayoutMap
from strategies.hybrid.rules import expert_dim, megatron_specs
from strategies.hybrid.strategy import HybridStrategy
from strategies.reads.mixed_precision import MixedPrecision

__all__ = ["HybridStrategy", "TensorParallelStrategy", "expert_dim", "megatron_specs"]


class TensorParallelStrategy(HybridStrategy):
    """Megatron tensor parallelism over ``tensor_parallel`` devices, data parallel across the rest.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> s = strategies.TensorParallelStrategy(tensor_parallel=2)
        >>> s.mesh
        Mesh(data=4, fsdp=1, tensor=2)
        >>> s.variable_layout("mlp/down/kernel", jnp.zeros((256, 64))).sharding_specs
        ('tensor', 'unsharded')
    """

    name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel: int = 2,
        *,
        rules: LayoutMap | Sequence[tuple[str, Sequence[Any]]] | None = None,
        devices: Sequence[Any] | None = None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        super().__init__(
            data=-1,
            fsdp=1,
            tensor=tensor_parallel,
            rules=rules,
            devices=devices,
            mixed_precision=mixed_precision,
        )
