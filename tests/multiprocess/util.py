"""Helpers for tests that run real processes through dtensor.launch."""

from __future__ import annotations

import json
import pathlib
import sys

from dtensor.runtime.launch import LaunchResult, launch

WORKERS = pathlib.Path(__file__).parent / "workers"
REPO = pathlib.Path(__file__).resolve().parents[2]


class _Discard:
    """An output sink: the launcher's prefixed stream is not needed (outputs are kept)."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass


def run_worker(
    name: str,
    num_processes: int,
    *args: str,
    devices_per_process: int | None = None,
    timeout_s: float = 90,
    stop_on_failure: bool = True,
    grace_s: float = 1.0,
    env: dict[str, str] | None = None,
) -> LaunchResult:
    """Run ``workers/<name>.py`` as ``num_processes`` processes of one job."""
    full_env = {"PYTHONPATH": str(REPO)}
    full_env.update(env or {})
    return launch(
        [sys.executable, str(WORKERS / f"{name}.py"), *args],
        num_processes,
        devices_per_process=devices_per_process,
        timeout_s=timeout_s,
        grace_s=grace_s,
        stop_on_failure=stop_on_failure,
        env=full_env,
        out=_Discard(),  # type: ignore[arg-type]
    )


def report(result: LaunchResult) -> str:
    """Every rank's output, for assertion messages."""
    parts = [f"returncode={result.returncode} returncodes={result.returncodes}"]
    for rank, out in enumerate(result.outputs):
        parts.append(f"----- rank {rank} -----\n{out}")
    return "\n".join(parts)


def results(result: LaunchResult) -> list[dict]:
    """The ``RESULT {json}`` line each rank printed, in rank order."""
    found: list[dict] = []
    for rank, out in enumerate(result.outputs):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert len(lines) == 1, f"rank {rank} printed {len(lines)} RESULT lines\n{report(result)}"
        found.append(json.loads(lines[0][len("RESULT ") :]))
    return found


def expect_ok(result: LaunchResult, num_processes: int) -> list[dict]:
    assert result.returncode == 0, report(result)
    assert result.returncodes == (0,) * num_processes, report(result)
    return results(result)
