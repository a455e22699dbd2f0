"""`ReduceOp`: how per-device values combine."""

from __future__ import annotations

import enum

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
