"""One compile of a script's step for a topology, in its own process, cached on disk.

``--search`` and ``--fit`` (:mod:`dtensor.tpu.search`) compile each candidate through
``python -m dtensor.aot --json`` in a fresh process (a large model's compile holds several
GiB, released when the process exits) and keep its figures on disk
(``$DTENSOR_CACHE_DIR`` or ``~/.cache/dtensor/fit``), keyed by the script's text, its
arguments, the topology and the jax-dtensor, jax and libtpu versions: a second search reads
them back at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["cache_dir", "cached_compile", "merge_flags"]


def merge_flags(argv: Sequence[str], flags: Sequence[str]) -> list[str]:
    """``argv`` with ``flags`` added; a flag with a value replaces the one in ``argv``.

    Examples:
        >>> from dtensor.tpu.compiles import merge_flags
        >>> merge_flags(["--tensor", "2", "--remat"], ["--tensor", "4", "--scan"])
        ['--tensor', '4', '--remat', '--scan']
    """
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


def cache_dir(given: str | os.PathLike[str] | None = None) -> Path:
    """Where compiles are kept: ``given``, else ``$DTENSOR_CACHE_DIR``, else
    ``~/.cache/dtensor/fit``."""
    if given is not None:
        return Path(given)
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
    floor = report.get("step_floor") or {}
    return {
        "fits": bool(got.get("fits", fit.get("fits", False))),
        "peak_bytes_per_chip": fit.get("bytes_per_chip") or got.get("required_bytes"),
        "peak_bytes_per_device": report.get("peak_bytes_per_device"),
        "limit_bytes_per_chip": fit.get("limit_bytes_per_chip") or got.get("available_bytes"),
        "step_time_floor_seconds": report.get("step_time_floor_seconds"),
        "bound": floor.get("bound"),
        "compute_seconds": floor.get("compute_seconds"),
        "ici_seconds": floor.get("ici_seconds"),
        "dcn_seconds": floor.get("dcn_seconds"),
        "mfu_ceiling": report.get("mfu_ceiling"),
        "mesh": report.get("mesh"),
        "compile_seconds": got.get("compile_seconds"),
    }


def cached_compile(
    script: Path,
    argv: list[str],
    *,
    topology: str,
    num_slices: int,
    cache: Path,
    timeout: float,
) -> dict[str, Any]:
    """The compiled figures of ``script argv`` on ``topology``: from ``cache`` if there,
    else compiled in its own process and kept (a timed-out compile is not kept). The entry
    says which (``cached``)."""
    file = cache / f"{_key(script, argv, topology, num_slices)}.json"
    if file.exists():
        entry = {**json.loads(file.read_text()), "cached": True}
        entry["fits"] = entry.get("compiled_fits", entry["fits"])
        return entry
    entry = _compile(script, argv, topology, num_slices, timeout)
    if "timed out" not in str(entry.get("error", "")):
        cache.mkdir(parents=True, exist_ok=True)
        # Whole or not at all: a search beside this one (another process, the same cache)
        # reads the entry as soon as its name exists.
        part = file.with_name(f"{file.name}.{os.getpid()}.part")
        part.write_text(json.dumps(entry, sort_keys=True))
        os.replace(part, file)
    return {**entry, "cached": False}
