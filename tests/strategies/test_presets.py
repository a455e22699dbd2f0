"""Each preset's variable layouts (for real Flax NNX models), batch layout and repr."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor import UNSHARDED as U
from dtensor.core.tree import path_str
from tests.models import Block, MLPModel

DEVICES = jax.devices


def _build(strategy, model_cls=MLPModel):
    with strategy.scope():
        model = model_cls(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return model, opt


def _specs(tree):
    """``{path: sharding_specs}`` for every array of an NNX module/optimizer, read off the arrays."""
    out = {}
    for path, var in jax.tree_util.tree_leaves_with_path(
        nnx.state(tree), is_leaf=lambda v: isinstance(v, nnx.Variable)
    ):
        value = var.get_value()
        if isinstance(value, jax.Array) and value.ndim:
            out[path_str(path)] = dtensor.fetch_layout(value).sharding_specs
    return out


def _shards(x) -> int:
    """How many distinct pieces a global array is cut into."""
    return len(
        {
            tuple((s.start, s.stop) for s in idx)
            for idx in x.sharding.devices_indices_map(x.shape).values()
        }
    )


# ----------------------------------------------------------------- Mirrored
def test_mirrored_replicates_every_variable_and_optimizer_state():
    s = strategies.MirroredStrategy()
    model, opt = _build(s, Block)
    for tree in (model, opt):
        for path, var in jax.tree_util.tree_leaves_with_path(nnx.state(tree)):
            if isinstance(var, jax.Array):
                assert dtensor.fetch_layout(var).is_fully_replicated(), path
                assert dtensor.fetch_layout(var).mesh == s.mesh
                assert len(var.sharding.device_set) == 8
    assert s.batch_layout(2) == dtensor.Layout(["replica", U], s.mesh)
    assert s.batch_layout(0) == dtensor.Layout.replicated(s.mesh, 0)
    assert s.num_replicas_in_sync == 8


def test_mirrored_on_a_subset_of_devices():
    s = strategies.MirroredStrategy(devices=DEVICES()[:4])
    assert s.mesh.shape == {"replica": 4}
    assert s.num_replicas_in_sync == 4
    model, _ = _build(s)
    assert model.up.kernel.get_value().sharding.device_set == set(DEVICES()[:4])


def test_multi_worker_mirrored_splits_the_batch_over_workers_and_replicas():
    s = strategies.MultiWorkerMirroredStrategy()
    assert s.mesh.shape == {"worker": 1, "replica": 8}
    assert s.batch_layout(3) == dtensor.Layout([("worker", "replica"), U, U], s.mesh)
    model, _ = _build(s)
    assert all(all(d == U for d in specs) for specs in _specs(model).values())


# -------------------------------------------------------------- FullySharded
def test_fully_sharded_splits_large_kernels_8_ways_and_adam_state_follows():
    s = strategies.FullyShardedStrategy(min_shard_bytes=1024)
    model, opt = _build(s, Block)
    params = _specs(model)
    # Large kernels (>= 1 KiB): sharded on their largest divisible dimension, 8 ways.
    assert params["up/kernel"] == (U, "fsdp")  # (32, 64): 64 is the larger
    assert params["down/kernel"] == ("fsdp", U)  # (64, 32)
    assert params["embed/embedding"] == ("fsdp", U)  # (64, 32)
    assert params["attn/query/kernel"] == ("fsdp", U, U)  # (32, 4, 8)
    assert params["attn/out/kernel"] == (U, U, "fsdp")  # (4, 8, 32)
    assert _shards(model.up.kernel.get_value()) == 8
    assert model.up.kernel.get_value().addressable_shards[0].data.shape == (32, 8)
    # Small vectors (< 1 KiB): replicated.
    for name in ("up/bias", "down/bias", "ln1/scale", "ln2/bias", "head/bias"):
        assert params[name] == (U,), name
    # Adam's mu and nu have their parameter's layout.
    state = _specs(opt)
    for name, specs in params.items():
        assert state[f"opt_state/0/mu/{name}"] == specs, name
        assert state[f"opt_state/0/nu/{name}"] == specs, name
    assert s.batch_layout(2) == dtensor.Layout(["fsdp", U], s.mesh)


def test_fully_sharded_min_shard_bytes_threshold():
    # up/kernel is 16*64*4 = 4096 bytes, down/kernel 64*8*4 = 2048 bytes.
    s = strategies.FullyShardedStrategy(min_shard_bytes=4096)
    model, _ = _build(s)
    specs = _specs(model)
    assert specs["up/kernel"] == (U, "fsdp")
    assert specs["down/kernel"] == (U, U)
    everything = _specs(_build(strategies.FullyShardedStrategy(min_shard_bytes=0))[0])
    assert everything["down/kernel"] == ("fsdp", U)
    assert everything["up/bias"] == ("fsdp",)
    assert everything["down/bias"] == ("fsdp",)  # (8,): divisible by 8


def test_fully_sharded_leaves_indivisible_dims_whole():
    s = strategies.FullyShardedStrategy(min_shard_bytes=0)
    assert s.variable_layout("w", jnp.zeros((6, 10))).is_fully_replicated()
    assert s.variable_layout("w", jnp.zeros((6, 16))).sharding_specs == (U, "fsdp")


@pytest.mark.parametrize(
    "make",
    [
        lambda: strategies.FullyShardedStrategy(min_shard_bytes=1024),
        lambda: strategies.TensorParallelStrategy(tensor_parallel=2),
        lambda: strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2)),
        lambda: strategies.CentralStorageStrategy(),
    ],
    ids=["fully_sharded", "tensor_parallel", "parameter_server", "central_storage"],
)
def test_create_gives_the_same_layouts_and_values_as_scope(make):
    s = make()
    built, _ = _build(s)
    created = s.create(lambda: MLPModel(rngs=nnx.Rngs(0)))
    a = dict(jax.tree_util.tree_leaves_with_path(nnx.state(built)))
    b = dict(jax.tree_util.tree_leaves_with_path(nnx.state(created)))
    assert a.keys() == b.keys()
    for path in a:
        if isinstance(a[path], jax.Array):
            assert b[path].sharding.is_equivalent_to(a[path].sharding, a[path].ndim), path
            # Same seed, same values (up to float rounding of the jitted initialiser).
            np.testing.assert_allclose(
                np.asarray(b[path]), np.asarray(a[path]), rtol=1e-6, atol=1e-7
            )


# ---------------------------------------------------------- ParameterServer
def test_parameter_server_fixed_shards_splits_dim0_in_two():
    s = strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2))
    assert s.mesh.shape == {"ps": 2, "worker": 4}
    model, opt = _build(s)
    specs = _specs(model)
    assert specs["up/kernel"] == ("ps", U)
    assert specs["down/kernel"] == ("ps", U)
    assert specs["up/bias"] == ("ps",)
    k = model.up.kernel.get_value()
    assert _shards(k) == 2
    assert {sh.data.shape for sh in k.addressable_shards} == {(8, 64)}
    assert _specs(opt)["opt_state/0/mu/up/kernel"] == ("ps", U)
    # Compute is data parallel over all 8 devices.
    assert s.num_replicas_in_sync == 8
    assert s.batch_layout(2) == dtensor.Layout([("ps", "worker"), U], s.mesh)


def test_parameter_server_keeps_a_variable_whole_when_dim0_does_not_divide():
    s = strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2))
    assert s.variable_layout("w", jnp.zeros((7, 4))).is_fully_replicated()
    assert s.variable_layout("w", jnp.zeros((1, 4))).is_fully_replicated()
    assert s.variable_layout("w", jnp.zeros(())).rank == 0


def test_parameter_server_without_partitioner_replicates():
    s = strategies.ParameterServerStrategy()
    assert s.mesh.shape == {"ps": 1, "worker": 8}
    assert s.variable_layout("w", jnp.zeros((64, 64))).is_fully_replicated()


def test_min_size_partitioner():
    p = strategies.MinSizePartitioner(min_shard_bytes=1024, max_shards=4)
    assert p.num_shards((1024, 1), np.float32) == 4  # 4 KiB: four shards of 1 KiB
    assert p.num_shards((512, 1), np.float32) == 2  # 2 KiB: two shards of 1 KiB
    assert p.num_shards((128, 1), np.float32) == 1  # 512 B: too small to split
    assert p.num_shards((3, 4096), np.float32) == 3  # capped by dim 0
    assert p((4096, 2), "float32") == [4, 1]
    s = strategies.ParameterServerStrategy(
        strategies.MinSizePartitioner(min_shard_bytes=2048, max_shards=2)
    )
    assert s.mesh.shape == {"ps": 2, "worker": 4}
    model, _ = _build(s)
    specs = _specs(model)
    assert specs["up/kernel"] == ("ps", U)  # 4096 bytes: two shards of 2 KiB
    assert specs["down/kernel"] == (U, U)  # 2048 bytes: one shard
    assert specs["up/bias"] == (U,)


def test_max_size_partitioner():
    p = strategies.MaxSizePartitioner(max_shard_bytes=1024, max_shards=8)
    assert p.num_shards((1024, 1), np.float32) == 4
    assert p.num_shards((100, 1), np.float32) == 1
    assert p.num_shards((257, 1), np.float32) == 2  # 1028 bytes: just over one shard
    assert strategies.MaxSizePartitioner(max_shard_bytes=16)((64, 64), np.float32) == [
        64,
        1,
    ]  # capped by dim 0
    assert strategies.MaxSizePartitioner(max_shard_bytes=4, max_shards=3)((64,), np.float32) == [3]
    s = strategies.ParameterServerStrategy(
        strategies.MaxSizePartitioner(max_shard_bytes=2048, max_shards=4)
    )
    assert s.mesh.shape == {"ps": 4, "worker": 2}
    specs = _specs(_build(s)[0])
    assert specs["up/kernel"] == ("ps", U)  # 4096 bytes > 2 KiB
    assert specs["down/kernel"] == (U, U)  # 2048 bytes fit in one shard


# ----------------------------------------------------------- TensorParallel
def test_tensor_parallel_megatron_column_row_pattern():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    assert s.mesh.shape == {"data": 4, "fsdp": 1, "tensor": 2}
    assert s.num_replicas_in_sync == 4
    model, opt = _build(s, Block)
    specs = _specs(model)
    want = {
        "up/kernel": (U, "tensor"),  # column: output features split
        "up/bias": ("tensor",),
        "down/kernel": ("tensor", U),  # row: input features split
        "down/bias": (U,),
        "attn/query/kernel": (U, "tensor", U),  # (in, heads, head_dim): heads split
        "attn/key/kernel": (U, "tensor", U),
        "attn/value/kernel": (U, "tensor", U),
        "attn/out/kernel": ("tensor", U, U),  # (heads, head_dim, out): heads split
        "embed/embedding": ("tensor", U),  # vocabulary split
        "head/kernel": (U, "tensor"),  # the output head: column (vocabulary split)
        "head/bias": ("tensor",),
        "ln1/scale": (U,),
    }
    for name, spec in want.items():
        assert specs[name] == spec, name
    opt_specs = _specs(opt)
    assert opt_specs["opt_state/0/mu/up/kernel"] == (U, "tensor")
    assert opt_specs["opt_state/0/nu/attn/out/kernel"] == ("tensor", U, U)
    assert s.batch_layout(2) == dtensor.Layout([("data", "fsdp"), U], s.mesh)


def test_tensor_parallel_rules_override_megatron():
    s = strategies.TensorParallelStrategy(
        tensor_parallel=2, rules=[("up/kernel", ("tensor", None))]
    )
    assert s.variable_layout("up/kernel", jnp.zeros((16, 64))).sharding_specs == ("tensor", U)
    assert s.variable_layout("down/kernel", jnp.zeros((64, 8))).sharding_specs == ("tensor", U)
    assert s.rule_name("up/kernel", jnp.zeros((16, 64))) == "up/kernel"
    assert s.rule_name("down/kernel", jnp.zeros((64, 8))) == "megatron row"


def test_tensor_parallel_replicates_what_does_not_divide():
    s = strategies.TensorParallelStrategy(tensor_parallel=4)
    with pytest.warns(UserWarning, match=r"variable mlp/up/kernel \(shape \(16, 6\)\)"):
        assert s.variable_layout("mlp/up/kernel", jnp.zeros((16, 6))).is_fully_replicated()
    assert (
        s.rule_name("mlp/up/kernel", jnp.zeros((16, 6)))
        == "megatron column (not divisible: replicated)"
    )


def test_hybrid_combines_tensor_and_fsdp():
    s = strategies.HybridStrategy(data=2, fsdp=2, tensor=2, min_shard_bytes=0)
    assert s.mesh.shape == {"data": 2, "fsdp": 2, "tensor": 2}
    assert s.num_replicas_in_sync == 4
    specs = _specs(_build(s, Block)[0])
    assert specs["up/kernel"] == ("fsdp", "tensor")
    assert specs["down/kernel"] == ("tensor", "fsdp")
    assert specs["attn/query/kernel"] == ("fsdp", "tensor", U)
    assert specs["attn/out/kernel"] == ("tensor", U, "fsdp")
    assert specs["head/kernel"] == ("fsdp", "tensor")
    assert specs["embed/embedding"] == ("tensor", "fsdp")
    assert specs["up/bias"] == ("tensor",)
    assert specs["ln1/scale"] == ("fsdp",)
    assert s.batch_layout(2) == dtensor.Layout([("data", "fsdp"), U], s.mesh)
    # With the default min_shard_bytes, small variables are not FSDP-sharded.
    big = strategies.HybridStrategy(data=2, fsdp=2, tensor=2)
    assert big.variable_layout("ln/scale", jnp.zeros((32,))).is_fully_replicated()


# ------------------------------------------------------------ LayoutStrategy
class _Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.up = nnx.Linear(16, 64, kernel_init=init, rngs=rngs)
        self.down = nnx.Linear(64, 8, rngs=rngs)
        self.head = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.down(jax.nn.relu(self.up(x))))


def test_layout_strategy_annotations_then_layout_map_then_replicated():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    # The rule for up/kernel is overridden by the model's own annotation.
    lm = dtensor.LayoutMap(mesh, [("up/kernel", ("model", None)), ("down/kernel", ("model", None))])
    s = strategies.LayoutStrategy(mesh, lm)
    model, opt = _build(s, _Annotated)
    specs = _specs(model)
    assert specs["up/kernel"] == (U, "model")  # annotation
    assert specs["down/kernel"] == ("model", U)  # LayoutMap
    assert specs["head/kernel"] == (U, U)  # neither
    assert _specs(opt)["opt_state/0/mu/up/kernel"] == (U, "model")
    assert _specs(opt)["opt_state/0/nu/down/kernel"] == ("model", U)
    _, rules = s.variable_layouts(model)
    assert rules["up"]["kernel"] == "flax annotation"
    assert rules["down"]["kernel"] == "down/kernel"
    assert rules["head"]["kernel"] is None
    created = s.create(lambda: _Annotated(rngs=nnx.Rngs(0)))
    assert _specs(created) == specs
    assert s.batch_layout(2) == dtensor.Layout(["batch", U], mesh)
    assert s.num_replicas_in_sync == 4


def test_layout_strategy_batch_dim_name():
    mesh = dtensor.create_mesh([("batch", 4), ("model", 2)])
    s = strategies.LayoutStrategy(mesh, batch_dim_name="model")
    assert s.batch_layout(2) == dtensor.Layout(["model", U], mesh)
    assert s.num_replicas_in_sync == 2


# ------------------------------------------------------------ CentralStorage
def test_central_storage_keeps_one_copy_on_the_parameter_device():
    param_dev = DEVICES()[3]
    s = strategies.CentralStorageStrategy(parameter_device=param_dev)
    model, opt = _build(s)
    for tree in (model, opt):
        for path, v in jax.tree_util.tree_leaves_with_path(nnx.state(tree)):
            if isinstance(v, jax.Array):
                assert v.sharding.device_set == {param_dev}, path
    assert s.num_replicas_in_sync == 8
    assert s.batch_layout(2) == dtensor.Layout(["replica", U], s.mesh)
    params = s.distribute_variables({"w": jnp.ones((4, 4))})
    assert params["w"].sharding.device_set == {param_dev}


def test_central_storage_defaults_to_the_first_compute_device():
    s = strategies.CentralStorageStrategy(compute_devices=DEVICES()[4:])
    assert s.parameter_device == DEVICES()[4]
    assert s.mesh.shape == {"replica": 4}
    model, _ = _build(s)
    assert model.up.kernel.get_value().sharding.device_set == {DEVICES()[4]}


# ----------------------------------------------------------- OneDevice / TPU
def test_one_device_puts_everything_on_its_device():
    dev = DEVICES()[2]
    s = strategies.OneDeviceStrategy(dev)
    model, opt = _build(s)
    assert model.up.kernel.get_value().sharding.device_set == {dev}
    assert opt.opt_state[0].mu["up"]["kernel"].get_value().sharding.device_set == {dev}
    assert s.num_replicas_in_sync == 1
    assert s.batch_layout(2).is_fully_replicated()
    assert s.batch_layout(2).mesh.device_list == [dev]
    assert strategies.OneDeviceStrategy("cpu:1").device == DEVICES()[1]
    assert strategies.OneDeviceStrategy("/cpu:5").device == DEVICES()[5]
    assert strategies.OneDeviceStrategy().device == DEVICES()[0]


def test_tpu_strategy_with_explicit_devices():
    s = strategies.TPUStrategy(devices=DEVICES()[:4])
    assert s.mesh.shape == {"replica": 4}
    assert list(s.mesh.device_list) == DEVICES()[:4]
    assert s.batch_layout(2) == dtensor.Layout(["replica", U], s.mesh)
    model, _ = _build(s)
    v = model.up.kernel.get_value()
    assert dtensor.fetch_layout(v).is_fully_replicated()
    assert v.sharding.device_set == set(DEVICES()[:4])


# ---------------------------------------------------------------- describe
@pytest.mark.parametrize(
    ("make", "text"),
    [
        (
            lambda: strategies.MirroredStrategy(),
            "MirroredStrategy(mesh=Mesh(replica=8), replicas=8)",
        ),
        (
            lambda: strategies.FullyShardedStrategy(),
            "FullyShardedStrategy(mesh=Mesh(fsdp=8), replicas=8)",
        ),
        (
            lambda: strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2)),
            "ParameterServerStrategy(FixedShardsPartitioner(2), mesh=Mesh(ps=2, worker=4))",
        ),
        (
            lambda: strategies.TensorParallelStrategy(tensor_parallel=2),
            "TensorParallelStrategy(mesh=Mesh(data=4, fsdp=1, tensor=2), replicas=4)",
        ),
        (
            lambda: strategies.OneDeviceStrategy(),
            "OneDeviceStrategy(mesh=Mesh(device=1), replicas=1)",
        ),
    ],
)
def test_repr_and_describe_show_the_mesh(make, text):
    s = make()
    assert repr(s) == text
    assert s.describe().splitlines()[0] == text


def test_variable_layouts_reports_rules():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    model, _ = _build(s)
    layouts, rules = s.variable_layouts(model)
    assert layouts["up"]["kernel"] == dtensor.Layout([U, "tensor"], s.mesh)
    assert rules["up"]["kernel"] == "megatron column"
    assert rules["down"]["kernel"] == "megatron row"


def _row(text, path):
    (line,) = [ln for ln in text.splitlines() if ln.strip().startswith(f"{path} ")]
    return re.split(r"\s{2,}", line.strip())


def test_describe_lists_each_variable_with_its_layout_and_rule():
    s = strategies.TensorParallelStrategy(tensor_parallel=2)
    model, _ = _build(s)
    text = s.describe(model)
    assert text.splitlines()[0] == repr(s)
    assert _row(text, "up/kernel") == [
        "up/kernel",
        "16×64",
        "[·, tensor]",
        "megatron column",
        "2.0 KiB",
    ]
    assert _row(text, "down/kernel")[2:4] == ["[tensor, ·]", "megatron row"]
    assert "Mesh(data=4, fsdp=1, tensor=2)" in text and "dtype f32" in text  # one dtype: said once
    # An abstract model works too (nothing is materialised).
    f = strategies.FullyShardedStrategy(min_shard_bytes=4096)
    text = f.describe(nnx.eval_shape(lambda: MLPModel(rngs=nnx.Rngs(0))))
    assert _row(text, "up/kernel")[2:] == ["[·, fsdp]", "512 B"]  # 4 KiB over 8 devices
    assert _row(text, "down/kernel")[2] == "[·, ·]"  # 2 KiB: below the threshold
    assert "rule fully_sharded" in " ".join(text.split())  # one rule: said once


def test_central_storage_takes_devices_like_every_preset():
    import jax

    s = strategies.CentralStorageStrategy(devices=jax.devices()[:4])
    assert s.num_replicas_in_sync == 4 and s.parameter_device == jax.devices()[0]
    with pytest.raises(ValueError, match="both compute_devices= and devices="):
        strategies.CentralStorageStrategy(jax.devices()[:2], devices=jax.devices()[:2])


class _PlainPair(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(8, 16, rngs=rngs)
        self.down = nnx.Linear(16, 8, rngs=rngs)


class _AnnotatedPair(nnx.Module):
    """Flax sharding annotations on a bare Param and on a Linear's kernel."""

    def __init__(self, rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.w = nnx.Param(init(rngs.params(), (8, 16)))
        self.up = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)


