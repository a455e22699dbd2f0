"""The demo (`make demo`) as a newcomer runs it: readable at 80 columns, scriptable with --json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train.py"


def _run(args: list[str], tmp_path: Path, *, launch: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(DEMO), "--out", str(tmp_path), "--fresh", "--sample-chars", "8", *args]
    if launch:
        launcher = [sys.executable, "-m", "dtensor.launch", "-n", str(launch)]
        cmd = [*launcher, "--devices-per-process", "2", "--", sys.executable, *cmd[1:]]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)


@pytest.mark.slow
def test_demo_tables_fit_80_columns_one_line_per_variable(tmp_path):
    proc = _run(["--steps", "3", "--strategy", "tensor_parallel", "--save-every", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    table = lines[next(i for i, line in enumerate(lines) if "variable layouts under" in line) :]
    kernels = [line for line in table if "/kernel" in line]
    # 2 blocks x (query, key, value, out, up, down) + head: one line each, none wrapped.
    assert len(kernels) == 13, "\n".join(table[:40])
    assert any("[·, tensor, ·]" in line for line in kernels)


@pytest.mark.slow
def test_demo_json_is_the_only_stdout(tmp_path):
    proc = _run(["--steps", "4", "--json", "--save-every", "0"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["strategy"] == "mirrored" and result["steps"] == 4 and result["devices"] == 8
    assert result["loss_last"] < result["loss_first"]
    assert result["comm_bytes_per_device"] >= result["min_comm_bytes_per_device"] > 0


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.xdist_group("multiprocess")
def test_demo_quiet_under_the_launcher(tmp_path):
    proc = _run(["--steps", "2", "--quiet", "--save-every", "0"], tmp_path, launch=2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summaries = [line for line in proc.stdout.splitlines() if "steps on 4 devices" in line]
    assert len(summaries) == 1 and "mirrored: 2 steps on 4 devices, loss" in summaries[0]


@pytest.mark.slow
@pytest.mark.xdist_group("gcs")
def test_demo_keeps_its_run_in_a_bucket_and_resumes_model_and_data(gcs, gcs_emulator):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(DEMO), "--out", gcs, "--sample-chars", "4", "--json"]
    runs = []
    for steps in (3, 5):
        proc = subprocess.run(
            [*cmd, "--steps", str(steps), "--save-every", "0"],
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
            cwd=Path.cwd(),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout))
    assert [r["resumed_from"] for r in runs] == [0, 3]
    assert runs[1]["checkpoints"] == f"{gcs}/mirrored/checkpoints"
    stored = gcs_emulator.object_path(gcs) / "mirrored"
    assert json.loads((stored / "results.json").read_text())["steps"] == 5
    assert (stored / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The data position went with each step: 3 global batches read, then 5.
    for step in (3, 5):
        record = json.loads(
            (stored / "checkpoints" / str(step) / "data" / "process_0.json").read_text()
        )
        assert record["state"]["batches"] == step
