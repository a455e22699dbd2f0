"""dtensor.checkpoint integrity: checksums recorded at save, damaged steps found, skipped, named.

Every test damages real orbax checkpoints on disk (a flipped byte, a truncated
or deleted file) and checks what restore, latest_step, verify and the CLI say.
"""

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtensor
from dtensor import Layout, checkpoint
from dtensor.checkpoint import Checkpointer, CheckpointError, DamagedCheckpointError

ROOT = Path(__file__).resolve().parents[1]

# A read that orbax abandons after a failure may complete later, from TensorStore's own thread,
# into orbax's closed event loop ("Event loop is closed", reported with object None). In a real
# process dtensor.checkpoint drops that report (see test_a_failed_read_leaves_no_library_noise_
# on_stderr); pytest swaps in its own sys.unraisablehook around each test, so it sees it here.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. None:pytest.PytestUnraisableExceptionWarning"
)


def bits(x):
    a = np.asarray(x)
    return a.dtype.str, a.shape, a.tobytes()


def state(step):
    """A 16 MiB array and a small one.

    Each of the array's eight 2 MiB shards is one value in OCDBT, so whichever data file holds
    it is larger (~1.85 MiB compressed) than the quick check reads whole: under load OCDBT
    flushes the shards into several data files (in one CI run the biggest was 0.92 MiB when
    the shards were 256 KiB).
    """
    mesh = dtensor.create_mesh([("x", 8)])
    w = jax.random.normal(jax.random.key(step), (4096, 1024))
    return {"w": dtensor.relayout(w, Layout(["x", None], mesh)), "b": jnp.arange(8.0) + step}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Steps 1 and 2, written once; each test damages its own copy."""
    d = tmp_path_factory.mktemp("pristine")
    for step in (1, 2):
        checkpoint.save(d, state(step), step=step)
    return d


@pytest.fixture
def ckpt_dir(pristine, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(pristine, d)
    return d


def files(step_dir):
    return sorted(p for p in Path(step_dir).rglob("*") if p.is_file())


def biggest_data_file(step_dir):
    return max(
        (p for p in files(Path(step_dir) / "state") if p.parent.name == "d"), key=os.path.getsize
    )


def flip_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(path, keep=0.5):
    os.truncate(path, int(path.stat().st_size * keep))


def rel(path, step_dir):
    return str(Path(path).relative_to(step_dir))


# ------------------------------------------------------------------ records
def test_every_step_carries_shard_and_file_checksums(ckpt_dir):
    step_dir = ckpt_dir / "2"
    import json

    record = json.loads((step_dir / "checksums" / "process_0.json").read_text())
    assert record["algorithm"] == "crc32" and record["process_count"] == 1
    w = record["arrays"]["w"]
    assert len(w) == 8 and sorted(tuple(r["index"][0]) for r in w)[:2] == [(0, 512), (512, 1024)]
    assert all(r["nbytes"] == 512 * 1024 * 4 for r in w)
    written = json.loads((step_dir / "checksums" / "files.json").read_text())["files"]
    assert "manifest/metadata" in written and "state/_METADATA" in written
    assert rel(biggest_data_file(step_dir), step_dir) in written
    checks = checkpoint.verify(ckpt_dir)
    assert [(c.step, c.status, c.arrays) for c in checks] == [(1, "ok", 2), (2, "ok", 2)]
    assert checks[1].bytes > 12 * 2**20  # zstd-compressed by orbax


# ----------------------------------------------------------- flipped byte
def test_flipped_byte_falls_back_to_previous_step_with_a_warning(ckpt_dir):
    data_file = biggest_data_file(ckpt_dir / "2")
    assert data_file.stat().st_size > 2**20  # found by the restore itself, not the quick check
    flip_byte(data_file, at=2**20)
    with pytest.warns(UserWarning, match=r"skipping checkpoint step 2: .*step 2 .* is damaged"):
        out = checkpoint.restore(ckpt_dir)
    assert bits(out["w"]) == bits(state(1)["w"]) and bits(out["b"]) == bits(state(1)["b"])

    name = rel(data_file, ckpt_dir / "2")
    shard = r"shard \[\d+:\d+,0:1024\] does not match its checksum"
    with pytest.raises(CheckpointError, match=rf"step 2 in .* is damaged: {shard}") as e:
        checkpoint.restore(ckpt_dir, step=2)
    assert isinstance(e.value, DamagedCheckpointError)
    assert (e.value.step, e.value.array, e.value.file) == (2, "w", name)
    assert f"array 'w', file '{name}'" in str(e.value)
    assert e.value.__cause__ is None and (
        e.value.__suppress_context__ or e.value.__context__ is None
    )


def test_flipped_byte_found_when_restoring_into_another_layout(ckpt_dir):
    flip_byte(biggest_data_file(ckpt_dir / "2"), at=2**20)
    two = dtensor.create_mesh([("y", 2)], devices=jax.devices()[:2])
    target = {"w": Layout([None, "y"], two), "b": Layout([None], two)}
    with pytest.raises(DamagedCheckpointError, match="array 'w'"):
        checkpoint.restore(ckpt_dir, target, step=2)
    out = checkpoint.restore(ckpt_dir, target, step=1)
    assert dtensor.fetch_layout(out["w"]) == Layout([None, "y"], two)
    assert bits(out["w"]) == bits(state(1)["w"])


def test_flipped_byte_in_a_small_file_is_found_by_latest_step(ckpt_dir):
    flip_byte(ckpt_dir / "2" / "state" / "_METADATA", at=5)
    with Checkpointer(ckpt_dir, create=False) as ckpt:
        with pytest.warns(UserWarning, match=r"skipping checkpoint step 2.*file 'state/_METADATA'"):
            assert ckpt.latest_step() == 1
        assert ckpt.all_steps() == [1, 2]


def test_restore_without_verification_reads_the_damage_silently(ckpt_dir):
    """What the checksums protect against: orbax itself returns the changed values."""
    flip_byte(biggest_data_file(ckpt_dir / "2"), at=2**20)
    out = checkpoint.restore(ckpt_dir, step=2, verify=False)
    assert bits(out["w"]) != bits(state(2)["w"])


# ------------------------------------------------------ truncated, deleted
def test_truncated_data_file(ckpt_dir):
    data_file = biggest_data_file(ckpt_dir / "2")
    truncate(data_file)
    with pytest.raises(DamagedCheckpointError, match=r"step 2 .* a file is truncated") as e:
        checkpoint.restore(ckpt_dir, step=2)
    assert (e.value.array, e.value.file) == ("w", rel(data_file, ckpt_dir / "2"))
    with pytest.warns(UserWarning, match="skipping checkpoint step 2"):
        assert bits(checkpoint.restore(ckpt_dir)["b"]) == bits(state(1)["b"])
    with pytest.raises(DamagedCheckpointError, match="truncated") as e:  # orbax failed: explained
        checkpoint.restore(ckpt_dir, step=2, verify=False)
    assert e.value.array == "w"


def test_deleted_data_file(ckpt_dir):
    data_file = biggest_data_file(ckpt_dir / "2")
    data_file.unlink()
    with pytest.raises(DamagedCheckpointError, match="a file it was written with is missing") as e:
        checkpoint.restore(ckpt_dir, step=2)
    assert (e.value.array, e.value.file) == ("w", rel(data_file, ckpt_dir / "2"))


def test_truncated_orbax_metadata(ckpt_dir):
    truncate(ckpt_dir / "2" / "state" / "_METADATA", keep=0.1)
    with pytest.raises(DamagedCheckpointError, match=r"truncated .*file 'state/_METADATA'") as e:
        checkpoint.restore(ckpt_dir, step=2)
    assert e.value.array is None
    with pytest.raises(DamagedCheckpointError, match=r"truncated .*file 'state/_METADATA'"):
        checkpoint.restore(ckpt_dir, step=2, verify=False)


def test_truncated_manifest(ckpt_dir):
    truncate(ckpt_dir / "2" / "manifest" / "metadata", keep=0.3)
    with pytest.raises(DamagedCheckpointError, match=r"truncated .*file 'manifest/metadata'"):
        checkpoint.restore(ckpt_dir, step=2)
    with pytest.raises(
        DamagedCheckpointError, match=r"manifest cannot be read .*manifest/metadata"
    ):
        checkpoint.read_manifest(ckpt_dir, step=2)
    with pytest.warns(UserWarning, match="skipping checkpoint step 2"):
        assert bits(checkpoint.restore(ckpt_dir)["w"]) == bits(state(1)["w"])


def test_missing_or_truncated_checksum_records(ckpt_dir):
    truncate(ckpt_dir / "2" / "checksums" / "process_0.json")
    with pytest.raises(DamagedCheckpointError, match=r"checksum record is unreadable .*process_0"):
        checkpoint.restore(ckpt_dir, step=2)
    shutil.rmtree(ckpt_dir / "2" / "checksums")
    with pytest.raises(DamagedCheckpointError, match="its checksum records are missing"):
        checkpoint.restore(ckpt_dir, step=2)


def test_every_step_damaged(ckpt_dir):
    for step in ("1", "2"):
        truncate(biggest_data_file(ckpt_dir / step))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match=r"every step in .* is damaged \(\[1, 2\]\)"):
            checkpoint.restore(ckpt_dir)
    assert len(seen) == 2


def test_step_written_before_checksums_existed_is_unverified_not_damaged(ckpt_dir):
    """A format-1 step (no ``checksums`` item, no ``kind``) restores as before."""
    import json

    shutil.rmtree(ckpt_dir / "1" / "checksums")
    manifest_file = ckpt_dir / "1" / "manifest" / "metadata"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps(dict(manifest, format=1)))
    assert bits(checkpoint.restore(ckpt_dir, step=1)["w"]) == bits(state(1)["w"])
    assert [(c.step, c.status) for c in checkpoint.verify(ckpt_dir)] == [
        (1, "unverified"),
        (2, "ok"),
    ]


# ----------------------------------------------------------- verify and CLI
def test_verify_raises_naming_step_array_and_file(ckpt_dir):
    data_file = biggest_data_file(ckpt_dir / "2")
    flip_byte(data_file, at=2**20)
    with pytest.raises(DamagedCheckpointError, match=r"step 2 .*array 'w'") as e:
        checkpoint.verify(ckpt_dir)
    assert e.value.file == rel(data_file, ckpt_dir / "2")
    assert [(c.step, c.status) for c in e.value.checks] == [(1, "ok"), (2, "damaged")]
    assert [c.status for c in checkpoint.verify(ckpt_dir, step=1)] == ["ok"]
    with pytest.raises(CheckpointError, match=r"step 7 is not a complete checkpoint .*\[1, 2\]"):
        checkpoint.verify(ckpt_dir, step=7)


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "dtensor.checkpoint", *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_verify_prints_a_table_and_exits_nonzero_on_damage(ckpt_dir):
    ok = run_cli("verify", ckpt_dir)
    assert ok.returncode == 0, ok.stderr[-2000:]
    lines = [line for line in ok.stdout.splitlines() if "│" in line]
    assert len(lines) == 2 and all(" ok " in line for line in lines)
    assert "MiB" in lines[1]

    truncate(biggest_data_file(ckpt_dir / "2"))
    bad = run_cli("verify", ckpt_dir)
    assert bad.returncode == 1
    rows = [line for line in bad.stdout.splitlines() if "│" in line]
    assert " ok " in rows[0] and " damaged " in rows[1]
    assert "array w" in bad.stdout and "truncated" in bad.stdout
    assert "damaged steps: [2]" in bad.stdout
    assert "Traceback" not in bad.stderr and "Event loop is closed" not in bad.stderr

    missing = run_cli("verify", ckpt_dir / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stdout


# ---------------------------------------------- host values keep their type
def test_numpy_scalars_and_int64_round_trip(tmp_path):
    tree = {
        "i64": np.int64(2**40 + 3),
        "u8": np.uint8(200),
        "f16": np.float16(1.5),
        "flag": np.bool_(True),
        "arr64": np.arange(3, dtype=np.int64) + 2**33,
        "f64": np.linspace(0, 1, 4),
        "py_int": 7,
        "py_float": 0.25,
        "py_bool": False,
        "dev": jnp.arange(4, dtype=jnp.int32),
    }
    checkpoint.save(tmp_path, tree)
    out = checkpoint.restore(tmp_path)
    for name in ("i64", "u8", "f16", "flag"):
        assert type(out[name]) is type(tree[name]) and out[name] == tree[name]
    assert out["arr64"].dtype == np.int64 and out["arr64"].tolist() == tree["arr64"].tolist()
    assert bits(out["f64"]) == bits(tree["f64"])
    assert (type(out["py_int"]), out["py_int"]) == (int, 7)
    assert (type(out["py_float"]), out["py_float"]) == (float, 0.25)
    assert (type(out["py_bool"]), out["py_bool"]) == (bool, False)
    assert isinstance(out["dev"], jax.Array) and bits(out["dev"]) == bits(tree["dev"])
    manifest = {e["path"]: e for e in checkpoint.read_manifest(tmp_path)["leaves"]}
    assert manifest["i64"]["kind"] == "numpy_scalar" and manifest["i64"]["dtype"] == "int64"
    assert manifest["py_int"]["kind"] == "int" and "kind" not in manifest["dev"]

    target = {k: (type(v)(0) if np.isscalar(v) else np.zeros_like(v)) for k, v in tree.items()}
    target["dev"] = jnp.zeros(4, jnp.int32)
    back = checkpoint.restore(tmp_path, target)
    assert type(back["i64"]) is np.int64 and back["i64"] == 2**40 + 3
    assert type(back["f16"]) is np.float16 and type(back["py_float"]) is float
    assert back["arr64"].dtype == np.int64 and back["arr64"][0] == 2**33


def test_int64_under_a_mesh_target_stays_on_the_host(tmp_path):
    checkpoint.save(tmp_path, {"n": np.arange(2, dtype=np.int64) + 2**40, "w": jnp.ones(8)})
    mesh = dtensor.create_mesh([("x", 8)])
    out = checkpoint.restore(tmp_path, mesh)
    assert isinstance(out["n"], np.ndarray) and out["n"].tolist() == [2**40, 2**40 + 1]
    assert dtensor.fetch_layout(out["w"]) == Layout.replicated(mesh, 1)


def test_restored_shards_are_checked_in_any_layout(pristine):
    """Every recorded shard is hashed, whether the restore keeps the saved layout or not."""
    from dtensor.checkpoint import integrity

    with Checkpointer(pristine, create=False) as ckpt:
        _, records, _ = ckpt.quick_check(2)
        same = ckpt.restore(2)
        two = dtensor.create_mesh([("y", 2)], devices=jax.devices()[:2])
        other = ckpt.restore(2, {"w": Layout([None, "y"], two), "b": Layout(["y"], two)})
    assert integrity.check_arrays(same, records) == ([], 9)
    assert integrity.check_arrays(other, records) == ([], 9)
    records["w"][3] = dict(records["w"][3], crc32=records["w"][3]["crc32"] ^ 1)
    bad, _ = integrity.check_arrays(other, records)
    assert [(path, rec["index"]) for path, rec in bad] == [("w", records["w"][3]["index"])]


def test_a_failed_read_leaves_no_library_noise_on_stderr(ckpt_dir):
    """One CheckpointError, and none of orbax's logs or abandoned-coroutine reports."""
    truncate(biggest_data_file(ckpt_dir / "2"))
    shutil.rmtree(ckpt_dir / "2" / "checksums")  # nothing to explain it: orbax really fails
    script = (
        "import gc, sys, jax\n"
        "from dtensor import checkpoint\n"
        "try:\n"
        f"    checkpoint.restore({str(ckpt_dir)!r}, step=2, verify=False)\n"
        "except checkpoint.CheckpointError as e:\n"
        "    print('ERROR', type(e).__name__, e.__cause__, e.__context__)\n"
        "gc.collect()\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ERROR DamagedCheckpointError None None" in proc.stdout
    for noise in ("Traceback", "Exception ignored", "Event loop is closed", "ERROR:absl"):
        assert noise not in proc.stderr, proc.stderr[-2000:]
