"""HybridStrategy's mesh plan: its six axes in mesh order, and the pipeline over ``stage``.

The mesh is ``data`` (then ``stage``), ``fsdp``, ``context``, ``expert``, ``tensor``, each
axis of size 1 but ``data``, ``fsdp`` and ``tensor`` left out (``context`` comes right after
``stage`` when there is one, before ``fsdp``). :class:`PipelinePlanning` holds what the
``stage`` axis needs: the schedule's checks, where the ``pipeline=`` blocks live in a model,
and the plan a step's blocks run by (:mod:`strategies.reads.pipeline`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import flax.nnx as nnx
import numpy as np

from strategies.base import Strategy
from strategies.reads.pipeline import PipelinePlan, find_stacks
from strategies.reads.swaps import check_remat

__all__ = ["SCHEDULES", "PipelinePlanning", "mesh_dims"]

_T = "tensor"
_E = "expert"
_C = "context"
_S = "stage"
_ROUNDS = ("circular", "interleaved-1f1b")  # the schedules with rounds (repeats)
SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved-1f1b", "zero-bubble")


def mesh_dims(
    data: int, fsdp: int, tensor: int, *, stage: int = 1, context: int = 1, expert: int = 1
) -> list[tuple[str, int]]:
    """HybridStrategy's mesh axes in order, with their sizes; an axis of size 1 is left out
    but ``data``, ``fsdp`` and ``tensor``.

    Examples:
        >>> from strategies.hybrid.mesh_plan import mesh_dims
        >>> mesh_dims(-1, 2, 2, context=2)
        [('data', -1), ('fsdp', 2), ('context', 2), ('tensor', 2)]
        >>> mesh_dims(1, 2, 1, stage=2, context=2, expert=2)
        [('data', 1), ('stage', 2), ('context', 2), ('fsdp', 2), ('expert', 2), ('tensor', 1)]
    """
    for name, size in (("expert", expert), ("context", context), ("stage", stage)):
        if not isinstance(size, int) or size < 1:
            raise ValueError(
                f"HybridStrategy({name}={size!r}): the {name}-parallel size must be a "
                f"positive integer (1: no {name} axis)."
            )
    dims = [("data", data), ("fsdp", fsdp), ("tensor", tensor)]
    if stage > 1:
        dims.insert(1, (_S, stage))
    if context > 1:  # an axis of size 1 is left out of the mesh
        dims.insert(2, (_C, context))
    if expert > 1:
        dims.insert(len(dims) - 1, (_E, expert))
    return dims


class PipelinePlanning(Strategy):
    """The ``stage`` axis: the schedule, the ``pipeline=`` blocks found in a model, the plan."""

    stage: int
    microbatches: int
    schedule: str
    repeats: int | None
    pipeline: tuple[type, ...]
    remat: Any
    _stacks: dict[tuple[str, ...], str]

    def _check_pipeline(
        self,
        stage: int,
        microbatches: int | None,
        schedule: str,
        repeats: int | None,
        pipeline: Sequence[type] | None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(
                f"HybridStrategy(schedule={schedule!r}): valid schedules are {SCHEDULES} "
                "('gpipe': each stage its consecutive layers; 'circular': each stage several "
                "layer groups, the ring gone round several times; '1f1b', "
                "'interleaved-1f1b' and 'zero-bubble' interleave the forward and backward "
                "passes of different microbatches, holding about 2 x stage microbatches' "
                "activations, not all of them)."
            )
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(
                f"HybridStrategy(microbatches={microbatches!r}): the microbatch count must be "
                "a positive integer (default: the stage count)."
            )
        if repeats is not None and (not isinstance(repeats, int) or repeats < 1):
            raise ValueError(
                f"HybridStrategy(repeats={repeats!r}): the circular schedule's rounds must be "
                "a positive integer (default: one layer per stage per round)."
            )
        if repeats is not None and repeats > 1 and schedule not in _ROUNDS:
            raise ValueError(
                f"HybridStrategy(repeats={repeats}) goes with schedule='circular' or "
                f"'interleaved-1f1b' ({schedule!r} goes round the stages once); pass one of "
                "them or drop repeats."
            )
        classes = check_remat(pipeline)
        if stage > 1 and not classes:
            raise ValueError(
                f"HybridStrategy(stage={stage}) needs pipeline=(Block,): the module class of "
                "the blocks the model repeats (a scanned stack or a list of identical blocks), "
                "which the stages split between them."
            )
        if stage == 1 and (classes or microbatches not in (None, 1)):
            raise ValueError(
                "HybridStrategy(pipeline=..., microbatches=...) pipelines over a stage axis: "
                f"pass stage=S > 1 with them (got stage={stage})."
            )
        m = stage if microbatches is None else microbatches
        if schedule == "circular" and stage > 1 and m < stage:
            raise ValueError(
                f"HybridStrategy(schedule='circular', stage={stage}, microbatches={m}): the "
                "circular schedule needs at least as many microbatches as stages (a "
                "microbatch comes back to stage 0 for its next round only after stage 0 has "
                f"started every one of this round). Pass microbatches >= {stage}, or "
                "schedule='gpipe'."
            )
        if schedule == "interleaved-1f1b" and stage > 1 and m % stage:
            raise ValueError(
                f"HybridStrategy(schedule='interleaved-1f1b', stage={stage}, microbatches={m}): "
                f"the schedule runs microbatches in groups of the {stage} stages; pass "
                f"microbatches a multiple of {stage}, or schedule='1f1b'."
            )
        self.stage = stage
        self.microbatches = m if stage > 1 else 1
        self.schedule = schedule
        self.repeats = repeats
        self.pipeline = classes
        self._stacks: dict[tuple[str, ...], str] = {}

    @property
    def bubble_fraction(self) -> float:
        """The idle fraction of a step by the schedule (0 without ``stage``); for the
        circular and interleaved schedules with ``repeats=None`` the rounds are known once a
        model is seen. The interleaved schedules' by their tick tables
        (:attr:`dtensor.core.schedules.Schedule.bubble_fraction`)."""
        from dtensor.core.pipeline import bubble_fraction
        from dtensor.core.schedules import INTERLEAVED_SCHEDULES, make_schedule

        if self.stage > 1 and self.schedule in INTERLEAVED_SCHEDULES:
            table = make_schedule(self.schedule, self.stage, self.microbatches, self._rounds() or 1)
            return table.bubble_fraction
        return bubble_fraction(self.stage, self.microbatches, self._rounds() or 1)

    def pipeline_description(self) -> str:
        """The schedule in words (``""`` without ``stage``), as ``explain`` reports it."""
        if self.stage == 1:
            return ""
        r = self._rounds() or 1
        text = f"{self.schedule}, {self.stage} stages x {self.microbatches} microbatches"
        return text + (f", {r} rounds" if self.schedule in _ROUNDS else "")

    def _rounds(self, layers: int | None = None) -> int | None:
        if self.schedule not in _ROUNDS:
            return 1
        if self.repeats is not None:
            return self.repeats
        layers = layers or getattr(self, "_layers", None)
        return None if not layers else max(1, layers // self.stage)

    def observe(self, node: Any) -> None:
        """With ``stage``: learn where ``node`` holds the ``pipeline=`` blocks (their paths),
        which the layout rules split over ``stage`` (once per object)."""
        if self.stage == 1:
            return
        seen = self.__dict__.setdefault("_seen", weakref.WeakSet())
        try:
            if node in seen:
                return
            seen.add(node)
        except TypeError:  # not weakly referenceable: look every time
            pass
        found = find_stacks(node, self.pipeline)
        for path, kind in found.items():
            key = tuple(str(p) for p in path)
            self._stacks[key[:-1] + ("*",) if kind == "list" else key] = kind
            if kind == "list":
                self._layers = sum(1 for p in found if p[:-1] == path[:-1])
        for path, kind in found.items():
            if kind == "stack":
                stack = _node_at(node, path)
                leads = [
                    np.shape(v.get_raw_value())[0]
                    for _, v in nnx.iter_graph(stack)
                    if isinstance(v, nnx.Variable)
                ]
                self._layers = int(leads[0])

    def pipeline_plan(self) -> PipelinePlan:
        """How a step's ``pipeline=`` blocks run in stages (a fresh plan per trace)."""
        return PipelinePlan(
            classes=self.pipeline,
            stages=self.stage,
            microbatches=self.microbatches,
            # (rounds left to the step where not given: one layer group a stage a round of
            # the stack it meets, whose layers may be groups of blocks, Gemma 3's pairs)
            repeats=self.repeats if self.schedule in _ROUNDS else 1,
            axis=_S,
            batch_axes=self.batch_axes,
            # With remat=: each tick recomputed whole (its layer's weights read inside it,
            # so it keeps its input alone); the blocks' own remat is skipped there.
            remat=bool(self.remat),
            policy=None,
            preset=type(self).__name__,
            schedule=self.schedule,
        )


def _node_at(root: Any, path: tuple[Any, ...]) -> Any:
    for p, node in nnx.iter_graph(root):
        if tuple(p) == tuple(path):
            return node
    raise KeyError(path)
