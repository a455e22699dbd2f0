"""NVIDIA GPU topologies from XLA's GPU compiler: devices, meshes, presets compiled ahead of time."""

from __future__ import annotations

import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import dtensor
import strategies
from dtensor.analysis.memory import MemoryFit
from dtensor.gpu import topology as gpu_topology_module
from dtensor.gpu.specs import GPUS, gpu_spec, memory_fraction
from dtensor.gpu.topology import GPU_MODELS, GpuTopologyError, parse_gpu_topology, target_config
from dtensor.tpu import aot
from tests.models import abstract_block_step, deep_mlp_step, make_train_step
from tests.test_aot import DEMO

GIB = 1 << 30
# One host, two hosts, two slices of two hosts.
TOPOLOGIES = ["h100:1x8", "h100:2x8", "h100:2x2x8"]


# ----------------------------------------------------------------- topologies
def test_gpu_topology_devices():
    devices = dtensor.gpu_topology("h100:2x8")
    assert len(devices) == 16
    assert {d.platform for d in devices} == {"gpu"}
    assert {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    assert [d.process_index for d in devices] == [0] * 8 + [1] * 8  # one process per host
    assert dtensor.gpu_topology("h100", hosts=2) == devices  # the same objects each time
    assert gpu_spec(devices) is GPUS["h100"]

    two = dtensor.gpu_topology("h100:2x2x8")
    assert len(two) == 32 and len({d.process_index for d in two}) == 4
    # coords are (slice, host in slice, GPU in host).
    assert [tuple(d.coords) for d in two[::8]] == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert dtensor.gpu_topology("h100", hosts=2, slices=2) == two

    for model, kind in (
        ("h200", "NVIDIA H200"),
        ("a100-80gb", "NVIDIA A100-SXM4-80GB"),
        ("b200", "NVIDIA B200"),
    ):
        got = dtensor.gpu_topology(model)
        assert len(got) == 8 and got[0].device_kind == kind and gpu_spec(got).name == model
    assert gpu_spec(jax.devices()) is None and gpu_spec([]) is None


def test_parse_and_errors():
    assert parse_gpu_topology("H100:1x4") == ("h100", 1, 1, 4)
    assert parse_gpu_topology("a100-80gb", hosts=8, slices=2) == ("a100-80gb", 2, 8, 8)
    with pytest.raises(GpuTopologyError, match=r"no GPU model 'v100'; known models: h100, h200"):
        dtensor.gpu_topology("v100:1x8")
    with pytest.raises(GpuTopologyError, match=r"must be HOSTSxGPUS .* got '2x'"):
        dtensor.gpu_topology("h100:2x")
    with pytest.raises(GpuTopologyError, match=r"16 GPUs per host, but a h100 host has at most 8"):
        dtensor.gpu_topology("h100:1x16")
    with pytest.raises(GpuTopologyError, match=r"give the sizes either in the name or as hosts="):
        dtensor.gpu_topology("h100:2x8", hosts=2)
    with pytest.raises(GpuTopologyError, match=r"hosts=0\): hosts must be a positive integer"):
        dtensor.gpu_topology("h100", hosts=0)
    with pytest.raises(GpuTopologyError, match=r"name=None\): the name must be a string"):
        dtensor.gpu_topology(None)  # type: ignore[arg-type]
    with pytest.raises(GpuTopologyError, match=r"'p100' has no target config; known models"):
        target_config("p100")


def test_missing_plugin_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "jax_plugins.xla_cuda12" else real(name, *a),
    )
    with pytest.raises(
        RuntimeError,
        match=r"needs JAX's CUDA plugin .* pip install -e '\.\[gpu-aot\]' in this project",
    ):
        dtensor.gpu_topology("h100:3x8")  # a size not cached yet


def test_target_configs_are_cited_data():
    from importlib.metadata import version

    cudnn = tuple(int(p) for p in version("nvidia-cudnn-cu12").split(".")[:2])
    for model in GPU_MODELS:
        text = target_config(model)
        block = text[text.index("gpu_device_info {") : text.index("}\ndevice_description_str")]
        fields = [
            ln for ln in block.splitlines()[1:] if ln.strip() and not ln.strip().startswith("#")
        ]
        assert fields and all("#" in ln for ln in fields), model  # every number has its source
        memory = int(re.search(r"device_memory_size: (\d+)", text).group(1))
        assert memory == GPUS[model].hbm_bytes
        assert f'device_description_str: "{GPUS[model].device_kind}"' in text
        assert f"dnn_version_info {{ major: {cudnn[0]} minor: {cudnn[1]}" in text


