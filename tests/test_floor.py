"""The step-time floor, the MFU ceiling, the chip table and the per-matmul minimum."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import dtensor
from dtensor.analysis import memory
from dtensor.analysis.floor import between_hosts_bytes, matmul_flops, step_floor
from dtensor.analysis.hardware import CHIPS, USABLE_HBM_GIB, chip_of
from dtensor.analysis.minimum import REFERENCE_NAMES, matmul_reference

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_one_chip_table_feeds_the_memory_verdict():
    assert memory.USABLE_HBM_GIB is USABLE_HBM_GIB
    # tpu7x: one TensorCore's (half a chip's 192 GB): its two TensorCores are two devices
    assert memory.CHIP_HBM_GIB == {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "tpu7x": 96}
    chip = chip_of(dtensor.tpu_topology("v5p:2x2x2"))
    assert chip is CHIPS["TPU v5"] and chip.peak_flops == 459e12
    assert chip.ici_bytes_per_s == 600e9 and chip.dcn_bytes_per_s == 50e9 / 8
    assert chip_of(jax.devices()) is None and chip_of([]) is None


def test_matmul_flops_count_every_scan_iteration_as_unrolled():
    w = jnp.zeros((6, 32, 32))
    x = jnp.zeros((4, 32))

    def scanned(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    def unrolled(w, x):
        for i in range(6):
            x = jnp.tanh(x @ w[i])
        return x.sum()

    for f in (scanned, unrolled):
        # forward 6 x (2*4*32*32); backward dX and dW, each as many
        assert matmul_flops(jax.make_jaxpr(jax.grad(f, (0, 1)))(w, x)) == 3 * 6 * 2 * 4 * 32 * 32
    remat = jax.checkpoint(lambda wi, h: jnp.tanh(h @ wi))

    def rematted(w, x):
        return jax.lax.scan(lambda h, wi: (remat(wi, h), None), x, w)[0].sum()

    # the recomputed forward matmul of each layer is counted too
    assert matmul_flops(jax.make_jaxpr(jax.grad(rematted, (0, 1)))(w, x)) == 4 * 6 * 2 * 4 * 32 * 32


def test_matmul_flops_count_shard_map_bodies_per_device_and_pallas_kernels_per_grid_step():
    """MaxText's splash attention: a Pallas kernel (one block's matmuls) inside a shard_map
    (one device's share); both count as the whole program's matmuls."""
    from jax.experimental import pallas as pl
    from jax.sharding import PartitionSpec as P

    x, w = jnp.zeros((16, 8)), jnp.zeros((8, 4))
    whole = 2 * 16 * 4 * 8
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    local = jax.shard_map(
        lambda x, w: x @ w, mesh=mesh, in_specs=(P("a"), P()), out_specs=P("a"), axis_names={"a"}
    )
    assert matmul_flops(jax.make_jaxpr(local)(x, w)) == whole

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = x_ref[...] @ w_ref[...]

    blocks = pl.pallas_call(
        kernel,
        grid=(4,),
        in_specs=[pl.BlockSpec((4, 8), lambda i: (i, 0)), pl.BlockSpec((8, 4), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((4, 4), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((16, 4), jnp.float32),
        interpret=True,
    )
    assert matmul_flops(jax.make_jaxpr(blocks)(x, w)) == whole


def test_tpu_report_has_a_floor_and_an_mfu_ceiling():
    devices = dtensor.tpu_topology("v5e:2x2")
    mesh = dtensor.create_mesh([("x", 4)], devices=devices)
    w = jax.ShapeDtypeStruct(
        (2048, 2048), jnp.bfloat16, sharding=dtensor.Layout(["x", None], mesh).sharding
    )
    b = jax.ShapeDtypeStruct(
        (512, 2048), jnp.bfloat16, sharding=dtensor.Layout(["x", None], mesh).sharding
    )

    def step(w, b):
        g = jax.grad(lambda w: ((b @ w).astype(jnp.float32) ** 2).mean())(w)
        return w - 0.1 * g.astype(w.dtype)

    report = dtensor.explain(step, w, b)
    floor = report.step_floor
    # The step's matmuls, from the shapes: the forward b @ w, (512, 2048) x (2048, 2048),
    # and dW = b.T @ dy, (2048, 512) x (512, 2048); 2 FLOPs per multiply-add. b is not
    # differentiated, so there is no dX matmul: exactly 2 matmuls, split over 4 chips.
    forward = 2 * 512 * 2048 * 2048
    d_w = 2 * 2048 * 2048 * 512
    assert floor.chip == "v5e" and floor.devices == 4
    assert floor.flops_per_device == (forward + d_w) / 4
    assert floor.compute_seconds == pytest.approx(floor.flops_per_device / 197e12)
    assert floor.ici_seconds == pytest.approx(report.comm_bytes_per_device / 200e9)
    assert report.step_time_floor_seconds == max(floor.compute_seconds, floor.ici_seconds)
    assert report.mfu_ceiling is None
    model = 6 * 2048 * 2048 * 512
    ceiling = report.with_model_flops(model).mfu_ceiling
    assert ceiling == pytest.approx(model / (4 * 197e12 * report.step_time_floor_seconds))
    assert 0 < ceiling <= 1
    d = report.with_model_flops(model).to_dict()
    assert d["mfu_ceiling"] == ceiling and d["step_floor"]["bound"] in ("compute", "ICI")
    assert "step-time floor" in str(report)
    cpu = dtensor.explain(step, *_on_cpu(w, b))
    assert cpu.step_floor is None and cpu.step_time_floor_seconds is None


def test_gpu_report_has_a_floor_over_nvlink_and_the_network_between_hosts():
    devices = dtensor.gpu_topology("h100:2x8")
    chip = chip_of(devices)
    assert chip.generation == "h100" and chip.peak_flops == 989e12 and chip.hbm_gib == 80
    assert chip.ici_bytes_per_s == 450e9 and chip.dcn_bytes_per_s == 50e9
    assert chip.networks == ("NVLink", "IB") and CHIPS["TPU v5"].networks == ("ICI", "DCN")
    mesh = dtensor.create_mesh([("x", 16)], devices=devices)
    lay = dtensor.Layout(["x", None], mesh).sharding
    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=lay)
    b = jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16, sharding=lay)

    def step(w, b):
        g = jax.grad(lambda w: ((b @ w).astype(jnp.float32) ** 2).mean())(w)
        return w - 0.1 * g.astype(w.dtype)

    report = dtensor.explain(step, w, b)
    floor = report.step_floor
    assert floor.chip == "h100" and floor.devices == 16 and floor.networks == ("NVLink", "IB")
    assert floor.compute_seconds == pytest.approx(floor.flops_per_device / 989e12)
    # The mesh spans both hosts: its collectives cross the network between them, where each
    # host takes in at least half of the data over its 8 NICs: 1/2 / (15/16) / 8 of the
    # ring bytes.
    ib = [c for c in report.collectives if c.network == "ib"]
    assert ib and report.ib_bytes_per_device > 0
    assert floor.ici_seconds == pytest.approx(report.nvlink_bytes_per_device / 450e9)
    between = sum(between_hosts_bytes(c, mesh) for c in ib)
    assert between == pytest.approx(report.ib_bytes_per_device * 0.5 / (15 / 16) / 8)
    assert floor.dcn_seconds == pytest.approx(between / 50e9)
    assert floor.bound in ("compute", "NVLink", "IB") and "ICI" not in str(report)
    assert f"step-time floor ({floor.bound}-bound)" in str(report)


def test_between_hosts_bytes_by_group_shape():
    from dtensor.analysis.collective import Collective

    devices = dtensor.gpu_topology("h100:2x8")
    # data across the two hosts (1 GPU of each group per host), tensor inside a host
    mesh = dtensor.create_mesh([("data", 2), ("tensor", 8)], devices=devices)

    def one(kind, axes, n, ring):
        return between_hosts_bytes(Collective(kind, axes, "f32", (1,), n, ring, count=3), mesh)

    assert one("all-reduce", ("data",), 2, 1000.0) == 3 * 1000.0  # h = n = 2, g = 1
    assert one("all-reduce", ("tensor",), 8, 1000.0) == 0.0  # inside a host
    assert one("all-to-all", ("data", "tensor"), 16, 1500.0) == pytest.approx(3 * 800.0)
    assert one("all-gather", ("data", "tensor"), 16, 1500.0) == pytest.approx(3 * 100.0)


def _on_cpu(*structs):
    mesh = dtensor.create_mesh([("x", 4)], devices=jax.devices()[:4])
    lay = dtensor.Layout(["x", None], mesh).sharding
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=lay) for s in structs]


def test_step_floor_takes_the_larger_and_knows_no_dcn_for_v4():
    f = step_floor(0.0, 3e9, 0.0, CHIPS["TPU v4"], devices=8)
    assert f.seconds == 0.01 and f.bound == "ICI" and f.dcn_seconds is None
    g = step_floor(0.0, 0.0, 25e6, CHIPS["TPU v5 lite"])
    assert g.bound == "DCN" and g.seconds == pytest.approx(0.008)


def test_the_minimum_takes_moving_activations_where_cheaper():
    # A 4 MiB weight split 8 ways read by a small batch: moving the batch-split activations
    # (an all-to-all of each device's share) is far cheaper than gathering the weight.
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    x = jax.ShapeDtypeStruct((64, 1024), jnp.float32)
    j = jax.make_jaxpr(jax.grad(lambda w, x: ((x @ w) ** 2).sum()))(w, x)
    # forward x @ w only (dW reads no weight): 7/8 * |x| / 8
    assert matmul_reference(j, {0: 8}, 8) == pytest.approx(7 / 8 * 64 * 1024 * 4 / 8)
    # a huge batch: gathering the weight is the cheaper, (k-1)/k * |w|
    big = jax.ShapeDtypeStruct((1 << 16, 1024), jnp.float32)
    j2 = jax.make_jaxpr(lambda w, x: x @ w)(w, big)
    assert matmul_reference(j2, {0: 8}, 8) == pytest.approx(7 / 8 * 1024 * 1024 * 4)
    assert matmul_reference(j2, {}, 8) == 0.0

    s = dtensor.create_mesh([("x", 8)])
    ws = jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=dtensor.Layout(["x", None], s).sharding)
    xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dtensor.Layout(["x", None], s).sharding)
    report = dtensor.explain(jax.grad(lambda w, x: ((x @ w) ** 2).sum()), ws, xs)
    refs = report.min_comm_references
    assert list(refs) == list(REFERENCE_NAMES)
    assert refs[REFERENCE_NAMES[0]] == 3 * 7 / 8 * 1024 * 1024 * 4
    assert report.min_comm_bytes_per_device == min(refs.values()) < refs[REFERENCE_NAMES[0]]
    assert report.comm_ratio >= 1


def _first(row, key):
    """``key`` per device, per chip or per GPU (the benchmarks name their units)."""
    return next((row[k] for k in (f"{key}_device", f"{key}_chip", f"{key}_gpu") if k in row), None)


def _ratios(payload):
    # gpu_presets.json keeps its large-model rows apart from the presets' ("large")
    rows = [*(payload.get("rows") or payload.get("results") or []), *payload.get("large", [])]
    for row in rows:
        comm = _first(row, "comm_bytes_per")
        low = _first(row, "min_comm_bytes_per")
        if comm is None or low is None or (comm == 0 and low == 0):
            continue
        yield row, (math.inf if low == 0 else comm / low)


@pytest.mark.parametrize(
    "name", ["comm_memory", "fsdp_scale", "tpu_presets", "gpu_presets", "fsdp_scale_gpu"]
)
def test_every_benchmark_row_communicates_at_least_its_minimum(name):
    payload = json.loads((RESULTS / f"{name}.json").read_text())
    ratios = list(_ratios(payload))
    assert ratios
    low = [(r.get("size") or r.get("preset") or r.get("strategy"), x) for r, x in ratios if x < 1]
    assert not low, f"{name}: rows below their minimum: {low}"


def test_a_benchmark_row_computed_live_communicates_at_least_its_minimum():
    """One comm_memory row (the MLP under tensor_parallel, its minimum within a few bytes of
    what it sends) compiled now by the benchmark's own function: held to comm/min >= 1 and
    to the committed row, so the check above is not only about a file."""
    import argparse

    from benchmarks import comm_memory

    payload = json.loads((RESULTS / "comm_memory.json").read_text())
    settings = payload["settings"]
    assert settings["devices"] == jax.device_count()
    committed = next(
        r for r in payload["results"] if (r["preset"], r["model"]) == ("tensor_parallel", "mlp")
    )
    args = argparse.Namespace(
        features=settings["features"], hidden=settings["hidden"], batch=settings["batch"]
    )
    live = comm_memory.measure("tensor_parallel", "mlp", args)
    assert live["min_comm_bytes_per_device"] > 0
    assert live["comm_bytes_per_device"] / live["min_comm_bytes_per_device"] >= 1
    for key in ("comm_bytes_per_device", "min_comm_bytes_per_device", "by_kind"):
        assert live[key] == committed[key], key


def test_megablox_grouped_matmuls_count_their_data_dependent_row_tiles():
    """MaxText's dropless MoE runs megablox's gmm/tgmm, whose grid has a run-time row-tile
    count: a grid step's matmul times the static grid alone is a quarter of the work at 4
    row tiles. Every row meets one expert's k x n block: 2 m k n, forward and transposed."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm, tgmm

    from dtensor.analysis.floor import uncounted_kernels

    m, k, n, g = 512, 256, 384, 4
    lhs = jnp.zeros((m, k), jnp.bfloat16)
    sizes = jnp.asarray([64, 192, 128, 128], jnp.int32)  # uneven groups: the same work
    fwd = jax.make_jaxpr(lambda a, b, s: gmm(a, b, s, tiling=(128, 128, 128)))(
        lhs, jnp.zeros((g, k, n), jnp.bfloat16), sizes
    )
    grad = jax.make_jaxpr(lambda a, b, s: tgmm(a.T, b, s, tiling=(128, 128, 128)))(
        lhs, jnp.zeros((m, n), jnp.bfloat16), sizes
    )
    assert matmul_flops(fwd) == matmul_flops(grad) == 2.0 * m * k * n
    assert uncounted_kernels(fwd) == [] and uncounted_kernels(grad) == []
    # The same sizes through jax.lax.ragged_dot (our MoE's grouped matmul) agree.
    ragged = jax.make_jaxpr(jax.lax.ragged_dot)(lhs, jnp.zeros((g, k, n), jnp.bfloat16), sizes)
    assert matmul_flops(ragged) == 2.0 * m * k * n
