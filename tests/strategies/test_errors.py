"""Bad input to the strategies: every error names what was wrong, what we got, and the fix."""

from __future__ import annotations

import re
import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dtensor
import strategies
from strategies import InputContext
from tests.models import MLPModel


def test_scope_of_one_strategy_inside_another():
    outer = strategies.MirroredStrategy()
    inner = strategies.FullyShardedStrategy()
    with outer.scope():
        with pytest.raises(
            ValueError,
            match=r"cannot enter the scope of FullyShardedStrategy\(mesh=Mesh\(fsdp=8\).*inside the scope of "
            r"MirroredStrategy\(mesh=Mesh\(replica=8\).*Leave the outer `with strategy.scope\(\):` block first",
        ):
            with inner.scope():
                pass
        # The failed entry left the outer scope intact.
        assert strategies.get_strategy() is outer
        assert dtensor.current_mesh() == outer.mesh
    assert isinstance(strategies.get_strategy(), strategies.OneDeviceStrategy)
    assert dtensor.current_mesh() is None


def test_run_with_an_array_on_another_mesh():
    s = strategies.MirroredStrategy()
    other = dtensor.create_mesh([("batch", 4), ("model", 2)])
    x = dtensor.copy_to_mesh(np.ones((8, 2), np.float32), dtensor.Layout(["batch", None], other))
    with pytest.raises(
        dtensor.LayoutError,
        match=r"argument args\[1\]\['x'\] of run\(\) is laid out on Mesh\(batch=4, model=2\), but "
        r"MirroredStrategy\(.*\) runs on Mesh\(replica=8\)\. Move it with dtensor\.relayout\(x, "
        r"strategy\.batch_layout\(x\.ndim\)\) or pass host \(numpy\) data",
    ):
        s.run(lambda scale, batch: batch["x"] * scale, args=(2.0, {"x": x}))
    with pytest.raises(
        dtensor.LayoutError,
        match=r"argument kwargs\['batch'\] of run\(\) is laid out on Mesh\(batch=4",
    ):
        s.run(lambda batch: batch * 2, kwargs={"batch": x})


def test_run_with_a_batch_that_does_not_divide_over_the_replicas():
    s = strategies.FullyShardedStrategy()
    with pytest.raises(
        dtensor.LayoutError,
        match=r"the global batch \(argument args\[0\]\['x'\], shape \(12, 2\)\) has 12 rows, which does not divide "
        r"over the 8 replicas of FullyShardedStrategy.*a multiple of 8, or distribute the dataset with pad=True",
    ):
        s.run(lambda b: b["x"].sum(), args=({"x": np.ones((12, 2))},))


def test_dataset_batch_that_does_not_divide():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    with pytest.raises(
        dtensor.LayoutError,
        match=r"the global batch of 6 rows does not divide over the 4 shards of mesh axes \('data', 'fsdp'\)",
    ):
        list(s.experimental_distribute_dataset([{"x": np.ones((6, 2))}]))


