"""The local checkpoint tier (one process, 8 devices): which tier a restore takes, and what it survives.

A ``Checkpointer(directory, local_directory=...)`` writes each step to both
tiers (``save_local``: the local one only); a restore takes the newest step of
either, the local one when both have it, and falls back to the persistent tier
with a warning when the local step cannot serve (a damaged block, a target it
does not match). A write killed midway leaves no step behind. The processes'
side (peer copies, a replaced host, a lost slice) is in
tests/multiprocess/test_checkpoint_tiers.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor.checkpoint import Checkpointer, CheckpointError
from strategies.failure_handling import PreemptionCheckpointHandler
from tests.models import MLPModel, make_train_step, mlp_batches, mlp_loss


@pytest.fixture
def mesh():
    return dtensor.create_mesh([("x", 4), ("y", 2)])


def _tree(mesh, v: float):
    lay = dtensor.Layout(["x", "y"], mesh)
    w = dtensor.copy_to_mesh(jnp.arange(32.0).reshape(8, 4) + v, lay)
    b = dtensor.copy_to_mesh(jnp.full((6,), v, jnp.bfloat16), dtensor.Layout.replicated(mesh, 1))
    return {"w": w, "b": b, "n": np.int64(v), "key": jax.random.key(int(v))}


def _target(mesh):
    return _tree(mesh, 0.0)


def test_the_newest_tier_is_restored_and_the_local_one_when_both_have_it(tmp_path, mesh):
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        ck.save(1, _tree(mesh, 1.0))
        ck.save_local(2, _tree(mesh, 2.0))
        ck.save_local(3, _tree(mesh, 3.0))
        ck.wait()
        assert ck.all_steps() == [1] and ck.local_steps() == [2, 3]  # kept: the newest 2
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        out = ck.restore(None, _target(mesh))
        assert (ck.restored_step, ck.restored_tier) == (3, "local")
        np.testing.assert_array_equal(out["w"], np.arange(32.0).reshape(8, 4) + 3)
        assert out["w"].sharding == _target(mesh)["w"].sharding
        assert out["b"].dtype == jnp.bfloat16 and float(out["b"][0]) == 3.0
        assert out["n"] == 3 and isinstance(out["n"], np.int64)
        np.testing.assert_array_equal(
            jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(3))
        )
        ck.save(4, _tree(mesh, 4.0))  # both tiers: the local one is as new, and is taken
        ck.wait()
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        ck.restore(None, _target(mesh))
        assert (ck.restored_step, ck.restored_tier) == (4, "local")
    with Checkpointer(tmp_path / "p") as ck:  # no local tier: the persistent step
        ck.restore(None, _target(mesh))
        assert (ck.restored_step, ck.restored_tier) == (4, "persistent")


def test_a_damaged_local_block_falls_back_to_the_persistent_tier_with_a_warning(tmp_path, mesh):
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        ck.save(1, _tree(mesh, 1.0))
        ck.save_local(2, _tree(mesh, 2.0))
        ck.wait()
    own = tmp_path / "l" / "process_0" / "step_2" / "own.bin"
    raw = bytearray(own.read_bytes())
    raw[-3] ^= 0x10  # a bit flipped in the last block's data
    own.write_bytes(bytes(raw))
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        with pytest.warns(UserWarning, match=r"local checkpoint step 2 cannot be restored.*CRC"):
            out = ck.restore(None, _target(mesh))
        assert (ck.restored_step, ck.restored_tier) == (1, "persistent")
        np.testing.assert_array_equal(out["w"], np.arange(32.0).reshape(8, 4) + 1)


def test_a_target_that_does_not_match_the_local_step_is_refused_naming_the_path(tmp_path, mesh):
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        ck.save(1, _tree(mesh, 1.0))
        ck.wait()
    wrong = {**_target(mesh), "w": jnp.zeros((8, 5))}
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        with pytest.raises(CheckpointError, match=r"'w': saved float32\[8,4\] vs target float"):
            ck.restore(None, wrong)


def test_a_process_killed_while_writing_a_local_step_leaves_the_last_good_one(tmp_path, mesh):
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        ck.save_local(1, _tree(mesh, 1.0))
        ck.wait()
    # A child process that dies (SIGKILL) inside the write of step 2, its files written but
    # the folder not yet renamed.
    code = textwrap.dedent(
        f"""
        import os, signal, jax
        jax.config.update("jax_num_cpu_devices", 8)
        import dtensor, jax.numpy as jnp
        from dtensor.checkpoint import Checkpointer, local_tier
        def die(*args):
            os.kill(os.getpid(), signal.SIGKILL)
        local_tier.os.replace = die
        mesh = dtensor.create_mesh([("x", 8)])
        w = dtensor.copy_to_mesh(jnp.zeros((8, 4)), dtensor.Layout(["x", None], mesh))
        ck = Checkpointer({str(tmp_path / "p")!r}, local_directory={str(tmp_path / "l")!r})
        ck.save_local(2, {{"w": w}})
        ck.wait()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    folder = tmp_path / "l" / "process_0"
    assert sorted(p.name for p in folder.iterdir()) == ["step_1", f"step_2.tmp{_pid(folder)}"]
    with Checkpointer(tmp_path / "p", local_directory=tmp_path / "l") as ck:
        assert ck.local_steps() == [1]
        assert sorted(p.name for p in folder.iterdir()) == ["step_1"]  # the debris is gone
        out = ck.restore(None, _target(mesh))
        assert (ck.restored_step, ck.restored_tier) == (1, "local")
        np.testing.assert_array_equal(out["w"], np.arange(32.0).reshape(8, 4) + 1)


