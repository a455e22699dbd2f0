"""Smoke test: each benchmark script runs with tiny settings and writes valid JSON."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

from benchmarks import comm_memory, overhead, peers, plot

TINY = ["--features=16", "--hidden=64", "--batch=16"]


@pytest.mark.slow
def test_benchmarks_write_json_and_a_plot(tmp_path):
    comm_memory.main([*TINY, "--presets=mirrored,fully_sharded", "--out", str(tmp_path)])
    overhead.main(
        [
            *TINY,
            "--presets=one_device,fully_sharded",
            "--rounds=2",
            "--steps=2",
            "--out",
            str(tmp_path),
        ]
    )
    peers.main([*TINY, "--rounds=1", "--steps=2", "--out", str(tmp_path)])

    comm = json.loads((tmp_path / "comm_memory.json").read_text())
    assert comm["benchmark"] == "comm_memory"
    by = {(r["preset"], r["model"]): r for r in comm["results"]}
    assert set(by) == {
        (p, m) for p in ("mirrored", "fully_sharded") for m in ("mlp", "transformer")
    }
    # The minimum is a lower bound (per matmul, the cheaper of gathering the weight or moving
    # its activations); against the ZeRO reference alone, FSDP's gathers at reads move about
    # what gathering every weight costs.
    assert by["fully_sharded", "transformer"]["comm_ratio"] >= 1
    assert by["fully_sharded", "transformer"]["zero_ratio"] <= 1.05
    assert by["mirrored", "mlp"]["comm_ratio"] <= 1.02
    assert "reduce-scatter" in by["fully_sharded", "mlp"]["by_kind"]

    over = json.loads((tmp_path / "overhead.json").read_text())
    assert [r["preset"] for r in over["results"]] == ["one_device", "fully_sharded"]
    for r in over["results"]:
        assert len(r["ratios"]) == 2  # one ratio per round
        assert all(math.isfinite(x) and x > 0 for x in r["ratios"] + r["cached_ratios"])
        assert r["ratio"] == {
            "min": min(r["ratios"]),
            "median": statistics.median(r["ratios"]),
            "max": max(r["ratios"]),
        }

    peer = {r["peer"]: r for r in json.loads((tmp_path / "peers.json").read_text())["results"]}
    ours, raw = peer["mirrored_strategy_run"], peer["raw_jax_jit"]
    for r in (ours, raw):
        ms = r["ms_per_step"]
        assert r["status"] == "ok" and 0 < ms["min"] <= ms["median"] <= ms["max"]
    # The ratio is the two medians' quotient (no timing bound: speed lives in benchmarks/).
    assert ours["ratio_to_raw_jit"] == pytest.approx(
        ours["ms_per_step"]["median"] / raw["ms_per_step"]["median"]
    )
    for name, module in (
        ("keras_data_parallel_jax", "keras"),
        ("tf_mirrored_strategy", "tensorflow"),
    ):
        installed = importlib.util.find_spec(module) is not None
        # A peer that is installed must run: "failed" is a broken benchmark, not a result.
        assert peer[name]["status"] == ("ok" if installed else "not installed"), peer[name]
        if installed:
            assert peer[name]["ratio_to_raw_jit"] > 0
        else:
            assert peer[name]["requires"] == module

    png = plot.main(["--results", str(tmp_path)])
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_fsdp_scale_rows_on_cpu(tmp_path, capsys):
    """The FSDP-at-scale benchmark, tiny decoder on 8 CPU devices: rows and options applied."""
    from benchmarks import fsdp_scale

    fsdp_scale.main(
        ["--sizes=", "--topologies=", "--cpu-sizes=tiny", "--options=default,bf16,f32 highest"]
        + ["--out", str(tmp_path)]
    )
    got = json.loads((tmp_path / "fsdp_scale.json").read_text())
    rows = {r["option"]: r for r in got["rows"]}
    assert set(rows) == {"default", "bf16", "f32 highest"}
    assert all("error" not in r for r in rows.values()), rows
    assert rows["bf16"]["applied"] == {"mixed_precision": "strategy"}
    assert rows["f32 highest"]["matmul_precision"] == "highest"
    for r in rows.values():
        # On CPU the default gathers at reads: weight gradients are reduce-scattered.
        assert r["comm_by_kind"].get("reduce-scatter", 0) > 0
        assert r["all_gather_bytes_per_device"] > 0
        # at or above the minimum, a lower bound (moving the activations of the tiny
        # batch would cost far less than gathering the weights)
        assert r["comm_ratio"] >= 1
        assert set(r["min_comm_references"]) == {
            "weights gathered (ZeRO)",
            "per matmul: cheaper of weight or activations",
        }
    # --merge keeps the rows this run does not measure.
    fsdp_scale.main(
        ["--sizes=", "--topologies=", "--cpu-sizes=tiny", "--options=xla plan", "--merge"]
        + ["--out", str(tmp_path)]
    )
    merged = json.loads((tmp_path / "fsdp_scale.json").read_text())
    assert {r["option"] for r in merged["rows"]} == {"default", "bf16", "f32 highest", "xla plan"}
    assert {r["option"]: r for r in merged["rows"]}["bf16"] == rows["bf16"]
    # The README's table comes from the results file.
    capsys.readouterr()
    fsdp_scale.main(["--markdown", "cpu", "--out", str(tmp_path)])
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("| model | options | peak per chip")
    assert len(table) == 2 + 4 and all(line.startswith("| tiny |") for line in table[2:])
    bf16 = next(line for line in table if "`MixedPrecision()`" in line)
    assert f"| {rows['bf16']['comm_ratio']:.2f} |" in bf16
    # The side by side with MaxText: its reference figures, ours not measured in this run.
    fsdp_scale.main(["--markdown", "maxtext", "--out", str(tmp_path)])
    side = capsys.readouterr().out.splitlines()
    assert side[0].startswith("| model | topology | global batch | MaxText peak per chip")
    assert "| llama2-70b | v5p:4x4x4 | 64 x 1024 | 21.16 GiB |" in "\n".join(side)
    assert all(line.endswith("| — | — | — | — |") for line in side[2:])


def test_fsdp_scale_gpu_tables_are_the_docs_tables(capsys):
    """GPU topologies' rows live in fsdp_scale_gpu.json; --markdown prints them per GPU, and
    the README and the large-models guide show those tables as printed."""
    from pathlib import Path

    from benchmarks import fsdp_scale

    root = Path(__file__).resolve().parents[1]
    guide = "docs/guides/large_models.md"
    for topology, docs in (("h100:1x8", [guide]), ("h100:8x8", [guide])):
        fsdp_scale.main(["--markdown", topology])
        table = capsys.readouterr().out.splitlines()
        assert table[0].startswith("| model | options | peak per GPU |") and len(table) > 2
        for doc in docs:
            lines = (root / doc).read_text().splitlines()
            missing = [line for line in table if line not in lines]
            assert not missing, f"{doc}, {topology}: not the results' table: {missing}"
    with pytest.raises(SystemExit):
        fsdp_scale.main(["--sizes", "2b", "--topologies", "h100:1x8,v5e:4x4", "--cpu-sizes="])
    assert "mix GPUs with TPUs/CPU" in capsys.readouterr().err


def test_checkpoint_gcs_benchmark_tiny(tmp_path, gcs, gcs_emulator):
    """The bucket-vs-disk benchmark with a 2 MiB tree, into the suite's emulator (a fresh
    gs:// URL, an empty working directory that must stay free of a local ./gs:): the bucket
    rows come from objects in the bucket, and the JSON holds both places."""
    from benchmarks import checkpoint_gcs

    got = checkpoint_gcs.main(
        ["--gib=0.002", "--arrays=1", "--out", str(tmp_path), "--bucket", gcs]
    )
    # the step the benchmark saved is committed in the bucket, its array data with it
    stored = gcs_emulator.object_path(gcs) / "bench0" / "0"
    assert (stored / "commit_success.txt").is_file()
    assert (stored / "state" / "manifest.ocdbt").is_file()
    saved = json.loads((tmp_path / "checkpoint_gcs.json").read_text())
    assert saved["benchmark"] == "checkpoint_gcs"
    for where in ("local", "bucket"):
        for op in ("save", "restore"):
            assert saved[where][op]["median"] > 0
    assert got["ratio_bucket_to_local"]["save_plus_restore"] == pytest.approx(
        saved["save_plus_restore_s"]["bucket"] / saved["save_plus_restore_s"]["local"]
    )


def test_checkpoint_gcs_benchmark_refuses_a_bucket_that_is_not_a_url(capsys):
    from benchmarks import checkpoint_gcs

    with pytest.raises(SystemExit):
        checkpoint_gcs.main(["--bucket", "/tmp/not-a-bucket"])
    assert "--bucket '/tmp/not-a-bucket' is not a gs:// URL" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_checkpoint_tiers_benchmark_tiny(tmp_path):
    """The tiers benchmark as a 2-process job with 4 MiB a process: every tier's save and
    restore timed (each restore asserted in the job to come from its tier), and the
    Young/Daly arithmetic from those times."""
    from benchmarks import checkpoint_tiers

    got = checkpoint_tiers.main(["--gib=0.004", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "checkpoint_tiers.json").read_text())
    assert saved["benchmark"] == "checkpoint_tiers" and got["config"]["processes"] == 2
    assert saved["bytes_per_process"] == pytest.approx(0.004 * 2**30, rel=0.05)
    for key in ("persistent_save", "local_save", "local", "peer", "persistent"):
        assert saved["median_s"][key] > 0
    t, mtbf = saved["median_s"], 6 * 3600
    row = saved["goodput"]["persistent only"]
    assert row["interval_s"] == pytest.approx((2 * t["persistent_save_blocking"] * mtbf) ** 0.5)
    assert row["lost_fraction"] == pytest.approx(
        t["persistent_save_blocking"] / row["interval_s"]
        + (row["interval_s"] / 2 + t["persistent"]) / mtbf
    )


def test_checkpoint_guide_tiers_table_is_the_results(capsys):
    from benchmarks import checkpoint_tiers

    checkpoint_tiers.main(["--markdown"])
    table = capsys.readouterr().out.splitlines()
    lines = (Path(__file__).resolve().parents[1] / "docs/guides/checkpoints.md").read_text()
    missing = [line for line in table if line not in lines.splitlines()]
    assert len(table) == 5 and not missing, missing
