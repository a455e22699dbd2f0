"""Per-tensor transforms between a checkpoint's tensors and a model's: transpose, split or merge
dimensions (head reshapes), permute a dimension (RoPE's interleaved <-> halves order), cast.

Each transform goes both ways (:meth:`Transform.apply` from the checkpoint's side to the
model's, :meth:`Transform.undo` back), and maps a *box* of the model's tensor (the
``(start, stop)`` of each dimension that one device holds) to the box of the checkpoint's
tensor to read (:meth:`Transform.source_box`), so a process reads only its slices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "AsType",
    "Box",
    "Transform",
    "astype",
    "is_lossless_cast",
    "merge_dims",
    "permute",
    "rope_permute",
    "split_dim",
    "transpose",
]

Box = tuple[tuple[int, int], ...]
Finish = Callable[[np.ndarray], np.ndarray]


class Transform:
    """One step from the checkpoint's side (``source``) to the model's (``target``)."""

    def shape(self, source: tuple[int, ...]) -> tuple[int, ...]:
        """The target shape of a source tensor of shape ``source``."""
        return source

    def unshape(self, target: tuple[int, ...]) -> tuple[int, ...]:
        """The source shape of a target tensor of shape ``target``."""
        return target

    def apply(self, x: np.ndarray) -> np.ndarray:
        """A source tensor as the target's."""
        return x

    def undo(self, y: np.ndarray) -> np.ndarray:
        """A target tensor as the source's."""
        return y

    def source_box(self, box: Box, source: tuple[int, ...]) -> tuple[Box, Finish]:
        """The source box covering the target ``box``, and what turns it into the target box."""
        return box, lambda x: x


class _Transpose(Transform):
    def __init__(self, perm: tuple[int, ...] | None) -> None:
        self.perm = perm

    def _perm(self, rank: int) -> tuple[int, ...]:
        return self.perm if self.perm is not None else tuple(range(rank))[::-1]

    def shape(self, source):
        return tuple(source[p] for p in self._perm(len(source)))

    def unshape(self, target):
        inv = np.argsort(self._perm(len(target)))
        return tuple(target[p] for p in inv)

    def apply(self, x):
        return np.transpose(x, self._perm(x.ndim))

    def undo(self, y):
        return np.transpose(y, np.argsort(self._perm(y.ndim)))

    def source_box(self, box, source):
        perm = self._perm(len(source))
        out = [(0, 0)] * len(perm)
        for j, p in enumerate(perm):
            out[p] = box[j]
        return tuple(out), lambda x: np.transpose(x, perm)

    def __repr__(self) -> str:
        return "transpose()" if self.perm is None else f"transpose{self.perm}"


def transpose(*perm: int) -> Transform:
    """Permute the dimensions: the target's dimension ``j`` is the source's ``perm[j]``;
    no argument reverses them (a Linear weight stored ``[out, in]`` read as ``[in, out]``).

    Examples:
        >>> import numpy as np
        >>> from dtensor.checkpoint import transpose
        >>> transpose().apply(np.zeros((3, 2))).shape, transpose(1, 2, 0).shape((2, 3, 4))
        ((2, 3), (3, 4, 2))
    """
    return _Transpose(tuple(perm) if perm else None)