def test_deviceless_env_is_set_only_while_the_plugin_loads(monkeypatch):
    monkeypatch.delenv("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", raising=False)
    seen = []
    with gpu_topology_module._deviceless():
        seen.append(__import__("os").environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"))
    assert seen == [None if gpu_topology_module._has_gpu() else "1"]
    assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in __import__("os").environ
    # A machine with GPUs keeps the plugin's checks.
    monkeypatch.setattr(gpu_topology_module, "_has_gpu", lambda: True)
    with gpu_topology_module._deviceless():
        assert "JAX_SKIP_CUDA_CONSTRAINTS_CHECK" not in __import__("os").environ


# ------------------------------------------------------------ memory verdict
def test_gpu_memory_limit_is_jax_allocator_pool(monkeypatch):
    assert memory_fraction() == 0.75
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert memory_fraction() == 0.9
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")
    assert memory_fraction() == 0.5
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "nonsense")
    assert memory_fraction() == 0.75
    fit = MemoryFit("h100", 80 * GIB, 1, 50 * GIB, 0, 0, 15 * GIB, 0, None, 60 * GIB, "GPU")
    assert not fit.fits and str(fit).startswith("will not fit: needs 65.0 GiB per h100 GPU")
    assert "a h100 GPU has 80.0 GiB of HBM, 60.0 GiB usable by a program" in str(fit)


@pytest.mark.slow
def test_too_large_for_a_gpu_under_mirrored_fits_fully_sharded():
    step, args = deep_mlp_step(20)  # 20 GiB of float32 weights, 60 with Adam's moments
    devices = dtensor.gpu_topology("h100:1x8")
    mirrored = strategies.MirroredStrategy(devices).explain(step, args=args)
    fit = mirrored.memory_fit
    assert fit.unit == "GPU" and fit.chip == "h100" and not fit.fits
    assert fit.limit_bytes_per_chip == int(0.75 * 80 * GIB) and fit.argument_bytes > 60 * GIB
    assert "will not fit" in str(fit) and "FullyShardedStrategy" in str(fit)
    sharded = strategies.FullyShardedStrategy(devices).explain(step, args=args)
    assert sharded.memory_fit.fits and sharded.memory_fit.argument_bytes < 8 * GIB


# --------------------------------------------------- presets, compiled for GPU
@pytest.fixture(scope="module")
def abstract_block():
    return abstract_block_step(64)


@pytest.mark.slow
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_every_preset_compiles_for_gpu(abstract_block, topology):
    step, args = abstract_block
    devices = dtensor.gpu_topology(topology)
    hosts = len({d.process_index for d in devices})
    for name in strategies.PRESET_NAMES:
        strategy = strategies.from_name(name, devices=devices)
        report = strategy.explain(step, args=args)
        assert report.mesh == repr(strategy.mesh)
        assert not [w for w in report.warnings if w.kind == "silent-replication"], name
        assert report.argument_bytes_per_device >= report.state_bytes_per_device > 0, name
        fit = report.memory_fit
        assert fit is not None and fit.fits and fit.chip == "h100" and fit.unit == "GPU", name
        assert report.ici_bytes_per_device is None and report.dcn_bytes_per_device is None
        nvlink, ib = report.nvlink_bytes_per_device, report.ib_bytes_per_device
        assert nvlink + ib == pytest.approx(report.comm_bytes_per_device), name
        assert {c.network for c in report.collectives} <= {"nvlink", "ib"}, name
        if name == "one_device":
            assert report.comm_bytes_per_device == 0
        elif hosts == 1:
            assert ib == 0 and nvlink > 0, name
        else:
            assert ib > 0, name


@pytest.mark.slow
def test_data_parallel_over_two_hosts_crosses_the_network_in_one_all_reduce(abstract_block):
    step, args = abstract_block
    devices = dtensor.gpu_topology("h100:2x8")
    report = strategies.from_name("multi_worker_mirrored", devices=devices).explain(step, args=args)
    ib = [c for c in report.collectives if c.network == "ib"]
    assert ib and {c.kind for c in ib} == {"all-reduce"} and {c.group_size for c in ib} == {16}
    assert "over InfiniBand/RoCE (between hosts)" in str(report)
    # Tensor parallelism inside a host (4 of its 8 GPUs), data parallelism across: the
    # tensor-axis collectives never leave a host.
    tp = strategies.TensorParallelStrategy(4, devices=devices)
    report = tp.explain(step, args=args)
    assert {c.network for c in report.collectives if c.mesh_axes == ("tensor",)} == {"nvlink"}
    assert report.nvlink_bytes_per_device > 0


