"""strategies.failure_handling: preemption saves at a step boundary and exact resumption."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
from dtensor import checkpoint
from dtensor.checkpoint.checkpointer import Checkpointer
from strategies.failure_handling import (
    RESTARTABLE_EXIT_CODE,
    PreemptionCheckpointHandler,
    TerminationConfig,
)

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "workers_ckpt" / "train_preemptible.py"
TOTAL_STEPS = 12


class Worker:
    """A training process (or a dtensor.launch job) whose stdout lines are read with timeouts."""

    def __init__(
        self, ckpt_dir, out_path, pause_at=None, *, processes=None, go_file=None, start_npz=None
    ):
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        if start_npz is not None:
            env["START_NPZ"] = str(start_npz)
        if pause_at is not None:
            env["PAUSE_AT_STEP"] = str(pause_at)
        if go_file is not None:
            env["GO_FILE"] = str(go_file)
        cmd = [sys.executable, str(WORKER), str(ckpt_dir), str(out_path), str(TOTAL_STEPS)]
        if processes:
            launcher = [sys.executable, "-m", "dtensor.launch", "-n", str(processes)]
            cmd = [
                *launcher,
                "--devices-per-process",
                "1",
                "--keep-going",
                "--timeout",
                "100",
                "--",
                *cmd,
            ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("<EOF>")

    def wait_for(self, prefix, timeout=90):
        while True:
            line = self.lines.get(timeout=timeout)
            self.seen.append(line)
            if line.startswith(prefix):
                return line
            if line == "<EOF>":
                raise AssertionError(
                    f"worker ended before {prefix!r}: {self.seen} {self.proc.stderr.read()[-3000:]}"
                )

    def finish(self, timeout=90):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            raise
        while True:
            try:
                line = self.lines.get(timeout=10)
            except queue.Empty:
                break
            if line == "<EOF>":
                break
            self.seen.append(line)
        return rc, self.proc.stderr.read()


def test_sigterm_mid_step_saves_at_boundary_and_resume_is_bitwise_exact(tmp_path):
    reference = Worker(tmp_path / "ref", tmp_path / "ref.npz")
    stopped = Worker(tmp_path / "ckpt", tmp_path / "resumed.npz", pause_at=5)
    try:
        stopped.wait_for("PAUSED 5")
        stopped.proc.send_signal(signal.SIGTERM)
        rc, err = stopped.finish()
        assert rc == RESTARTABLE_EXIT_CODE, err[-3000:]
        # Step 6 (the one running when the signal came) finished and was saved, then it exited.
        assert stopped.seen[-1].startswith("PAUSED 5 pid=") and not any(
            x.startswith("STEP 6") for x in stopped.seen
        )
        assert Checkpointer(tmp_path / "ckpt").all_steps() == [6]

        resumed = Worker(tmp_path / "ckpt", tmp_path / "resumed.npz")
        assert resumed.wait_for("START") == "START 6"
        rc, err = resumed.finish()
        assert rc == 0, err[-3000:]
        assert [x.split()[1] for x in resumed.seen if x.startswith("STEP")] == [
            str(i) for i in range(7, TOTAL_STEPS + 1)
        ]
        rc, err = reference.finish()
        assert rc == 0, err[-3000:]
    finally:
        for w in (reference, stopped):
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(timeout=10)

    ref, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "resumed.npz")
    assert sorted(ref.files) == sorted(got.files) and len(ref.files) > 10
    for name in ref.files:
        assert ref[name].tobytes() == got[name].tobytes(), name
    # The losses after the restart equal the uninterrupted run's, step by step.
    ref_losses = {
        line.split()[1]: line.split()[2] for line in reference.seen if line.startswith("STEP")
    }
    for line in resumed.seen:
        if line.startswith("STEP"):
            assert ref_losses[line.split()[1]] == line.split()[2]


# ----------------------------------------------------------------- in-process
def make_model():
    model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def sgd_step(model, optimizer):
    grads = nnx.grad(lambda m: (m(jnp.ones((2, 4))) ** 2).sum())(model)
    optimizer.update(model, grads)


def test_interval_saves_and_restore_at_construction(tmp_path):
    model, opt = make_model()
    h = PreemptionCheckpointHandler(
        tmp_path, {"model": model, "opt": opt}, save_interval_steps=3, max_to_keep=2
    )
    assert h.total_run_calls == 0
    for _ in range(7):
        h.run(sgd_step, model, opt)
    h.close()
    assert h.total_run_calls == 7
    assert Checkpointer(tmp_path).all_steps() == [3, 6]

    replay, replay_opt = make_model()
    for _ in range(6):
        sgd_step(replay, replay_opt)
    model2, opt2 = make_model()
    h2 = PreemptionCheckpointHandler(tmp_path, {"model": model2, "opt": opt2})
    assert h2.total_run_calls == 6
    assert model2.kernel[...].tobytes() == np.asarray(replay.kernel[...]).tobytes()
    assert int(opt2.step[...]) == 6
    h2.close()


def test_plain_pytrees_are_replaced_in_the_holder(tmp_path):
    state = {"params": {"w": jnp.zeros(3)}, "opt": optax.adam(1e-3).init({"w": jnp.zeros(3)})}
    h = PreemptionCheckpointHandler(tmp_path, state, save_interval_steps=1, async_save=False)

    def step():
        state["params"] = {"w": state["params"]["w"] + 1.5}

    for _ in range(2):
        h.run(step)
    h.close()
    fresh = {"params": {"w": jnp.zeros(3)}, "opt": optax.adam(1e-3).init({"w": jnp.zeros(3)})}
    h2 = PreemptionCheckpointHandler(tmp_path, fresh)
    assert h2.total_run_calls == 2
    assert fresh["params"]["w"].tolist() == [3.0, 3.0, 3.0]
    assert isinstance(fresh["opt"][0], optax.ScaleByAdamState)
    h2.close()


def test_damaged_latest_step_is_skipped_and_training_resumes_from_the_previous(tmp_path):
    model, opt = make_model()
    h = PreemptionCheckpointHandler(
        tmp_path, {"model": model, "opt": opt}, save_interval_steps=2, async_save=False
    )
    for _ in range(4):
        h.run(sgd_step, model, opt)
    h.close()
    assert Checkpointer(tmp_path).all_steps() == [2, 4]
    manifest = tmp_path / "4" / "manifest" / "metadata"
    os.truncate(manifest, manifest.stat().st_size // 2)

    replay, replay_opt = make_model()
    for _ in range(2):
        sgd_step(replay, replay_opt)
    model2, opt2 = make_model()
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 4: .*manifest/metadata"):
        h2 = PreemptionCheckpointHandler(
            tmp_path, {"model": model2, "opt": opt2}, save_interval_steps=2, async_save=False
        )
    assert h2.total_run_calls == 2 and int(opt2.step[...]) == 2
    assert model2.kernel[...].tobytes() == np.asarray(replay.kernel[...]).tobytes()
    assert h2.checkpointer.all_steps() == [2]  # the damaged step is gone, so step 4 can be saved
    for _ in range(2):
        h2.run(sgd_step, model2, opt2)
    h2.close()
    assert Checkpointer(tmp_path).all_steps() == [2, 4]
    assert [c.status for c in checkpoint.verify(tmp_path)] == ["ok", "ok"]


def test_signal_in_a_step_saves_at_the_boundary_and_calls_exit_fn(tmp_path):
    exits = []
    model, opt = make_model()
    before = signal.getsignal(signal.SIGUSR1)
    h = PreemptionCheckpointHandler(
        tmp_path,
        {"model": model, "opt": opt},
        termination_config=TerminationConfig(exit_fn=lambda: exits.append(h.total_run_calls)),
        signals=(signal.SIGUSR1,),
    )
    assert signal.getsignal(signal.SIGUSR1) != before

    def step(i):
        sgd_step(model, opt)
        if i == 2:
            os.kill(os.getpid(), signal.SIGUSR1)  # arrives mid-step; the step still finishes
        return i * 10

    results = [h.run(step, i) for i in range(3)]
    assert results == [0, 10, 20]
    assert exits == [3]
    assert Checkpointer(tmp_path).all_steps() == [3]
    assert signal.getsignal(signal.SIGUSR1) == before  # handler closed: the old one is back
    with pytest.raises(RuntimeError, match="is closed"):
        h.run(step, 0)


def test_default_exit_and_custom_save_fn(tmp_path):
    calls = []
    h = PreemptionCheckpointHandler(
        tmp_path,
        {"w": jnp.zeros(2)},
        termination_config=TerminationConfig(
            save_fn=lambda: calls.append("saved"), termination_watcher_fn=lambda: len(calls) == 0
        ),
    )
    with pytest.raises(SystemExit) as e:
        h.run(lambda: None)
    assert e.value.code == RESTARTABLE_EXIT_CODE
    assert calls == ["saved"]
    assert Checkpointer(tmp_path).all_steps() == []  # save_fn replaced the default save


def test_grace_period_keeps_training_while_time_is_left(tmp_path):
    h = PreemptionCheckpointHandler(
        tmp_path,
        {"w": jnp.zeros(2)},
        termination_config=TerminationConfig(grace_period=3600, exit_fn=lambda: None),
        signals=(signal.SIGUSR1,),
    )
    os.kill(os.getpid(), signal.SIGUSR1)
    for _ in range(3):
        h.run(lambda: None)
    assert h.preemption_noticed and Checkpointer(tmp_path).all_steps() == []
    h.close()


def test_bad_checkpoint_arguments(tmp_path):
    with pytest.raises(TypeError, match="checkpoint must be a mapping"):
        PreemptionCheckpointHandler(tmp_path, [jnp.zeros(2)])
    with pytest.raises(TypeError, match=r"entries \['w'\] are plain pytrees.*read-only"):
        PreemptionCheckpointHandler(tmp_path, types.MappingProxyType({"w": jnp.zeros(2)}))
    with pytest.raises(ValueError, match="save_interval_steps=0 is not valid"):
        PreemptionCheckpointHandler(tmp_path, {"w": jnp.zeros(2)}, save_interval_steps=0)


def steps_of(lines, rank):
    """``{step: loss}`` from one rank's "[rank r] STEP n loss" lines of a launch job."""
    tag = f"[rank {rank}] STEP "
    return {x.split()[3]: x.split()[4] for x in lines if x.startswith(tag)}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_sigterm_to_one_both_save_same_step_and_resume_exactly(tmp_path):
    go = tmp_path / "go"
    reference = Worker(tmp_path / "ref", tmp_path / "ref.npz", processes=2)
    stopped = Worker(tmp_path / "ckpt", tmp_path / "out.npz", pause_at=5, processes=2, go_file=go)
    resumed = None
    try:
        line = stopped.wait_for("[rank 1] PAUSED 5")
        os.kill(int(line.rsplit("pid=", 1)[1]), signal.SIGTERM)  # only rank 1 is told
        time.sleep(1.0)  # the notice reaches rank 0 through the coordination service
        go.touch()
        rc, err = stopped.finish(timeout=100)
        assert rc == RESTARTABLE_EXIT_CODE, stopped.seen[-20:]
        for rank in (0, 1):  # both ranks finished the running step, then saved and stopped
            assert "6" not in steps_of(stopped.seen, rank) and "5" in steps_of(stopped.seen, rank)
        assert Checkpointer(tmp_path / "ckpt").all_steps() == [6]

        resumed = Worker(
            tmp_path / "ckpt", tmp_path / "out.npz", processes=2, start_npz=tmp_path / "start.npz"
        )
        rc, err = resumed.finish(timeout=100)
        assert rc == 0, resumed.seen[-20:]
        assert any(x == "[rank 1] START 6" for x in resumed.seen)
        rc, err = reference.finish(timeout=100)
        assert rc == 0, reference.seen[-20:]
    finally:
        for w in (reference, stopped, resumed):
            if w is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(timeout=10)
    ref, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "out.npz")
    assert sorted(ref.files) == sorted(got.files) and len(ref.files) > 10
    for name in ref.files:
        assert ref[name].tobytes() == got[name].tobytes(), name
    for rank in (0, 1):
        after = steps_of(resumed.seen, rank)
        assert sorted(after, key=int) == [str(i) for i in range(7, TOTAL_STEPS + 1)]
        assert all(steps_of(reference.seen, rank)[k] == v for k, v in after.items())

    # 2 processes -> 1: the checkpoint the 2-process job wrote restores here, on one device,
    # to exactly what the 2-process job restored from it.
    one = dtensor.create_mesh([("x", 1)])
    restored = checkpoint.restore(tmp_path / "ckpt", one, step=6)
    start = np.load(tmp_path / "start.npz")
    flat = {
        jax.tree_util.keystr(p): np.asarray(
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        )
        for p, v in jax.tree_util.tree_leaves_with_path(restored)
    }
    assert len(flat) == len(start.files)
    names = {"[0]": "['model']", "[1]": "['optimizer']"}
    for name in start.files:  # "[0]['l1']['kernel']" there is "['model']['l1']['kernel']" here
        key = names[name[:3]] + name[3:].replace("['opt_state'][0]", "['opt_state']['0']")
        assert flat[key].tobytes() == start[name].tobytes(), name
