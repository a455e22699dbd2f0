"""TPU topologies from libtpu's compiler: devices, meshes, presets compiled ahead of time."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import dtensor
import strategies
from dtensor.analysis.collective import array_bytes
from dtensor.analysis.memory import (
    CHIP_HBM_GIB,
    MemoryFit,
    WillNotFitError,
    chip_generation,
    padded_bytes,
)
from dtensor.tpu.topology import TopologyError
from tests.models import abstract_block_step, deep_mlp_step

TOPOLOGIES = [("v5e:4x4", 1), ("v5e:4x4", 2), ("v4:2x2x2", 1), ("tpu7x:2x2x2", 1)]
GIB = 1 << 30


# ----------------------------------------------------------------- topologies
def test_tpu_topology_devices():
    devices = dtensor.tpu_topology("v5e:4x4")
    assert len(devices) == 16
    assert {d.platform for d in devices} == {"tpu"}
    assert {d.device_kind for d in devices} == {"TPU v5 lite"}
    assert sorted(tuple(d.coords[:2]) for d in devices) == [
        (x, y) for x in range(4) for y in range(4)
    ]
    assert len({d.process_index for d in devices}) == 4  # 4 hosts of 2x2 chips
    assert dtensor.tpu_topology("v5e:4x4") == devices  # the same objects each time

    two = dtensor.tpu_topology("v5e:4x4", num_slices=2)
    assert len(two) == 32
    assert [d.slice_index for d in two] == [0] * 16 + [1] * 16

    v4 = dtensor.tpu_topology("v4:2x2x2")
    assert len(v4) == 8 and {d.core_on_chip for d in v4} == {0}  # 8 chips, megacore as on a VM
    assert chip_generation(v4) == "v4" and chip_generation(devices) == "v5e"
    assert chip_generation(dtensor.tpu_topology("v5p:2x2x2")) == "v5p"
    assert chip_generation(jax.devices()) is None


def test_tpu_topology_errors():
    with pytest.raises(
        TopologyError, match=r"'v9:4x4'\): unknown TPU generation 'v9'.*Examples: 'v5p-128'"
    ):
        dtensor.tpu_topology("v9:4x4")
    with pytest.raises(TopologyError, match=r"'v5e:3x3'.*not divisible.*'v5p-128'"):
        dtensor.tpu_topology("v5e:3x3")
    with pytest.raises(TopologyError, match=r"'4x4'\) is not a TPU slice name.*'v5p-128'"):
        dtensor.tpu_topology("4x4")
    with pytest.raises(
        TopologyError, match=r"num_slices=0\): num_slices must be a positive integer"
    ):
        dtensor.tpu_topology("v5e:4x4", num_slices=0)
    with pytest.raises(
        TopologyError, match=r"name=None\): the name must be a string such as 'v5p-128'"
    ):
        dtensor.tpu_topology(None)  # type: ignore[arg-type]


def test_meshes_over_a_topology():
    devices = dtensor.tpu_topology("v5e:4x4")
    mesh = dtensor.create_mesh([("data", 4), ("model", 4)], devices=devices)
    assert mesh.platform == "tpu" and mesh.shape == {"data": 4, "model": 4}
    for name in strategies.PRESET_NAMES:
        s = strategies.from_name(name, devices=devices)
        assert s.mesh.platform == "tpu"
        assert s.mesh.size == (1 if name == "one_device" else 16)


def test_multislice_mesh_keeps_each_slice_contiguous_on_the_ici_axes():
    devices = dtensor.tpu_topology("v5e:4x4", num_slices=2)
    mesh = dtensor.create_distributed_mesh(
        [("data", 1), ("fsdp", 4), ("tensor", 4)], [("data", 2)], devices=devices
    )
    assert mesh.shape == {"data": 2, "fsdp": 4, "tensor": 4}
    grid = mesh.devices
    every_chip = sorted((x, y) for x in range(4) for y in range(4))
    for s in range(2):
        block = grid[s]
        assert {d.slice_index for d in block.flat} == {s}
        assert sorted(tuple(d.coords[:2]) for d in block.flat) == every_chip
        # Neighbours along each ICI axis are neighbouring chips.
        for a in range(block.shape[0]):
            for b in range(block.shape[1]):
                for da, db in ((1, 0), (0, 1)):
                    if a + da < block.shape[0] and b + db < block.shape[1]:
                        p, q = block[a, b].coords, block[a + da, b + db].coords
                        assert sum(abs(i - j) for i, j in zip(p, q, strict=True)) == 1
    # DCN on an inner axis: each slice is one contiguous half of that axis.
    mesh = dtensor.create_distributed_mesh(
        [("data", 2), ("model", 8)], [("model", 2)], devices=devices
    )
    assert mesh.shape == {"data": 2, "model": 16}
    slice_of = np.vectorize(lambda d: d.slice_index)(mesh.devices)
    assert (slice_of[:, :8] == 0).all() and (slice_of[:, 8:] == 1).all()


# ------------------------------------------------------- fit verdict, padding
def test_memory_fit_verdict():
    fit = MemoryFit("v5e", 16 * GIB, 1, 12 * GIB, 12 * GIB, 12 * GIB, 3 * GIB, 1 << 20)
    assert fit.fits and fit.bytes_per_chip == 15 * GIB + (1 << 20)
    assert str(fit).startswith("fits: 15.0 GiB per v5e chip")
    big = MemoryFit("v4", 32 * GIB, 2, 10 * GIB, 0, 0, 7 * GIB, 0)
    assert not big.fits and big.bytes_per_chip == 34 * GIB
    assert str(big).startswith("will not fit: needs 34.0 GiB per v4 chip")
    assert "x2 TensorCores per chip" in str(
        big
    ) and "a v4 chip has 32.0 GiB of HBM (106% of it)" in str(big)
    assert big.to_dict()["fits"] is False and CHIP_HBM_GIB == {
        "v4": 32,
        "v5e": 16,
        "v5p": 95,
        "v6e": 32,
        "tpu7x": 96,  # a TensorCore's: half an Ironwood chip
    }


def test_usable_hbm_is_what_the_tpu_compiler_allows():
    """The fit verdict's limit per chip is libtpu's own "available HBM", not the chip's HBM."""
    from dtensor.analysis.memory import USABLE_HBM_GIB

    for topology, chip in (
        ("v5e:2x2", "v5e"),
        ("v5p:2x2x1", "v5p"),
        ("v6e:2x2", "v6e"),
        ("v4:2x2x1", "v4"),
    ):
        devices = dtensor.tpu_topology(topology)[:1]
        mesh = jax.sharding.Mesh(devices, ("x",))
        x = jax.ShapeDtypeStruct(
            (1 << 28,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P())
        )
        # 150 GiB of outputs: more than any chip has.
        with pytest.raises(WillNotFitError) as err:
            dtensor.explain(lambda x: jnp.stack([jnp.sin(x * i) for i in range(150)]), x)
        assert err.value.available == pytest.approx(USABLE_HBM_GIB[chip] * GIB, rel=1e-3)
    # tpu7x: one TensorCore's (libtpu's rematerialisation trips on the program above there)
    device = dtensor.tpu_topology("tpu7x:2x2x1")[0]
    one = jax.sharding.SingleDeviceSharding(device)
    with pytest.raises(WillNotFitError) as err:
        dtensor.explain(
            jax.jit(lambda x: x + jnp.ones((200 * GIB // 4,), jnp.float32), out_shardings=one),
            jax.ShapeDtypeStruct((), jnp.float32, sharding=one),
            variables={},
        )
    assert err.value.available == pytest.approx(USABLE_HBM_GIB["tpu7x"] * GIB, rel=1e-3)
    # 15.9 GiB fits a v5e chip's 16 GiB but not the 15.75 GiB a program may use.
    near = MemoryFit("v5e", 16 * GIB, 1, 10 * GIB, 0, 0, int(5.9 * GIB), 0, None, int(15.75 * GIB))
    assert not near.fits and "15.8 GiB usable by a program" in str(near)
    assert MemoryFit("v5e", 16 * GIB, 1, 10 * GIB, 0, 0, int(5.9 * GIB), 0).fits


def test_padded_bytes_follows_tpu_tiles():
    class L:
        def __init__(self, order, tiling):
            self.major_to_minor, self.tiling = order, tiling

    assert padded_bytes((32,), np.float32, L((0,), ((128,),))) == 512
    assert padded_bytes((), np.int32, L((), ((128,),))) == 512
    # (32, 4, 8) stored heads-major: physical (4, 8, 32), tiles of (8, 128).
    assert padded_bytes((32, 4, 8), np.float32, L((1, 2, 0), ((8, 128),))) == 4 * 8 * 128 * 4
    assert padded_bytes((64, 1000), jnp.bfloat16, L((0, 1), ((8, 128), (2, 1)))) == 64 * 1024 * 2
    assert padded_bytes((3, 5), np.float32, None) == 60


# --------------------------------------------------- presets, compiled for TPU
@pytest.fixture(scope="module")
def abstract_block():
    return abstract_block_step(64)


@functools.cache
def _preset_report(topology: str, num_slices: int, name: str):
    """The preset and its explain of the block's step on the topology, compiled once a process:
    the per-preset test and the state-size test below read the same compiles (their
    ``tpu-presets`` group keeps them on one xdist worker)."""
    step, args = abstract_block_step(64)
    devices = dtensor.tpu_topology(topology, num_slices=num_slices)
    strategy = strategies.from_name(name, devices=devices)
    return strategy, strategy.explain(step, args=args)


def _argument_bytes(report) -> tuple[int, int]:
    """(state, batch) bytes per device: each input's shard, in the compiled TPU layout."""
    compiled = report.compiled
    avals = jax.tree.leaves(compiled.in_avals[0])
    formats = jax.tree.leaves(compiled.input_formats[0])
    n_state = len(jax.tree.leaves(compiled.in_avals[0][0]))
    sizes = []
    for aval, fmt in zip(avals, formats, strict=True):
        on_device = fmt.sharding.memory_kind in (None, "device")
        shard = fmt.sharding.shard_shape(aval.shape)
        sizes.append(padded_bytes(shard, aval.dtype, fmt.layout) if on_device else 0)
    return sum(sizes[:n_state]), sum(sizes[n_state:])


@pytest.mark.slow
@pytest.mark.xdist_group("tpu-presets")
@pytest.mark.parametrize(("topology", "num_slices"), TOPOLOGIES, ids=lambda v: str(v))
def test_every_preset_compiles_for_tpu(topology, num_slices):
    for name in strategies.PRESET_NAMES:
        strategy, report = _preset_report(topology, num_slices, name)
        assert report.mesh == repr(strategy.mesh)
        assert not [w for w in report.warnings if w.kind == "silent-replication"], name
        # The compiled arguments are exactly the variables over their shards, plus the batch.
        state, batch = _argument_bytes(report)
        assert report.argument_bytes_per_device == state + batch, name
        assert state >= report.state_bytes_per_device > 0
        fit = report.memory_fit
        assert fit is not None and fit.fits and fit.chip == topology.split(":")[0], name
        # One device a chip: v4 runs megacore, as on a Cloud TPU VM; tpu7x's two TensorCores
        # are two devices, its memory checked per TensorCore.
        assert fit.devices_per_chip == 1
        assert fit.unit == ("TensorCore" if topology.startswith("tpu7x") else "chip")
        assert report.ici_bytes_per_device is not None and report.dcn_bytes_per_device is not None
        assert report.ici_bytes_per_device + report.dcn_bytes_per_device == pytest.approx(
            report.comm_bytes_per_device
        )
        if num_slices == 1 or name == "one_device":
            assert report.dcn_bytes_per_device == 0, name
        else:
            assert report.dcn_bytes_per_device > 0, name


@pytest.mark.xdist_group("tpu-presets")
def test_sharded_state_is_smaller_per_chip():
    _, mirrored = _preset_report("v5e:4x4", 1, "mirrored")
    _, fsdp = _preset_report("v5e:4x4", 1, "fully_sharded")
    state_m, _ = _argument_bytes(mirrored)
    state_f, _ = _argument_bytes(fsdp)
    assert mirrored.state_bytes_per_device == sum(v.global_bytes for v in mirrored.variables)
    assert fsdp.state_bytes_per_device < mirrored.state_bytes_per_device / 4
    assert state_f < state_m


@pytest.mark.slow
def test_data_parallel_on_two_slices_crosses_dcn_once_per_step(abstract_block):
    step, args = abstract_block
    devices = dtensor.tpu_topology("v5e:4x4", num_slices=2)
    grad_bytes = sum(
        math.prod(v.shape) * np.dtype(v.dtype).itemsize
        for v in jax.tree.leaves(nnx.state(args[0], nnx.Param))
    )
    for name, dcn_axis in (("multi_worker_mirrored", "worker"), ("tpu", "replica")):
        strategy = strategies.from_name(name, devices=devices)
        # The replica axis spans the slices: slice 0 is its first half.
        slices = [d.slice_index for d in strategy.mesh.device_list]
        assert slices == [0] * 16 + [1] * 16
        report = strategy.explain(step, args=args)
        dcn = [c for c in report.collectives if c.network == "dcn"]
        assert dcn and {c.kind for c in dcn} == {"all-reduce"}, name
        assert {c.count for c in dcn} == {1} and {c.group_size for c in dcn} == {2}
        assert {c.mesh_axes for c in dcn} == {(dcn_axis,)}
        # Each gradient byte crosses DCN at most once (a 2-slice all-reduce sends what it reduces).
        assert 0 < report.dcn_bytes_per_device <= grad_bytes
        assert report.dcn_bytes_per_device == sum(c.total_bytes_per_device for c in dcn)
        assert all(c.network == "ici" for c in report.collectives if c not in dcn)
        assert "over DCN (between slices)" in str(report)

    # Sharding the variables over all 32 chips instead sends them across DCN, several times a step.
    report = strategies.from_name("fully_sharded", devices=devices).explain(step, args=args)
    kinds = {c.kind for c in report.collectives if c.network == "dcn"}
    assert "all-gather" in kinds


def test_too_large_for_hbm_under_mirrored_fits_fully_sharded():
    width, layers = 16384, 5  # 5 GiB of float32 weights, 15 GiB with Adam's moments
    step, (model, optimizer, batch) = deep_mlp_step(layers, width)
    devices = dtensor.tpu_topology("v5e:4x4")

    # The TPU compiler itself refuses the replicated program: it exceeds the chip's HBM.
    with pytest.raises(
        WillNotFitError,
        match=r"will not fit: the TPU compiler needs 1\d\.\d GiB .* but 15\.\d GiB of HBM",
    ) as err:
        strategies.MirroredStrategy(devices).explain(step, args=(model, optimizer, batch))
    assert err.value.required > err.value.available > 15 * GIB

    sharded = strategies.FullyShardedStrategy(devices).explain(step, args=(model, optimizer, batch))
    fit = sharded.memory_fit
    assert fit.fits and fit.argument_bytes < 1.1 * GIB  # 15 GiB of state over 16 chips
    assert str(fit).startswith("fits: ")
    assert sharded.state_bytes_per_device == pytest.approx(
        3 * layers * width * width * 4 / 16, rel=1e-3
    )


@pytest.mark.parametrize("gather_at_read", [True, False])
def test_tpu_fused_reduce_scatter_is_counted_as_one(gather_at_read):
    """libtpu emits FSDP's gradient reduce-scatter as an all-reduce + slice fusion; it moves
    (n-1)/n of the gradient, not an all-reduce's 2(n-1)/n."""
    layers, dim, batch = 2, 1024, 64
    devices = dtensor.tpu_topology("v5e:2x2")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(dim, dim, use_bias=False, rngs=rngs) for _ in range(layers)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    def step(model, opt, b):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(b["x"]) - b["y"]) ** 2))(model)
        opt.update(model, grads)
        return loss

    s = strategies.FullyShardedStrategy(devices, min_shard_bytes=0, gather_at_read=gather_at_read)
    model, opt = nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))(MLP(nnx.Rngs(0)))
    )
    xy = {k: jax.ShapeDtypeStruct((batch, dim), jnp.float32) for k in "xy"}
    report = s.explain(step, args=(model, opt, xy))
    kernel = dim * dim * 4
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
    # One per kernel gradient, each sending (n-1)/n of it (the padding libtpu adds aside).
    assert len(scatters) == layers
    for c in scatters:
        assert 0.75 * kernel <= c.total_bytes_per_device <= 0.75 * kernel * 1.15
    big_reduces = [
        c for c in report.collectives if c.kind == "all-reduce" and c.total_bytes_per_device > 1024
    ]
    assert big_reduces == []


