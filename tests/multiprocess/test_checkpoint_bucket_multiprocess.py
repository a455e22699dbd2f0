"""Two processes under dtensor.launch write one checkpoint to a bucket; verify checks both."""

from __future__ import annotations

import pytest

from dtensor import checkpoint
from tests.multiprocess.util import expect_ok, run_worker

pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("multiprocess")]


@pytest.mark.timeout(240)
def test_two_writers_one_bucket_checkpoint_and_verify_reads_every_process(gcs, gcs_emulator):
    got = expect_ok(run_worker("ckpt_two_writers", 2, gcs, devices_per_process=2), 2)
    for r in got:
        assert r["same_bits"] and r["replicated_bits"], r
        assert r["layout"].startswith("sharding_specs:x,unsharded")  # the saved layout: rows split
    step = gcs_emulator.object_path(gcs) / "1"
    state = step / "state"
    own = sorted(p.name for p in state.iterdir() if p.name.startswith("ocdbt.process_"))
    assert own == ["ocdbt.process_0", "ocdbt.process_1"]  # each process wrote its own shards
    assert (step / "checksums" / "process_1.json").is_file()
    assert [c.status for c in checkpoint.verify(gcs)] == ["ok"]

    # A flipped byte in process 1's data: its size is unchanged, only its shard checksums see it.
    data = max((state / "ocdbt.process_1" / "d").iterdir(), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.DamagedCheckpointError, match=r"step 1 .* damaged.*array 'w'"):
        checkpoint.verify(gcs)
