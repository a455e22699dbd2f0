"""Find the options under which a training step fits a TPU topology: ``python -m dtensor.aot --fit``.

:func:`fit` compiles a script's step (the ``aot_step`` hook of
:mod:`dtensor.tpu.aot`) for a topology under a ladder of options, in the
order that costs least first:

1. the options as given;
2. ``--mixed-precision bf16`` (float32 master variables, bfloat16 reads);
3. ``--remat`` (recompute each repeated block in the backward pass), then
   the cheaper-to-run remat policy ``--remat-policy dots_saveable`` (saves
   the matmul outputs: less recomputation, more memory), then
   ``--mixed-precision bf16-compute`` (``MixedPrecision(module_dtype=True)``:
   bfloat16 arithmetic in modules that pin float32 compute, as Flax's own
   Gemma does);
4. ``--scan`` (the layers in one ``nnx.scan``: one compiled layer), then,
   for ``fully_sharded``, ``--gather-layers`` (each scanned layer gathered in
   the loop body: a lower floor and peak on Llama 2 70B, a higher floor on a
   Gemma-7B-shaped decoder, so it is tried as a rung that may run faster);
5. ``--offload-optimizer`` (optimizer state in host memory);
6. the next preset: ``--strategy hybrid --tensor N`` (Megatron tensor
   parallelism on top of the fsdp axis) for N = 2, 4.

It stops at the first configuration that fits the chip's usable HBM, then
also compiles those further rungs that may run faster (a lighter remat
policy), and returns the fitting configuration with the lowest step-time
floor (:mod:`dtensor.analysis.floor`; rematerialisation raises it), with the
command line that compiles it. The flags are those of ``examples/train.py``;
a script opts in by accepting them.

Each compile runs in its own process (a large model's compile holds several
GiB) through ``python -m dtensor.aot --json``, and its result is cached on
disk (``$DTENSOR_CACHE_DIR`` or ``~/.cache/dtensor/fit``), keyed by the
script's text, its arguments, the topology and the jax-dtensor, jax and
libtpu versions:
a second ``--fit`` reads them back at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["FitError", "FitResult", "Rung", "choose", "fit", "ladder"]


class FitError(ValueError):
    """A script :func:`fit` cannot search."""


@dataclasses.dataclass(frozen=True, slots=True)
class Rung:
    """One configuration of the search: its name and the flags it adds to the script's."""

    name: str
    flags: tuple[str, ...]
    faster_than_previous: bool = False  # tried after a fit (less recomputation)


def _strategy(argv: Sequence[str]) -> str:
    argv = list(argv)
    return argv[argv.index("--strategy") + 1] if "--strategy" in argv[:-1] else ""


def ladder(argv: Sequence[str]) -> list[Rung]:
    """The configurations :func:`fit` tries for a script's ``argv``, in order.

    Examples:
        >>> from dtensor.tpu.search import ladder
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
    fsdp = _strategy(argv) in ("", "fully_sharded")
    if fsdp:  # FullyShardedStrategy(gather_layers=True): a lower floor on some models only
        rungs.append(Rung("bf16 + remat + scan + gather layers", (*scan, "--gather-layers"), True))
    rungs.append(Rung("bf16 + remat + scan + offload optimizer", (*scan, "--offload-optimizer")))
    if fsdp:
        for t in (2, 4):
            flags = ("--strategy", "hybrid", "--tensor", str(t), *scan)
            rungs.append(Rung(f"hybrid tensor={t} + bf16 + remat + scan", flags))
    return rungs


@dataclasses.dataclass
class FitResult:
    """What :func:`fit` tried (``tried``: one dict per compile) and chose (``best``, or ``None``)."""

    script: str
    argv: list[str]
    topology: str
    num_slices: int
    tried: list[dict[str, Any]]
    best: dict[str, Any] | None

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
        """JSON-ready: the search, the choice and its command line."""
        return {
            "argv": self.argv,
            "best": self.best,
            "command": self.command(),
            "num_slices": self.num_slices,
            "script": self.script,
            "topology": self.topology,
            "tried": self.tried,
        }


def _merge(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` with ``flags`` added; a flag with a value replaces the one in ``argv``."""
    out = list(argv)
    i = 0
    flags = list(flags)
    while i < len(flags):
        flag = flags[i]
        takes_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flag in out:
            j = out.index(flag)
            if takes_value and j + 1 < len(out):
                out[j + 1] = flags[i + 1]
        else:
            out += flags[i : i + 2] if takes_value else [flag]
        i += 2 if takes_value else 1
    return out


def _versions() -> str:
    from dtensor.version import __version__

    found = [f"jax-dtensor=={__version__}"]
    for dist in ("jax", "jaxlib", "libtpu", "libtpu-nightly"):
        try:
            found.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return ",".join(found)


