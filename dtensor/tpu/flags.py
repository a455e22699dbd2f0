"""A script's command line as plans: :func:`plan_from_argv` reads one back into a
:class:`~dtensor.tpu.plan.Plan` (any preset the script names: ``fully_sharded`` is ``fsdp``
over every chip), so that ``--fit``'s rungs and a user's own flags are estimated by the same
model (:mod:`dtensor.tpu.estimate`); :func:`ladder` lists ``--fit``'s memory rungs for the
preset a command line names (:class:`Rung`), as the flags each adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Sequence

from dtensor.tpu.plan import KNOB_FLAGS, Plan

__all__ = ["Rung", "ladder", "plan_from_argv"]

_BOOLEAN = ("--remat", "--scan", "--gather-layers", "--offload-optimizer")
_BOOLEAN += ("--no-reshard-after-forward",)


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
        >>> from dtensor.tpu.flags import plan_from_argv
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
        >>> from dtensor.tpu.flags import ladder
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
