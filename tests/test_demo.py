"""The demo (`make demo`) as a newcomer runs it: readable at 80 columns, scriptable with --json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
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
def test_demo_ctrl_c_in_a_bucket_then_resumes_model_optimizer_and_data(gcs, gcs_emulator):
    """Ctrl-C mid-run saves model, optimizer and data position in the bucket; a second run resumes."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(DEMO), "--out", gcs, "--sample-chars", "4"]
    stored = gcs_emulator.object_path(gcs) / "mirrored"
    first = subprocess.Popen(
        [*cmd, "--steps", "400", "--save-every", "1", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 300
        while not (stored / "checkpoints" / "1" / "commit_success.txt").is_file():
            assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)  # Ctrl-C
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-3000:]
    steps = sorted(int(p.name) for p in (stored / "checkpoints").iterdir() if p.name.isdigit())
    stopped = steps[-1]
    assert 1 <= stopped < 400
    second = subprocess.run(
        [*cmd, "--steps", str(stopped + 2), "--save-every", "0", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout)
    assert result["resumed_from"] == stopped
    assert result["checkpoints"] == f"{gcs}/mirrored/checkpoints"
    assert json.loads((stored / "results.json").read_text())["steps"] == stopped + 2
    assert (stored / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # The data position went with each step: `step` global batches read at step `step`.
    for step in (stopped, stopped + 2):
        saved = stored / "checkpoints" / str(step) / "data" / "process_0.json"
        assert json.loads(saved.read_text())["state"]["batches"] == step
