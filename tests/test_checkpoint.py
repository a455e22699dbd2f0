"""dtensor.checkpoint: round trips, resharding, Flax/optax objects, errors, atomicity."""

import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
from dtensor import Layout, checkpoint
from dtensor.checkpoint.checkpointer import Checkpointer, CheckpointError

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers_ckpt"


def bits(x):
    """The exact bytes of an array (bitwise comparison, NaN-safe)."""
    a = np.asarray(x)
    return a.dtype.str, a.shape, a.tobytes()


def assert_tree_bits_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        assert bits(x) == bits(y)


def run_worker(script, *args, devices=None, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(WORKERS / script), *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def mesh8():
    return dtensor.create_mesh([("data", 4), ("model", 2)])


@pytest.fixture
def sharded_tree(mesh8):
    w = jax.random.normal(jax.random.key(1), (16, 8))
    return {
        "w": dtensor.relayout(w, Layout(["data", "model"], mesh8)),
        "b": dtensor.relayout(jnp.arange(8.0), Layout(["model"], mesh8)),
        "step": dtensor.relayout(jnp.asarray(7, jnp.int32), Layout([], mesh8)),
        "host": np.arange(6, dtype=np.int16).reshape(2, 3),
    }


# ---------------------------------------------------------------- round trips
def test_restore_without_target_keeps_saved_layouts(tmp_path, sharded_tree, mesh8):
    checkpoint.save(tmp_path, sharded_tree)
    out = checkpoint.restore(tmp_path)
    assert_tree_bits_equal(out, sharded_tree)
    assert dtensor.fetch_layout(out["w"]) == Layout(["data", "model"], mesh8)
    assert dtensor.fetch_layout(out["b"]) == Layout(["model"], mesh8)


def test_manifest_records_mesh_layouts_and_versions(tmp_path, sharded_tree):
    checkpoint.save(tmp_path, sharded_tree, step=3)
    m = checkpoint.read_manifest(tmp_path)
    assert m["step"] == 3
    assert m["mesh"] == {"axes": {"data": 4, "model": 2}, "axis_types": "auto"}
    by_path = {e["path"]: e for e in m["leaves"]}
    assert by_path["w"]["shape"] == [16, 8] and by_path["w"]["dtype"] == "float32"
    assert by_path["w"]["layout"].startswith("sharding_specs:data,model, mesh:|data=4,model=2|")
    assert by_path["host"]["layout"] is None and by_path["host"]["dtype"] == "int16"
    assert {"jax", "flax", "orbax-checkpoint", "jax-dtensor"} <= set(m["versions"])


def test_reshard_8_devices_to_4_and_to_1(tmp_path, sharded_tree):
    checkpoint.save(tmp_path, sharded_tree)
    devices = jax.devices()
    four = dtensor.create_mesh([("fsdp", 4)], devices=devices[4:])
    target = {
        "w": Layout([None, "fsdp"], four),
        "b": Layout(["fsdp"], four),
        "step": Layout([], four),
        "host": Layout(["fsdp", None], dtensor.create_mesh([("fsdp", 2)], devices=devices[:2])),
    }
    out = checkpoint.restore(tmp_path, target)
    assert_tree_bits_equal(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, sharded_tree))
    assert dtensor.fetch_layout(out["w"]) == Layout([None, "fsdp"], four)
    assert out["w"].addressable_shards[0].data.shape == (16, 2)

    one = dtensor.create_mesh([("x", 1)], devices=[devices[3]])
    out1 = checkpoint.restore(tmp_path, one)
    assert_tree_bits_equal(jax.tree.map(np.asarray, out1), jax.tree.map(np.asarray, sharded_tree))
    assert out1["w"].sharding.device_set == {devices[3]}