def test_tpu_linen_functional_fsdp_step_reduce_scatters_its_gradients():
    """A Linen/optax (params, opt_state) step under FullyShardedStrategy on TPU: XLA's plan
    (the default there) reduce-scatters each kernel's gradient, as for an NNX step; with
    donate_argnums the old state is not kept beside the new one."""
    import flax.linen as nn

    layers, dim, batch = 2, 1024, 64
    devices = dtensor.tpu_topology("v5e:2x2")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(layers):
                x = jax.nn.relu(nn.Dense(dim, use_bias=False, name=f"l{i}")(x))
            return x

    model, tx = MLP(), optax.adam(1e-3)

    def step(params, opt_state, b):
        def loss(p):
            return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    s = strategies.FullyShardedStrategy(devices, min_shard_bytes=0)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, dim)))["params"])
    opt_state = s.distribute_variables(jax.eval_shape(tx.init, params))
    params = s.distribute_variables(params)
    xy = {k: jax.ShapeDtypeStruct((batch, dim), jnp.float32) for k in "xy"}
    kept = s.explain(step, args=(params, opt_state, xy))
    donated = s.explain(step, args=(params, opt_state, xy), donate_argnums=(0, 1))
    kernel = dim * dim * 4
    for report in (kept, donated):
        scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
        assert len(scatters) == layers
        assert all(c.dtype == "f32" and c.total_bytes_per_device >= 0.75 * kernel for c in scatters)
        assert not [
            c
            for c in report.collectives
            if c.kind == "all-reduce" and c.total_bytes_per_device > 1024
        ]
    state = 3 * layers * kernel // 4  # params + Adam's two moments, split over 4 chips
    # Donation aliases the whole old state to the new one, and the old state leaves the peak:
    # it falls by the state, give or take how the compiler schedules its temporaries around the
    # update (libtpu 0.0.42: by more than the 6.3 MB state; libtpu 0.0.50.1: by 6.1 MB, 97%).
    assert donated.alias_bytes_per_device >= state
    assert kept.peak_bytes_per_device - donated.peak_bytes_per_device >= 0.9 * state