def _same_pytree(in_scope, plain):
    a, b = nnx.state(in_scope), nnx.state(plain)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6), a, b)  # same values
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    for x, y in zip(
        jax.tree.leaves(a, is_leaf=is_var), jax.tree.leaves(b, is_leaf=is_var), strict=True
    ):
        assert type(x) is type(y) and x.get_metadata() == y.get_metadata()


@pytest.mark.parametrize("model_cls", [_PlainPair, _AnnotatedPair])
@pytest.mark.parametrize("name", strategies.PRESET_NAMES)
def test_a_model_built_in_scope_is_the_same_pytree(name, model_cls):
    """scope() lays a model out and changes nothing else: structure, metadata, values."""
    s = strategies.from_name(name)
    # Eager sharding off (annotations are metadata only): built in scope or not.
    with nnx.use_eager_sharding(False):
        plain = model_cls(nnx.Rngs(0))
        with s.scope():
            in_scope = model_cls(nnx.Rngs(0))
    _same_pytree(in_scope, plain)
    # Flax's default (eager sharding on): an annotated model is built under a mesh with its axes.
    model_mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(model_mesh):
        plain = model_cls(nnx.Rngs(0))
    with s.scope():
        in_scope = model_cls(nnx.Rngs(0))
    _same_pytree(in_scope, plain)