def test_tpu_strategy_without_tpus():
    with pytest.raises(
        ValueError,
        match=r"TPUStrategy\(\) found no TPU devices: this machine has \['cpu'\] devices\. .*pass devices= explicitly",
    ):
        strategies.TPUStrategy()


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (
            lambda: strategies.FixedShardsPartitioner(0),
            r"FixedShardsPartitioner\(num_shards=0\): num_shards must be a positive integer",
        ),
        (lambda: strategies.FixedShardsPartitioner(-3), r"FixedShardsPartitioner\(num_shards=-3\)"),
        (
            lambda: strategies.FixedShardsPartitioner(2.5),
            r"FixedShardsPartitioner\(num_shards=2\.5\).*e\.g\. num_shards=2",
        ),
        (
            lambda: strategies.FixedShardsPartitioner(True),
            r"FixedShardsPartitioner\(num_shards=True\)",
        ),
        (
            lambda: strategies.MinSizePartitioner(min_shard_bytes=-1, max_shards=2),
            r"MinSizePartitioner\(min_shard_bytes=-1\): min_shard_bytes must be a positive integer",
        ),
        (
            lambda: strategies.MinSizePartitioner(max_shards=0),
            r"MinSizePartitioner\(max_shards=0\)",
        ),
        (
            lambda: strategies.MaxSizePartitioner(max_shard_bytes=-5),
            r"MaxSizePartitioner\(max_shard_bytes=-5\): max_shard_bytes must be a positive integer",
        ),
        (
            lambda: strategies.MaxSizePartitioner(max_shard_bytes=0),
            r"MaxSizePartitioner\(max_shard_bytes=0\)",
        ),
        (
            lambda: strategies.MaxSizePartitioner(1024, max_shards=-1),
            r"MaxSizePartitioner\(max_shards=-1\)",
        ),
    ],
)
def test_partitioners_reject_nonsense(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_parameter_server_bad_arguments():
    with pytest.raises(
        TypeError,
        match=r"variable_partitioner='two' is not a partitioner; use FixedShardsPartitioner\(n\)",
    ):
        strategies.ParameterServerStrategy("two")
    with pytest.raises(
        ValueError,
        match=r"num_ps=3 must be a positive number of devices that divides the 8 devices.*\[1, 2, 4, 8\]",
    ):
        strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2), num_ps=3)
    with pytest.raises(ValueError, match=r"num_ps=0 must be a positive"):
        strategies.ParameterServerStrategy(num_ps=0)


def test_input_context_batch_sizes_that_do_not_divide():
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=0, num_replicas_in_sync=8)
    with pytest.raises(
        ValueError,
        match=r"global batch size 63 does not divide over 8 replicas; use a multiple of 8",
    ):
        ctx.get_per_replica_batch_size(63)
    with pytest.raises(
        ValueError,
        match=r"global batch size 63 does not divide over 2 input pipelines; use a multiple of 2",
    ):
        ctx.get_per_pipeline_batch_size(63)


def test_input_function_returning_the_wrong_number_of_rows():
    s = strategies.MirroredStrategy()

    def per_replica_rows(ctx):  # the TF habit: batches of one replica's size
        return [{"x": np.ones((ctx.get_per_replica_batch_size(64), 2))}]

    with pytest.raises(
        dtensor.LayoutError,
        match=r"the dataset function's batch 0 has 8 rows, but this input pipeline's share of the global batch 64 "
        r"is 64 rows \(64 / 1 input pipelines\)\. .*batch by ctx\.get_per_pipeline_batch_size\(64\)",
    ):
        list(s.distribute_datasets_from_function(per_replica_rows))

    def short_last(ctx):
        n = ctx.get_per_pipeline_batch_size(16)
        return [{"x": np.ones((n, 2))}, {"x": np.ones((n - 12, 2))}]

    it = iter(s.distribute_datasets_from_function(short_last))
    assert next(it)["x"].shape == (16, 2)
    with pytest.raises(
        dtensor.LayoutError,
        match=r"batch 1 has 4 rows, .* share of the global batch 16 is 16 rows.*pad=True",
    ):
        next(it)
    # With pad=True a short last batch is padded to the full global batch (and weighted) instead.
    (_, w0), (b1, w1) = list(s.distribute_datasets_from_function(short_last, pad=True))
    assert b1["x"].shape == (16, 2)
    assert float(w1.sum()) == 4.0
    assert float(w0.sum()) == 16.0


def test_per_replica_mode_with_sharded_variables():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    with s.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
    with pytest.raises(
        dtensor.LayoutError,
        match=r"per-replica run needs variables whole on every replica, but FullyShardedStrategy.*splits one over "
        r"the replica axes.*Use run\(\) without per_replica=True",
    ):
        s.run(lambda m, x: m(x), args=(model, np.ones((8, 16), np.float32)), per_replica=True)


def test_unsupported_cross_device_options():
    # Strings are not cross-device ops (tests/strategies/test_cross_device_ops.py has the rest).
    with pytest.raises(
        ValueError,
        match=r"MirroredStrategy\(cross_device_ops='nccl'\) is not a cross-device ops object",
    ):
        strategies.MirroredStrategy(cross_device_ops="nccl")
    with pytest.raises(
        ValueError,
        match=r"MultiWorkerMirroredStrategy\(communication_options='ring'\) is not a strategies.CommunicationOptions",
    ):
        strategies.MultiWorkerMirroredStrategy(communication_options="ring")


