"""The plans ``python -m dtensor.aot --search`` chooses from: ``HybridStrategy``'s six axes,
``across_slices``, the pipeline and context modes and the memory rungs, for one model on one
topology.

A :class:`Plan` is one configuration, written as the training script's flags
(:meth:`Plan.flags`, the ``examples/train.py`` spelling) and as the ``HybridStrategy(...)``
a user pastes (:meth:`Plan.strategy_line`). :func:`enumerate_plans` lists every plan whose
axis sizes multiply to the chip count and divide the model (:class:`ModelFacts`): ``tensor``
its heads, KV heads and MLP width, ``stage`` its layers, ``expert`` its experts, ``context``
its sequence, ``data x fsdp x expert`` its batch (each microbatch's, with a pipeline), and,
on several slices, the axis that spans them a multiple of their count. Only the knobs whose
flags the script accepts are turned: a script with fewer flags gets fewer plans.

:func:`plan_from_argv` reads a command line back into a plan (any preset the script names:
``fully_sharded`` is ``fsdp`` over every chip), so that ``--fit``'s rungs and a user's own
flags are estimated by the same model (:mod:`dtensor.tpu.estimate`). :func:`ladder` lists
``--fit``'s memory rungs for the preset a command line names (:class:`Rung`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "AXES",
    "KNOB_FLAGS",
    "ModelFacts",
    "Plan",
    "Rung",
    "enumerate_plans",
    "ladder",
    "plan_from_argv",
]

#: HybridStrategy's axes, in its mesh order.
AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")

#: Each knob of a plan and the script flag that turns it (``examples/train.py``'s spelling).
KNOB_FLAGS = {
    "strategy": "--strategy",
    "data": "--data",
    "tensor": "--tensor",
    "stage": "--stage",
    "microbatches": "--microbatches",
    "schedule": "--schedule",
    "context": "--context",
    "context_mode": "--context-mode",
    "expert": "--expert",
    "across_slices": "--across-slices",
    "precision": "--mixed-precision",
    "remat": "--remat",
    "remat_policy": "--remat-policy",
    "scan": "--scan",
    "gather_layers": "--gather-layers",
    "offload": "--offload-optimizer",
    "reshard": "--no-reshard-after-forward",
    "loss_chunks": "--loss-chunks",
    "loss_tiling": "--loss-tiling",
}
#: The loss in slices is searched where a device's logits (float32 and bf16) are at least this
#: large (Llama 3.1 405B, fsdp=128 tensor=4 on v5p:8x8x8: 0.73 GiB of them, and the loss by
#: token slices lowered the compiled peak 25.8 -> 22.9 GiB).
LOGITS_BYTES = 2**29
_BOOLEAN = ("--remat", "--scan", "--gather-layers", "--offload-optimizer")
_BOOLEAN += ("--no-reshard-after-forward",)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelFacts:
    """A model's shapes, as a script's ``search_facts(argv)`` hook gives them.

    ``params`` counts every parameter (tied embeddings once); ``flags`` are the script's
    flags the search may set; ``model_flops`` one step's (``None``: estimated as ``6 x
    params x tokens``); ``attention`` what the step's attention keeps (``"xla"``: float32
    scores of ``[batch, heads, seq, seq]``; a kernel's name, or ``"auto"``: none);
    ``precisions`` the ``--mixed-precision`` values the search tries (``"bf16-compute"``
    for a model whose modules pin their computation dtype, as Flax's own Gemma does: plain
    ``"bf16"`` leaves its arithmetic in float32).
    """

    params: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    ffn: int
    vocab: int
    batch: int
    seq: int
    experts: int = 0
    experts_per_token: int = 0
    tied: bool = True
    attention: str = "auto"
    block: str = ""
    model_flops: float | None = None
    flags: tuple[str, ...] = ()
    precisions: tuple[str, ...] = ("none", "bf16")

    @classmethod
    def from_dict(cls, facts: dict[str, Any]) -> ModelFacts:
        """From a hook's dict; unknown keys are ignored, ``flags`` becomes a tuple."""
        names = {f.name for f in dataclasses.fields(cls)}
        kept = {k: v for k, v in facts.items() if k in names}
        kept["flags"] = tuple(kept.get("flags", ()))
        if "precisions" in kept:
            kept["precisions"] = tuple(kept["precisions"])
        return cls(**kept)

    def accepts(self, knob: str) -> bool:
        """Whether the script takes ``knob``'s flag (:data:`KNOB_FLAGS`)."""
        return KNOB_FLAGS[knob] in self.flags


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """One configuration: the six axes' sizes, the modes, and the memory rungs.

    ``preset`` is the script's ``--strategy`` (``"hybrid"``; ``"fully_sharded"`` and others
    come from :func:`plan_from_argv`). ``precision`` is ``"none"`` (float32), ``"bf16"``
    (float32 master variables, bfloat16 reads) or ``"bf16-compute"`` (and each module's
    computation dtype set to bfloat16: ``MixedPrecision(module_dtype=True)``); ``remat``
    ``"none"``, ``"full"`` (keep only block inputs) or a ``jax.checkpoint_policies`` name;
    ``reshard`` ``False`` keeps the gathered weights from the forward pass for the backward
    one.
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    stage: int = 1
    context: int = 1
    expert: int = 1
    across_slices: str | None = None
    microbatches: int = 1
    schedule: str = "gpipe"
    context_mode: str = "gather"
    precision: str = "bf16"
    remat: str = "full"
    scan: bool = False
    gather_layers: bool = False
    offload: bool = False
    reshard: bool = True
    preset: str = "hybrid"
    loss_chunks: int = 1
    loss_tiling: str = "vocab"

    @property
    def chips(self) -> int:
        """The product of the axes."""
        return self.data * self.fsdp * self.tensor * self.stage * self.context * self.expert

    @property
    def sizes(self) -> dict[str, int]:
        """Axis name -> size, in mesh order."""
        return {a: getattr(self, a) for a in AXES}

    def name(self) -> str:
        """A short label: the axes above 1, then the rungs (``fsdp=8 tensor=2 bf16 remat``)."""
        parts = [f"{a}={n}" for a, n in self.sizes.items() if n > 1] or ["one chip"]
        if self.preset != "hybrid":
            parts.insert(0, self.preset)
        if self.stage > 1:
            parts.append(f"{self.schedule} x{self.microbatches}")
        if self.context > 1 and self.context_mode != "gather":
            parts.append(self.context_mode)
        if self.across_slices:
            parts.append(f"{self.across_slices} over DCN")
        names = {"none": "fp32", "bf16": "bf16", "bf16-compute": "bf16 compute"}
        parts.append(names.get(self.precision, self.precision))
        if self.remat != "none":
            parts.append("remat" if self.remat == "full" else f"remat ({self.remat})")
        parts += [w for w, on in (("scan", self.scan), ("gather layers", self.gather_layers),
                                  ("offload", self.offload), ("keep gathered", not self.reshard))
                  if on]  # fmt: skip
        if self.loss_chunks > 1:
            tokens = " by tokens" if self.loss_tiling == "tokens" else ""
            parts.append(f"loss/{self.loss_chunks}{tokens}")
        return " ".join(parts)

    def flags(self) -> list[str]:
        """The script's flags for this plan (``examples/train.py``'s spelling)."""
        out = ["--strategy", self.preset]
        if self.preset == "hybrid":
            if self.data > 1 or self.across_slices:
                out += ["--data", str(self.data)]
            for axis in ("tensor", "stage", "context", "expert"):
                if getattr(self, axis) > 1:
                    out += [KNOB_FLAGS[axis], str(getattr(self, axis))]
            if self.stage > 1:
                out += ["--microbatches", str(self.microbatches), "--schedule", self.schedule]
            if self.context > 1:
                out += ["--context-mode", self.context_mode]
            if self.across_slices:
                out += ["--across-slices", self.across_slices]
        if self.precision != "none":
            out += ["--mixed-precision", self.precision]
        if self.remat != "none":
            out.append("--remat")
            if self.remat != "full":
                out += ["--remat-policy", self.remat]
        for on, flag in ((self.scan, "--scan"), (self.gather_layers, "--gather-layers"),
                         (self.offload, "--offload-optimizer"),
                         (not self.reshard, "--no-reshard-after-forward")):  # fmt: skip
            if on:
                out.append(flag)
        if self.loss_chunks > 1:
            out += ["--loss-chunks", str(self.loss_chunks)]
            if self.loss_tiling != "vocab":
                out += ["--loss-tiling", self.loss_tiling]
        return out

    def strategy_line(self) -> str:
        """The preset to paste: ``HybridStrategy(data=1, fsdp=8, tensor=2, ...)``.

        Examples:
            >>> from dtensor.tpu.plans import Plan
            >>> Plan(fsdp=8, tensor=2).strategy_line()
            'HybridStrategy(data=1, fsdp=8, tensor=2, mixed_precision=MixedPrecision(param_dtype=jnp.bfloat16), remat=(Block,))'
        """
        if self.preset == "hybrid":
            args = [f"data={self.data}", f"fsdp={self.fsdp}", f"tensor={self.tensor}"]
            for axis in ("stage", "context", "expert"):
                if getattr(self, axis) > 1:
                    args.append(f"{axis}={getattr(self, axis)}")
            if self.stage > 1:
                args += [f"microbatches={self.microbatches}", f"schedule={self.schedule!r}"]
                args.append("pipeline=(Block,)")
            if self.context > 1:
                args.append(f"context_mode={self.context_mode!r}")
            if self.across_slices:
                args.append(f"across_slices={self.across_slices!r}")
            name = "HybridStrategy"
        else:
            args, name = [], {"fully_sharded": "FullyShardedStrategy"}.get(self.preset, "")
            if not name:
                return f"strategies.from_name({self.preset!r})"
        if self.precision != "none":
            extra = ", module_dtype=True" if self.precision == "bf16-compute" else ""
            args.append(f"mixed_precision=MixedPrecision(param_dtype=jnp.bfloat16{extra})")
        if self.remat != "none":
            args.append("remat=(Block,)")
            if self.remat != "full":
                args.append(f"remat_policy={self.remat!r}")
        if not self.reshard:
            args.append("reshard_after_forward=False")
        if self.offload:
            args.append("offload_optimizer=True")
        if self.gather_layers:
            args.append("gather_layers=True")
        return f"{name}({', '.join(args)})"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(n: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every ordered factorisation of ``n`` into ``parts`` factors."""
    if parts == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _splits(n // d, parts - 1):
            yield (d, *rest)


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
    modes = ("gather", "ring") if ring else ("gather",)
    if plan.stage == 1:
        if facts.batch % replicas == 0:
            for mode in modes:
                yield dataclasses.replace(plan, context_mode=mode)
        return
    schedules = ("gpipe", "circular") if facts.accepts("schedule") else ("gpipe",)
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
            remats.append("dots_saveable")
    scan = facts.accepts("scan") and facts.layers >= 8
    # the slices cost a recompute of the head (Gemma 3 12B fully sharded on v5e:4x4: 954 ms
    # against 879 ms whole) and do not always lower the peak (Gemma 7B, fsdp=2 tensor=8: 10.7
    # GiB against 10.6): searched only where a device's float32 and bf16 logits pass 2 GiB
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


@functools.cache
def _argv_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--strategy", default="")
    for knob in ("data", "tensor", "stage", "microbatches", "context", "expert", "loss_chunks"):
        p.add_argument(KNOB_FLAGS[knob], type=int, default=None)
    for knob in ("schedule", "context_mode", "across_slices", "precision", "remat_policy",
                 "loss_tiling"):  # fmt: skip
        p.add_argument(KNOB_FLAGS[knob], default=None)
    for flag in _BOOLEAN:
        p.add_argument(flag, action="store_true")
    return p


def plan_from_argv(argv: Sequence[str], *, chips: int, num_slices: int = 1) -> Plan | None:
    """The plan a command line asks for, as ``examples/train.py`` builds it (``None``: a
    preset whose layout the model does not describe).

    Examples:
        >>> from dtensor.tpu.plans import plan_from_argv
        >>> plan_from_argv(["--strategy", "hybrid", "--tensor", "2", "--remat"], chips=8).name()
        'fsdp=4 tensor=2 fp32 remat'
        >>> plan_from_argv(["--strategy", "fully_sharded", "--mixed-precision", "bf16"], chips=8).fsdp
        8
    """
    args, _ = _argv_parser().parse_known_args(list(argv))
    rungs = {
        "precision": args.mixed_precision or "none",
        "remat": (args.remat_policy or "full") if args.remat else "none",
        "scan": args.scan,
        "gather_layers": args.gather_layers,
        "offload": args.offload_optimizer,
        "reshard": not args.no_reshard_after_forward,
        "preset": args.strategy or "fully_sharded",
        "loss_chunks": args.loss_chunks or 1,
        "loss_tiling": args.loss_tiling or "vocab",
    }
    if args.strategy in ("", "fully_sharded"):
        return Plan(fsdp=chips, **rungs)
    if args.strategy in ("mirrored", "tpu", "one_device"):
        return Plan(data=chips, **rungs)
    if args.strategy != "hybrid":
        return None
    t, s = args.tensor or 1, args.stage or 1
    c, e = args.context or 1, args.expert or 1
    d = args.data or (num_slices if args.across_slices in (None, "data") else 1)
    if s > 1 and args.across_slices == "stage":
        d = args.data or 1
    if chips % (d * t * s * c * e):
        return None
    return Plan(
        data=d,
        fsdp=chips // (d * t * s * c * e),
        tensor=t,
        stage=s,
        context=c,
        expert=e,
        across_slices=(args.across_slices or ("data" if d % num_slices == 0 else "fsdp"))
        if num_slices > 1
        else None,
        microbatches=(args.microbatches or s) if s > 1 else 1,
        schedule=args.schedule or "gpipe",
        context_mode=args.context_mode or "gather",
        **rungs,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Rung:
    """One configuration of ``--fit``'s ladder: its name and the flags it adds to the script's."""

    name: str
    flags: tuple[str, ...]
    faster_than_previous: bool = False  # without a model: tried after a fit (less recomputation)


def _strategy(argv: Sequence[str]) -> str:
    argv = list(argv)
    return argv[argv.index("--strategy") + 1] if "--strategy" in argv[:-1] else ""


def ladder(argv: Sequence[str]) -> list[Rung]:
    """The configurations ``--fit`` (:func:`dtensor.tpu.fit`) chooses from for a script's ``argv``, cheapest first.

    Examples:
        >>> from dtensor.tpu.plans import ladder
        >>> [r.name for r in ladder(["--strategy", "fully_sharded"])][:4]
        ['as given', 'bf16', 'bf16 + remat', 'bf16 + remat (dots_saveable)']
    """
    bf16 = ("--mixed-precision", "bf16")
    remat = (*bf16, "--remat")
    scan = (*remat, "--scan")
    rungs = [
        Rung("as given", ()),
        Rung("bf16", bf16),
        Rung("bf16 + remat", remat),
        Rung("bf16 + remat (dots_saveable)", (*remat, "--remat-policy", "dots_saveable"), True),
        Rung("bf16 compute + remat", ("--mixed-precision", "bf16-compute", "--remat")),
        Rung("bf16 + remat + scan", scan),
        Rung(
            "bf16 + remat (dots_saveable) + scan",
            (*scan, "--remat-policy", "dots_saveable"),
            True,
        ),
    ]
    # No gather-layers rung: on the slices Cloud TPU builds, FullyShardedStrategy(
    # gather_layers=True) lowers no model's floor or peak (Llama 2 70B 24.7 -> 25.0 GiB,
    # Llama 3.1 405B 31.3 -> 32.4 GiB at equal floors; the scanned 7b's floor 406 -> 744 ms).
    fsdp = _strategy(argv) in ("", "fully_sharded")
    rungs.append(Rung("bf16 + remat + scan + offload optimizer", (*scan, "--offload-optimizer")))
    if fsdp:
        for t in (2, 4):
            flags = ("--strategy", "hybrid", "--tensor", str(t), *scan)
            rungs.append(Rung(f"hybrid tensor={t} + bf16 + remat + scan", flags))
    return rungs
