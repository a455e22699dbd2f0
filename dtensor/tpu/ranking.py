"""Which plan ``--search`` / ``--fit`` compiles next, and when it stops (:mod:`dtensor.tpu.search`).

With the analytic model (:mod:`dtensor.tpu.estimate`): first the default plan's best
variant (what a user runs without a search: ``FullyShardedStrategy`` on one slice, data
across slices and fsdp within them on several; where its predicted peak is within 1.6x of
the limit), then the plan predicted to fit with the lowest predicted floor; while none is
predicted to fit and nothing compiled fits, the plan with the lowest predicted peak. Predictions are the estimates times the geometric mean of the
compiled/estimated ratios seen so far (1 before the first compile). The search stops when the
best plan left, even at the most favourable ratio seen, would not beat the best compiled floor
(a plan predicted within the limit but not its 5% headroom is compiled only when its floor
beats the best even at the model's spread);
a plan whose compute alone (its estimate at the lowest compute ratio seen: the FLOPs change
little from plan to plan) would not beat it is never compiled.

Without the model (a script with no ``search_facts`` hook): the candidates in their order (the
ladder's, cheapest first), stopping at the first fit but for the rungs marked as possibly
faster after it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Calibration", "choose", "next_candidate"]


class Calibration:
    """The compiled/estimated ratios of peak and floor seen so far, by plan family (the axes
    above 1, and the schedule with a pipeline): a plan's estimate is corrected by its own
    family's ratios where one of it was compiled, else by all of them."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, float | None, float | None]] = []
        self.compute: list[float] = []

    @property
    def floor(self) -> list[float]:
        """Every compiled/estimated floor ratio seen."""
        return [f for _, _, f in self.seen if f]

    def add(self, entry: dict[str, Any], plan: Any = None) -> None:
        """Learn from a compiled entry's ``ratio`` (if it has one) for ``plan``."""
        ratio = entry.get("ratio") or {}
        if ratio.get("peak") or ratio.get("floor"):
            self.seen.append((_family(plan), ratio.get("peak"), ratio.get("floor")))
        if ratio.get("compute"):
            self.compute.append(ratio["compute"])

    def least_compute(self, est: Any) -> float:
        """The least compute time ``est``'s plan may come out with: its estimate at the lowest
        compiled/estimated compute ratio seen (0 before a compile reports one)."""
        if not self.compute or not getattr(est, "compute_seconds", None):
            return 0.0
        return est.compute_seconds * min(self.compute)

    @staticmethod
    def _mean(xs: Sequence[float]) -> float:
        return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else 1.0

    def predict(self, est: Any, plan: Any = None) -> tuple[float, float]:
        """``(peak, floor)`` of an estimate, corrected by the ratios seen.

        Examples:
            >>> from types import SimpleNamespace
            >>> from dtensor.tpu.ranking import Calibration
            >>> c = Calibration(); c.add({"ratio": {"peak": 2.0, "floor": 0.5}})
            >>> c.predict(SimpleNamespace(peak_bytes_per_device=10.0, step_time_floor_seconds=1.0))
            (20.0, 0.5)
        """
        family = _family(plan)
        own = [x for x in self.seen if x[0] == family]
        peak = self._mean([p for _, p, _ in (own or self.seen) if p])
        if not own and family[-1:] == ("offload",):  # none compiled yet: the prior
            peak = max(peak, OFFLOAD_PEAK_PRIOR)
        return (
            est.peak_bytes_per_device * peak,
            est.step_time_floor_seconds * self._mean([f for _, _, f in (own or self.seen) if f]),
        )

    def optimism(self) -> float:
        """How much lower than predicted a floor may come out: the largest ratio seen over the
        smallest (at least 1.15, the model's spread on the tiny decoders)."""
        if len(self.floor) < 2:
            return 1.15
        return max(1.15, max(self.floor) / min(self.floor))

    def rank(self, candidates: Sequence[Any], limit: float) -> list[Any]:
        """Candidates with an estimate: those predicted to fit by predicted floor (floors
        within 2% of each other by the simpler plan, then the lower peak), then the rest by
        predicted peak."""
        scored = [
            (c, *self.predict(c.estimate, c.plan)) for c in candidates if c.estimate is not None
        ]
        fitting = sorted((x for x in scored if x[1] <= HEADROOM * limit), key=_order)
        over = sorted((x for x in scored if x[1] > HEADROOM * limit), key=lambda x: x[1])
        return [x[0] for x in fitting + over]