def test_reshard_into_live_arrays_and_shape_dtype_structs(tmp_path, sharded_tree):
    checkpoint.save(tmp_path, sharded_tree)
    two = dtensor.create_mesh([("x", 2)], devices=jax.devices()[:2])
    live = {
        "w": dtensor.relayout(jnp.zeros((16, 8)), Layout(["x", None], two)),
        "b": jax.ShapeDtypeStruct((8,), jnp.float32, sharding=Layout(["x"], two).sharding),
        "step": jnp.zeros((), jnp.int32),
        "host": np.zeros((2, 3), np.int16),
    }
    out = checkpoint.restore(tmp_path, live)
    assert_tree_bits_equal(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, sharded_tree))
    assert dtensor.fetch_layout(out["w"]) == Layout(["x", None], two)
    assert dtensor.fetch_layout(out["b"]) == Layout(["x"], two)
    assert isinstance(out["host"], np.ndarray)


class DuckStrategy:
    """Anything with a mesh and variable_layout(path, leaf) is used as a layout policy."""

    def __init__(self, mesh):
        self.mesh = mesh
        self.paths = []

    def variable_layout(self, path, leaf):
        self.paths.append(path)
        if path == "w":
            return Layout(["x", None], self.mesh)
        return None  # replicated on self.mesh


def test_restore_with_strategy_layout_map_and_function(tmp_path, sharded_tree):
    checkpoint.save(tmp_path, sharded_tree)
    mesh = dtensor.create_mesh([("x", 8)])
    strategy = DuckStrategy(mesh)
    out = checkpoint.restore(tmp_path, strategy)
    assert sorted(strategy.paths) == ["b", "host", "step", "w"]
    assert dtensor.fetch_layout(out["w"]) == Layout(["x", None], mesh)
    assert dtensor.fetch_layout(out["b"]).is_fully_replicated()
    assert_tree_bits_equal(jax.tree.map(np.asarray, out), jax.tree.map(np.asarray, sharded_tree))

    lm = dtensor.LayoutMap(mesh, [("^b$", ("x",))])
    out = checkpoint.restore(tmp_path, lm)
    assert dtensor.fetch_layout(out["b"]) == Layout(["x"], mesh)
    out = checkpoint.restore(tmp_path, lambda path, leaf: Layout.replicated(mesh, len(leaf.shape)))
    assert dtensor.fetch_layout(out["w"]).is_fully_replicated()
    assert bits(out["w"]) == bits(sharded_tree["w"])