def test_multi_worker_mirrored_with_uneven_processes():
    devices = [types.SimpleNamespace(process_index=p) for p in (0, 0, 0, 1)]
    with pytest.raises(
        ValueError,
        match=r"needs the same number of devices in every process; got \[3, 1\] per process",
    ):
        strategies.MultiWorkerMirroredStrategy(devices=devices)


def test_fully_sharded_negative_min_shard_bytes():
    with pytest.raises(
        ValueError, match=r"min_shard_bytes=-1 is negative; use 0 to shard every variable"
    ):
        strategies.FullyShardedStrategy(min_shard_bytes=-1)


def test_layout_strategy_bad_arguments():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    other = dtensor.create_mesh([("batch", 8)])
    with pytest.raises(
        ValueError,
        match=r"the LayoutMap is over Mesh\(batch=8\) but the strategy's mesh is Mesh\(batch=4, model=2\)",
    ):
        strategies.LayoutStrategy(mesh, dtensor.LayoutMap(other))
    with pytest.raises(ValueError, match=r"batch_dim_name.*'data'"):
        strategies.LayoutStrategy(mesh, batch_dim_name="data")


def test_reduce_along_an_axis_the_value_does_not_have():
    s = strategies.MirroredStrategy()
    per_replica = s.experimental_distribute_values_from_function(
        lambda ctx: np.ones((2, 3), np.float32)
    )
    with pytest.raises(
        ValueError,
        match=r"strategy\.reduce\(\.\.\., axis=3\): each replica's value has rank 2 \(shape "
        r"\(2, 3\)\), so axis must be None or in \[-2, 1\]\. Pass axis=None to reduce across "
        r"replicas only",
    ):
        s.reduce("sum", per_replica, axis=3)
    with pytest.raises(
        ValueError,
        match=r"strategy\.reduce\(\.\.\., axis=3\): the value at \['loss'\] is one global array of "
        r"rank 2 \(shape \(4, 4\); its batch dimension already spans all replicas\), so axis must "
        r"be None or in \[-2, 1\]\. Pass axis=None to get it back unchanged",
    ):
        s.reduce("mean", {"loss": np.ones((4, 4), np.float32)}, axis=3)
    with pytest.raises(ValueError, match=r"axis=-1\): the value is one global array of rank 0"):
        s.reduce("sum", np.float32(1.0), axis=-1)
    with pytest.raises(TypeError, match=r"axis='batch'\): axis must be an int or None, got a str"):
        s.reduce("sum", per_replica, axis="batch")
    # In range: the checks let it through.
    assert s.reduce("sum", per_replica, axis=-1).shape == (2,)


def test_run_with_a_function_name_or_unwrapped_args():
    s = strategies.MirroredStrategy()
    with pytest.raises(
        TypeError,
        match=r"run\(fn='train_step'\): fn must be a callable step, got a str \(the name of a "
        r"function, 'train_step'\?\)\. Pass the function itself: run\(train_step, \.\.\.\)",
    ):
        s.run("train_step", args=(np.ones((8, 2)),))
    with pytest.raises(TypeError, match=r"explain\(fn=3\): fn must be a callable step, got a int"):
        s.explain(3)
    with pytest.raises(
        TypeError,
        match=r"run\(args=<ndarray float32\[8, 2\]>\): args must be a tuple of the step's "
        r"positional arguments, got a ndarray\. Wrap a single argument in a tuple: args=\(x,\)",
    ):
        s.run(lambda x: x.sum(), args=np.ones((8, 2), np.float32))
    with pytest.raises(TypeError, match=r"run\(kwargs=\[1, 2\]\): kwargs must be a dict"):
        s.run(lambda x: x, kwargs=[1, 2])


class _Narrow(nnx.Module):
    """A column-parallel layer (`up`) whose 3 output features do not split over 2 devices."""

    def __init__(self, rngs):
        self.up = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        return self.up(x)


