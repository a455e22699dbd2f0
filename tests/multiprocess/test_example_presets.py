"""The documented multi-process command of the example runs to its end under every preset.

`python -m dtensor.launch -n 2 -- python examples/train.py --strategy NAME` (the README,
the multi-process guide) trains, checkpoints, samples from the model and writes
`results.json` on 2 processes x 4 devices, for each name `--list-strategies` offers, and
its losses are those of the same run as one process (same model, same global batches);
so is the pretrained-weights guide's `--init-from PATH` run under `fully_sharded`.
Each run is a few steps; the sample (a gather of the whole model on every process) is
where sharded presets used to fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from strategies.registry import PRESET_NAMES

ROOT = Path(__file__).resolve().parents[2]
STEPS = ["--steps", "2", "--sample-chars", "3", "--save-every", "0", "--fresh", "--quiet"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.xdist_group("multiprocess"),
]


def _train(out: Path, *args: str, processes: int) -> dict:
    """``examples/train.py ARGS`` as ``processes`` processes (through the launcher) or one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "JAX_PLATFORMS": "cpu"}
    env.pop("DTENSOR_DEVICES_PER_PROCESS", None)
    train = [sys.executable, str(ROOT / "examples" / "train.py"), *args, "--out", str(out)]
    if processes > 1:
        train = [sys.executable, "-m", "dtensor.launch", "-n", str(processes), "--", *train]
    proc = subprocess.run(
        ["timeout", "-k", "10", "280", *train, *STEPS],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    strategy = args[args.index("--strategy") + 1]
    return json.loads((out / strategy / "results.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The reference: the same run as one process with 8 devices."""
    return _train(tmp_path_factory.mktemp("one"), "--strategy", "one_device", processes=1)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_runs_the_example_to_its_end_on_2_processes(name, one_process, tmp_path):
    result = _train(tmp_path, "--strategy", name, processes=2)
    assert (result["processes"], result["local_devices"], result["devices"]) == (2, 4, 8)
    assert result["steps"] == 2 and len(result["sample"]) == len("def ") + 3
    assert (tmp_path / name / "loss.png").stat().st_size > 0
    assert (tmp_path / name / "checkpoints").is_dir()
    for key in ("loss_first", "loss_last"):
        assert result[key] == pytest.approx(one_process[key], rel=2e-5), (name, key)


@pytest.mark.timeout(600)
def test_fine_tuning_from_a_hugging_face_checkpoint_on_2_processes(tmp_path):
    from tests.test_hf_checkpoints import write_hf

    write_hf(tmp_path / "hf", "llama")
    args = ["--strategy", "fully_sharded", "--init-from", str(tmp_path / "hf")]
    args += ["--seq-len", "16", "--batch-size", "8"]
    two = _train(tmp_path / "two", *args, processes=2)
    one = _train(tmp_path / "one", *args, processes=1)
    assert (two["processes"], one["processes"]) == (2, 1)
    assert two["init_from"] == str(tmp_path / "hf")
    for key in ("loss_first", "loss_last"):
        assert two[key] == pytest.approx(one[key], rel=2e-5), key


@pytest.mark.timeout(360)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_stages_spanning_the_processes_read_one_share_and_train_as_one_process(
    schedule, one_process, tmp_path
):
    """``--stage 2`` on 2 processes: each process holds one stage of every row, so both read
    the whole batch (one input pipeline), not half of it each."""
    args = ["--strategy", "hybrid", "--stage", "2", "--schedule", schedule]
    result = _train(tmp_path, *args, processes=2)
    assert (result["processes"], result["devices"]) == (2, 8)
    for key in ("loss_first", "loss_last"):
        assert result[key] == pytest.approx(one_process[key], rel=2e-5), (schedule, key)


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_the_local_tier_command_resumes_a_replaced_process_from_its_peer(tmp_path):
    """The checkpoints guide's command, `--local-checkpoints DIR --local-every N`, on 2 processes:
    stopped at step 4 and restarted with process 1's disk empty and no persistent step, the run
    resumes from the peer tier and ends where an uninterrupted run ends."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "JAX_PLATFORMS": "cpu"}
    env.pop("DTENSOR_DEVICES_PER_PROCESS", None)

    def run(out: Path, local: Path, steps: int) -> dict:
        train = [sys.executable, "-m", "dtensor.launch", "-n", "2", "--", sys.executable]
        train += [str(ROOT / "examples" / "train.py"), "--strategy", "fully_sharded"]
        train += ["--local-checkpoints", str(local), "--local-every", "2", "--save-every", "100"]
        train += ["--steps", str(steps), "--sample-chars", "3", "--quiet", "--out", str(out)]
        proc = subprocess.run(
            ["timeout", "-k", "10", "280", *train],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return json.loads((out / "fully_sharded" / "results.json").read_text())

    straight = run(tmp_path / "a", tmp_path / "al", 6)
    first = run(tmp_path / "b", tmp_path / "bl", 4)
    assert (first["restored_from_tier"], first["global_batch"]) == (None, 32)

    shutil.rmtree(tmp_path / "b" / "fully_sharded" / "checkpoints" / "4")  # the bucket lags
    shutil.rmtree(tmp_path / "bl" / "process_1")  # a replacement host
    resumed = run(tmp_path / "b", tmp_path / "bl", 6)
    assert (resumed["resumed_from"], resumed["restored_from_tier"]) == (4, "peer")
    assert resumed["global_batch"] == 32 and resumed["processes"] == 2
    assert resumed["loss_last"] == straight["loss_last"]