# ----------------------------------------------------------- Flax and optax
class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.layers = nnx.List([nnx.Linear(16, 16, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        return self.layers[1](self.layers[0](self.drop(self.l1(x))))


def test_nnx_module_and_optimizer_restored_in_place(tmp_path):
    model = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
    opt.update(model, grads)
    model(jnp.ones((2, 8)))  # advances the dropout RNG
    checkpoint.save(tmp_path, {"model": model, "opt": opt, "epoch": 2})
    expected = jax.tree.map(
        lambda v: (
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        ),
        nnx.state((model, opt)).to_pure_dict(),
    )

    mesh = dtensor.create_mesh([("x", 8)])
    model2 = Net(nnx.Rngs(5))
    dtensor.distribute(model2, lambda path, leaf: Layout.replicated(mesh, np.ndim(leaf)))
    opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    out = checkpoint.restore(tmp_path, {"model": model2, "opt": opt2, "epoch": 0})
    assert out["model"] is model2 and out["opt"] is opt2 and out["epoch"] == 2
    got = jax.tree.map(
        lambda v: (
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        ),
        nnx.state((model2, opt2)).to_pure_dict(),
    )
    assert_tree_bits_equal(got, expected)
    assert dtensor.fetch_layout(model2.l1.kernel[...]) == Layout.replicated(mesh, 2)
    assert jax.dtypes.issubdtype(model2.drop.rngs.key[...].dtype, jax.dtypes.prng_key)
    # Same RNG state: the next dropout masks agree.
    assert bits(model2(jnp.ones((2, 8)))) == bits(model(jnp.ones((2, 8))))


def test_linen_params_and_optax_state(tmp_path):
    params = nn.Dense(4).init(jax.random.key(0), jnp.ones((1, 8)))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    updates, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), opt_state, params)
    params = optax.apply_updates(params, updates)
    checkpoint.save(tmp_path, {"params": params, "opt_state": opt_state})
    target = jax.tree.map(jnp.zeros_like, {"params": params, "opt_state": opt_state})
    out = checkpoint.restore(tmp_path, target)
    assert isinstance(out["opt_state"][0], optax.ScaleByAdamState)
    assert_tree_bits_equal(out, {"params": params, "opt_state": opt_state})


def test_boxed_linen_params(tmp_path):
    boxed = {"kernel": nn.Partitioned(jnp.arange(8.0).reshape(4, 2), names=("embed", None))}
    checkpoint.save(tmp_path, boxed)
    assert [e["path"] for e in checkpoint.read_manifest(tmp_path)["leaves"]] == ["kernel"]
    target = {"kernel": nn.Partitioned(jnp.zeros((4, 2)), names=("embed", None))}
    out = checkpoint.restore(tmp_path, target)
    assert isinstance(out["kernel"], nn.Partitioned) and out["kernel"].names == ("embed", None)
    assert bits(out["kernel"].unbox()) == bits(boxed["kernel"].unbox())


# --------------------------------------------------------------- Checkpointer
def test_checkpointer_interval_max_to_keep_and_async(tmp_path):
    mesh = dtensor.create_mesh([("x", 8)])
    w = dtensor.relayout(jnp.arange(64.0), Layout(["x"], mesh))
    with Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as ckpt:
        saved = [ckpt.save(step, {"w": w + step}) for step in range(7)]
        assert saved == [True, False, True, False, True, False, True]
        assert ckpt.save(7, {"w": w + 7}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7]
        assert ckpt.latest_step() == 7
        assert bits(ckpt.restore(6)["w"]) == bits(w + 6)
        assert bits(ckpt.restore()["w"]) == bits(w + 7)
    assert sorted(os.listdir(tmp_path)) == ["6", "7"]


def test_async_save_is_not_affected_by_later_updates(tmp_path):
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    before = np.asarray(model.kernel[...]).copy()
    with Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, {"model": model})
        model.kernel[...] = model.kernel[...] + 1.0  # training goes on
        ckpt.wait()
    fresh = nnx.Linear(64, 64, rngs=nnx.Rngs(9))
    checkpoint.restore(tmp_path, {"model": fresh})
    assert bits(fresh.kernel[...]) == bits(before)


# --------------------------------------------------------------------- errors
def test_mismatched_target_lists_differing_paths(tmp_path, sharded_tree):
    checkpoint.save(tmp_path, sharded_tree)
    bad = dict(sharded_tree)
    bad["w"] = jnp.zeros((8, 8))
    bad["b"] = jnp.zeros((8,), jnp.int32)
    del bad["host"]
    bad["extra"] = jnp.zeros(3)
    with pytest.raises(CheckpointError, match=r"4 differing path\(s\)") as e:
        checkpoint.restore(tmp_path, bad)
    msg = str(e.value)
    assert "'w': saved float32[16,8] vs target float32[8,8]" in msg
    assert "'b': saved float32[8] vs target int32[8]" in msg
    assert "'extra': not in the checkpoint (target has float32[3])" in msg
    assert "'host': in the checkpoint (int16[2,3]) but not in the target" in msg
    assert "read_manifest" in msg


def test_mismatched_nnx_model_is_reported(tmp_path):
    checkpoint.save(tmp_path, {"model": nnx.Linear(4, 8, rngs=nnx.Rngs(0))})
    with pytest.raises(
        CheckpointError, match=r"'model/kernel': saved float32\[4,8\] vs target float32\[4,6\]"
    ):
        checkpoint.restore(tmp_path, {"model": nnx.Linear(4, 6, rngs=nnx.Rngs(0))})