def test_tensor_parallel_on_dimensions_that_do_not_divide():
    s = strategies.TensorParallelStrategy(2)
    with pytest.warns(UserWarning, match=r"TensorParallelStrategy: variable up/") as record:
        with s.scope():
            model = _Narrow(nnx.Rngs(0))
    messages = sorted(str(w.message) for w in record if "TensorParallelStrategy" in str(w.message))
    assert len(messages) == 2  # once per variable: up/bias and up/kernel
    assert re.search(
        r"TensorParallelStrategy: variable up/kernel \(shape \(5, 3\)\) matches the "
        r"Megatron column rule, which splits dimension 1 \(size 3\) over the 'tensor' axis of "
        r"size 2 \(the tensor-parallel size\), but 3 is not divisible by 2; the variable is "
        r"replicated on every device instead\. Make dimension 1 a multiple of 2, choose a "
        r"tensor-parallel size that divides 3, or give the variable its own layout",
        messages[1],
    )
    assert "variable up/bias (shape (3,))" in messages[0]
    assert record[0].filename == __file__  # points at the user's line, not ours
    assert dtensor.fetch_layout(model.up.kernel.get_value()).is_fully_replicated()
    report = s.explain(lambda m, x: m(x).sum(), args=(model, np.ones((8, 5), np.float32)))
    found = {(w.kind, w.path) for w in report.warnings}
    assert found >= {("silent-replication", "0/up/kernel"), ("silent-replication", "0/up/bias")}
    kernel = next(w for w in report.warnings if w.path == "0/up/kernel")
    assert (
        "splits dimension 1 (size 3)" in kernel.message and "tensor-parallel size" in kernel.message
    )
    # A rule of the user's own for the variable is not a silent fallback.
    ruled = strategies.TensorParallelStrategy(2, rules=[("up/.*", (None,))])
    assert ruled.layout_findings("up/bias", np.zeros(3)) == []


def test_ragged_batch_is_one_error_with_its_distinct_sizes():
    s = strategies.MirroredStrategy()
    # Twelve arrays, three sizes: the error lists the sizes, not every leaf.
    batch = [np.ones((n, 2), np.float32) for n in (8, 12, 8, 4, 12, 12, 8, 8, 12, 4, 8, 8)]
    with pytest.raises(
        dtensor.LayoutError,
        match=r"the global batch's arrays have different leading sizes: 8 rows \(args\[0\]\[0\] and "
        r"5 more\), 12 rows \(args\[0\]\[1\] and 3 more\), 4 rows \(args\[0\]\[3\] and 1 more\); 4 "
        r"and 12 do not divide over the 8 replicas of MirroredStrategy\(.*\)\. Every array of a "
        r"batch needs the same number of rows, a multiple of 8: pad or trim the odd ones",
    ) as err:
        s.run(lambda b: sum(x.sum() for x in b), args=(batch,))
    assert "args[0][11]" not in str(err.value)
    # Different sizes that all divide are still a valid call (a step may take several batches).
    s.run(lambda a, b: a.sum() + b.sum(), args=(np.ones((8, 2)), np.ones((16, 2))))
    # Through a dataset: a ragged Python list (token ids of different lengths) is named as such.
    with pytest.raises(
        dtensor.LayoutError,
        match=r"batch\['ids'\] is a ragged list: its 8 rows have different lengths, 3 items \(row 0 "
        r"and 5 more\), 2 items \(row 1\), 5 items \(row 4\)\. Every row of a batch needs the same "
        r"length; pad the rows to one length",
    ):
        ids = [[1, 2, 3], [4, 5], [1, 2, 3], [1, 2, 3], [1, 2, 3, 4, 5]] + [[7, 8, 9]] * 3
        list(s.experimental_distribute_dataset([{"ids": ids}]))
    # A rectangular one is simply an array.
    (got,) = s.experimental_distribute_dataset([{"ids": [[1, 2]] * 8}])
    assert got["ids"].shape == (8, 2)
    with pytest.raises(
        dtensor.LayoutError,
        match=r"different leading sizes: 8 rows \(batch\['x'\]\), 16 rows \(batch\['y'\]\); every "
        r"array in a batch needs the same number of rows \(dimension 0\)",
    ):
        list(s.experimental_distribute_dataset([{"x": np.ones((8, 2)), "y": np.ones((16,))}]))


