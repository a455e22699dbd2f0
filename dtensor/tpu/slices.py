"""Cloud TPU slices by name: accelerator type ↔ chip grid ↔ torus links, no libtpu needed.

A user rents a slice by its accelerator type (``v5p-128``, ``v5litepod-16``,
``v6e-256``, ``v4-128``: the number counts TensorCores on v4/v5p, 2 a chip,
and chips on v5e/v6e) or by generation and chip grid (``v5p:4x4x4``). What
the TPU compiler makes of a program depends on more than the chip count: on a
slice whose grid is a torus (wraparound links) an FSDP gather over 64 chips is
an all-gather; on the same grid without the links, an all-reduce of a
zero-padded buffer (3x the bytes and temporaries). :func:`describe_slice`
gives the slice as Cloud TPU builds it, so ahead-of-time compiles see the
machine a job will run on:

- v4 and v5p: a 3-D grid of chips, one device a chip (megacore), 2x2x1 chips a
  host. A slice whose every dimension is a multiple of 4 (v5p-128 = 4x4x4 and
  up) is a torus in all three dimensions; smaller slices (v5p-64 = 2x4x4 and
  below) have no wraparound links. The shapes ``k x k x 2k`` and
  ``k x 2k x 2k`` (``k`` a multiple of 4: 4x4x8, 4x8x8, 8x8x16...) can also
  be built as *twisted* tori (Cloud TPU's v4 documentation): name them with
  the ``_twisted`` suffix (``"v4:4x4x8_twisted"``); without it they are the
  ordinary torus, as Cloud TPU's accelerator types give them.
- tpu7x (Ironwood): a 3-D grid as v5p's (``tpu7x-128`` = 4x4x4, a torus;
  ``tpu7x-8`` = 2x2x1, one host of 4 chips), the number counting TensorCores,
  2 a chip; each TensorCore is a JAX device (libtpu has no megacore for it),
  so a slice has twice as many devices as chips.
- v5e and v6e: a 2-D grid of chips, 2x2 a host; only a dimension of 16 chips
  (the full pod's side) wraps: v5e-256 / v6e-256 (16x16) on both, v5e-128 /
  v6e-128 (8x16) on the long one, smaller slices on none.

``wrap=`` overrides the links for a reservation that differs.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = ["SliceError", "TpuSlice", "accelerator_types", "describe_slice"]

# Generation names as users write them -> ours (libtpu's topology names take ours).
_GENERATIONS = {
    "v4": "v4",
    "v5p": "v5p",
    "v5": "v5p",
    "v5e": "v5e",
    "v5litepod": "v5e",
    "v6e": "v6e",
    "tpu7x": "tpu7x",
    "v7x": "tpu7x",
    "ironwood": "tpu7x",
}
_THREE_D = {"v4", "v5p", "tpu7x"}
# Accelerator-type numbers count TensorCores on v4/v5p/tpu7x (2 a chip), chips on v5e/v6e.
_CORES_PER_CHIP = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1, "tpu7x": 2}
# Devices a chip: v4/v5p run megacore (one device a chip); Ironwood's two TensorCores are two
# devices (libtpu has no megacore configuration for it).
DEVICES_PER_CHIP = {"v4": 1, "v5p": 1, "v5e": 1, "v6e": 1, "tpu7x": 2}
# Chip grids of the 2-D generations and of the 3-D ones below a full torus (by chip count).
_GRIDS_2D = {
    1: (1, 1),
    4: (2, 2),
    8: (2, 4),
    16: (4, 4),
    32: (4, 8),
    64: (8, 8),
    128: (8, 16),
    256: (16, 16),
}
_SMALL_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}
_MAX_CHIPS = {"v4": 4096, "v5p": 8960, "v5e": 256, "v6e": 256, "tpu7x": 9216}

EXAMPLES = (
    "'v5p-128', 'v5litepod-16', 'v6e-256', 'v4-128', 'tpu7x-128', 'v5p:4x4x4', 'v5e:4x4', "
    "'tpu7x:4x4x4'"
)


class SliceError(ValueError):
    """A TPU slice name that Cloud TPU does not build."""


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """One Cloud TPU slice: its generation, chip grid and links.

    Attributes:
        generation: ``"v4"``, ``"v5p"``, ``"v5e"``, ``"v6e"`` or ``"tpu7x"`` (Ironwood).
        grid: chips along each dimension (3 on v4/v5p, 2 on v5e/v6e).
        wrap: wraparound (torus) links along x, y, z.
        twisted: a twisted torus (only ``k x k x 2k`` / ``k x 2k x 2k``).
        chip_config: libtpu's chip configuration (``"megacore"``: one device
            a chip on v4/v5p; ``"default"`` on v5e/v6e, and on tpu7x, whose two
            TensorCores are two devices).
        chips_per_host: chips of one host along x, y, z.
    """

    generation: str
    grid: tuple[int, ...]
    wrap: tuple[bool, bool, bool]
    twisted: bool = False
    chip_config: str = "default"
    chips_per_host: tuple[int, int, int] = (2, 2, 1)

    @property
    def chips(self) -> int:
        """Chips in the slice."""
        return math.prod(self.grid)

    @property
    def devices(self) -> int:
        """JAX devices in the slice: one a chip, two a tpu7x chip."""
        return self.chips * DEVICES_PER_CHIP[self.generation]

    @property
    def grid_name(self) -> str:
        """libtpu's topology name: ``"v5p:4x4x4"`` (``_twisted`` appended if so)."""
        return f"{self.generation}:{'x'.join(map(str, self.grid))}" + (
            "_twisted" if self.twisted else ""
        )

    @property
    def accelerator_type(self) -> str:
        """Cloud TPU's accelerator type: ``"v5p-128"``, ``"v5litepod-16"``, ``"v6e-256"``."""
        prefix = "v5litepod" if self.generation == "v5e" else self.generation
        return f"{prefix}-{self.chips * _CORES_PER_CHIP[self.generation]}"

    @property
    def is_torus(self) -> bool:
        """Whether any dimension has wraparound links."""
        return any(self.wrap)

    def __str__(self) -> str:
        links = "torus " + "".join("xyz"[i] for i, w in enumerate(self.wrap) if w)
        return (
            f"{self.accelerator_type} ({self.grid_name}, {self.chips} chips, "
            f"{'twisted ' if self.twisted else ''}{links if self.is_torus else 'no wraparound links'})"
        )