#: A floor within this fraction of the best compiled one is a tie, not worth a compile (Llama
#: 3.1 8B at 32768 tokens: every plan of the same FLOPs, compute-bound, came out at the best
#: plan's floor, their compute estimates a hair under it; the loss by token slices, 0.7%
#: under the vocabulary slices' floor, is a gain).
TIE = 0.001


def _may_beat(calibration: Calibration, est: Any, best_floor: float) -> bool:
    """Whether a plan's compute alone, at the lowest compute ratio seen, leaves it a chance to
    beat ``best_floor`` by more than :data:`TIE`."""
    return calibration.least_compute(est) < best_floor * (1 - TIE)


#: A plan is predicted to fit when its predicted peak is within this fraction of the limit
#: (the rest is the program's code and the compiler's own buffers).
HEADROOM = 0.95


#: The compiled/estimated peak of an offloading remat plan before one of its family is
#: compiled: the estimate does not see what the TPU compiler keeps on device around the host
#: copies (Llama 2 70B on v5p:4x4x4, four plans: x1.15 to x1.54, 6 GiB a chip above full
#: remat; their geometric mean).
OFFLOAD_PEAK_PRIOR = 1.38


def _family(plan: Any) -> tuple[str, ...]:
    """The preset (when not hybrid), the axes above 1, a pipeline's schedule and whether the
    remat plan offloads: plans the model errs alike on."""
    if plan is None:
        return ()
    from dtensor.tpu.estimate import OFFLOADED

    axes = tuple(a for a, n in plan.sizes.items() if n > 1)
    preset = (plan.preset,) if getattr(plan, "preset", "hybrid") != "hybrid" else ()
    offload = ("offload",) if getattr(plan, "remat", "") in OFFLOADED else ()
    return preset + axes + ((plan.schedule,) if plan.stage > 1 else ()) + offload


def _order(scored: tuple[Any, float, float]) -> tuple[int, int, float]:
    """Sort key of a predicted-fitting candidate: its floor in 2% steps, the plan's
    complexity (axes above 1, a ring, a schedule other than GPipe, kept weights), its peak."""
    candidate, peak, floor = scored
    plan = candidate.plan
    complexity = 0
    if plan is not None:
        complexity = sum(n > 1 for n in plan.sizes.values())
        complexity += (plan.context_mode != "gather") + (plan.schedule != "gpipe")
        complexity += (not plan.reshard) + (plan.remat not in ("none", "full"))
        complexity += getattr(plan, "loss_chunks", 1) > 1
    return (round(math.log(max(floor, 1e-12)) / math.log(1.02)), complexity, peak)


def next_candidate(
    remaining: Sequence[Any],
    tried: Sequence[dict[str, Any]],
    calibration: Calibration,
    limit: float,
) -> Any | None:
    """The candidate to compile next, or ``None`` to stop (see the module docs)."""
    best = choose(tried)
    scored = [
        (c, *calibration.predict(c.estimate, c.plan)) for c in remaining if c.estimate is not None
    ]
    if not scored:  # no model: the given order
        first = remaining[0]
        return None if best is not None and not first.faster else first
    best_floor = (best or {}).get("step_time_floor_seconds")
    fitting = [x for x in scored if x[1] <= HEADROOM * limit]
    if not tried:  # the plan a user runs without a search, compiled first
        preset = _preset_first(scored, fitting, limit)
        if preset is not None:
            return preset
    if best_floor:  # no compute-bound plan that cannot beat the best: its FLOPs alone lose
        fitting = [x for x in fitting if _may_beat(calibration, x[0].estimate, best_floor)]
        if not fitting:
            return _near_the_limit(scored, calibration, limit, best_floor)
    if fitting:
        pick, _, floor = min(fitting, key=_order)
        if best_floor and floor / calibration.optimism() >= best_floor:
            return _near_the_limit(scored, calibration, limit, best_floor)
        return pick
    if best is not None:
        return _near_the_limit(scored, calibration, limit, best_floor)
    return min(scored, key=lambda x: x[1])[0]