def _pid(folder) -> str:
    (tmp,) = [p.name for p in folder.iterdir() if ".tmp" in p.name]
    return tmp.split(".tmp")[1]


def test_bad_local_tier_settings_are_refused_with_the_fix(tmp_path, mesh):
    with pytest.raises(ValueError, match="is a URL; the local tier is each host's own"):
        Checkpointer(tmp_path / "p", local_directory="gs://bucket/local")
    with Checkpointer(tmp_path / "p") as ck:
        with pytest.raises(CheckpointError, match="has no local tier; pass local_directory="):
            ck.save_local(1, _tree(mesh, 1.0))
    with pytest.raises(ValueError, match="local_interval_steps=2 needs local_directory="):
        PreemptionCheckpointHandler(tmp_path / "h", {"w": {}}, local_interval_steps=2)


def test_the_handler_resumes_model_optimizer_and_data_from_the_local_tier_bitwise(tmp_path):
    """Killed after step 5 (local every step, persistent every 4): resumes at 5, as if never stopped."""
    s = strategies.HybridStrategy(data=2, fsdp=4, min_shard_bytes=0)
    batches = mlp_batches(steps=7, batch=8)
    step_fn = make_train_step(mlp_loss)

    def run(stop: int | None, ckpt, local):
        with s.scope():
            model = MLPModel(nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        h = PreemptionCheckpointHandler(
            ckpt,
            {"model": model, "opt": opt},
            s,
            save_interval_steps=4,
            local_directory=local,
            local_interval_steps=1,
        )
        start, tier = h.total_run_calls, h.restored_from_tier
        while h.total_run_calls < (stop or len(batches)):
            h.run(s.run, step_fn, args=(model, opt, batches[h.total_run_calls]))
        h.close()
        return start, tier, jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())

    _, _, straight = run(None, tmp_path / "a", tmp_path / "al")
    assert run(5, tmp_path / "b", tmp_path / "bl")[:2] == (0, None)
    start, tier, resumed = run(None, tmp_path / "b", tmp_path / "bl")
    assert (start, tier) == (5, "local")
    jax.tree.map(np.testing.assert_array_equal, resumed, straight)


def test_a_failed_preemption_save_says_so_at_once_and_the_local_tier_keeps_the_step(
    tmp_path, caplog
):
    """The bucket's write fails at preemption: the handler says so naming the step and what a
    restart resumes from, exits as preempted, and the restart takes the local tier's step."""
    from strategies.failure_handling import TerminationConfig

    s = strategies.MirroredStrategy()
    batches = mlp_batches(steps=6, batch=8)
    step_fn = make_train_step(mlp_loss)

    class Stopped(Exception):
        pass

    def stop() -> None:
        raise Stopped

    def build():
        with s.scope():
            model = MLPModel(nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
        return model, opt

    model, opt = build()
    h = PreemptionCheckpointHandler(
        tmp_path / "p",
        {"model": model, "opt": opt},
        s,
        local_directory=tmp_path / "l",
        termination_config=TerminationConfig(
            exit_fn=stop, termination_watcher_fn=lambda: h.total_run_calls == 3
        ),
    )

    def broken(*args, **kwargs):
        raise OSError(27, "File too large")

    h.checkpointer._manager.save = broken  # the persistent store fails mid-preemption
    with pytest.raises(Stopped), caplog.at_level("ERROR"):
        while True:
            h.run(s.run, step_fn, args=(model, opt, batches[h.total_run_calls]))
    (record,) = [r for r in caplog.records if "FAILED" in r.getMessage()]
    assert "preemption checkpoint of step 3 FAILED (OSError" in record.getMessage()
    assert "a restart resumes from the local tier's step 3" in record.getMessage()
    want = jax.tree.map(np.asarray, nnx.state(model, nnx.Param).to_pure_dict())
    model2, opt2 = build()
    h2 = PreemptionCheckpointHandler(
        tmp_path / "p", {"model": model2, "opt": opt2}, s, local_directory=tmp_path / "l"
    )
    assert (h2.total_run_calls, h2.restored_from_tier) == (3, "local")
    got = jax.tree.map(np.asarray, nnx.state(model2, nnx.Param).to_pure_dict())
    jax.tree.map(np.testing.assert_array_equal, got, want)
    h2.close()
