"""Two processes under dtensor.launch load a Hugging Face checkpoint, each reading its half,
and write it back; one process reads what they wrote."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.multiprocess.util import expect_ok, run_worker
from tests.test_hf_checkpoints import DATA, write_hf

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
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2  # written by both processes (files dealt round them)
    back = {}
    for f in files:
        back.update(load_file(tmp_path / "out" / f))
    assert sorted(back) == sorted(tensors)
    for name, value in tensors.items():
        np.testing.assert_array_equal(back[name], value, err_msg=name)
