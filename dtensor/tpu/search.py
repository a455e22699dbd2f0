"""The library picks the plan: ``python -m dtensor.aot --search`` and its memory-only mode ``--fit``.

:func:`search_plans` enumerates ``FullyShardedStrategy`` and ``HybridStrategy`` plans for a
script's model on a topology (:mod:`dtensor.tpu.plans`: the six axes, ``across_slices``, the
pipeline and context modes, the memory rungs), ranks them by an analytic model of memory and step time
(:mod:`dtensor.tpu.estimate`), compiles only the most promising few (``max_compiles``), each
in its own process and cached on disk (:mod:`dtensor.tpu.compiles`), and returns the fitting
plan with the lowest compiled step-time floor. After each compile the estimates of the plans
left are corrected by how far the model was from the compiler so far (the geometric mean of
the compiled/estimated ratios), and the search stops early when no plan left is predicted to
fit and beat the best compiled floor by more than the model's spread.

:func:`fit` is the same search over the memory rungs only (:func:`ladder`: precision, remat
and its policy, scan, optimizer offload, then a tensor axis), the axes as the
command line gives them; its choice, too, is the fitting configuration with the lowest floor.

The model's shapes come from the script's ``search_facts(argv) -> dict`` hook
(``examples/train.py``: parameters, layers, heads, KV heads, hidden, MLP, experts, vocabulary,
batch, sequence, and the flags it accepts). A script without the hook, or with fewer flags,
gets a smaller search: the rungs whose flags it has, in the ladder's order (cheapest first),
stopping at the first fit but for the rungs that may run faster.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dtensor.tpu.compiles import cache_dir as _cache_dir
from dtensor.tpu.compiles import cached_compile, merge_flags
from dtensor.tpu.estimate import Estimate, estimate
from dtensor.tpu.flags import Rung, ladder, plan_from_argv
from dtensor.tpu.plan import KNOB_FLAGS, ModelFacts, Plan
from dtensor.tpu.plans import enumerate_plans
from dtensor.tpu.ranking import Calibration, choose, next_candidate

__all__ = [
    "FitError",
    "FitResult",
    "Rung",
    "SearchResult",
    "choose",
    "fit",
    "ladder",
    "search_plans",
]

HOOK = "search_facts"


class FitError(ValueError):
    """A script :func:`fit` or :func:`search_plans` cannot search."""


@dataclasses.dataclass
class SearchResult:
    """What a search tried and chose.

    ``tried`` holds one dict a plan (``name``, ``argv``, ``strategy``: the preset to paste,
    ``compiled``, ``fits``, ``peak_bytes_per_device``, ``peak_bytes_per_chip``,
    ``step_time_floor_seconds``, ``bound``, ``mfu_ceiling``, the model's ``estimate`` and
    ``ratio`` compiled/estimated): the compiled plans first, then the best-ranked ones left
    (``compiled: False``, their figures the estimate's). ``best`` is the fitting compiled plan
    with the lowest floor, or ``None``; ``message`` says why nothing fits and what would.
    """

    script: str
    argv: list[str]
    topology: str
    num_slices: int
    tried: list[dict[str, Any]]
    best: dict[str, Any] | None
    mode: str = "fit"
    compiles: int = 0
    candidates: int = 0
    seconds: float = 0.0
    limit_bytes_per_chip: float | None = None
    message: str = ""

    def command(self, entry: dict[str, Any] | None = None) -> str | None:
        """The command line that compiles ``entry`` (default: the best)."""
        entry = entry or self.best
        if entry is None:
            return None
        head = ["python", "-m", "dtensor.aot", "--topology", self.topology]
        if self.num_slices > 1:
            head += ["--num-slices", str(self.num_slices)]
        return shlex.join([*head, "--", self.script, *entry["argv"]])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``best``, ``tried``, the command line and the search's figures."""
        return {
            "argv": self.argv,
            "best": self.best,
            "candidates": self.candidates,
            "command": self.command(),
            "compiles": self.compiles,
            "message": self.message,
            "mode": self.mode,
            "num_slices": self.num_slices,
            "script": self.script,
            "seconds": self.seconds,
            "topology": self.topology,
            "tried": self.tried,
        }


#: ``--fit``'s result (the same class).
FitResult = SearchResult


@dataclasses.dataclass
class _Candidate:
    name: str
    argv: list[str]
    plan: Plan | None
    estimate: Estimate | None
    faster: bool = False


def _script(script: str | os.PathLike[str], what: str) -> Path:
    path = Path(script)
    if not path.is_file():
        raise FitError(
            f"{what}: script {str(script)!r} does not exist (looked in {Path.cwd()}); give a "
            "training script with an aot_step hook, e.g. examples/train.py."
        )
    return path


def _hook(path: Path) -> Callable[[list[str]], Any] | None:
    """The script's ``search_facts`` hook, or ``None``."""
    from dtensor.tpu.scripts import load_script

    hook = getattr(load_script(path), HOOK, None)
    return hook if callable(hook) else None


def _facts(hook: Callable[[list[str]], Any] | None, argv: list[str]) -> ModelFacts | None:
    """``hook(argv)`` as :class:`ModelFacts` (``None`` without a hook)."""
    if hook is None:
        return None
    got = hook(list(argv))
    if not isinstance(got, dict):
        raise FitError(
            f"{HOOK}({argv}) returned {type(got).__name__}; it must return a dict of the "
            "model's shapes (params, layers, heads, kv_heads, head_dim, hidden, ffn, vocab, "
            "batch, seq) and the flags the script accepts -- see examples/facts.py."
        )
    return ModelFacts.from_dict(got)


@dataclasses.dataclass(frozen=True, slots=True)
class _Target:
    chips: int
    group: int
    chip: Any
    limit: float


def _target(topology: str, num_slices: int, max_bytes_per_chip: float | None) -> _Target:
    from dtensor.analysis.hardware import chip_of
    from dtensor.tpu.scripts import topology_devices

    devices = topology_devices(topology, num_slices=num_slices)
    gpu = devices[0].platform == "gpu"
    group = sum(d.process_index == devices[0].process_index for d in devices) if gpu else None
    chip = chip_of(devices)
    usable = chip.usable_hbm_gib * 2**30 if chip is not None else math.inf
    limit = max_bytes_per_chip if max_bytes_per_chip is not None else usable
    return _Target(len(devices), group or len(devices) // num_slices, chip, limit)


def _estimate(plan: Plan | None, facts: ModelFacts | None, target: _Target) -> Estimate | None:
    if plan is None or facts is None or target.chip is None:
        return None
    return estimate(plan, facts, target.chip, group=target.group)


def search_plans(
    script: str | os.PathLike[str],
    argv: Sequence[str] = (),
    *,
    topology: str,
    num_slices: int = 1,
    max_compiles: int = 6,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = 1800,
    max_bytes_per_chip: float | None = None,
    progress: Any = None,
    log: Callable[[str], None] | None = None,
    show: int = 12,
) -> SearchResult:
    """Search ``FullyShardedStrategy`` and ``HybridStrategy`` plans for ``script``'s model on
    ``topology`` (module docs).

    Args:
        script: a training script with the ``aot_step`` hook and, for the full search, the
            ``search_facts`` hook (``examples/train.py``).
        argv: the model's flags (``--model-size 2b --batch-size 16 --seq-len 1024``); the
            plan's flags (axes, precision, remat...) replace any given.
        topology: a TPU (``"v5e:4x4"``, ``"v5p-128"``) or GPU (``"h100:2x8"``) topology.
        num_slices: slices joined by DCN.
        max_compiles: at most this many plans compiled (cached ones count too).
        cache_dir: where compiles are kept (default ``$DTENSOR_CACHE_DIR`` or
            ``~/.cache/dtensor/fit``).
        timeout: seconds per compile.
        max_bytes_per_chip: fit within this instead of the chip's usable HBM.
        progress: an object with ``start(name, cached)`` and ``done(entry)`` (the CLI's
            progress bar), called around each compile.
        log: called with a line of text after each compile (e.g. ``print``).
        show: how many plans not compiled to list after the compiled ones.

    Returns:
        A :class:`SearchResult`; ``best`` is ``None`` when nothing compiled fits.

    Raises:
        FitError: no such script.

    Examples:
        A search compiles (a few seconds a plan for the tiny decoder; see
        ``tests/test_search.py``); what it returns reads like this:

        >>> import dtensor.tpu
        >>> found = dtensor.tpu.search_plans(  # doctest: +SKIP
        ...     "examples/train.py", ["--model-size", "tiny", "--batch-size", "16"],
        ...     topology="v5e:2x4", max_compiles=3)
        >>> found.best["strategy"]  # doctest: +SKIP
        'HybridStrategy(data=1, fsdp=8, tensor=1, mixed_precision=MixedPrecision(param_dtype=jnp.bfloat16))'
        >>> found.command()  # doctest: +SKIP
        'python -m dtensor.aot --topology v5e:2x4 -- examples/train.py --model-size tiny ...'
    """
    path = _script(script, "search")
    t0 = time.perf_counter()
    target = _target(topology, num_slices, max_bytes_per_chip)
    base = _strip_knobs(list(argv))
    hook = _hook(path)
    facts = _facts(hook, base)
    plans = enumerate_plans(facts, chips=target.chips, num_slices=num_slices) if facts else []
    if plans:
        accepted = set(facts.flags) if facts else set()
        candidates = [
            _Candidate(p.name(), merge_flags(base, _accepted(p.flags(), accepted)), p,
                       _estimate(p, facts, target))
            for p in plans
        ]  # fmt: skip
    else:  # no hook, or no plan the hook allows: the memory rungs the script takes
        candidates = _ladder_candidates(path, list(argv), None, hook, target, num_slices)
    found = _search(path, candidates, target, topology=topology, num_slices=num_slices,
                    max_compiles=max_compiles, cache=_cache_dir(cache_dir), timeout=timeout,
                    progress=progress, log=log, show=show, mode="search")  # fmt: skip
    return dataclasses.replace(
        found, script=str(script), argv=list(argv),
        seconds=time.perf_counter() - t0,
    )  # fmt: skip


def fit(
    script: str | os.PathLike[str],
    argv: Sequence[str] = (),
    *,
    topology: str,
    num_slices: int = 1,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = 1800,
    rungs: Sequence[Rung] | None = None,
    log: Callable[[str], None] | None = None,
    max_bytes_per_chip: float | None = None,
    max_compiles: int | None = None,
    progress: Any = None,
) -> SearchResult:
    """``--fit``: the search over the memory rungs of the preset ``argv`` names (module docs).

    Args:
        script: a training script with the ``aot_step`` hook (e.g. ``examples/train.py``).
        argv: its arguments (``--strategy fully_sharded --model-size 2b ...``).
        topology: a TPU topology (``"v5e:4x4"``) or a GPU one.
        num_slices: slices joined by DCN.
        cache_dir: where compiled results are kept (default ``$DTENSOR_CACHE_DIR``
            or ``~/.cache/dtensor/fit``).
        timeout: seconds per compile.
        rungs: the configurations to choose from (default :func:`ladder`).
        log: called with a line of text after each compile (e.g. ``print``).
        max_bytes_per_chip: fit within this many bytes per chip instead of
            the chip's usable HBM (to leave headroom).
        max_compiles: at most this many compiles (default: as many as it takes).
        progress: as :func:`search_plans`'s.

    Returns:
        A :class:`SearchResult` (``FitResult``); ``best`` is ``None`` when nothing fits.

    Raises:
        FitError: no such script.

    Examples:
        What a search returns, and the command line it prints (a search itself compiles;
        see ``tests/test_fit.py``):

        >>> from dtensor.tpu.search import FitResult
        >>> best = {"name": "bf16", "argv": ["--model-size", "2b", "--mixed-precision", "bf16"]}
        >>> FitResult("examples/train.py", [], "v5e:4x4", 1, [best], best).command()
        'python -m dtensor.aot --topology v5e:4x4 -- examples/train.py --model-size 2b --mixed-precision bf16'
    """
    path = _script(script, "fit")
    t0 = time.perf_counter()
    target = _target(topology, num_slices, max_bytes_per_chip)
    argv = list(argv)
    candidates = _ladder_candidates(path, argv, rungs, _hook(path), target, num_slices)
    # the configuration as given is checked first, whatever the model predicts of it
    given = next((c for c in candidates if c.argv == argv), None)
    found = _search(path, candidates, target, topology=topology, num_slices=num_slices,
                    max_compiles=max_compiles, cache=_cache_dir(cache_dir), timeout=timeout,
                    progress=progress, log=log, show=0, first=given)  # fmt: skip
    return dataclasses.replace(
        found, script=str(script), argv=argv, seconds=time.perf_counter() - t0
    )


def _strip_knobs(argv: list[str]) -> list[str]:
    """``argv`` without the flags a plan sets (the search decides them)."""
    knobs = set(KNOB_FLAGS.values()) | {"--model-remat", "--xla-plan", "--gather-at-reads"}
    out, i = [], 0
    while i < len(argv):
        if argv[i] in knobs:
            valued = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            i += 2 if valued else 1
            continue
        out.append(argv[i])
        i += 1
    return out


def _accepted(flags: list[str], accepted: set[str]) -> list[str]:
    """``flags`` without those (and their values) the script does not take."""
    out, i = [], 0
    while i < len(flags):
        valued = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flags[i] in accepted:
            out += flags[i : i + 2] if valued else [flags[i]]
        i += 2 if valued else 1
    return out


def _ladder_candidates(
    path: Path,
    argv: list[str],
    rungs: Sequence[Rung] | None,
    hook: Callable[[list[str]], Any] | None,
    target: _Target,
    num_slices: int,
) -> list[_Candidate]:
    """The ladder's rungs (or ``rungs``) the script takes, merged into ``argv``, estimated."""
    facts = _facts(hook, argv)
    if rungs is None:
        taken = set(facts.flags) if facts else _flags_in(path)
        rungs = [r for r in ladder(argv) if all(f in taken for f in r.flags if f.startswith("--"))]
    out: list[_Candidate] = []
    for rung in rungs:
        full = merge_flags(argv, rung.flags)
        if any(c.argv == full for c in out):
            continue  # the options as given already include this rung's
        at = _facts(hook, full) if facts is not None and full != argv else facts
        plan = plan_from_argv(full, chips=target.chips, num_slices=num_slices)
        out.append(_Candidate(rung.name, full, plan, _estimate(plan, at, target),
                              rung.faster_than_previous))  # fmt: skip
    return out


def _flags_in(path: Path) -> set[str]:
    """The ``--flags`` a script without the hook spells in its text."""
    import re

    return set(re.findall(r"--[a-z][a-z0-9-]*", path.read_text(errors="replace")))


def _search(
    path: Path,
    candidates: list[_Candidate],
    target: _Target,
    *,
    topology: str,
    num_slices: int,
    max_compiles: int | None,
    cache: Path,
    timeout: float,
    progress: Any,
    log: Callable[[str], None] | None,
    show: int,
    mode: str = "fit",
    first: _Candidate | None = None,
) -> SearchResult:
    """The one loop of ``--search`` and ``--fit``: pick, compile, correct the model, repeat
    (``first``, when given, is compiled first)."""
    remaining = list(candidates)
    calibration = Calibration()
    tried: list[dict[str, Any]] = []
    budget = len(candidates) if max_compiles is None else max_compiles
    while remaining and len(tried) < budget:
        if first is not None and not tried and first in remaining:
            pick = first
        else:
            pick = next_candidate(remaining, tried, calibration, target.limit)
        if pick is None:
            break
        remaining.remove(pick)
        if progress is not None:
            progress.start(pick.name, len(tried), budget)
        entry = cached_compile(path, pick.argv, topology=topology, num_slices=num_slices,
                               cache=cache, timeout=timeout)  # fmt: skip
        entry = _entry(pick, entry, target.limit)
        calibration.add(entry, pick.plan)
        tried.append(entry)
        if progress is not None:
            progress.done(entry)
        if log is not None:
            from dtensor.tpu.views import line

            log(line(entry))
    ranked = calibration.rank(remaining, target.limit)[:show]
    tried += [_predicted(c, calibration, target.limit) for c in ranked]
    best = choose(tried)
    result = SearchResult(
        "", [], topology, num_slices, tried, best, mode=mode,
        compiles=sum(1 for t in tried if t.get("compiled") and not t.get("cached")),
        candidates=len(candidates), limit_bytes_per_chip=target.limit,
    )  # fmt: skip
    if best is None:
        from dtensor.tpu.views import no_fit_message

        result.message = no_fit_message(result, target.limit)
    return result


def _entry(pick: _Candidate, compiled: dict[str, Any], limit: float) -> dict[str, Any]:
    entry = {**compiled, "compiled": True, "compiled_fits": compiled["fits"]}
    entry.update(name=pick.name, argv=pick.argv, strategy=_line(pick))
    peak = entry.get("peak_bytes_per_chip")
    if peak and limit < (entry.get("limit_bytes_per_chip") or math.inf):
        entry["fits"] = peak <= limit
        entry["limit_bytes_per_chip"] = limit
    if pick.estimate is not None:
        est = pick.estimate
        entry["estimate"] = est.to_dict()
        ratio = {}
        # a program over the HBM reports only its peak per chip (code included): still a ratio
        peak = entry.get("peak_bytes_per_device") or entry.get("peak_bytes_per_chip")
        if peak and est.peak_bytes_per_device:
            ratio["peak"] = peak / est.peak_bytes_per_device
        if entry.get("step_time_floor_seconds") and est.step_time_floor_seconds:
            ratio["floor"] = entry["step_time_floor_seconds"] / est.step_time_floor_seconds
        if entry.get("compute_seconds") and est.compute_seconds:
            ratio["compute"] = entry["compute_seconds"] / est.compute_seconds
        entry["ratio"] = ratio
    return entry


def _predicted(c: _Candidate, calibration: Any, limit: float) -> dict[str, Any]:
    """A plan not compiled: its estimate, corrected by the compiles so far."""
    est = c.estimate
    assert est is not None  # ranked candidates all have one
    peak, floor = calibration.predict(est, c.plan)
    return {
        "name": c.name,
        "argv": c.argv,
        "strategy": _line(c),
        "compiled": False,
        "fits": peak <= limit,
        "peak_bytes_per_device": peak,
        "peak_bytes_per_chip": peak,
        "step_time_floor_seconds": floor,
        "bound": est.bound,
        "mfu_ceiling": None if est.mfu_ceiling is None else est.mfu_ceiling * (
            est.step_time_floor_seconds / floor),
        "estimate": est.to_dict(),
    }  # fmt: skip


def _line(c: _Candidate) -> str:
    return c.plan.strategy_line() if c.plan is not None else ""
