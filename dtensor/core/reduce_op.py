"""`ReduceOp`: how per-device values combine."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """A reduction across devices, with tf.distribute's names.

    Examples:
        >>> from dtensor import ReduceOp
        >>> ReduceOp.SUM, ReduceOp("mean")
        (ReduceOp.SUM, ReduceOp.MEAN)
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"

    def __repr__(self) -> str:
        return f"ReduceOp.{self.name}"

    def across(self, value: Any, axes: str | Sequence[str]) -> Any:
        """Inside ``jax.shard_map``: combine ``value`` over mesh ``axes`` (psum/pmean/pmax/pmin).

        Examples:
            >>> import jax, dtensor
            >>> mesh = dtensor.create_mesh([("x", 8)])
            >>> f = jax.shard_map(lambda b: dtensor.ReduceOp.MAX.across(b, "x"), mesh=mesh.jax_mesh,
            ...                   in_specs=jax.sharding.PartitionSpec("x"), out_specs=jax.sharding.PartitionSpec())
            >>> f(jax.numpy.arange(8.0))
            Array([7.], dtype=float32)
        """
        import jax

        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if not axes:
            return value
        fn = {
            ReduceOp.SUM: jax.lax.psum,
            ReduceOp.MEAN: jax.lax.pmean,
            ReduceOp.MAX: jax.lax.pmax,
            ReduceOp.MIN: jax.lax.pmin,
        }[self]
        return fn(value, axes)

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a ``ReduceOp`` or its name in any case (``"SUM"``, ``"sum"``)."""
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            raise ValueError(
                f"reduce op {op!r} is not one of SUM, MEAN, MAX, MIN; pass dtensor.ReduceOp.SUM "
                "or its name."
            ) from None
