"""The input pipeline's position saved with a checkpoint (data=): Grain iterators, re-splitting, errors."""

import grain
import jax.numpy as jnp
import numpy as np
import pytest

import dtensor
import strategies
from dtensor import checkpoint
from dtensor.checkpoint import CheckpointError, datastate
from strategies.failure_handling import PreemptionCheckpointHandler


def ids(batch):
    return np.asarray(batch["id"]).tolist()


def grain_batches(n=32, rows=8):
    return (
        grain.MapDataset.range(n)
        .shuffle(seed=3)
        .map(lambda i: {"id": np.int32(i), "x": np.full((2,), i, np.float32)})
        .batch(rows)
    )


def test_distributed_grain_dataset_resumes_where_it_was_saved(tmp_path):
    s = strategies.MirroredStrategy()
    it = iter(s.experimental_distribute_dataset(grain_batches()))
    before = [ids(next(it)) for _ in range(2)]
    checkpoint.save(tmp_path, {"w": jnp.ones(2)}, step=2, data=it)
    after = [ids(b) for b in it]
    it2 = iter(s.experimental_distribute_dataset(grain_batches()))
    checkpoint.restore(tmp_path, data=it2)
    assert [ids(b) for b in it2] == after
    assert sorted(sum(before + after, [])) == list(range(32))


def test_grain_iterator_and_loader_states_round_trip(tmp_path):
    raw = iter(grain_batches().to_iter_dataset())
    next(raw)
    loader = grain.DataLoader(
        data_source=grain.sources.RangeDataSource(0, 16, 1),
        sampler=grain.samplers.IndexSampler(16, shuffle=True, seed=1, num_epochs=1),
        worker_count=0,
    )
    lit = iter(loader)
    [next(lit) for _ in range(5)]
    checkpoint.save(tmp_path / "a", {"w": jnp.ones(1)}, data=raw)
    checkpoint.save(tmp_path / "b", {"w": jnp.ones(1)}, data=lit)  # a bytes state (base64)
    want_raw, want_loader = ids(next(raw)), [int(next(lit)) for _ in range(3)]
    raw2 = iter(grain_batches().to_iter_dataset())
    lit2 = iter(loader)
    checkpoint.restore(tmp_path / "a", data=raw2)
    checkpoint.restore(tmp_path / "b", data=lit2)
    assert ids(next(raw2)) == want_raw
    assert [int(next(lit2)) for _ in range(3)] == want_loader


def test_positions_of_two_processes_resplit_for_one():
    s = strategies.MirroredStrategy()
    it = iter(s.distribute_datasets_from_function(lambda ctx: grain_batches()))
    # Two processes after 3 global batches of 8, each batched by 4 after to_iter_dataset().
    saved = [
        {"batches": 3, "source": {"next_index": 12}, "rows": 4, "process_local": True}
        for _ in range(2)
    ]
    assert it.resplit_state(saved)["source"] == {"next_index": 24}
    by_batch = [dict(st, source={"next_index": 3}) for st in saved]
    assert it.resplit_state(by_batch)["source"] == {"next_index": 3}


def test_a_position_that_cannot_be_resplit_names_the_process_counts():
    records = [
        {"process_count": 2, "process_index": i, "state": {"next_index": 3}} for i in range(2)
    ]
    raw = iter(grain_batches().to_iter_dataset())
    with pytest.raises(
        CheckpointError, match=r"positions of 2 processes, but 1 processes.*Resume on 2"
    ):
        datastate.apply(raw, records, 5, "gs://b/run")
    s = strategies.MirroredStrategy()
    it = iter(s.distribute_datasets_from_function(lambda ctx: grain_batches()))
    odd = [
        {"process_count": 2, "state": {"batches": 3, "source": {"epoch": 1}, "process_local": True}}
        for _ in range(2)
    ]
    with pytest.raises(
        CheckpointError, match=r"2 processes cannot be re-split over 1.*index-based"
    ):
        datastate.apply(it, odd, 5, "gs://b/run")


def test_data_errors(tmp_path):
    with pytest.raises(TypeError, match=r"data= must be an input iterator with get_state\(\)"):
        checkpoint.save(tmp_path, {"w": jnp.ones(1)}, data=[1, 2])
    with pytest.raises(TypeError, match=r"PreemptionCheckpointHandler: data= must be"):
        PreemptionCheckpointHandler(tmp_path / "h", {"w": jnp.ones(1)}, data=grain_batches())
    mesh = dtensor.create_mesh([("batch", 8)])
    plain = iter(dtensor.DTensorDataset([{"x": np.ones((8, 2))}], mesh, global_batch_size=8))
    with pytest.raises(TypeError, match=r"has no get_state\(\)/set_state\(\).*Grain"):
        plain.get_state()
    checkpoint.save(tmp_path, {"w": jnp.ones(1)}, step=0)
    with pytest.raises(CheckpointError, match=r"step 0 .* holds no input position"):
        checkpoint.restore(tmp_path, data=iter(grain_batches().to_iter_dataset()))
