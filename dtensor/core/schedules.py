"""Pipeline schedules as tick tables: which stage runs which microbatch's forward,
backward and weight gradient at each tick.

One SPMD loop (:func:`dtensor.core.interleaved.run_schedule`) runs any such table:
at each tick every stage runs at most one forward (``F``: its layers on one
microbatch), one backward (``B``: their input gradients, and for every schedule
but zero-bubble their weight gradients too) and one weight-gradient op (``W``,
zero-bubble only), chosen by the table; activations move one stage on and
cotangents one stage back over the ``stage`` axis after each tick. The stages
run in lockstep, so a tick costs what its busiest kind of work costs on any
stage: the loop is cut into phases by which kinds of work a tick holds, and a
tick without a backward anywhere runs no backward code.

Schedules (``S`` stages, ``M`` microbatches, ``R`` rounds):

- ``"1f1b"``: microbatch ``m`` runs forward on stage ``s`` at tick ``m + s`` and
  backward at ``m + 2S - 1 - s``; the loss of ``m`` is taken in the last stage
  the tick its forward ends. Stage ``s`` holds the activations of at most
  ``min(M, 2(S - s))`` microbatches however large ``M`` (the stages run in
  lockstep, a forward and a backward a tick, so a microbatch's round trip of
  ``2(S - s) - 1`` ticks sees that many forwards start; PyTorch's 1F1B, each
  stage at its own pace, holds ``S - s``). Bubble ``(S - 1) / (M + S - 1)``.
- ``"interleaved-1f1b"``: every stage holds ``R`` groups of layers ``S`` groups
  apart (the circular layout) and runs microbatches in groups of ``S``: the
  forwards of a group round by round, its backwards in reverse; ``M`` a
  multiple of ``S``. The warm-up and cool-down ticks shrink ``R``-fold, for
  ``R`` times the permutes.
- ``"zero-bubble"`` (ZB-H1, Qi et al. 2023): 1F1B's forwards and backwards with
  the backward split in two: ``B`` the input gradients (what the previous stage
  waits for) and ``W`` the weight gradients, deferred to the tick stage 0 runs
  the same microbatch's backward. The cool-down ticks run input gradients
  alone; ``M`` ticks of weight gradients, not ``M + S - 1``.

Cost model for :attr:`Schedule.bubble_fraction` (what ``explain`` reports): a
forward, an input gradient and a weight gradient cost one unit each (the
backward is two); a tick costs the units of the kinds any stage runs in it; the
bubble is the share of the stages' time not spent on the step's own work
(recomputation under remat is the step's work, not bubble).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["INTERLEAVED_SCHEDULES", "Schedule", "make_schedule"]

#: The schedules :func:`make_schedule` builds (forward and backward in one loop).
INTERLEAVED_SCHEDULES = ("1f1b", "interleaved-1f1b", "zero-bubble")

# Where a tick's input comes from (the ``*_src`` tables).
FROM_BATCH = -1  # the microbatch itself (the first virtual stage's forward)
FROM_WIRE = -2  # what arrived this tick over ``stage`` (used the tick it arrives)
FROM_LOSS = -3  # the loss's cotangent, computed in the last tick (last virtual stage)
NONE = -1


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule's tick table; see the module docstring.

    Every table is ``[ticks, stages]`` of int32 (``NONE`` where a stage runs
    nothing of that kind). ``*_m`` the microbatch, ``*_r`` the round (which of
    the stage's layer groups), ``*_src`` where the input comes from (a buffer
    slot, or ``FROM_*``), ``*_stash`` the activation-stash slot the forward
    writes and the backward (and weight gradient) reads.
    """

    name: str
    stages: int
    microbatches: int
    rounds: int
    #: tick -> stage -> (microbatch, virtual stage) of each kind of op, or None
    ops: tuple[tuple[tuple[Any, Any, Any], ...], ...]
    tables: dict[str, np.ndarray]
    #: per tick: the microbatch whose loss is taken (after its last forward), or -1
    loss_m: np.ndarray
    #: buffer sizes: forward inputs waiting, cotangents waiting, activation stash,
    #: stashed output cotangents (zero-bubble's weight gradients)
    slots: dict[str, int]

    @property
    def ticks(self) -> int:
        return len(self.ops)

    def kinds(self, t: int) -> tuple[bool, bool, bool, bool]:
        """Which kinds of work tick ``t`` runs: (forward, backward, weight grad, loss)."""
        row = self.ops[t]
        return (
            any(f is not None for f, _, _ in row),
            any(b is not None for _, b, _ in row),
            any(w is not None for _, _, w in row),
            bool(self.loss_m[t] >= 0),
        )

    def phases(self) -> list[tuple[int, int, tuple[bool, bool, bool, bool]]]:
        """Runs of consecutive ticks with the same kinds: ``(start, stop, kinds)``."""
        out: list[tuple[int, int, tuple[bool, bool, bool, bool]]] = []
        for t in range(self.ticks):
            k = self.kinds(t)
            if out and out[-1][2] == k:
                out[-1] = (out[-1][0], t + 1, k)
            else:
                out.append((t, t + 1, k))
        return out

    @functools.cached_property
    def time_units(self) -> float:
        """The step's time in op units (module docstring's cost model)."""
        split = self.name == "zero-bubble"
        total = 0.0
        for t in range(self.ticks):
            f, b, w, _ = self.kinds(t)
            total += f + (b * (1 if split else 2)) + w
        return total / self.rounds

    @property
    def bubble_fraction(self) -> float:
        """The stages' idle share of the step by the cost model (module docstring)."""
        work = 3.0 * self.microbatches
        return max(0.0, 1.0 - work / self.time_units)

    @functools.cached_property
    def in_flight(self) -> tuple[int, ...]:
        """Per stage: the most microbatches (layer groups, with rounds) whose activations
        it holds at once (from a forward to the backward, or weight gradient, that
        frees them)."""
        held = [0] * self.stages
        most = [0] * self.stages
        for row in self.ops:
            for s, (f, b, w) in enumerate(row):
                if f is not None:
                    held[s] += 1
                most[s] = max(most[s], held[s])
                freeing = w if self.name == "zero-bubble" else b
                if freeing is not None:
                    held[s] -= 1
        return tuple(most)

    def render(self, width: int = 3) -> str:
        """The tick table as text: a row per stage, a column per tick; ``F3`` the forward
        of microbatch 3, ``B3`` its backward, ``W3`` its weight gradient (with rounds,
        ``F3'`` is round 1, ``F3''`` round 2), ``.`` idle."""
        lines = []
        for s in range(self.stages):
            cells = []
            for row in self.ops:
                parts = []
                for kind, op in zip("FBW", row[s], strict=True):
                    if op is not None:
                        m, v = op
                        parts.append(f"{kind}{m}" + "'" * (v // self.stages))
                cells.append("/".join(parts) if parts else ".")
            w = max(width, *(len(c) for c in cells))
            lines.append(f"stage {s}: " + " ".join(c.ljust(w) for c in cells).rstrip())
        return "\n".join(lines)


def _orders(name: str, S: int, M: int, R: int) -> tuple[list[list[tuple[int, int]]], ...]:
    """Each stage's forward and backward order, as (microbatch, round) pairs."""
    if name == "interleaved-1f1b":
        f_order, b_order = [], []
        for k in range(M // S):
            group = range(k * S, (k + 1) * S)
            f_order += [(m, r) for r in range(R) for m in group]
            b_order += [(m, r) for r in reversed(range(R)) for m in group]
    else:
        f_order = [(m, 0) for m in range(M)]
        b_order = list(f_order)
    return [f_order] * S, [b_order] * S


def _check(name: str, S: int, M: int, R: int) -> None:
    if name not in INTERLEAVED_SCHEDULES:
        raise ValueError(
            f"pipeline schedule {name!r}: the interleaved schedules are "
            f"{INTERLEAVED_SCHEDULES} ('gpipe' and 'circular' run through "
            "dtensor.core.pipeline.pipeline)."
        )
    if S < 2 or M < 1 or R < 1:
        raise ValueError(
            f"pipeline schedule {name!r}: needs 2 or more stages, 1 or more microbatches "
            f"and rounds (got stages={S}, microbatches={M}, rounds={R})."
        )
    if name != "interleaved-1f1b" and R != 1:
        raise ValueError(
            f"pipeline schedule {name!r} goes round the stages once (rounds=1, got {R}); "
            "'interleaved-1f1b' takes several rounds."
        )
    if name == "interleaved-1f1b" and M % S:
        raise ValueError(
            f"pipeline schedule 'interleaved-1f1b' runs microbatches in groups of the "
            f"{S} stages: {M} microbatches is not a multiple of {S}. Choose microbatches "
            f"a multiple of {S}, or schedule='1f1b'."
        )


class _Slots:
    """Buffer slots of one kind on one stage, reused once freed (interval colouring)."""

    def __init__(self) -> None:
        self.free_at: list[int] = []  # slot -> the tick after which it is free

    def take(self, start: int, stop: int) -> int:
        """A slot free from tick ``start`` to ``stop`` (both included)."""
        for k, free in enumerate(self.free_at):
            if free < start:
                self.free_at[k] = stop
                return k
        self.free_at.append(stop)
        return len(self.free_at) - 1


@functools.lru_cache(maxsize=64)
def make_schedule(name: str, stages: int, microbatches: int, rounds: int = 1) -> Schedule:
    """The tick table of schedule ``name`` for ``stages`` x ``microbatches`` (x ``rounds``).

    Examples:
        >>> from dtensor.core.schedules import make_schedule
        >>> s = make_schedule("1f1b", 2, 4)
        >>> print(s.render())
        stage 0: F0    F1    F2    F3/B0 B1    B2    B3
        stage 1: .     F0    F1/B0 F2/B1 F3/B2 B3    .
        >>> round(s.bubble_fraction, 3), s.in_flight
        (0.2, (4, 2))
    """
    S, M, R = int(stages), int(microbatches), int(rounds)
    _check(name, S, M, R)
    V = R * S
    f_order, b_order = _orders(name, S, M, R)
    fi, bi = [0] * S, [0] * S
    f_done: dict[tuple[int, int], int] = {}
    b_done: dict[tuple[int, int], int] = {}
    rows: list[list[list[Any]]] = []
    t = 0
    while any(fi[s] < len(f_order[s]) or bi[s] < len(b_order[s]) for s in range(S)):
        row: list[list[Any]] = []
        for s in range(S):
            f: tuple[int, int] | None = None
            b: tuple[int, int] | None = None
            if fi[s] < len(f_order[s]):
                m, r = f_order[s][fi[s]]
                v = r * S + s
                if v == 0 or f_done.get((m, v - 1), t) < t:
                    f = (m, v)
            if bi[s] < len(b_order[s]):
                m, r = b_order[s][bi[s]]
                v = r * S + s
                ready = f_done.get((m, v), t) < t if v == V - 1 else b_done.get((m, v + 1), t) < t
                if ready:
                    b = (m, v)
            row.append([f, b, None])
        for s, (f, b, _) in enumerate(row):
            if f is not None:
                f_done[f] = t
                fi[s] += 1
            if b is not None:
                b_done[b] = t
                bi[s] += 1
        rows.append(row)
        t += 1
        if t > 4 * (M * R + V) + 8:  # the orders above never deadlock; a guard all the same
            raise AssertionError(f"schedule {name} ({S}, {M}, {R}) did not finish")
    if name == "zero-bubble":  # W(m, s) on the tick stage 0 runs B(m)
        for (m, v), tick in b_done.items():
            rows[b_done[(m, 0)]][v][2] = (m, v)
            assert tick <= b_done[(m, 0)]
    return _tables(name, S, M, R, rows, f_done, b_done)


def _tables(
    name: str,
    S: int,
    M: int,
    R: int,
    rows: list[list[list[Any]]],
    f_done: dict[tuple[int, int], int],
    b_done: dict[tuple[int, int], int],
) -> Schedule:
    V = R * S
    T = len(rows)
    keys = (
        "f_on f_m f_r f_src f_stash fa_slot "
        "b_on b_m b_r b_src b_stash b_first b_cot ba_slot pa_slot "
        "w_on w_m w_r w_stash w_cot"
    ).split()
    tab = {k: np.full((T, S), NONE, np.int32) for k in keys}
    for k in ("f_on", "b_on", "w_on", "b_first"):
        tab[k][:] = 0
    loss_m = np.full((T,), -1, np.int32)
    fin = [_Slots() for _ in range(S)]
    bin_ = [_Slots() for _ in range(S)]
    stash = [_Slots() for _ in range(S)]
    cot = [_Slots() for _ in range(S)]
    split = name == "zero-bubble"
    w_tick = {op: t for t, row in enumerate(rows) for s, (_, _, op) in enumerate(row) if op}

    def route(
        src: str, arrival: str, slots: _Slots, s: int, sent: int, t: int, direct: int
    ) -> None:
        """An input sent at tick ``sent`` and used at ``t`` on stage ``s``: taken as it
        arrives (``direct``), or kept in a buffer slot from its arrival to its use."""
        if sent + 1 == t:
            tab[src][t, s] = direct
            return
        k = slots.take(sent + 1, t)
        tab[arrival][sent + 1, s] = k
        tab[src][t, s] = k

    for (m, v), t in sorted(f_done.items(), key=lambda kv: kv[1]):
        s, r = v % S, v // S
        tab["f_on"][t, s], tab["f_m"][t, s], tab["f_r"][t, s] = 1, m, r
        if v == 0:
            tab["f_src"][t, s] = FROM_BATCH
        else:
            route("f_src", "fa_slot", fin[s], s, f_done[(m, v - 1)], t, FROM_WIRE)
        freed = w_tick[(m, v)] if split else b_done[(m, v)]
        tab["f_stash"][t, s] = stash[s].take(t, freed)
        if v == V - 1:
            loss_m[t] = m
    for (m, v), t in sorted(b_done.items(), key=lambda kv: kv[1]):
        s, r = v % S, v // S
        tab["b_on"][t, s], tab["b_m"][t, s], tab["b_r"][t, s] = 1, m, r
        tab["b_stash"][t, s] = tab["f_stash"][f_done[(m, v)], s]
        tab["b_first"][t, s] = int(v == 0)
        if v == V - 1:  # the loss's cotangent, from the tick after the last forward
            route("b_src", "pa_slot", bin_[s], s, f_done[(m, v)], t, FROM_LOSS)
        else:
            route("b_src", "ba_slot", bin_[s], s, b_done[(m, v + 1)], t, FROM_WIRE)
        if split:
            tw = w_tick[(m, v)]
            tab["w_on"][tw, s], tab["w_m"][tw, s], tab["w_r"][tw, s] = 1, m, r
            tab["w_stash"][tw, s] = tab["b_stash"][t, s]
            if tw == t:
                tab["w_cot"][tw, s] = FROM_WIRE  # this tick's own backward's cotangents
            else:
                k = cot[s].take(t, tw)
                tab["b_cot"][t, s] = k
                tab["w_cot"][tw, s] = k
    ops = tuple(tuple(tuple(op) for op in row) for row in rows)  # type: ignore[misc]
    slots = {
        "forward": max(len(x.free_at) for x in fin),
        "backward": max(len(x.free_at) for x in bin_),
        "stash": max(len(x.free_at) for x in stash),
        "cotangent": max(len(x.free_at) for x in cot),
    }
    return Schedule(name, S, M, R, ops, tab, loss_m, slots)  # type: ignore[arg-type]