# ------------------------------------------------------------------- the CLI
def test_cli_prints_a_gpu_verdict(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = aot.main(
        [
            "--topology",
            "h100:2x8",
            "--strategy",
            "multi_worker_mirrored",
            "--json",
            str(out),
            "--",
            DEMO,
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for needle in (
        "h100:2x8 (2 hosts of 8) = 16 NVIDIA H100 80GB HBM3 devices",
        "compiled by XLA:GPU",
        "memory per GPU",
        "HBM of a h100 GPU",
        "usable by one program (JAX's allocator, 75%)",
        "IB/RoCE",
        "OK fits:",
    ):
        assert needle in text, needle
    got = json.loads(out.read_text())
    assert got["device_kind"] == "NVIDIA H100 80GB HBM3" and got["devices"] == 16
    report = got["report"]
    assert report["memory_fit"]["unit"] == "GPU" and report["memory_fit"]["fits"] is True
    assert report["ib_bytes_per_device"] > 0 and report["dcn_bytes_per_device"] is None
    assert aot.main(["--topology", "h100:2x2x8", "--num-slices", "2", "--", DEMO]) == 2
    assert "already names 2 slices; drop --num-slices 2" in capsys.readouterr().err
    assert aot.main(["--topology", "h100:1x9", "--", DEMO]) == 2
    assert "9 GPUs per host, but a h100 host has at most 8" in capsys.readouterr().err


@pytest.mark.parametrize("gather_at_read", [True, False])
def test_gpu_fsdp_gradients_are_reduce_scattered(gather_at_read):
    """XLA:GPU emits reduce-scatter as a reduce-scatter-start/-done pair (one per kernel
    gradient, combined in a tuple): each counts, sending (n-1)/n of the gradient; the
    default plan on GPU (XLA's) reduce-scatters as the gather-at-read plan does."""
    layers, dim, batch = 2, 1024, 64
    devices = dtensor.gpu_topology("h100:1x8")

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.Linear(dim, dim, use_bias=False, rngs=rngs) for _ in range(layers)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = jax.nn.relu(layer(x))
            return x

    s = strategies.FullyShardedStrategy(devices, min_shard_bytes=0, gather_at_read=gather_at_read)
    assert strategies.FullyShardedStrategy(devices).gather_at_read is False  # XLA's plan on GPU
    model, opt = nnx.eval_shape(
        lambda: (lambda m: (m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)))(MLP(nnx.Rngs(0)))
    )
    xy = {k: jax.ShapeDtypeStruct((batch, dim), jnp.float32) for k in "xy"}
    step = make_train_step(lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2))
    report = s.explain(step, args=(model, opt, xy))
    scatters = [c for c in report.collectives if c.kind == "reduce-scatter"]
    assert len(scatters) == layers and {c.network for c in scatters} == {"nvlink"}
    for c in scatters:
        assert c.total_bytes_per_device == pytest.approx(7 / 8 * dim * dim * 4)
    assert not [
        c for c in report.collectives if c.kind == "all-reduce" and c.total_bytes_per_device > 1024
    ]


def test_gpu_presets_benchmark_results():
    """benchmarks/gpu_presets.py: every preset on h100:2x8 in the results file, each within
    what a program may use and crossing hosts; a size examples/train.py lacks is recorded."""
    from pathlib import Path

    import strategies as s
    from benchmarks import gpu_presets

    got = json.loads(
        (Path(__file__).parents[1] / "benchmarks/results/gpu_presets.json").read_text()
    )
    rows = {r["strategy"]: r for r in got["rows"]}
    assert got["topology"] == "h100:2x8" and set(rows) == set(s.PRESET_NAMES)
    for name, r in rows.items():
        assert r["fits"] and r["usable_bytes_per_gpu"] == int(0.75 * 80 * GIB), name
        if name != "one_device":
            assert r["ib_bytes_per_gpu"] > 0, name
    row = gpu_presets.large_row("no-such-size", "h100:8x8", "bf16 + remat", 64, 1024)
    assert row["error"] == "examples/train.py has no --model-size no-such-size yet"


def test_a_gpu_presets_row_computed_live_is_the_committed_one():
    """One gpu_presets.json row compiled now by the benchmark's own function (mirrored, the
    cheapest preset that crosses hosts): at least its minimum, and the committed figures."""
    from pathlib import Path

    from benchmarks import gpu_presets

    got = json.loads(
        (Path(__file__).parents[1] / "benchmarks/results/gpu_presets.json").read_text()
    )
    committed = next(r for r in got["rows"] if r["strategy"] == "mirrored")
    (live,) = gpu_presets.presets(
        got["topology"], got["model_size"], got["global_batch"], names=["mirrored"]
    )
    assert live["min_comm_bytes_per_gpu"] > 0
    assert live["comm_bytes_per_gpu"] / live["min_comm_bytes_per_gpu"] >= 1
    assert live["ib_bytes_per_gpu"] > 0  # two hosts: the all-reduce crosses the network
    for key in (
        "mesh",
        "comm_bytes_per_gpu",
        "min_comm_bytes_per_gpu",
        "nvlink_bytes_per_gpu",
        "ib_bytes_per_gpu",
        "comm_by_kind",
        "state_bytes_per_gpu",
        "fits",
    ):
        assert live[key] == committed[key], key
