"""`MixedPrecision`: compute in a low-precision dtype on float32 master variables."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["MixedPrecision"]


def _float_dtype(value: Any, name: str) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"MixedPrecision({name}={value!r}) is not a floating dtype (got "
            f"{dtype if dtype is not None else type(value).__name__}); valid are floating dtypes "
            f"such as jnp.bfloat16, jnp.float16 or jnp.float32. Pass one of those as {name}=."
        )
    return dtype


@dataclasses.dataclass(frozen=True, slots=True)
class MixedPrecision:
    """Float32 master variables and optimizer state; compute and gathers in ``param_dtype``.

    Passed as ``mixed_precision=`` to any preset. Inside a step every read of
    a floating ``nnx.Param`` is cast to ``param_dtype`` (under
    FullyShardedStrategy the local shard is cast *before* it is gathered, so
    the all-gathers move ``param_dtype``), and a sharded parameter's gradient
    is reduce-scattered in ``reduce_dtype``. Variables and optimizer state
    keep their own dtype (the master copy); integer values and non-``Param``
    state (batch-norm statistics) are left alone.

    A model that pins its arithmetic to float32 (Flax's ``dtype=jnp.float32``
    convention: each module's ``dtype`` attribute is its computation dtype, as
    in Flax's own Gemma) computes in float32 on the bfloat16 reads, keeping
    float32 activations. ``module_dtype=True`` also sets that attribute to
    ``param_dtype`` on every module of the step's model that has a floating
    one, on the objects the step traces (the user's modules are untouched).

    Args:
        param_dtype: the dtype parameters are computed (and gathered) in.
        reduce_dtype: the dtype gradients are reduced in.
        module_dtype: also compute in ``param_dtype`` in modules whose
            ``dtype`` attribute says float32.

    Examples:
        >>> import strategies, jax.numpy as jnp
        >>> mp = strategies.MixedPrecision()
        >>> mp.param_dtype, mp.reduce_dtype
        (dtype(bfloat16), dtype('float32'))
        >>> s = strategies.MirroredStrategy(mixed_precision=mp)
        >>> s.mixed_precision == mp
        True
    """

    param_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = jnp.float32
    module_dtype: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _float_dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", _float_dtype(self.reduce_dtype, "reduce_dtype"))

    def cast(self, value: Any) -> Any:
        """``value`` in ``param_dtype`` when it is floating; unchanged otherwise."""
        dtype = getattr(value, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype == self.param_dtype:
            return value
        return value.astype(self.param_dtype)

    def set_module_dtype(self, module: Any) -> None:
        """With ``module_dtype``: ``module.dtype`` to ``param_dtype`` where it is a wider float.

        Examples:
            >>> import strategies, jax.numpy as jnp
            >>> from flax import nnx
            >>> layer = nnx.Linear(2, 2, dtype=jnp.float32, rngs=nnx.Rngs(0))
            >>> strategies.MixedPrecision(module_dtype=True).set_module_dtype(layer)
            >>> layer.dtype
            dtype(bfloat16)
        """
        if not self.module_dtype:
            return
        dtype = getattr(module, "dtype", None)
        if dtype is None:
            return
        try:
            wider = jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype) != self.param_dtype
        except TypeError:  # not a dtype (None, or another meaning of the name)
            return
        if wider and np.dtype(dtype).itemsize > self.param_dtype.itemsize:
            module.dtype = self.param_dtype


def check_mixed_precision(value: Any) -> MixedPrecision | None:
    """``mixed_precision=`` as given to a preset, checked: ``None`` or a :class:`MixedPrecision`."""
    if value is None or isinstance(value, MixedPrecision):
        return value
    raise TypeError(
        f"mixed_precision={value!r} is a {type(value).__name__}, not a "
        "strategies.MixedPrecision; valid are None (compute in the variables' dtype) or "
        "strategies.MixedPrecision(param_dtype=..., reduce_dtype=...). Wrap the dtypes in "
        "strategies.MixedPrecision."
    )