class _EinsumDense(nnx.Module):
    """A Linear-like layer written as Flax's annotated Gemma writes them: einsum with out_sharding."""

    def __init__(self, din, dout, rngs, *, axes=("batch", "model"), run_at_init=False):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, axes[1]))
        self.w = nnx.Param(init(rngs.params(), (din, dout)))
        self.axes = axes
        if run_at_init:  # a constructor that traces a forward pass (shape inference, say)
            self(jnp.ones((8, din)))

    def __call__(self, x):
        return jnp.einsum("bd,df->bf", x, self.w[...], out_sharding=P(*self.axes))


def _loss_step(model, x):
    return (model(x) ** 2).mean()


def test_annotated_model_with_out_sharding_on_auto_axes():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])  # Auto axes: the default
    s = strategies.LayoutStrategy(mesh)
    with s.scope():
        model = _EinsumDense(8, 16, nnx.Rngs(0))
    x = np.ones((8, 8), np.float32)
    fix = (
        r"Build the mesh with Explicit axes and pass it \(and a LayoutMap built on it\) to the "
        r"strategy: strategies\.LayoutStrategy\(dtensor\.create_mesh\(\[\('batch', 4\), "
        r"\('model', 2\)\], axis_types=\"explicit\"\), layout_map\); or remove out_sharding= from "
        r"the model's layers"
    )
    with pytest.raises(
        dtensor.LayoutError,
        match=r"run\(\): the model passes out_sharding=P\('batch', 'model'\) to einsum \(at "
        r".*test_errors\.py:\d+.*\), which JAX accepts only on Explicit mesh axes, but "
        r"LayoutStrategy\(mesh=Mesh\(batch=4, model=2\), replicas=4\) runs on Auto axes \(mesh "
        r"axis 'batch' is Auto\)\. " + fix,
    ):
        s.run(_loss_step, args=(model, x))
    with pytest.raises(dtensor.LayoutError, match=r"explain\(\): the model passes out_sharding="):
        s.explain(_loss_step, args=(model, x))
    with pytest.raises(
        dtensor.LayoutError,
        match=r"building _EinsumDense in scope\(\): the model passes out_sharding=P\('batch', "
        r"'model'\) to einsum",
    ):
        with s.scope():
            _EinsumDense(8, 16, nnx.Rngs(0), run_at_init=True)
    with pytest.raises(dtensor.LayoutError, match=r"create\(\): the model passes out_sharding="):
        s.create(lambda: _EinsumDense(8, 16, nnx.Rngs(0), run_at_init=True))
    # Presets that build their own (Auto) mesh point at LayoutStrategy.
    tp = strategies.TensorParallelStrategy(2)
    with tp.scope():
        tp_model = _EinsumDense(8, 16, nnx.Rngs(0), axes=("data", "tensor"))
    with pytest.raises(
        dtensor.LayoutError,
        match=r"run\(\): .* but TensorParallelStrategy\(.*\) runs on Auto axes \(mesh axis 'data' "
        r"is Auto\)\. TensorParallelStrategy builds its mesh with Auto axes \(what unannotated "
        r"models need\); run an annotated model under strategies\.LayoutStrategy\(dtensor\."
        r"create_mesh\(\[\('data', 4\), \('fsdp', 1\), \('tensor', 2\)\], "
        r"axis_types=\"explicit\"\)\)",
    ):
        tp.run(_loss_step, args=(tp_model, x))
    # The fix the message gives runs.
    explicit = strategies.LayoutStrategy(
        dtensor.create_mesh([("batch", 4), ("model", 2)], axis_types="explicit")
    )
    with explicit.scope():
        model = _EinsumDense(8, 16, nnx.Rngs(0))
    assert np.isfinite(float(explicit.run(_loss_step, args=(model, x))))
