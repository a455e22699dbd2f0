"""The demo (`make demo`) as a newcomer runs it: readable at 80 columns, scriptable with --json."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "train.py"


def _run(args: list[str], tmp_path: Path, *, launch: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "80", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [
        sys.executable,
        str(DEMO),
        "--out",
        str(tmp_path),
        "--fresh",
        "--sample-chars",
        "8",
        *args,
    ]
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


def _command(args: list[str], out: Path) -> list[str]:
    return [sys.executable, str(DEMO), "--out", str(out), "--fresh", "--sample-chars", "8", *args]


@pytest.mark.slow
def test_demo_json_is_the_only_stdout_and_its_options_apply_1f1b_stages_train_as_mirrored(
    tmp_path,
):
    """--json prints one object; options the user gives are applied, not ignored: the
    character model in 2 pipeline stages by 1F1B, with remat, trains as mirrored does."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    common = ["--steps", "4", "--json", "--save-every", "0"]
    staged_args = ["--strategy", "hybrid", "--stage", "2", "--schedule", "1f1b", "--remat"]
    staged = subprocess.Popen(  # beside the mirrored run, not after it
        _command([*common, *staged_args], tmp_path / "staged"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        proc = _run(common, tmp_path)
        out, err = staged.communicate(timeout=400)
    finally:
        if staged.poll() is None:
            staged.kill()
            staged.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["strategy"] == "mirrored" and result["steps"] == 4 and result["devices"] == 8
    assert result["loss_last"] < result["loss_first"]
    assert result["comm_bytes_per_device"] >= result["min_comm_bytes_per_device"] > 0
    assert staged.returncode == 0, err[-3000:]
    got = json.loads(out)
    assert got["strategy"] == "hybrid" and got["steps"] == 4
    for key in ("loss_first", "loss_last"):
        assert got[key] == pytest.approx(result[key], rel=1e-5), key


def test_demo_refuses_options_it_cannot_apply_naming_them_and_the_fix():
    import importlib.util

    from rich.console import Console

    spec = importlib.util.spec_from_file_location("demo_train", DEMO)
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    console = Console(quiet=True)
    cases = {
        ("--strategy", "mirrored", "--stage", "2"): "--stage: not available under --strategy "
        "mirrored for the character-level model",
        ("--strategy", "hybrid", "--attention", "splash"): "--attention: not available",
        ("--strategy", "mirrored", "--mixed-precision", "bf16"): "--mixed-precision: not",
        ("--scan",): "--scan applies to the decoder's ahead-of-time compiles",
        ("--remat", "--model-remat"): "--model-remat applies to the decoder's",
    }
    for argv, message in cases.items():
        with pytest.raises(ValueError, match="drop it") as e:
            train.training_strategy(train.parse_args(list(argv)), None, console)
        assert message in str(e.value), (argv, str(e.value))
    # Without options: the preset as registered; with them, the strategy they describe.
    plain, _ = train.training_strategy(train.parse_args(["--strategy", "hybrid"]), None, console)
    assert type(plain).__name__ == "HybridStrategy" and "stage" not in plain.mesh.dim_names
    staged, _ = train.training_strategy(
        train.parse_args(["--strategy", "hybrid", "--stage", "2", "--schedule", "zero-bubble"]),
        None,
        console,
    )
    assert dict(staged.mesh.shape)["stage"] == 2
    remat, _ = train.training_strategy(
        train.parse_args(["--strategy", "hybrid", "--remat"]), None, console
    )  # an option of the preset alone, no axis: applied too
    assert remat.remat == (train.make_model_cls().Block,)
    plan = staged.pipeline_plan()
    assert plan.schedule == "zero-bubble" and plan.classes == (train.make_model_cls().Block,)


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
    """Ctrl-C mid-run saves model, optimizer and data position in the bucket; a second run
    resumes from them and reaches the very state the first run had reached uninterrupted."""
    import jax
    import numpy as np

    import dtensor.checkpoint
    from dtensor.checkpoint.storage import refresh, resolve

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(DEMO), "--out", gcs, "--sample-chars", "4"]
    stored = gcs_emulator.object_path(gcs) / "mirrored"
    url = f"{gcs}/mirrored/checkpoints"
    # Its output goes to a file, not a pipe nobody reads while it trains: gcsfs logs a line
    # per bucket call, and a full pipe would block the logging thread, then the checkpoint
    # commit waiting on it, then the run (seen under load: the run stopped at step 2).
    log = gcs_emulator.data_dir.parent / f"first-run-{uuid.uuid4().hex[:8]}.log"
    log_file = open(log, "w")  # noqa: SIM115 - closed below
    first = subprocess.Popen(
        [*cmd, "--steps", "400", "--save-every", "1", "--quiet"],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )

    def committed_from_2() -> bool:
        # Any step >= 2 committed: with a save every step and 3 kept, step 2 itself may be
        # gone (its folder stays behind on the emulator's disk, emptied) before a look here.
        top = stored / "checkpoints"
        steps = [p for p in top.iterdir() if p.name.isdigit()] if top.is_dir() else []
        return any(int(p.name) >= 2 and (p / "commit_success.txt").is_file() for p in steps)

    try:
        deadline = time.monotonic() + 300
        while not committed_from_2():
            assert first.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no step >= 2 committed within 300 s"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)  # Ctrl-C
        first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=60)
        log_file.close()
    assert first.returncode == 0, log.read_text()[-3000:]
    refresh(url)
    stopped = dtensor.checkpoint.latest_step(url)  # committed and intact, as listed by the API
    assert stopped is not None and 2 <= stopped < 400, stopped
    # The first run's state at its last step, uninterrupted since step 0: the reference.
    # Then that step goes (through the bucket's API), and a second run resumes from the
    # step before it and trains the one step again.
    reached = jax.device_get(dtensor.checkpoint.restore(url, step=stopped))
    resolve(f"{url}/{stopped}").rmtree()
    refresh(url)
    assert dtensor.checkpoint.latest_step(url) == stopped - 1
    second = subprocess.run(
        [*cmd, "--steps", str(stopped), "--save-every", "0", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    result = json.loads(second.stdout)
    assert result["resumed_from"] == stopped - 1
    assert result["checkpoints"] == f"{gcs}/mirrored/checkpoints"
    assert json.loads((stored / "results.json").read_text())["steps"] == stopped
    assert (stored / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # Model and optimizer came back (not only the step number): one step from them gives
    # the first run's parameters, Adam moments and step count.
    refresh(url)
    again = jax.device_get(dtensor.checkpoint.restore(url, step=stopped))
    assert jax.tree.structure(again) == jax.tree.structure(reached)
    assert int(again["optimizer"]["step"]) == int(reached["optimizer"]["step"]) == stopped
    for (path, got), want in zip(
        jax.tree_util.tree_leaves_with_path(again), jax.tree.leaves(reached), strict=True
    ):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        assert error <= 1e-6, (jax.tree_util.keystr(path), error)
    # The data position went with each step: `step` global batches read at step `step`.
    for step in (stopped - 1, stopped):
        saved = stored / "checkpoints" / str(step) / "data" / "process_0.json"
        assert json.loads(saved.read_text())["state"]["batches"] == step


def test_the_corpus_kept_between_runs_is_the_parsed_one_and_a_damaged_copy_is_parsed_again(
    tmp_path, monkeypatch
):
    """A few of the standard library's modules stand in for all of it: the keeping, reading
    back and parsing again are the same code whatever the directory holds, and each parse of
    the whole standard library takes seconds (four of them here)."""
    import importlib.util
    import shutil
    import sysconfig

    spec = importlib.util.spec_from_file_location("demo_corpus", ROOT / "examples" / "corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    stdlib = tmp_path / "stdlib"
    stdlib.mkdir()
    for name in ("abc", "bisect", "colorsys", "fnmatch", "glob", "shlex"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / f"{name}.py", stdlib)
    monkeypatch.setattr(corpus.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    parsed = corpus._parse_corpus(stdlib, 20_000)
    assert len(parsed) == 20_000  # cut: the six modules hold more
    assert corpus.build_corpus(20_000) == parsed  # parsed, then kept
    (kept,) = temp.glob("dtensor-demo-corpus-*.txt")
    assert list(temp.iterdir()) == [kept]  # nothing left beside it
    assert corpus.build_corpus(20_000) == parsed  # read back
    kept.write_text(kept.read_text(encoding="utf-8")[:-10], encoding="utf-8")  # cut short
    assert corpus.build_corpus(20_000) == parsed
    assert kept.read_text(encoding="utf-8").split("\n", 1)[1] == parsed  # and kept whole again
    assert corpus.build_corpus(10_000) == parsed[:10_000]  # another size: its own copy