def _near_the_limit(
    scored: Sequence[tuple[Any, float, float]],
    calibration: Calibration,
    limit: float,
    best_floor: float | None,
) -> Any | None:
    """Once a plan fits: one predicted within the limit but not its headroom, whose predicted
    floor beats the best compiled one even at the model's spread (``optimism``), is worth a
    compile (Gemma 2B within MaxText's 4.24 GiB: the GPipe plan compiled at 4.23 GiB, and the
    circular one beside it, predicted at the same peak, a third faster); else ``None``."""
    if not best_floor:
        return None
    near = [
        x
        for x in scored
        if HEADROOM * limit < x[1] <= limit
        and x[2] * calibration.optimism() < best_floor
        and _may_beat(calibration, x[0].estimate, best_floor)
    ]
    return min(near, key=_order)[0] if near else None


#: The first compile is the default plan's best variant where its predicted peak is within
#: this factor of the limit (further off, it is left to the ranking). The model overestimates
#: that family most: compiled/estimated peak 0.62 on Gemma 2B and 0.70 on Gemma 7B under
#: ``FullyShardedStrategy`` on v5e:4x4 (the 2B's, 3.5 GiB, fit MaxText's 4.24 GiB at an
#: estimated 5.67 GiB).
PRESET_REACH = 1.6


def _preset_first(
    scored: Sequence[tuple[Any, float, float]],
    fitting: Sequence[tuple[Any, float, float]],
    limit: float,
) -> Any | None:
    """The default plan to compile first (:func:`_default_plan`): the one predicted to fit
    with the lowest predicted floor, else the one with the lowest predicted peak if within
    :data:`PRESET_REACH` of the limit; ``None`` without such a plan.

    It is the plan a user runs without a search, so the table always shows what the search
    gained over it, and it calibrates the family the model errs on most (the embedding and
    the logits counted at once: 1.14x Gemma 3 12B's compiled peak, which fit MaxText's).
    """

    ours = [x for x in fitting if _default_plan(x[0].plan)]
    if ours:
        return min(ours, key=_order)[0]
    ours = [x for x in scored if _default_plan(x[0].plan)]
    if not ours:
        return None
    pick = min(ours, key=lambda x: x[1])
    return pick[0] if pick[1] <= PRESET_REACH * limit else None


def _default_plan(plan: Any) -> bool:
    """The plan a user runs without a search: ``FullyShardedStrategy`` on one slice; on
    several, data parallel across the slices and fully sharded within each (MaxText's
    default, FSDP2's HSDP)."""
    if plan is None:
        return False
    if getattr(plan, "preset", "hybrid") == "fully_sharded":
        return True
    sizes = getattr(plan, "sizes", {})
    others = [a for a, n in sizes.items() if n > 1 and a not in ("data", "fsdp")]
    return (
        getattr(plan, "across_slices", None) == "data" and sizes.get("data", 1) > 1 and not others
    )


def choose(tried: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fitting compiled entry with the lowest step-time floor; ``None`` when none fits.

    An entry without a floor (a chip the hardware table lacks) ranks after every entry with
    one, never first as a floor of 0 would; among entries without one the first tried (the
    least costly rung) wins. Estimated-only entries (``compiled: False``) never win.

    Examples:
        >>> from dtensor.tpu.ranking import choose
        >>> tried = [{"name": "a", "fits": True, "step_time_floor_seconds": None},
        ...          {"name": "b", "fits": True, "step_time_floor_seconds": 0.2},
        ...          {"name": "c", "fits": False, "step_time_floor_seconds": 0.1}]
        >>> choose(tried)["name"]
        'b'
    """
    fitting = [t for t in tried if t["fits"] and t.get("compiled", True)]

    def rank(t: dict[str, Any]) -> tuple[bool, float]:
        floor = t.get("step_time_floor_seconds")
        return (floor is None, floor or 0.0)

    return min(fitting, key=rank, default=None)
