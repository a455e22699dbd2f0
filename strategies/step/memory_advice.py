"""What would lower a step's memory, given the preset in use (for ``explain``'s verdicts).

:func:`memory_advice` names only the options the preset has and has not
turned on: a FullyShardedStrategy user is told about ``remat``,
``mixed_precision``, ``reshard_after_forward`` and ``offload_optimizer``
(where this version of the preset takes them) and more chips, never to
"shard the variables"; a data-parallel user is told to shard them.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["accepts", "gather_itemsize_ratio", "memory_advice"]


def accepts(cls: type, option: str) -> bool:
    """Whether ``cls``'s constructor takes the keyword ``option``.

    Examples:
        >>> import strategies
        >>> from strategies.step.memory_advice import accepts
        >>> accepts(strategies.FullyShardedStrategy, "min_shard_bytes")
        True
        >>> accepts(strategies.MirroredStrategy, "min_shard_bytes")
        False
    """
    try:
        return option in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False


def gather_itemsize_ratio(strategy: Any) -> float:
    """The gathered dtype's item size over float32's: 0.5 under a bfloat16 ``mixed_precision``."""
    import numpy as np

    mp = getattr(strategy, "mixed_precision", None)
    dtype = getattr(mp, "param_dtype", None)
    if dtype is None:
        return 1.0
    return np.dtype(dtype).itemsize / 4


def memory_advice(strategy: Any) -> str:
    """One sentence: what would help this preset's step fit.

    Examples:
        >>> import strategies
        >>> from strategies.step.memory_advice import memory_advice
        >>> "FullyShardedStrategy" in memory_advice(strategies.MirroredStrategy())
        True
        >>> "FullyShardedStrategy" in memory_advice(strategies.FullyShardedStrategy())
        False
    """
    cls = type(strategy)
    fsdp = "fsdp" in strategy.mesh.dim_names and "fsdp" in strategy.batch_axes
    if not fsdp:
        return (
            f"{cls.__name__} keeps a whole copy of the variables it does not split on every "
            "device: shard them (FullyShardedStrategy / HybridStrategy), shrink the batch, or "
            "use more chips."
        )
    tips: list[str] = []
    if getattr(strategy, "gather_at_read", True) is False:
        tips.append("gather_at_read=True (gather each weight at its read, free it after)")
    options = [
        (
            "remat",
            None,
            "remat=(YourBlock,) (recompute each block in the backward pass; keeps only block inputs)",
        ),
        (
            "mixed_precision",
            None,
            "mixed_precision=strategies.MixedPrecision(param_dtype=jnp.bfloat16) (half the "
            "gathered weights and activations)",
        ),
        (
            "reshard_after_forward",
            False,
            "reshard_after_forward=True (free gathered weights after the forward pass)",
        ),
        (
            "offload_optimizer",
            False,
            "offload_optimizer=True (optimizer state in host memory)",
        ),
    ]
    # Where this version of the preset lacks an option, the model can do the same itself.
    by_model = {
        "remat": "nnx.remat around each block's call (activation checkpointing in the model)",
        "mixed_precision": "bfloat16 compute in the model (cast each weight read; float32 "
        "variables)",
    }
    mp = getattr(strategy, "mixed_precision", None)
    if mp is not None and not getattr(mp, "module_dtype", True):
        # before offload: it costs no host traffic (Flax's Gemma 3 12B, v5e:4x4: 16.39 -> 13.44 GiB)
        tips.append(
            "MixedPrecision(module_dtype=True) (bfloat16 arithmetic and activations in modules "
            "whose dtype attribute pins float32, as Flax's own Gemma's do; bf16 reads alone "
            "keep float32 activations there)"
        )
    for option, off, tip in options:
        if not accepts(cls, option):
            if option in by_model:
                tips.append(by_model[option])
        elif getattr(strategy, option, off) in (off, ()):
            tips.append(tip)
    tips += ["a smaller batch per chip", "more chips (the sharded state divides by their number)"]
    return "Try " + "; ".join(tips) + "."