def _cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("DTENSOR_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "dtensor" / "fit"


def _key(script: Path, argv: list[str], topology: str, num_slices: int) -> str:
    h = hashlib.sha256()
    for part in (script.read_bytes(), json.dumps(argv), topology, str(num_slices), _versions()):
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _compile(
    script: Path, argv: list[str], topology: str, num_slices: int, timeout: float
) -> dict[str, Any]:
    """One ``python -m dtensor.aot --json`` compile in its own process: the entry."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "dtensor.aot", "--topology", topology]
        cmd += ["--num-slices", str(num_slices), "--json", str(out), "--", str(script), *argv]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS") or "cpu"}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"fits": False, "error": f"compile timed out after {timeout:.0f} s"}
        if not out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return {"fits": False, "error": " ".join(tail)[-500:]}
        got = json.loads(out.read_text())
    report = got.get("report") or {}
    fit = report.get("memory_fit") or {}
    return {
        "fits": bool(got.get("fits", fit.get("fits", False))),
        "peak_bytes_per_chip": fit.get("bytes_per_chip") or got.get("required_bytes"),
        "peak_bytes_per_device": report.get("peak_bytes_per_device"),
        "limit_bytes_per_chip": fit.get("limit_bytes_per_chip") or got.get("available_bytes"),
        "step_time_floor_seconds": report.get("step_time_floor_seconds"),
        "mfu_ceiling": report.get("mfu_ceiling"),
        "compile_seconds": got.get("compile_seconds"),
    }


def fit(
    script: str | os.PathLike[str],
    argv: Sequence[str] = (),
    *,
    topology: str,
    num_slices: int = 1,
    cache_dir: str | os.PathLike[str] | None = None,
    timeout: float = 1800,
    rungs: Sequence[Rung] | None = None,
    log: Any = None,
    max_bytes_per_chip: float | None = None,
) -> FitResult:
    """Search the options under which ``script``'s step fits ``topology`` (see the module docs).

    Args:
        script: a training script with the ``aot_step`` hook (e.g. ``examples/train.py``).
        argv: its arguments (``--strategy fully_sharded --model-size 2b ...``).
        topology: a TPU topology (``"v5e:4x4"``).
        num_slices: slices joined by DCN.
        cache_dir: where compiled results are kept (default ``$DTENSOR_CACHE_DIR``
            or ``~/.cache/dtensor/fit``).
        timeout: seconds per compile.
        rungs: the configurations to try (default :func:`ladder`).
        log: called with a line of text after each compile (e.g. ``print``).
        max_bytes_per_chip: fit within this many bytes per chip instead of
            the chip's usable HBM (to leave headroom).

    Returns:
        A :class:`FitResult`; ``best`` is ``None`` when nothing fits.

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
    path = Path(script)
    if not path.is_file():
        raise FitError(
            f"fit: script {str(script)!r} does not exist (looked in {Path.cwd()}); give a "
            "training script with an aot_step hook, e.g. examples/train.py."
        )
    argv = list(argv)
    cache = _cache_dir(cache_dir)
    tried: list[dict[str, Any]] = []
    found = False
    for rung in rungs if rungs is not None else ladder(argv):
        full = _merge(argv, rung.flags)
        if any(t["argv"] == full for t in tried):
            continue  # the options as given already include this rung's
        if found and not rung.faster_than_previous:
            break
        key = _key(path, full, topology, num_slices)
        file = cache / f"{key}.json"
        if file.exists():
            entry = {**json.loads(file.read_text()), "cached": True}
            entry["fits"] = entry.get("compiled_fits", entry["fits"])
        else:
            entry = _compile(path, full, topology, num_slices, timeout)
            if "timed out" not in str(entry.get("error", "")):
                cache.mkdir(parents=True, exist_ok=True)
                file.write_text(json.dumps(entry, sort_keys=True))
            entry["cached"] = False
        entry["compiled_fits"] = entry["fits"]
        entry.update(name=rung.name, argv=full)
        peak = entry.get("peak_bytes_per_chip")
        if max_bytes_per_chip is not None and peak:
            entry["fits"] = peak <= max_bytes_per_chip
            entry["limit_bytes_per_chip"] = max_bytes_per_chip
        tried.append(entry)
        found = found or entry["fits"]
        if log is not None:
            log(_line(entry))
    return FitResult(str(script), argv, topology, num_slices, tried, choose(tried))


def choose(tried: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fitting entry with the lowest step-time floor; ``None`` when none fits.

    An entry without a floor (a chip the hardware table lacks) ranks after
    every entry with one, never first as a floor of 0 would; among entries
    without one the first tried (the least costly rung) wins.

    Examples:
        >>> from dtensor.tpu.search import choose
        >>> tried = [{"name": "a", "fits": True, "step_time_floor_seconds": None},
        ...          {"name": "b", "fits": True, "step_time_floor_seconds": 0.2},
        ...          {"name": "c", "fits": False, "step_time_floor_seconds": 0.1}]
        >>> choose(tried)["name"]
        'b'
    """
    fitting = [t for t in tried if t["fits"]]

    def rank(t: dict[str, Any]) -> tuple[bool, float]:
        floor = t.get("step_time_floor_seconds")
        return (floor is None, floor or 0.0)

    return min(fitting, key=rank, default=None)


def _line(entry: dict[str, Any]) -> str:
    from dtensor.core.text import human_bytes

    peak = entry.get("peak_bytes_per_chip")
    floor = entry.get("step_time_floor_seconds")
    mfu = entry.get("mfu_ceiling")
    parts = [
        f"{entry['name']}: " + ("fits" if entry["fits"] else "does not fit"),
        f"peak {human_bytes(peak)} per chip" if peak else entry.get("error", ""),
        f"floor {floor * 1e3:.1f} ms" if floor else "",
        f"MFU ceiling {mfu:.1%}" if mfu else "",
        "(cached)" if entry.get("cached") else "",
    ]
    return ", ".join(p for p in parts[:4] if p) + (" " + parts[4] if parts[4] else "")