def _grid_for_chips(generation: str, chips: int, name: str) -> tuple[int, ...]:
    """The chip grid Cloud TPU gives an accelerator type of ``chips`` chips."""
    if generation not in _THREE_D:
        if chips in _GRIDS_2D:
            return _GRIDS_2D[chips]
    elif chips in _SMALL_3D:
        return _SMALL_3D[chips]
    elif chips == 1 and generation == "tpu7x":  # tpu7x-2: one chip (tpu7x-standard-1t)
        return (1, 1, 1)
    elif chips % 64 == 0:
        # Full slices: every side a multiple of 4; the most cubic such grid (the
        # smallest longest side, then the smallest sum), sides ascending.
        best: tuple[int, int, int] | None = None
        for a in range(4, round(chips ** (1 / 3)) + 5, 4):
            for b in range(a, chips // a + 1, 4):
                c, rest = divmod(chips, a * b)
                if rest or c < b or c % 4:
                    continue
                if best is None or (c, a + b + c) < (best[2], sum(best)):
                    best = (a, b, c)
        if best is not None:
            return best
    sizes = accelerator_types(generation)
    raise SliceError(
        f"tpu_topology({name!r}): Cloud TPU builds no {generation} slice of {chips} chips. "
        f"{generation} accelerator types: {', '.join(sizes[:10])}{', ...' if len(sizes) > 10 else ''} "
        f"(the number counts {'TensorCores, 2 a chip' if generation in _THREE_D else 'chips'})."
    )


def _default_wrap(generation: str, grid: tuple[int, ...]) -> tuple[bool, bool, bool]:
    if generation in _THREE_D:
        full = all(d % 4 == 0 for d in grid)
        return (full, full, full)
    return (grid[0] == 16, grid[1] == 16, False)


def _can_twist(grid: tuple[int, ...]) -> bool:
    a, b, c = sorted(grid)
    return a % 4 == 0 and ((a == b and c == 2 * a) or (b == c == 2 * a))


def _parse_wrap(wrap: object, name: str) -> tuple[bool, bool, bool]:
    if isinstance(wrap, bool):
        return (wrap, wrap, wrap)
    items = tuple(wrap) if isinstance(wrap, tuple | list) else ()
    if len(items) in (2, 3) and all(isinstance(w, bool) for w in items):
        return (items + (False,))[:3]  # type: ignore[return-value]
    raise SliceError(
        f"tpu_topology({name!r}, wrap={wrap!r}): wrap must be a bool (all dimensions) or one "
        "bool per grid dimension, e.g. wrap=(True, True, True) for a 4x4x4 torus or "
        "wrap=(False, True) for links on a v5e 8x16 slice's long side only."
    )


def describe_slice(name: str, *, wrap: object = None) -> TpuSlice:
    """The slice Cloud TPU builds for ``name``: its grid, links and chip configuration.

    Args:
        name: Cloud TPU's accelerator type (``"v5p-128"``, ``"v5litepod-16"``
            or ``"v5e-16"``, ``"v6e-256"``, ``"v4-128"``) or a generation and
            chip grid (``"v5p:4x4x4"``, ``"v5e:4x4"``; ``_twisted`` /
            ``_untwisted`` after a twistable 3-D grid).
        wrap: override the wraparound links: a bool for every dimension or one
            per dimension. ``None`` (default): as Cloud TPU builds the slice.

    Returns:
        The :class:`TpuSlice`.

    Raises:
        SliceError: a name Cloud TPU does not build, or a bad ``wrap``.

    Examples:
        >>> from dtensor.tpu.slices import describe_slice
        >>> print(describe_slice("v5p-128"))
        v5p-128 (v5p:4x4x4, 64 chips, torus xyz)
        >>> print(describe_slice("v5e:4x4"))
        v5litepod-16 (v5e:4x4, 16 chips, no wraparound links)
        >>> describe_slice("v5e-128").wrap
        (False, True, False)
        >>> describe_slice("v4:4x4x8_twisted").grid_name
        'v4:4x4x8_twisted'
    """
    if not isinstance(name, str) or not name.strip():
        raise SliceError(
            f"tpu_topology(name={name!r}): the name must be a string such as {EXAMPLES}."
        )
    text = name.strip().lower()
    twisted = False
    if m := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)+)(_twisted|_untwisted)?", text):
        gen_word, dims, suffix = m.groups()
        generation = _GENERATIONS.get(gen_word)
        grid = tuple(int(d) for d in dims.split("x"))
        twisted = suffix == "_twisted"
        if generation is None:
            raise SliceError(
                f"tpu_topology({name!r}): unknown TPU generation {gen_word!r}; Cloud TPU's are "
                f"v4, v5p, v5e (v5litepod), v6e and tpu7x (Ironwood). Examples: {EXAMPLES}."
            )
        rank = 3 if generation in _THREE_D else 2
        if len(grid) == 3 and rank == 2 and grid[2] == 1:
            grid = grid[:2]
        if len(grid) != rank or min(grid) < 1:
            raise SliceError(
                f"tpu_topology({name!r}): a {generation} grid has {rank} dimensions "
                f"(e.g. {'v5p:4x4x4' if rank == 3 else 'v5e:4x4'}); got {dims}."
            )
    elif m := re.fullmatch(r"([a-z0-9]+)-(\d+)", text):
        gen_word, count = m.groups()
        generation = _GENERATIONS.get(gen_word)
        if generation is None:
            raise SliceError(
                f"tpu_topology({name!r}): unknown accelerator type; Cloud TPU's are "
                f"v4-N, v5p-N, v5litepod-N (or v5e-N), v6e-N and tpu7x-N. Examples: {EXAMPLES}."
            )
        cores = int(count)
        per_chip = _CORES_PER_CHIP[generation]
        if cores % per_chip or cores < per_chip:
            raise SliceError(
                f"tpu_topology({name!r}): {generation} accelerator types count TensorCores, "
                f"{per_chip} a chip; {cores} is not a whole number of chips (e.g. "
                f"{generation}-{2 * per_chip * max(1, cores // (2 * per_chip))})."
            )
        grid = _grid_for_chips(generation, cores // per_chip, name)
    else:
        raise SliceError(
            f"tpu_topology({name!r}) is not a TPU slice name: write Cloud TPU's accelerator "
            f"type or a generation and chip grid, e.g. {EXAMPLES}."
        )
    if math.prod(grid) > _MAX_CHIPS[generation]:
        raise SliceError(
            f"tpu_topology({name!r}): {math.prod(grid)} chips is more than a {generation} pod "
            f"holds ({_MAX_CHIPS[generation]})."
        )
    if twisted and (generation not in _THREE_D or not _can_twist(grid)):
        raise SliceError(
            f"tpu_topology({name!r}): only k x k x 2k and k x 2k x 2k grids (k a multiple of "
            "4, e.g. v4:4x4x8, v5p:4x8x8) can be twisted tori; drop '_twisted'."
        )
    links = _default_wrap(generation, grid) if wrap is None else _parse_wrap(wrap, name)
    if twisted and not all(links):
        raise SliceError(
            f"tpu_topology({name!r}, wrap={wrap!r}): a twisted torus wraps in every dimension; "
            "drop wrap= or '_twisted'."
        )
    return TpuSlice(
        generation=generation,
        grid=grid,
        wrap=links,
        twisted=twisted,
        chip_config="megacore" if generation in ("v4", "v5p") else "default",
        chips_per_host=(2, 2, 1) if math.prod(grid) >= 4 else (1, 1, 1),
    )


def accelerator_types(generation: str) -> list[str]:
    """Cloud TPU's accelerator types of a generation, smallest first (no libtpu needed).

    Examples:
        >>> from dtensor.tpu.slices import accelerator_types
        >>> accelerator_types("v5e")
        ['v5litepod-1', 'v5litepod-4', 'v5litepod-8', 'v5litepod-16', 'v5litepod-32', 'v5litepod-64', 'v5litepod-128', 'v5litepod-256']
        >>> accelerator_types("v5p")[:6]
        ['v5p-8', 'v5p-16', 'v5p-32', 'v5p-64', 'v5p-128', 'v5p-256']
    """
    generation = _GENERATIONS.get(generation, generation)
    if generation not in _CORES_PER_CHIP:
        raise SliceError(f"accelerator_types({generation!r}): one of v4, v5p, v5e, v6e, tpu7x.")
    prefix = "v5litepod" if generation == "v5e" else generation
    per_chip = _CORES_PER_CHIP[generation]
    if generation in _THREE_D:
        chips = sorted(_SMALL_3D) + list(range(64, _MAX_CHIPS[generation] + 1, 64))
        chips = [1, *chips] if generation == "tpu7x" else chips
    else:
        chips = sorted(_GRIDS_2D)
    return [f"{prefix}-{c * per_chip}" for c in chips]