def test_many_differences_are_truncated(tmp_path):
    checkpoint.save(tmp_path, {f"a{i}": jnp.zeros(2) for i in range(8)})
    with pytest.raises(CheckpointError, match=r"8 differing path\(s\).*and 3 more"):
        checkpoint.restore(tmp_path, {f"a{i}": jnp.zeros(3) for i in range(8)})


def test_layout_that_does_not_fit_saved_shape(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.zeros((6, 2))})
    mesh = dtensor.create_mesh([("x", 4)], devices=jax.devices()[:4])
    with pytest.raises(dtensor.LayoutError, match="w dimension 0 has size 6"):
        checkpoint.restore(tmp_path, {"w": Layout(["x", None], mesh)})


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.restore(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.read_manifest(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "nope", create=False)


def test_directory_without_complete_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        checkpoint.restore(tmp_path)
    (tmp_path / "3.orbax-checkpoint-tmp-123").mkdir()
    with pytest.raises(
        CheckpointError, match=r"only unfinished writes: \['3.orbax-checkpoint-tmp-123'\]"
    ):
        checkpoint.restore(tmp_path)


def test_unknown_step_and_existing_step(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.zeros(2)}, step=4)
    with pytest.raises(CheckpointError, match=r"step 5 is not a complete checkpoint.*\[4\]"):
        checkpoint.restore(tmp_path, step=5)
    with pytest.raises(CheckpointError, match="step 4 already exists"):
        checkpoint.save(tmp_path, {"w": jnp.zeros(2)}, step=4)
    assert checkpoint.save(tmp_path, {"w": jnp.ones(2)}) == 5


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="max_to_keep=0 is not valid"):
        Checkpointer(tmp_path, max_to_keep=0)
    with pytest.raises(ValueError, match="save_interval_steps=0 is not valid"):
        Checkpointer(tmp_path, save_interval_steps=0)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match="step=-1 is not valid"):
        ckpt.save(-1, {"w": jnp.zeros(2)})


def test_checkpoint_not_written_by_dtensor(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path, item_names=("state",)) as mngr:
        mngr.save(0, args=ocp.args.Composite(state=ocp.args.StandardSave({"w": jnp.zeros(2)})))
        mngr.wait_until_finished()
    with pytest.raises(CheckpointError, match="has no dtensor manifest"):
        checkpoint.restore(tmp_path)


# ----------------------------------------------------------- real processes
def test_sigkill_during_async_save_keeps_previous_checkpoint(tmp_path):
    proc = run_worker("kill_during_save.py", tmp_path)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert "SAVING" in proc.stdout
    ckpt = Checkpointer(tmp_path)
    assert ckpt.unfinished() and ckpt.unfinished()[0].startswith("2.orbax-checkpoint-tmp")
    assert ckpt.all_steps() == [1]
    assert bits(ckpt.restore()["w"]) == bits(jnp.arange(16.0))
    # The directory stays usable: step 2 can be written again.
    assert ckpt.save(2, {"w": jnp.ones(3)})
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2]
    assert [c.status for c in checkpoint.verify(tmp_path)] == ["ok", "ok"]
    ckpt.close()


def test_restore_in_a_process_with_4_devices(tmp_path, sharded_tree):
    checkpoint.save(tmp_path / "ckpt", sharded_tree)
    proc = run_worker("restore_resharded.py", tmp_path / "ckpt", tmp_path / "out.npz", 4)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "DONE 4" in proc.stdout
    out = np.load(tmp_path / "out.npz")
    for name in ("w", "b", "step", "host"):
        assert bits(out[name]) == bits(sharded_tree[name])
    assert int(out["w:devices"]) == 4 and tuple(out["w:shard"]) == (4, 8)
    assert tuple(out["step:shard"]) == ()
    assert bits(out["plain:w"]) == bits(sharded_tree["w"])
    assert int(out["plain:w:devices"]) == 4 and bool(out["plain:w:replicated"])
