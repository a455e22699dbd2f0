"""The HBM roofline read from compiled TPU programs whose answer is known (libtpu, ahead of time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import SingleDeviceSharding

import dtensor
from dtensor.analysis.hardware import chip_of
from dtensor.analysis.roofline import hbm_roofline


def _compiled(fn, *shapes):
    device = dtensor.tpu_topology("v5p:2x2x1")[0]
    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=SingleDeviceSharding(device)) for s in shapes
    ]
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).compile().as_text()


def test_an_elementwise_pass_is_hbm_bound_at_its_bytes_over_bandwidth():
    chip = chip_of(dtensor.tpu_topology("v5p:2x2x1"))
    text = _compiled(lambda x: x * 2.0 + 1.0, (4096, 4096))
    r = hbm_roofline(text, chip.hbm_bytes_per_s, chip.peak_flops)
    assert r.bytes == 2 * 4096 * 4096 * 4  # read once, written once
    assert r.flops == 0 and r.seconds == pytest.approx(r.bytes / 2765e9)
    assert r.memory_seconds == r.seconds


def test_a_large_matmul_is_compute_bound_at_its_flops_over_peak():
    chip = chip_of(dtensor.tpu_topology("v5p:2x2x1"))
    n = 4096
    text = _compiled(lambda a, b: a @ b, (n, n), (n, n))
    r = hbm_roofline(text, chip.hbm_bytes_per_s, chip.peak_flops)
    assert r.flops == 2 * n**3
    assert r.seconds >= 2 * n**3 / chip.peak_flops
    assert r.bytes >= 3 * n * n * 4  # both operands read, the output written


def test_a_scanned_stack_is_read_one_layer_slice_an_iteration():
    """A loop over the 16 layers of a stacked weight: each iteration's kernels read that
    layer's slice, not the whole stack, so the stack's bytes count once a step."""
    chip = chip_of(dtensor.tpu_topology("v5p:2x2x1"))
    layers, d = 16, 512

    def run(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0]

    text = _compiled(run, (layers, d, d), (8, d))
    r = hbm_roofline(text, chip.hbm_bytes_per_s, chip.peak_flops)
    stack = layers * d * d * 4
    # libtpu casts the float32 stack to bfloat16 once ahead of the loop (read, half written),
    # and each iteration reads its bfloat16 layer: twice the stack, plus the activations
    # (8 x 512 float32, a few copies an iteration: 0.8 MB)
    assert r.bytes == pytest.approx(2 * stack, rel=0.05)
    assert r.flops == layers * 2 * 8 * d * d


def test_explain_reports_the_roofline_beside_the_floor():
    devices = dtensor.tpu_topology("v5p:2x2x1")
    mesh = dtensor.create_mesh([("data", 4)], devices=devices)
    layout = dtensor.Layout.batch_sharded(mesh, "data", 2)
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=layout.sharding)
    report = dtensor.explain(lambda v, x: x * 2.0 + 1.0, {}, x, variables={})
    floor = report.step_floor
    assert floor.hbm_bytes == 2 * 4096 * 4096 * 4 / 4  # each chip's quarter
    assert floor.hbm_seconds == pytest.approx(floor.hbm_bytes / 2765e9)
    assert floor.seconds == floor.compute_seconds == 0.0  # not in the floor yet
    assert np.isfinite(floor.hbm_seconds)


def test_floors_stay_below_the_steps_measured_on_tpus_and_the_guide_shows_them():
    """benchmarks/results/measured_steps.json (compiled ahead of time beside steps measured on
    real TPUs): every floor below its measured step, and the large-models guide's table is
    ``benchmarks.measured_steps --markdown`` of it."""
    import json
    from pathlib import Path

    from benchmarks import measured_steps

    root = Path(__file__).resolve().parents[1]
    rows = json.loads((root / "benchmarks" / "results" / "measured_steps.json").read_text())["rows"]
    assert rows and {r["size"] for r in rows} >= {"llama3.1-70b"}
    for r in rows:
        assert r["floor_ms"] / 1e3 < r["measured_s"], r
        assert r["measured_over_floor"] == pytest.approx(
            r["measured_s"] / (r["floor_ms"] / 1e3), rel=1e-3
        )
        assert r["hbm_roofline_ms"] / 1e3 < r["measured_s"], r
    guide = (root / "docs" / "guides" / "large_models.md").read_text()
    assert " ".join(measured_steps.markdown(rows).split()) in " ".join(guide.split())
