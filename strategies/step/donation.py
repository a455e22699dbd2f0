"""Donated positional arguments of a step (``run(..., donate_argnums=...)``), as ``jax.jit`` donates.

A functional step ``step(params, opt_state, batch) -> (params, opt_state,
loss)`` returns new parameters and optimizer state the size of the old ones;
donating the old ones lets XLA write the new ones into their buffers instead
of holding both. NNX models and optimizers need nothing: their state is
donated always.

The compiled step takes the arrays of a call in two lists, donated and kept
(:class:`Step`), so the donation is per leaf: a donated positional argument
donates every array leaf of its pytree. Arrays that ``run`` places first
(host data, arrays on one device) are donated as the placed copy; the
caller's own stays valid.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from dtensor.core.tree import is_node
from strategies.step import args as argkinds

__all__ = [
    "Call",
    "Step",
    "check_argnums",
    "check_reduction",
    "donated_mask",
    "jit_step",
    "prepare_call",
]


def check_argnums(donate_argnums: Any, args: Any, method: str) -> frozenset[int]:
    """The positional indices ``donate_argnums`` names (negatives from the end), checked."""
    given = (donate_argnums,) if not isinstance(donate_argnums, Sequence) else donate_argnums
    n = len(args) if isinstance(args, tuple | list) else 0
    valid = f"0 to {n - 1} (or -{n} to -1)" if n else "none: args=() has no positional arguments"
    out = set()
    for given_i in given:
        i = _position(given_i)
        if i is None:
            raise TypeError(
                f"{method}(donate_argnums={donate_argnums!r}): donate_argnums must be an int "
                f"or a sequence of ints, positions in args=, but it holds {given_i!r} (a "
                f"{type(given_i).__name__}). Valid positions: {valid}. Pass e.g. "
                f"donate_argnums=(0, 1) to donate the first two arguments."
            )
        if not -n <= i < n:
            raise ValueError(
                f"{method}(donate_argnums={donate_argnums!r}): position {i} is out of range for "
                f"the {n} positional argument{'' if n == 1 else 's'} in args=. Valid positions: "
                f"{valid}. Name positions of args= (keyword arguments cannot be donated: pass "
                "them positionally)."
            )
        out.add(i % n)
    return frozenset(out)


def _position(i: Any) -> int | None:
    """``i`` as a position (ints, numpy integers), or ``None`` (``True`` is not a position)."""
    if isinstance(i, bool | np.bool_):
        return None
    try:
        return operator.index(i)
    except TypeError:
        return None


def donated_mask(with_paths: list[tuple[Any, Any]], argnums: frozenset[int]) -> tuple[bool, ...]:
    """For each array leaf of the flattened ``(args, kwargs)``, whether it is donated."""
    if not argnums:
        return ()
    return tuple(
        path[0].idx == 0 and path[1].idx in argnums
        for path, v in with_paths
        if argkinds.kind_of(v) is argkinds.ARRAY
    )


def split(mask: tuple[bool, ...], arrays: list[Any]) -> tuple[list[Any], list[Any]]:
    """``arrays`` as (donated, kept) by ``mask``."""
    donated = [a for a, d in zip(arrays, mask, strict=True) if d]
    kept = [a for a, d in zip(arrays, mask, strict=True) if not d]
    return donated, kept


def merge(mask: tuple[bool, ...], donated: list[Any], kept: list[Any]) -> list[Any]:
    """The inverse of :func:`split`."""
    given, rest = iter(donated), iter(kept)
    return [next(given) if d else next(rest) for d in mask]


class Step:
    """A compiled step called as ``step(state, arrays)``.

    ``jitted`` is the ``jax.jit`` function; it takes ``(state, *step.args(arrays))``
    (what :func:`dtensor.explain` is given, so it compiles the same program).
    """

    __slots__ = ("jitted", "mask")

    def __init__(self, jitted: Any, mask: tuple[bool, ...] = ()) -> None:
        self.jitted = jitted
        self.mask = mask if any(mask) else ()

    def args(self, arrays: list[Any]) -> tuple[list[Any], ...]:
        """The array arguments of ``jitted``: ``(arrays,)``, or ``(donated, kept)``."""
        return split(self.mask, arrays) if self.mask else (arrays,)

    def __call__(self, state: Any, arrays: list[Any]) -> Any:
        return self.jitted(state, *self.args(arrays))


def jit_step(
    pure: Callable[[Any, list[Any]], Any], *, has_state: bool, mask: tuple[bool, ...]
) -> Step:
    """``pure(state, arrays)`` as one ``jax.jit``: the NNX state donated, and the arrays ``mask`` names."""
    state = (0,) if has_state else ()
    if not any(mask):
        return Step(jax.jit(pure, donate_argnums=state))

    def pure_split(state: Any, donated: list[Any], kept: list[Any]) -> Any:
        return pure(state, merge(mask, donated, kept))

    return Step(jax.jit(pure_split, donate_argnums=(*state, 1)), mask)


def check_reduction(
    mask: tuple[bool, ...], strategy: Any, method: str, donate_argnums: Any
) -> None:
    """Raise if this step is compiled by the explicit reduction of ``cross_device_ops``."""
    if not any(mask):
        return
    raise ValueError(
        f"{method}(donate_argnums={donate_argnums!r}): {strategy!r} compiles steps with the "
        f"explicit gradient reduction of {strategy.gradient_reduction!r}, which does not donate "
        "array arguments. NNX models and optimizers are donated already; drop donate_argnums, "
        "or use the strategy's default cross_device_ops."
    )


class Call(NamedTuple):
    """A ``run``/``explain`` call's arguments, checked and sorted."""

    fn: Callable[..., Any]
    with_paths: list[tuple[Any, Any]]  # (path, leaf) of (args, kwargs), NNX nodes whole
    treedef: Any
    mask: tuple[bool, ...]  # per array leaf: donated
    flat: list[Any]
    nodes: list[Any]  # the NNX modules and optimizers among the leaves


def prepare_call(
    strategy: Any,
    fn: Any,
    args: Any,
    kwargs: Any,
    donate_argnums: Any,
    method: str,
    *,
    explicit_reduction: bool,
) -> Call:
    """Check ``fn``, flatten ``(args, kwargs)`` and work out the donation, before anything compiles.

    ``explicit_reduction``: the step is compiled by the strategy's explicit
    gradient reduction, which refuses donated arrays.
    """
    fn = argkinds.check_callable(fn, method)
    with_paths, treedef = argkinds.flatten_args(args, kwargs)
    mask = donated_mask(with_paths, check_argnums(donate_argnums, args, method))
    if explicit_reduction and strategy.gradient_reduction is not None:
        check_reduction(mask, strategy, method, donate_argnums)
    flat = [v for _, v in with_paths]
    nodes = [v for v in flat if is_node(v)]
    return Call(fn, with_paths, treedef, mask, flat, nodes)
