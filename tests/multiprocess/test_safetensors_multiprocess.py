"""Two processes under dtensor.launch load a Hugging Face checkpoint, each reading its half,
and write it back; one process reads what they wrote. A save in which one process fails
raises on both and leaves the checkpoint before it as it was; a save with fewer files leaves
none of the old ones."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.multiprocess.util import expect_ok, run_worker
from tests.test_hf_checkpoints import DATA, one_process_run, run_train_py, write_hf

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("multiprocess")]


@pytest.mark.timeout(300)
def test_two_processes_read_their_halves_match_transformers_and_save_it_back(tmp_path):
    hf = tmp_path / "hf"
    tensors = write_hf(hf, "llama")
    shutil.copy(DATA / "hf_llama.npz", hf / "logits.npz")
    total = sum(v.nbytes for v in tensors.values())
    got = expect_ok(
        run_worker(
            "safetensors_two",
            2,
            str(hf),
            str(tmp_path / "out"),
            devices_per_process=4,
            timeout_s=240,
        ),
        2,
    )
    for r in got:
        assert r["max_diff"] < 1e-4, r
        # FSDP over 2 x 4 devices: each process holds, and reads, half of every tensor.
        assert abs(r["bytes_read"] / total - 0.5) < 0.02, (r, total)
    first = got[0]["first"]
    shards = sorted(n for n in first if n.startswith("out/model-"))
    assert "out/model.safetensors.index.json" in first
    assert len(shards) >= 2  # written by both processes (files dealt round them)
    # Process 1's disk was full: both raised, and not a byte of the first save changed.
    assert "writing 'model-00002-of-" in got[1]["failed"], got[1]["failed"]
    assert "No space left on device" in got[1]["failed"]
    assert "process(es) [1] failed to write their files" in got[0]["failed"], got[0]["failed"]
    for r in got:
        assert r["after_failure"] == first, r["after_failure"]
    # The last save wrote one file: no index and none of the first save's shards are left.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "out"]
    back = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_py_exports_a_hugging_face_folder_from_two_processes(tmp_path, tmp_path_factory):
    """`dtensor.launch -n 2 -- train.py --init-from PATH --export-hf DIR` (the guide's command):
    both processes save (a collective); the folder is the one-process run's, to float32
    rounding of the sums that differ between 8 devices on one process and 2 x 4."""
    result = run_train_py(tmp_path, launch=2)
    assert result["processes"] == 2 and result["export_hf"] == str(tmp_path / "export")
    folder, alone = one_process_run(tmp_path_factory)
    assert result["loss_first"] == pytest.approx(alone["loss_first"], abs=1e-5)
    names = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert names == sorted(p.name for p in (folder / "export").iterdir())
    config = (tmp_path / "export" / "config.json").read_text()
    assert config == (folder / "export" / "config.json").read_text()
    two = load_file(tmp_path / "export" / "model.safetensors")
    one = load_file(folder / "export" / "model.safetensors")
    assert sorted(two) == sorted(one)
    for name, value in one.items():
        np.testing.assert_allclose(two[name], value, atol=1e-5, rtol=0, err_msg=name)
