"""DTensorDataset and MultiWorkerMirrored communication options across 2 real processes."""

from __future__ import annotations

import numpy as np
import pytest

from tests.multiprocess.util import expect_ok, run_worker


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_dataset_shares_and_communication_options_across_processes():
    got = expect_ok(run_worker("dataset_shares", 2, devices_per_process=2, timeout_s=150), 2)
    data = np.arange(64.0).reshape(16, 4)
    want = [float(data[:8].sum()), float(data[8:].sum())]
    for rank, r in enumerate(got):
        assert r["global_sums"] == want
        assert r["local_sums"] == want  # shares stitched in process order
        # Each process holds only its own rows (2 devices x 2 rows each).
        assert r["local_rows"] == [[4 * rank, 4 * rank + 2]] * 2
        losses = r["losses"]
        default, _ = losses["default"]
        np.testing.assert_allclose(losses["ring"][0], default, rtol=1e-5)
        np.testing.assert_allclose(losses["packs"][0], default, rtol=1e-5)
        np.testing.assert_allclose(losses["hierarchical"][0], default, rtol=1e-5)
        assert losses["default"][1] == ["all-reduce"]
        assert losses["ring"][1] == ["collective-permute"]
        assert losses["hierarchical"][1] == ["all-gather", "all-reduce", "reduce-scatter"]
    assert got[0]["losses"]["default"] == got[1]["losses"]["default"]
    assert got[0]["share_error"] is None
    assert (
        "2 rows per process x 2 input pipelines but global_batch_size is 8" in got[1]["share_error"]
    )
