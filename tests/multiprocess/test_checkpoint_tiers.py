"""The local tier across real processes: a replaced host, a lost slice, and what the bucket serves.

tests/multiprocess/workers/tiers.py trains an NNX MLP under
``HybridStrategy(data=processes // 2, fsdp=2)`` with a Grain pipeline, the
local tier saved every step and the persistent tier every 4 steps. A process
SIGKILLs itself at the start of step 6 (a host lost mid-step); the job stops.

* A replacement host (its local folder gone) on as many processes: the job
  resumes at step 5 from the ``peer`` tier (the replaced process's shards sent
  back by the process that kept its copy), with the global batches and the
  final parameters of an uninterrupted run, bit for bit, and without reading
  the persistent tier's step (a bucket of the GCS emulator, its downloads
  counted: only orbax's listing of the steps reads their small metadata files).
* A whole "slice" lost for good (processes 2 and 3 of 4): the job goes on with
  2 processes from the ``local`` tier with the same global batch of 8, each
  step reading the same examples as the uninterrupted run (in another row
  order: the input pipelines interleave) and parameters equal to float32
  rounding (the batch mean is summed in another order).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from dtensor.runtime.exit_codes import EXIT_PEER_LOST
from tests.multiprocess.util import expect_ok, report, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

TOTAL, KILL = 6, 6


def _run(
    processes: int,
    ckpt,
    local,
    *kill: str,
    ok: bool = True,
    total: int = TOTAL,
    stop_on_failure: bool = True,
    env: dict[str, str] | None = None,
):
    r = run_worker(
        "tiers",
        processes,
        str(ckpt),
        str(local),
        str(total),
        *kill,
        devices_per_process=1,
        timeout_s=120,
        stop_on_failure=stop_on_failure,
        env=env,
    )
    if not ok and not stop_on_failure:
        return r
    if not ok:
        assert r.returncode != 0, report(r)
        killed = [int(k) for k in kill[1].split(",")]
        assert all(r.returncodes[k] == -9 or r.returncodes[k] == 137 for k in killed), report(r)
        return None
    return expect_ok(r, processes)[0]


def _floats(hexes: dict) -> dict:
    return {k: np.frombuffer(bytes.fromhex(v), np.float32) for k, v in hexes.items()}


def test_a_replaced_process_resumes_from_its_peer_s_copy_bitwise(tmp_path):
    straight = _run(2, tmp_path / "a", tmp_path / "al")
    _run(2, tmp_path / "b", tmp_path / "bl", str(KILL), "1", ok=False)
    shutil.rmtree(tmp_path / "bl" / "process_1")  # the replacement host's disk is empty
    resumed = _run(2, tmp_path / "b", tmp_path / "bl")
    assert (resumed["start"], resumed["tier"]) == (KILL - 1, "peer")
    assert resumed["seen"] == straight["seen"][KILL - 1 :]
    assert resumed["params"] == straight["params"]


@pytest.mark.extended
def test_four_processes_resume_from_the_peer_tier_without_reading_the_bucket(
    tmp_path, gcs, gcs_emulator
):
    straight = _run(4, tmp_path / "a", tmp_path / "al")
    _run(4, gcs, tmp_path / "bl", str(KILL), "1", ok=False)
    shutil.rmtree(tmp_path / "bl" / "process_1")
    prefix = gcs[len("gs://") :].split("/", 1)[1]
    before = len(gcs_emulator.downloads(prefix))
    resumed = _run(4, gcs, tmp_path / "bl")
    assert (resumed["start"], resumed["tier"]) == (KILL - 1, "peer")
    # Listing the bucket's steps reads orbax's small per-step _CHECKPOINT_METADATA; nothing
    # of a step's arrays, manifest or data positions is read.
    read = {name.split("/", 1)[1] for name in gcs_emulator.downloads(prefix)[before:]}
    assert read <= {"4/_CHECKPOINT_METADATA"}, read
    assert resumed["seen"] == straight["seen"][KILL - 1 :]
    assert resumed["params"] == straight["params"]


def _same_examples(resumed: dict, straight: dict, first: int) -> None:
    for (step, ids), (s0, ids0) in zip(resumed["seen"], straight["seen"][first:], strict=False):
        assert step == s0 and sorted(ids) == sorted(ids0) and len(ids) == 8


def _close(resumed: dict, straight: dict) -> None:
    got, want = _floats(resumed["params"]), _floats(straight["params"])
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.extended
def test_a_lost_slice_goes_on_with_fewer_processes_and_back_with_the_same_global_batch(tmp_path):
    """4 processes, a slice (2 and 3) lost at step 6; on 2 to step 8; on 4 again (new hosts) to 10."""
    straight = _run(4, tmp_path / "a", tmp_path / "al", total=10)
    _run(4, tmp_path / "b", tmp_path / "bl", str(KILL), "2,3", ok=False)
    for gone in ("process_2", "process_3"):
        shutil.rmtree(tmp_path / "bl" / gone)  # their hosts are gone for good
    fewer = _run(2, tmp_path / "b", tmp_path / "bl", total=8)
    # Each survivor holds the blocks its devices need (the slices were replicas): no transfer.
    assert (fewer["start"], fewer["tier"], fewer["processes"]) == (KILL - 1, "local", 2)
    _same_examples(fewer, straight, KILL - 1)
    again = _run(4, tmp_path / "b", tmp_path / "bl", total=10)
    # The new hosts' folders are empty: their blocks come from the survivors.
    assert (again["start"], again["tier"], again["processes"]) == (8, "peer", 4)
    _same_examples(again, straight, 8)
    _close(again, straight)


def test_a_process_killed_during_the_peer_copy_loses_no_good_step(tmp_path):
    """Killed inside step 5's local save (its own shards being written, the copy crossing)."""
    straight = _run(2, tmp_path / "a", tmp_path / "al")
    _run(2, tmp_path / "b", tmp_path / "bl", "5", "1", "copy", ok=False)
    resumed = _run(2, tmp_path / "b", tmp_path / "bl")
    assert (resumed["start"], resumed["tier"]) == (4, "local")  # step 4: whole on both
    assert resumed["seen"] == straight["seen"][4:]
    assert resumed["params"] == straight["params"]


