"""Dataset distribution through strategies: layouts, prefetching, input functions, padding."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dtensor
import strategies
from dtensor import UNSHARDED as U
from strategies import InputContext


def _batches(n=3, rows=16):
    return [
        {"x": np.full((rows, 3), i, np.float32), "y": np.arange(rows, dtype=np.int32) + 100 * i}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda: strategies.MirroredStrategy(),
        lambda: strategies.FullyShardedStrategy(),
        lambda: strategies.TensorParallelStrategy(tensor_parallel=2),
        lambda: strategies.OneDeviceStrategy(),
    ],
    ids=["mirrored", "fully_sharded", "tensor_parallel", "one_device"],
)
def test_elements_become_global_arrays_in_the_batch_layout(make):
    s = make()
    out = list(s.experimental_distribute_dataset(_batches()))
    assert len(out) == 3
    for i, b in enumerate(out):
        assert isinstance(b["x"], jax.Array)
        assert b["x"].shape == (16, 3)
        assert b["x"].sharding.is_equivalent_to(s.batch_layout(2).sharding, 2)
        assert b["y"].sharding.is_equivalent_to(s.batch_layout(1).sharding, 1)
        np.testing.assert_array_equal(b["x"], np.full((16, 3), i))
        np.testing.assert_array_equal(b["y"], np.arange(16) + 100 * i)


def test_each_device_holds_its_rows():
    s = strategies.MirroredStrategy()
    (b,) = list(s.experimental_distribute_dataset([{"x": np.arange(16, dtype=np.float32)}]))
    by_device = {sh.device: sh.data.tolist() for sh in b["x"].addressable_shards}
    assert by_device == {d: [2.0 * i, 2.0 * i + 1] for i, d in enumerate(s.mesh.device_list)}


def test_prefetching_reads_ahead_on_a_background_thread():
    s = strategies.MirroredStrategy()
    pulled = []
    ready = threading.Event()

    def source():
        for i in range(10):
            pulled.append(i)
            if i == 2:
                ready.set()
            yield {"x": np.full((8,), i, np.float32)}

    it = iter(s.experimental_distribute_dataset(source(), prefetch=2))
    first = next(it)
    assert ready.wait(timeout=30)  # the thread reads ahead without being asked
    assert float(first["x"][0]) == 0.0
    # A bounded buffer: at most prefetch batches placed, plus one in hand, ahead.
    assert len(pulled) <= 1 + 2 + 1
    rest = [float(b["x"][0]) for b in it]
    assert rest == [float(i) for i in range(1, 10)]


def test_prefetch_zero_is_lazy():
    s = strategies.MirroredStrategy()
    pulled = []

    def source():
        for i in range(3):
            pulled.append(i)
            yield {"x": np.full((8,), i, np.float32)}

    it = iter(s.experimental_distribute_dataset(source(), prefetch=0))
    assert pulled == []
    next(it)
    assert pulled == [0]


def test_iteration_of_a_finite_list_ends_and_restarts():
    s = strategies.MirroredStrategy()
    ds = s.experimental_distribute_dataset(_batches(2))
    it = iter(ds)
    next(it)
    next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert len(list(ds)) == 2  # a list can be iterated again
    assert len(ds) == 2


def test_an_exception_in_the_source_surfaces():
    s = strategies.MirroredStrategy()

    def source():
        yield {"x": np.ones((8, 2), np.float32)}
        raise RuntimeError("reading shard 7 failed")

    it = iter(s.experimental_distribute_dataset(source()))
    assert next(it)["x"].shape == (8, 2)
    with pytest.raises(RuntimeError, match="reading shard 7 failed"):
        next(it)


def test_distribute_datasets_from_function_single_process():
    s = strategies.MirroredStrategy()
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        rows = ctx.get_per_pipeline_batch_size(16)
        return [{"x": np.arange(rows, dtype=np.float32) + 100 * i} for i in range(2)]

    out = list(s.distribute_datasets_from_function(dataset_fn))
    (ctx,) = seen
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 8)
    assert len(out) == 2
    np.testing.assert_array_equal(out[1]["x"], np.arange(16) + 100)
    assert dtensor.fetch_layout(out[0]["x"]) == s.batch_layout(1)


def test_distribute_datasets_from_function_over_two_batch_axes():
    s = strategies.HybridStrategy(data=2, fsdp=2, tensor=2)
    out = list(
        s.distribute_datasets_from_function(
            lambda ctx: [{"x": np.ones((ctx.get_per_pipeline_batch_size(8), 4))}]
        )
    )
    assert out[0]["x"].shape == (8, 4)
    assert dtensor.fetch_layout(out[0]["x"]) == dtensor.Layout([("data", "fsdp"), U], s.mesh)


def test_input_context_values():
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(64) == 8
    assert ctx.get_per_pipeline_batch_size(64) == 32
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (2, 1, 8)
    assert InputContext() == InputContext(1, 0, 1)
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    assert s.input_context() == InputContext(
        num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=4
    )
    assert s.input_context().get_per_replica_batch_size(32) == 8


def test_uneven_global_batch_raises_with_both_numbers():
    s = strategies.MirroredStrategy()
    with pytest.raises(
        dtensor.LayoutError,
        match=r"global batch of 12 rows does not divide over the 8 shards.*pad=True",
    ):
        list(s.experimental_distribute_dataset([{"x": np.ones((12, 2))}]))


def test_pad_gives_a_padded_batch_and_weights_that_keep_means_exact():
    s = strategies.MirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(13, 3)).astype(np.float32)
    y = rng.normal(size=(13,)).astype(np.float32)
    batches = [{"x": x, "y": y}, {"x": x[:8], "y": y[:8]}]
    out = list(s.experimental_distribute_dataset(batches, pad=True))
    (b, w), (b2, w2) = out
    assert b["x"].shape == (16, 3)
    np.testing.assert_array_equal(b["x"][:13], x)
    np.testing.assert_array_equal(b["x"][13:], 0)
    np.testing.assert_array_equal(w, [1.0] * 13 + [0.0] * 3)
    assert dtensor.fetch_layout(w) == s.batch_layout(1)
    assert b2["x"].shape == (8, 3)  # already even: kept, all weights 1
    np.testing.assert_array_equal(w2, np.ones(8))

    def weighted_mse(params, batch, weights):
        err = (batch["x"] @ params - batch["y"]) ** 2
        return jnp.sum(err * weights) / jnp.sum(weights)

    host_params = np.array([0.5, -1.0, 2.0], np.float32)
    params = dtensor.copy_to_mesh(host_params, dtensor.Layout.replicated(s.mesh, 1))  # not a batch
    got = s.run(weighted_mse, args=(params, b, w))
    want = np.mean((x @ host_params - y) ** 2)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    # The gradient too: padding rows carry no weight.
    g = s.run(jax.grad(weighted_mse), args=(params, b, w))
    g_ref = jax.grad(lambda p: jnp.mean((x @ p - y) ** 2))(host_params)
    np.testing.assert_allclose(g, g_ref, rtol=1e-5)


def test_pad_with_an_input_function():
    s = strategies.MirroredStrategy()
    out = list(s.distribute_datasets_from_function(lambda ctx: [{"x": np.ones((5, 2))}], pad=True))
    (b, w) = out[0]
    assert b["x"].shape == (8, 2)
    assert float(w.sum()) == 5.0
