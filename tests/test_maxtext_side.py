"""benchmarks.maxtext_side's pure parts: a compiled program's files read as explain reads ours.

Nothing here needs the MaxText venv or downloads anything: the "driver's files" are made
from a small step compiled for a TPU topology in this venv, and the results file is the
committed one.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import dtensor
from benchmarks import fsdp_tables, maxtext_side
from dtensor.analysis.floor import matmul_flops

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _driver_files(tmp_path: Path):
    """What the driver writes for a program (hlo.txt, compiled.json), for a small FSDP step
    on v5e:2x2, and explain's report of the same step."""
    mesh = dtensor.create_mesh([("fsdp", 4)], devices=dtensor.tpu_topology("v5e:2x2"))
    split = dtensor.Layout(["fsdp", None], mesh).sharding
    w = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=split)
    b = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16, sharding=split)

    def step(w, b):
        g = jax.grad(lambda w: ((b @ w).astype(jnp.float32) ** 2).mean())(w)
        return w - 0.1 * g.astype(w.dtype)

    report = dtensor.explain(step, w, b)
    compiled = report.compiled
    mem = compiled.memory_analysis()
    fields = ("argument", "output", "alias", "temp", "generated_code")
    record = {
        "memory": {f"{f}_size_in_bytes": int(getattr(mem, f"{f}_size_in_bytes")) for f in fields},
        "matmul_flops": matmul_flops(jax.make_jaxpr(step)(w, b)),
        "mesh_shape": [[a, s] for a, s in mesh.shape.items()],
        "slices": [int(getattr(d, "slice_index", 0)) for d in mesh.device_list],
        "device_kind": mesh.device_list[0].device_kind,
    }
    (tmp_path / "hlo.txt").write_text(compiled.as_text())
    (tmp_path / "compiled.json").write_text(json.dumps(record))
    return report, record


def test_a_compiled_program_is_read_as_explain_reads_it(tmp_path):
    report, record = _driver_files(tmp_path)
    figures = maxtext_side.analyse((tmp_path / "hlo.txt").read_text(), record, 6.0 * 2048**2 * 512)
    ours = report.step_floor
    assert figures["step_floor"] == ours.to_dict()
    assert figures["step_time_floor_seconds"] == report.step_time_floor_seconds
    assert figures["ici_bytes_per_device"] == pytest.approx(report.comm_bytes_per_device)
    assert figures["dcn_bytes_per_device"] == 0.0 and figures["devices"] == 4
    assert figures["mfu_ceiling"] == pytest.approx(
        report.with_model_flops(6.0 * 2048**2 * 512).mfu_ceiling
    )
    assert figures["mesh"] == {"fsdp": 4} and figures["async_repeat_bytes_per_device"] == 0.0
    mem = record["memory"]
    assert figures["peak_bytes_per_chip"] == (
        (report.peak_bytes_per_device or 0) + mem["generated_code_size_in_bytes"]
    )


def test_the_results_file_feeds_the_side_by_side_table():
    payload = json.loads((RESULTS / "maxtext_side.json").read_text())
    theirs = maxtext_side.by_row(payload)
    side = json.loads((RESULTS / "fsdp_scale.json").read_text())
    table = fsdp_tables.side_by_side(side, payload).splitlines()
    assert table[0].endswith("| MaxText's floor | MaxText's MFU ceiling |")
    assert set(fsdp_tables.MAXTEXT_GIB) <= set(theirs), "a side-by-side row lacks MaxText's floor"
    for (size, topology), r in theirs.items():
        if (size, topology) not in fsdp_tables.MAXTEXT_GIB:  # 405B: MaxText's side only
            continue
        # The table's MaxText peak is the measured one, and every line of the row shows its floor.
        assert r["peak_bytes_per_chip"] / (1 << 30) == pytest.approx(
            fsdp_tables.MAXTEXT_GIB[(size, topology)], abs=0.005
        ), (size, topology)
        floor = f"| {r['step_time_floor_seconds'] * 1e3:.0f} ms ({r['step_floor']['bound']}) |"
        lines = [line for line in table if line.startswith(f"| {size} | {topology} |")]
        assert lines and all(floor in line for line in lines), (size, topology)
        assert r["libtpu"] in ("0.0.50.1", "0.0.52") and r["maxtext"] == "0.2.5"
    # Without the file the columns say "not measured".
    assert fsdp_tables.side_by_side(side).splitlines()[2].endswith("| — | — |")


def test_rows_merge_in_table_order_and_keys_name_folders():
    a = {"size": "7b", "topology": "v5e:4x4"}
    b = {"size": "2b", "topology": "v5e:4x4"}
    merged = maxtext_side.merge(maxtext_side.merge({"rows": []}, a), b)
    assert [r["size"] for r in merged["rows"]] == ["2b", "7b"]
    assert len({maxtext_side.row_key(s, t) for s, t, _, _ in maxtext_side.ROWS}) == len(
        maxtext_side.ROWS
    )
