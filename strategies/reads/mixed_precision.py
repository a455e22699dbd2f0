"""`MixedPrecision`: compute in a low-precision dtype on float32 master variables."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

__all__ = ["MixedPrecision", "to_bfloat16"]


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

    A float32 read of one layer of a scanned stack (``nnx.scan``) is cast to
    bfloat16 by its bits (rounded to nearest even: the values XLA's convert
    gives), not by a convert: libtpu moves a convert of a scanned layer's
    weights out of the loop, casting every layer's shard whole ahead of it and
    holding that bfloat16 copy (2 bytes a parameter) through the step; the
    bits stay in the loop, one layer at a time (Mixtral 8x7B on v5p-64,
    ``fsdp=2 expert=8 tensor=2``: 28.75 GiB a chip with the convert, 25.9 GiB
    without; the same floor). Other reads are converts.

    Args:
        param_dtype: the dtype parameters are computed (and gathered) in.
        reduce_dtype: the dtype gradients are reduced in.
        module_dtype: also compute in ``param_dtype`` in modules whose
            ``dtype`` attribute says float32.
        hoist_casts: cast scanned layers with XLA's convert too, which the
            compiler may move out of the loop (above).

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
    hoist_casts: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _float_dtype(self.param_dtype, "param_dtype"))
        object.__setattr__(self, "reduce_dtype", _float_dtype(self.reduce_dtype, "reduce_dtype"))

    def cast(self, value: Any) -> Any:
        """``value`` in ``param_dtype`` when it is floating; unchanged otherwise."""
        dtype = getattr(value, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype == self.param_dtype:
            return value
        return value.astype(self.param_dtype)

    def cast_layer(self, value: Any) -> Any:
        """:meth:`cast` for a read of one layer of a stack inside a scanned loop: float32 to
        bfloat16 by the bits (:func:`to_bfloat16`) unless ``hoist_casts``."""
        dtype = getattr(value, "dtype", None)
        if not self.hoist_casts and dtype == np.float32 and self.param_dtype == jnp.bfloat16:
            return to_bfloat16(value)
        return self.cast(value)

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


def to_bfloat16(x: Any) -> jax.Array:
    """``x.astype(jnp.bfloat16)`` for float32 ``x``, computed from its bits (round to nearest
    even; a NaN becomes the quiet NaN of its sign, as a convert makes it), which the compiler
    cannot move out of a loop as it moves a convert (:class:`MixedPrecision`).

    Differentiated as a convert: its tangent is ``tangent.astype(jnp.bfloat16)``, so forward
    mode (``jax.jvp``, ``jax.jacfwd``, Hessian-vector products) works and reverse mode gives
    the cotangent in float32.

    Args:
        x: a float32 array.

    Returns:
        ``x`` in bfloat16, bit for bit what ``x.astype(jnp.bfloat16)`` gives.

    Raises:
        TypeError: ``x`` is not float32.

    Examples:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> from strategies.reads.mixed_precision import to_bfloat16
        >>> x = jnp.asarray([1.0, 1.00390625, 1.01171875, -3e38, np.inf, 1e-40], jnp.float32)
        >>> bool((to_bfloat16(x) == x.astype(jnp.bfloat16)).all())
        True
        >>> jax.jvp(to_bfloat16, (x,), (jnp.ones_like(x),))[1].dtype
        dtype(bfloat16)
    """
    x = jnp.asarray(x)
    if x.dtype != np.float32:
        raise TypeError(
            f"to_bfloat16 got a {x.dtype} array of shape {x.shape}; it casts float32 only (by "
            "its bits). Cast other dtypes with x.astype(jnp.bfloat16)."
        )
    return _to_bfloat16_p.bind(x)


def _bits_to_bfloat16(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    odd = (bits >> 16) & jnp.uint32(1)
    rounded = (bits + jnp.uint32(0x7FFF) + odd) >> 16
    # A NaN (exponent all ones, mantissa not zero) would round into an infinity or carry into
    # the sign: it becomes the quiet NaN of its own sign (0x7FC0 or 0xFFC0), as a convert's.
    nan = (bits & jnp.uint32(0x7FFFFFFF)) > jnp.uint32(0x7F800000)
    quiet = ((bits >> 16) & jnp.uint32(0x8000)) | jnp.uint32(0x7FC0)
    out = jax.lax.select(nan, quiet, rounded).astype(jnp.uint16)
    return jax.lax.bitcast_convert_type(out, jnp.bfloat16)


# A primitive (lowered to the bit operations above, differentiated as a convert), not a
# custom_jvp: jax 0.10's partial evaluation of a scan (the loop-invariant hoisting in its
# linearisation) inlines a custom_jvp function whose input varies over the loop and drops its
# rule (jax 0.12's stages the call out instead), so a scanned step's forward pass was
# differentiated through the bit operations, whose derivative is zero: Hessian-vector
# products through scanned layers came out wrong, and explain's minimum lost the scanned
# weights. A custom_vjp has no forward mode at all. A primitive keeps its rules through every
# transformation, and a differentiated step's jaxpr shows the cast as one equation of the
# weight (dtensor.analysis.minimum follows a weight through it).
_to_bfloat16_p = jcore.Primitive("to_bfloat16")
_to_bfloat16_p.def_impl(jax.jit(_bits_to_bfloat16))
_to_bfloat16_p.def_abstract_eval(lambda x: x.update(dtype=np.dtype(jnp.bfloat16), weak_type=False))
mlir.register_lowering(_to_bfloat16_p, mlir.lower_fun(_bits_to_bfloat16, multiple_results=False))
ad.defjvp(_to_bfloat16_p, lambda tangent, x: tangent.astype(jnp.bfloat16))
batching.defvectorized(_to_bfloat16_p)