def _sizes(sizes: Sequence[int], total: int, what: str) -> tuple[int, ...]:
    sizes = tuple(int(s) for s in sizes)
    if sizes.count(-1) > 1:
        raise ValueError(f"{what}: at most one size may be -1, got {sizes}.")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if known == 0 or total % known:
            raise ValueError(f"{what}: {total} does not divide into {sizes}.")
        sizes = tuple(total // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != total:
        raise ValueError(f"{what}: sizes {sizes} hold {math.prod(sizes)} elements, not {total}.")
    return sizes


class _Split(Transform):
    """Source dimension ``dim`` becomes target dimensions ``dim .. dim+len(sizes)-1``."""

    def __init__(self, dim: int, sizes: Sequence[int]) -> None:
        self.dim, self.sizes = dim, tuple(sizes)

    def _at(self, rank: int) -> int:
        return self.dim % rank

    def shape(self, source):
        d = self._at(len(source))
        return source[:d] + _sizes(self.sizes, source[d], repr(self)) + source[d + 1 :]

    def unshape(self, target):
        n = len(self.sizes)
        d = self.dim % (len(target) - n + 1)
        return target[:d] + (math.prod(target[d : d + n]),) + target[d + n :]

    def apply(self, x):
        return x.reshape(self.shape(x.shape))

    def undo(self, y):
        return y.reshape(self.unshape(y.shape))

    def source_box(self, box, source):
        d = self._at(len(source))
        sizes = _sizes(self.sizes, source[d], repr(self))
        n, inner = len(sizes), math.prod(sizes[1:])
        (a, b), rest = box[d], box[d + 1 : d + n]
        src = box[:d] + ((a * inner, b * inner),) + box[d + n :]

        def finish(x: np.ndarray) -> np.ndarray:
            y = x.reshape(x.shape[:d] + (b - a, *sizes[1:]) + x.shape[d + 1 :])
            index = (slice(None),) * (d + 1) + tuple(slice(lo, hi) for lo, hi in rest)
            return y[index]

        return src, finish

    def __repr__(self) -> str:
        return f"split_dim({self.dim}, {self.sizes})"


class _Merge(Transform):
    """Source dimensions ``dim .. dim+len(sizes)-1`` become target dimension ``dim``."""

    def __init__(self, dim: int, sizes: Sequence[int]) -> None:
        self.dim, self.sizes = dim, tuple(sizes)

    def shape(self, source):
        n = len(self.sizes)
        d = self.dim % (len(source) - n + 1)
        return source[:d] + (math.prod(source[d : d + n]),) + source[d + n :]

    def unshape(self, target):
        d = self.dim % len(target)
        return target[:d] + _sizes(self.sizes, target[d], repr(self)) + target[d + 1 :]

    def apply(self, x):
        return x.reshape(self.shape(x.shape))

    def undo(self, y):
        return y.reshape(self.unshape(y.shape))

    def source_box(self, box, source):
        n = len(self.sizes)
        d = self.dim % (len(source) - n + 1)
        sizes = source[d : d + n]
        inner = math.prod(sizes[1:])
        lo, hi = box[d]
        first, last = lo // inner, -(-hi // inner)
        src = box[:d] + ((first, last),) + tuple((0, s) for s in sizes[1:]) + box[d + 1 :]

        def finish(x: np.ndarray) -> np.ndarray:
            y = x.reshape(x.shape[:d] + (-1,) + x.shape[d + n :])
            index = (slice(None),) * d + (slice(lo - first * inner, hi - first * inner),)
            return y[index]

        return src, finish

    def __repr__(self) -> str:
        return f"merge_dims({self.dim}, {self.sizes})"


def split_dim(dim: int, sizes: Sequence[int]) -> Transform:
    """Split dimension ``dim`` into ``sizes`` (one may be -1): ``[heads * head_dim, d]`` ->
    ``[heads, head_dim, d]`` is ``split_dim(0, (heads, -1))``. Saving merges them back.

    Examples:
        >>> from dtensor.checkpoint import split_dim
        >>> split_dim(1, (4, -1)).shape((64, 128)), split_dim(1, (4, -1)).unshape((64, 4, 32))
        ((64, 4, 32), (64, 128))
    """
    return _Split(dim, sizes)


def merge_dims(dim: int, sizes: Sequence[int]) -> Transform:
    """Merge dimensions ``dim .. dim+len(sizes)-1`` (of sizes ``sizes``, one may be -1) into
    one: the inverse of :func:`split_dim`.

    Examples:
        >>> from dtensor.checkpoint import merge_dims
        >>> merge_dims(0, (4, -1)).shape((4, 16, 64)), merge_dims(0, (4, -1)).unshape((64, 64))
        ((64, 64), (4, 16, 64))
    """
    return _Merge(dim, sizes)


class _Permute(Transform):
    """Target index ``j`` along ``dim`` is source index ``order[j]``."""

    def __init__(self, dim: int, order: Callable[[int], np.ndarray], name: str) -> None:
        self.dim, self.order, self.name = dim, order, name

    def apply(self, x):
        return np.take(x, self.order(x.shape[self.dim]), axis=self.dim)

    def undo(self, y):
        return np.take(y, np.argsort(self.order(y.shape[self.dim])), axis=self.dim)

    def source_box(self, box, source):
        d = self.dim % len(source)
        idx = self.order(source[d])[box[d][0] : box[d][1]]
        if idx.size == 0:
            return box, lambda x: x
        lo = int(idx.min())
        src = box[:d] + ((lo, int(idx.max()) + 1),) + box[d + 1 :]
        return src, lambda x: np.take(x, idx - lo, axis=d)

    def __repr__(self) -> str:
        return self.name


def permute(dim: int, order: Sequence[int]) -> Transform:
    """Reorder dimension ``dim``: the target's index ``j`` is the source's ``order[j]``.

    Examples:
        >>> import numpy as np
        >>> from dtensor.checkpoint import permute
        >>> permute(0, [2, 0, 1]).apply(np.array([10, 11, 12])).tolist()
        [12, 10, 11]
    """
    fixed = np.asarray(order, np.int64)
    return _Permute(dim, lambda n: fixed, f"permute({dim}, {fixed.tolist()})")


def rope_permute(dim: int, head_dim: int, *, to: str = "halves") -> Transform:
    """Reorder the rotary dimensions of every head along ``dim`` (a multiple of ``head_dim``):
    ``to="halves"`` reads weights made for interleaved pairs (Meta's original Llama, GPT-J)
    into a model that rotates halves (Hugging Face's ``rotate_half``, ``examples/decoder.py``);
    ``to="interleaved"`` the other way. Hugging Face's Llama checkpoints already rotate halves.

    Examples:
        >>> import numpy as np
        >>> from dtensor.checkpoint import rope_permute
        >>> rope_permute(0, 4).apply(np.arange(8)).tolist()   # two heads of 4
        [0, 2, 1, 3, 4, 6, 5, 7]
    """
    if to not in ("halves", "interleaved") or head_dim % 2:
        raise ValueError(
            f"rope_permute(to={to!r}, head_dim={head_dim}): `to` is 'halves' or 'interleaved' "
            "and head_dim even."
        )
    half = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    one = half if to == "halves" else np.argsort(half)

    def order(n: int) -> np.ndarray:
        if n % head_dim:
            raise ValueError(f"rope_permute: dimension of {n} is not whole heads of {head_dim}.")
        return (np.arange(n // head_dim)[:, None] * head_dim + one[None, :]).reshape(-1)

    return _Permute(dim, order, f"rope_permute({dim}, {head_dim}, to={to!r})")


def is_lossless_cast(stored: Any, target: Any) -> bool:
    """Whether every ``stored`` value is exactly a ``target`` value: the same dtype, or a float
    widened (bfloat16/float16 -> float32, float32 -> float64, float8 -> bfloat16...).

    Examples:
        >>> import ml_dtypes, numpy as np
        >>> from dtensor.checkpoint.transforms import is_lossless_cast
        >>> is_lossless_cast(ml_dtypes.bfloat16, np.float32), is_lossless_cast(np.float16, np.float32)
        (True, True)
        >>> is_lossless_cast(np.float32, ml_dtypes.bfloat16), is_lossless_cast(np.int32, np.float32)
        (False, False)
    """
    import ml_dtypes

    stored, target = np.dtype(stored), np.dtype(target)
    if stored == target:
        return True
    try:
        a, b = ml_dtypes.finfo(stored), ml_dtypes.finfo(target)
    except ValueError:  # not both floats: ints, bools and anything else only as themselves
        return False
    return b.nmant >= a.nmant and b.maxexp >= a.maxexp and b.minexp <= a.minexp


class AsType(Transform):
    """A cast: to ``dtype`` when loading (``None``: the target's own dtype, lossless float
    widening only), to ``saved`` when saving (``None``: as the tree holds it)."""

    def __init__(self, dtype: Any = None, saved: Any = None) -> None:
        self.dtype = None if dtype is None else np.dtype(dtype)
        self.saved = None if saved is None else np.dtype(saved)

    def undo(self, y):
        return y if self.saved is None else y.astype(self.saved)

    def __repr__(self) -> str:
        return f"astype({self.dtype}, saved={self.saved})"


def astype(dtype: Any = None, *, saved: Any = None) -> Transform:
    """Cast on load and on save.

    Loading: ``dtype=None`` (the default) casts to whatever the target holds, but only a
    lossless float widening (a bfloat16 or float16 checkpoint into float32 master weights;
    :func:`is_lossless_cast`): any other difference (``int32``, ``uint8`` or ``bool`` into
    float32, float32 into bfloat16) is refused, naming the tensor. An explicit ``dtype``
    casts whatever the checkpoint stores to it: the way to ask for a lossy or integer cast.
    Saving: to ``saved`` (default: the tree's own dtype).

    Examples:
        >>> import jax.numpy as jnp
        >>> from dtensor.checkpoint import astype
        >>> astype(saved=jnp.bfloat16)
        astype(None, saved=bfloat16)
        >>> astype(jnp.bfloat16)   # load a float32 checkpoint into bfloat16 weights, as asked
        astype(bfloat16, saved=None)
    """
    return AsType(dtype, saved)