@pytest.mark.extended
def test_the_coordinator_killed_under_load_is_named_in_time_and_the_local_tier_resumes(tmp_path):
    """Process 0 SIGKILLed mid-step beside two CPU burners: each survivor names it and exits 75
    within heartbeat + 10 s (the documented bound) by itself (the launcher does not stop them);
    restarted on the same hosts, the job resumes from the local tier."""
    straight = _run(4, tmp_path / "a", tmp_path / "al")
    burn = "while True: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(2)]
    try:
        start = time.time()
        r = _run(
            4,
            tmp_path / "b",
            tmp_path / "bl",
            str(KILL),
            "0",
            ok=False,
            stop_on_failure=False,
            env={"DTENSOR_HEARTBEAT_TIMEOUT_S": "5"},
        )
        ended = time.time()
    finally:
        for b in burners:  # ours, by PID
            b.kill()
            b.wait()
    assert r.returncodes[0] in (-9, 137) and r.returncodes[1:] == (EXIT_PEER_LOST,) * 3, report(r)
    (killed_at,) = [
        float(ln.split()[1]) for ln in r.outputs[0].splitlines() if ln.startswith("KILL")
    ]
    assert start < killed_at and ended - killed_at < 5 + 10, report(r)
    for out in r.outputs[1:]:
        assert "lost process 0 (the coordinator at 127.0.0.1:" in out, report(r)
    resumed = _run(4, tmp_path / "b", tmp_path / "bl")
    assert (resumed["start"], resumed["tier"]) == (KILL - 1, "local")
    assert resumed["params"] == straight["params"]
