"""The plans ``python -m dtensor.aot --search`` chooses from: ``HybridStrategy``'s six axes,
``across_slices``, the pipeline and context modes and the memory rungs, for one model on one
topology.

A :class:`~dtensor.tpu.plan.Plan` is one configuration (:mod:`dtensor.tpu.plan`: its flags
and the ``HybridStrategy(...)`` a user pastes). :func:`enumerate_plans` lists every plan whose
axis sizes multiply to the chip count and divide the model (:class:`ModelFacts`): ``tensor``
its heads, KV heads and MLP width, ``stage`` its layers, ``expert`` its experts, ``context``
its sequence, ``data x fsdp x expert`` its batch (each microbatch's, with a pipeline), and,
on several slices, the axis that spans them a multiple of their count. Only the knobs whose
flags the script accepts are turned: a script with fewer flags gets fewer plans.

:func:`plan_from_argv` (a command line read back into a plan) and :func:`ladder` (``--fit``'s
memory rungs) live in :mod:`dtensor.tpu.flags`, :class:`ModelFacts` and :class:`Plan` in
:mod:`dtensor.tpu.plan`; all are importable from here too.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from dtensor.tpu.flags import Rung as Rung
from dtensor.tpu.flags import ladder as ladder
from dtensor.tpu.flags import plan_from_argv as plan_from_argv
from dtensor.tpu.plan import AXES as AXES
from dtensor.tpu.plan import KNOB_FLAGS as KNOB_FLAGS
from dtensor.tpu.plan import ModelFacts, Plan

__all__ = [
    "AXES",
    "KNOB_FLAGS",
    "LOGITS_BYTES",
    "ModelFacts",
    "Plan",
    "Rung",
    "device_tokens",
    "enumerate_plans",
    "ladder",
    "logits_bytes",
    "plan_from_argv",
]

#: The loss in slices is searched where a device's logits (float32 and bf16) are at least this
#: large (Llama 3.1 405B, fsdp=128 tensor=4 on v5p:8x8x8: 0.73 GiB of them, and the loss by
#: token slices lowered the compiled peak 25.8 -> 22.9 GiB).
LOGITS_BYTES = 2**29


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(facts: ModelFacts, *, chips: int, num_slices: int = 1) -> list[Plan]:
    """Every plan for ``facts`` on ``chips`` chips in ``num_slices`` slices (see the module docs).

    Examples:
        >>> from dtensor.tpu.plans import ModelFacts, enumerate_plans
        >>> facts = ModelFacts(params=10**6, layers=4, heads=4, kv_heads=2, head_dim=16,
        ...                    hidden=64, ffn=256, vocab=128, batch=16, seq=256,
        ...                    flags=("--strategy", "--data", "--tensor", "--mixed-precision", "--remat"))
        >>> plans = enumerate_plans(facts, chips=8)
        >>> len(plans), sorted({p.tensor for p in plans}), plans[0].strategy_line()
        (32, [1, 2], 'FullyShardedStrategy()')
    """
    if not facts.accepts("strategy"):
        return []
    tensors = (
        [t for t in _divisors(chips) if _tensor_ok(facts, t)] if facts.accepts("tensor") else [1]
    )
    stages = [s for s in _divisors(min(chips, facts.layers)) if facts.layers % s == 0]
    stages = stages if facts.accepts("stage") else [1]
    contexts = (
        [c for c in _divisors(chips) if facts.seq % c == 0] if facts.accepts("context") else [1]
    )
    experts = [e for e in _divisors(chips) if facts.experts and facts.experts % e == 0]
    experts = (experts or [1]) if facts.accepts("expert") else [1]
    plans: list[Plan] = []
    if num_slices == 1 and facts.batch % chips == 0:
        # FullyShardedStrategy first: its gathers at each read, not XLA's plan for the same
        # fsdp mesh (Gemma 7B on v5e:4x4, bf16 + remat + scan: 405.9 ms against
        # HybridStrategy's best, 564.3 ms), so it wins a tie with the hybrid fsdp plan
        plans.extend(_rungs(Plan(fsdp=chips, preset="fully_sharded"), facts))
    for t, s, c, e in itertools.product(tensors, stages, contexts, experts):
        if chips % (t * s * c * e):
            continue
        rest = chips // (t * s * c * e)
        datas = (
            _divisors(rest)
            if facts.accepts("data")
            else [num_slices if rest % num_slices == 0 else 1]
        )
        for d in datas:
            f = rest // d
            base = Plan(data=d, fsdp=f, tensor=t, stage=s, context=c, expert=e)
            for placed in _placements(base, facts, num_slices):
                for timed in _pipelines(placed, facts):
                    plans.extend(_rungs(timed, facts))
    return list(dict.fromkeys(plans))


def _tensor_ok(facts: ModelFacts, t: int) -> bool:
    return facts.heads % t == 0 and facts.kv_heads % t == 0 and facts.ffn % t == 0


def _placements(plan: Plan, facts: ModelFacts, slices: int) -> Iterator[Plan]:
    """The plan with each axis that may span the slices (none on one slice)."""
    if slices == 1:
        yield plan
        return
    options = ("data", "fsdp", "stage") if facts.accepts("across_slices") else ("data",)
    for axis in options:
        if getattr(plan, axis) % slices == 0 and getattr(plan, axis) > 1:
            yield dataclasses.replace(plan, across_slices=axis)


def _pipelines(plan: Plan, facts: ModelFacts) -> Iterator[Plan]:
    """The plan with each microbatch count (the stages, twice and four times them) and
    schedule whose microbatch divides over ``data x fsdp x expert``; the context modes."""
    replicas = plan.data * plan.fsdp * plan.expert
    # the ring runs XLA's attention or a masked kernel: the splash kernel of a plain causal
    # decoder takes the gather only (dtensor.context_attention refuses the pair)
    ring = plan.context > 1 and facts.accepts("context_mode") and facts.attention != "splash"
    modes: tuple[str, ...] = ("gather", "ring") if ring else ("gather",)
    # Ulysses gives each device whole heads: the query heads (after tensor) divide over context
    t = plan.tensor if facts.kv_heads % plan.tensor == 0 else 1
    if ring and facts.heads % t == 0 and (facts.heads // t) % plan.context == 0:
        modes += ("ulysses",)
    if plan.stage == 1:
        if facts.batch % replicas == 0:
            for mode in modes:
                yield dataclasses.replace(plan, context_mode=mode)
        return
    # 1F1B and its interleaved form hold about 2 x stage microbatches, not all of them;
    # zero-bubble's smaller bubble costs a recomputed forward (docs/guides/large_models.md),
    # so the search leaves it to be asked for by name.
    schedules = ("gpipe", "circular", "1f1b", "interleaved-1f1b")
    schedules = schedules if facts.accepts("schedule") else ("gpipe",)
    counts = (1, 2, 4) if facts.accepts("microbatches") else (1,)
    for k, schedule, mode in itertools.product(counts, schedules, modes):
        m = plan.stage * k
        if facts.batch % (m * replicas) == 0:
            yield dataclasses.replace(plan, microbatches=m, schedule=schedule, context_mode=mode)


def _rungs(plan: Plan, facts: ModelFacts) -> Iterator[Plan]:
    """The plan under each memory rung the script takes: precision, remat (and its policy).
    ``scan`` is chosen, not searched: on for a script that takes it and a model of 8 layers
    or more (one compiled layer: a compile minutes shorter). Keeping gathered weights
    (``reshard=False``) and gathering layers in the loop body are not searched: they apply to
    weights gathered at their reads (``gather_at_read``, the CPU default) and to
    ``FullyShardedStrategy``; on TPU and GPU ``HybridStrategy`` leaves the gathers to XLA.
    The loss over the vocabulary in 8 slices (``--loss-chunks 8``, where 8 divides it) is
    searched too where a device's logits pass :data:`LOGITS_BYTES`: one slice's float32
    logits at a time (at 32768 tokens a chip, Llama 3's 128256-word logits are 23 GiB); and,
    for a script that takes ``--loss-tiling``, the tokens in 8 slices, each slice's gradients
    taken in the forward pass (the same memory, no logits recomputed). That one comes first
    among a plan's rungs: where the model predicts them the same peak (the layers' working
    set above the logits), a search that has nothing fitting yet compiles it before the
    whole loss, which the model undercounts (Llama 3.1 405B, fsdp=128 tensor=4: predicted
    alike, compiled 22.9 GiB against 25.8); a plan that fits is ranked the simpler first."""
    precisions = facts.precisions if facts.accepts("precision") else ("none",)
    remats = ["none"]
    if facts.accepts("remat"):
        remats.append("full")
        if facts.accepts("remat_policy"):
            # JAX's dots_saveable, and the per-tensor plans the model names its tensors for
            remats += ["dots_saveable", *facts.remat_policies]
    scan = facts.accepts("scan") and facts.layers >= 8
    # the slices cost a recompute of the head (Gemma 3 12B fully sharded on v5e:4x4: 954 ms
    # against 879 ms whole) and do not always lower the peak (Gemma 7B, fsdp=2 tensor=8: 10.7
    # GiB against 10.6): searched only where a device's float32 and bf16 logits reach LOGITS_BYTES (0.5 GiB)
    big = logits_bytes(plan, facts, 2.0) * plan.loss_chunks >= LOGITS_BYTES
    slices = facts.accepts("loss_chunks") and facts.vocab % 8 == 0 and big
    chunks = [(1, "vocab")] + ([(8, "vocab")] if slices else [])
    # the tokens in slices, each one's gradients taken in the forward pass: no recompute
    if slices and facts.accepts("loss_tiling") and facts.seq % (8 * plan.context) == 0:
        chunks.insert(0, (8, "tokens"))
    for precision, remat, (n, tiling) in itertools.product(precisions, remats, chunks):
        yield dataclasses.replace(plan, precision=precision, remat=remat, scan=scan,
                                  loss_chunks=n, loss_tiling=tiling)  # fmt: skip


def device_tokens(plan: Plan, facts: ModelFacts) -> float:
    """A device's tokens: the batch over ``data x fsdp x expert``, the sequence over ``context``."""
    return facts.batch * facts.seq / (plan.data * plan.fsdp * plan.expert * plan.context)


def logits_bytes(plan: Plan, facts: ModelFacts, compute_bytes: float) -> float:
    """A device's live logits: float32 and the compute dtype, the vocabulary over ``tensor``,
    one of ``plan.loss_chunks`` slices at a time."""
    vocab = facts.vocab / plan.tensor / plan.loss_chunks
    return device_tokens(plan, facts) * vocab * (4 + compute_bytes)