def test_tpu_collectives_inside_scanned_layers_count_every_layer():
    """libtpu's optimised HLO drops a while loop's known_trip_count: the trip count comes from
    the loop condition, so the collectives of a decoder's layers in nnx.scan count once per
    layer (and pass), not once."""
    from dtensor.analysis.hlo_text import computations, multipliers
    from examples.decoder import CONFIGS, Block, Decoder, loss_fn

    devices = dtensor.tpu_topology("v5e:2x2")
    s = strategies.FullyShardedStrategy(
        devices, min_shard_bytes=0, mixed_precision=strategies.MixedPrecision(), remat=(Block,)
    )
    batch = {k: jax.ShapeDtypeStruct((8, 128), jnp.int32) for k in "xy"}

    def step(model, opt, b):
        loss, grads = nnx.value_and_grad(loss_fn)(model, b)
        opt.update(model, grads)
        return loss

    cfg = CONFIGS["small"].replace(scan=True)
    model, opt = nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adamw(1e-3), wrt=nnx.Param)))(
            Decoder(cfg, rngs=nnx.Rngs(0))
        )
    )
    report = s.explain(step, args=(model, opt, batch))
    text = report.compiled.as_text()
    assert "known_trip_count" not in text  # what the fallback is for
    comps, entry = computations(text)
    loops = [i for c in comps.values() for i in c if i.opcode == "while"]
    assert len(loops) >= 2  # forward and backward scans
    bodies = {re.search(r"body=%?([\w.\-]+)", i.rest).group(1) for i in loops}
    assert {multipliers(comps, entry)[b] for b in bodies} == {cfg.layers}
    # Every collective runs once per layer (inside a scanned loop) or once (outside).
    assert {c.count for c in report.collectives} == {1, cfg.layers}
    # Known answers, whatever the compiler release: every layer's bf16 weights are gathered in
    # the forward pass and again in the backward pass (remat), and the embedding for the lookup
    # and again for its gradient, a chain of libtpu's async collective fusions counted once:
    # 2 x (layers x one layer's weights + the rest) in bf16, up to what libtpu gathers a second
    # time or keeps: 1.041x on libtpu 0.0.42 (one query- and one key-shaped kernel gathered
    # again in each layer's backward pass), 0.9994x on 0.0.50 (it keeps 8 KiB of one pass's
    # gathered kernels for the other: 1.9988x the bf16 weights). Each piece of a chain counted,
    # they came to 3.1x this; counted once per program instead of once per layer, about 0.3x.
    params = nnx.state(model, nnx.Param)
    stacked = jax.tree.leaves(params["layers"])
    assert {x.shape[0] for x in stacked} == {cfg.layers}
    layer = 2 * sum(math.prod(x.shape[1:]) for x in stacked)
    rest = 2 * sum(
        math.prod(x.shape) for k, v in params.items() if k != "layers" for x in jax.tree.leaves(v)
    )
    assert rest > 0  # the embedding, the final norm
    gathers = [c for c in report.collectives if c.kind == "all-gather"]
    gathered = sum(array_bytes(c.dtype, c.shape) * c.count for c in gathers)
    in_loop = sum(array_bytes(c.dtype, c.shape) * c.count for c in gathers if c.count > 1)
    assert 0.99 <= gathered / (2 * (cfg.layers * layer + rest)) <= 1.1
    assert in_loop >= 0.99 * 2 * cfg.layers * layer
    # Every gradient is reduced somewhere (all-reduce, or reduce-scatter whose input is
    # group_size times its output).
    bf16_weights = 2 * sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    reduced = sum(
        array_bytes(c.dtype, c.shape)
        * c.count
        * (c.group_size if c.kind == "reduce-scatter" else 1)
        for c in report.collectives
        if c.kind in ("all-reduce", "reduce-scatter")
    )
    assert reduced >= bf16_weights
