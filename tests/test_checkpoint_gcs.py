"""dtensor.checkpoint and the preemption handler against a real GCS JSON API.

``gcp-storage-emulator`` runs on loopback (see tests/gcs.py); the ``gcs``
fixture gives each test a fresh ``gs://`` URL and fails it when anything lands
in a local ``gs:`` directory.
"""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor import checkpoint
from dtensor.checkpoint import Checkpointer, CheckpointError
from tests.models import MLPModel

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers_ckpt"


def bits(x):
    return np.asarray(x).tobytes()


def pure(*objs):
    """NNX state as plain arrays (typed keys as their raw data)."""
    state = nnx.state(objs if len(objs) > 1 else objs[0]).to_pure_dict()
    return jax.tree.map(
        lambda v: (
            jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v
        ),
        state,
    )


def run(args, timeout=120):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_arrays_round_trip_in_a_bucket(gcs, gcs_emulator):
    mesh = dtensor.create_mesh([("x", 4), ("y", 2)])
    w = dtensor.copy_to_mesh(jnp.arange(32.0).reshape(8, 4), dtensor.Layout(["x", "y"], mesh))
    host = np.arange(6, dtype=np.int16).reshape(2, 3)
    assert checkpoint.save(gcs, {"w": w, "host": host, "n": 7}, step=3) == 3
    out = checkpoint.restore(gcs)
    assert bits(out["w"]) == bits(w) and out["n"] == 7
    assert out["host"].dtype == np.int16 and bits(out["host"]) == bits(host)
    assert dtensor.fetch_layout(out["w"]) == dtensor.Layout(["x", "y"], mesh)
    # orbax's commit protocol for object stores: the marker written last, into the step.
    stored = gcs_emulator.object_path(gcs)
    assert (stored / "3" / "commit_success.txt").is_file()
    assert (stored / "3" / "checksums" / "files.json").is_file()
    assert checkpoint.read_manifest(gcs)["step"] == 3
    assert checkpoint.latest_step(gcs) == 3
    assert checkpoint.latest_step(gcs + "/nothing-here") is None
    assert [(c.step, c.status) for c in checkpoint.verify(gcs)] == [(3, "ok")]


def test_nnx_model_and_optimizer_into_another_mesh_and_preset(gcs):
    fsdp = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with fsdp.scope():
        model = MLPModel(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
    assert dtensor.fetch_layout(model.up.kernel[...]).mesh.size == 8
    with Checkpointer(gcs, async_save=True) as ckpt:
        ckpt.save(1, {"model": model, "opt": opt})
        ckpt.wait()
        assert ckpt.all_steps() == [1]

    mirrored = strategies.MirroredStrategy(devices=jax.devices()[:4])
    with mirrored.scope():
        model2 = MLPModel(nnx.Rngs(7))
        opt2 = nnx.Optimizer(model2, optax.adam(1e-2), wrt=nnx.Param)
    checkpoint.restore(gcs, {"model": model2, "opt": opt2})
    got, want = pure(model2, opt2), pure(model, opt)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert bits(a) == bits(b)
    layout = dtensor.fetch_layout(model2.up.kernel[...])
    assert layout.mesh.size == 4 and layout.is_fully_replicated()


def test_flipped_byte_in_a_stored_object_falls_back_with_a_warning(gcs, gcs_emulator):
    big = jnp.arange(64 * 1024, dtype=jnp.float32)
    checkpoint.save(gcs, {"w": big}, step=1)
    checkpoint.save(gcs, {"w": big + 1}, step=2)
    data = gcs_emulator.object_path(gcs) / "2" / "state" / "d"
    flip_a_byte(max(data.iterdir(), key=lambda p: p.stat().st_size))
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 2: .* is damaged"):
        out = checkpoint.restore(gcs)
    assert bits(out["w"]) == bits(big)
    with pytest.raises(checkpoint.DamagedCheckpointError, match=r"step 2 in 'gs://.*' is damaged"):
        checkpoint.verify(gcs)

    # The CLI, as a user runs it, on the bucket: exit 1 and the damaged step named.
    proc = run(["-m", "dtensor.checkpoint", "verify", gcs])
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    assert "damaged steps: [2]" in proc.stdout
    assert "gs://" in proc.stdout


def test_missing_bucket_is_one_clear_error(gcs):
    url = "gs://no-such-bucket-dtensor/run"
    with pytest.raises(CheckpointError, match=r"'gs://no-such-bucket-dtensor/run'.*bucket"):
        checkpoint.save(url, {"w": jnp.ones(3)}, step=1)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        checkpoint.restore(url)


def test_sigkill_during_async_save_leaves_no_committed_partial_step(gcs):
    proc = run([WORKERS / "kill_during_save.py", gcs])
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert "SAVING" in proc.stdout
    ckpt = Checkpointer(gcs)
    assert ckpt.all_steps() == [1]
    assert ckpt.unfinished() in ([], ["2"])  # an uncommitted step 2 is never listed
    assert bits(ckpt.restore()["w"]) == bits(jnp.arange(16.0))
    assert ckpt.save(2, {"w": jnp.ones(3)})  # the step number can be written again
    ckpt.wait()
    assert ckpt.all_steps() == [1, 2] and ckpt.unfinished() == []
    assert [c.status for c in checkpoint.verify(gcs)] == ["ok", "ok"]
    ckpt.close()


@pytest.mark.parametrize(
    ("error", "what", "fix"),
    [
        (
            PermissionError("403 Forbidden: caller does not have storage.objects.create"),
            "permission denied",
            "objectAdmin",
        ),
        (
            OSError("Anonymous caller: 401 Unauthorized"),
            "no credentials",
            "gcloud auth application-default login",
        ),
        (
            FileNotFoundError("The specified bucket does not exist. 404"),
            "the bucket does not exist",
            "gcloud storage buckets create",
        ),
    ],
)
def test_store_errors_name_the_url_and_the_fix(error, what, fix):
    from dtensor.checkpoint.storage import store_errors

    with pytest.raises(CheckpointError, match=rf"'gs://b/run': {what} .*{fix}"):
        with store_errors("gs://b/run"):
            raise error
    # Not the store's error (orbax refusing a value): left as it was.
    with pytest.raises(ValueError, match="^Cannot serialize host local"):
        with store_errors("gs://b/run"):
            raise ValueError("Cannot serialize host local jax.Array")
