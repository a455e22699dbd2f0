"""``python -m dtensor.aot --fit`` / ``dtensor.tpu.fit``: the option search on the TPU compiler."""

from __future__ import annotations

import json

import pytest

import dtensor.tpu
from dtensor.tpu import aot
from dtensor.tpu.compiles import merge_flags
from dtensor.tpu.search import FitError, Rung, choose, ladder
from tests.test_search import forwarding_script

ARGV = ["--strategy", "fully_sharded", "--model-size", "small", "--batch-size", "16"]
ARGV += ["--seq-len", "512"]


def test_ladder_order_and_flag_merging():
    names = [r.name for r in ladder(ARGV)]
    assert names == [
        "as given",
        "bf16",
        "bf16 + remat",
        "bf16 + remat (dots_saveable)",
        "bf16 compute + remat",
        "bf16 + remat + scan",
        "bf16 + remat (dots_saveable) + scan",
        "bf16 + remat + scan + offload optimizer",
        "hybrid tensor=2 + bf16 + remat + scan",
        "hybrid tensor=4 + bf16 + remat + scan",
    ]
    hybrid = [r.name for r in ladder(["--strategy", "hybrid"])]
    assert hybrid[-1] == "bf16 + remat + scan + offload optimizer"
    # No gather-layers rung (it lowers no model's floor or peak on the true slices); the
    # lighter remat policies are tried only once a rung fits, as ones that may run faster.
    assert not any("gather layers" in n for n in names + hybrid)
    assert [r.name for r in ladder(ARGV) if r.faster_than_previous] == [
        "bf16 + remat (dots_saveable)",
        "bf16 + remat (dots_saveable) + scan",
    ]
    merged = merge_flags(["--strategy", "fully_sharded", "--remat"], ladder(ARGV)[-1].flags)
    assert merged[:2] == ["--strategy", "hybrid"] and merged.count("--remat") == 1
    assert merged[merged.index("--tensor") + 1] == "4"


def test_fit_refuses_a_missing_script(tmp_path):
    with pytest.raises(FitError, match=r"fit: script '.*nope.py' does not exist"):
        dtensor.tpu.fit(tmp_path / "nope.py", ARGV, topology="v5e:2x2")


@pytest.mark.slow
def test_fit_finds_the_cheapest_fitting_options_and_caches_them(tmp_path, capsys):
    # The demo's character model (a quick compile) on a v5e:2x2, searched over a short ladder
    # whose rungs shrink the batch: the logic of the search, not the options themselves. The
    # script has no search_facts hook, so no model ranks the rungs: they are tried in order
    # (dtensor.tpu.ranking; with the model, tests/test_search.py).
    script = forwarding_script(tmp_path, "demo_without_facts.py")
    argv = ["--strategy", "fully_sharded", "--model-size", "demo", "--seq-len", "64"]
    argv += ["--batch-size", "4096"]
    rungs = [
        Rung("as given", ()),
        # the options as given already hold this rung's: never compiled, never listed
        Rung("batch 4096", ("--batch-size", "4096")),
        Rung("batch 256", ("--batch-size", "256")),
        Rung("batch 128", ("--batch-size", "128"), True),
        Rung("batch 64", ("--batch-size", "64")),
    ]
    cache = tmp_path / "cache"
    first = dtensor.tpu.fit(script, argv, topology="v5e:2x2", cache_dir=cache, rungs=rungs)
    # It fits a v5e's 15.75 GiB as given: one compile, and no rung that is not faster.
    assert [t["name"] for t in first.tried] == ["as given"]
    given = first.best
    assert given["fits"] and given["peak_bytes_per_chip"] > 0
    # The character-level demo model gives no model FLOPs (its script's hook returns None).
    assert given["step_time_floor_seconds"] > 0 and given["mfu_ceiling"] is None

    # Within half of that, the search walks on to the first rung that fits, then tries the
    # faster one after it, and stops at the next that is not faster.
    budget = 0.5 * given["peak_bytes_per_chip"]
    found = dtensor.tpu.fit(
        script, argv, topology="v5e:2x2", cache_dir=cache, rungs=rungs, max_bytes_per_chip=budget
    )
    assert [t["name"] for t in found.tried] == ["as given", "batch 256", "batch 128"]
    assert found.tried[0]["cached"] and not found.tried[0]["fits"]
    assert not found.tried[1]["cached"] and found.tried[1]["fits"]
    best = found.best
    assert best["peak_bytes_per_chip"] <= budget
    # Both fit. Every matmul of the step has the batch as a free dimension, so batch 128
    # does half the FLOPs of batch 256 and its floor is the lower (below it whichever of
    # compute and ICI bounds it): it wins, though it was tried later.
    first_fit, faster = found.tried[1], found.tried[2]
    assert first_fit["fits"] and faster["fits"]
    assert 0 < faster["step_time_floor_seconds"] < first_fit["step_time_floor_seconds"]
    assert best["name"] == "batch 128"
    assert found.command() == (
        "python -m dtensor.aot --topology v5e:2x2 -- " + script + " " + " ".join(best["argv"])
    )
    # A second search is read back from the cache, with the same answer.
    again = dtensor.tpu.fit(
        script, argv, topology="v5e:2x2", cache_dir=cache, rungs=rungs, max_bytes_per_chip=budget
    )
    assert all(t["cached"] for t in again.tried) and again.best["argv"] == best["argv"]

    # The command line (the default ladder, of which the script spells no flag: its first rung
    # only, cached) writes the JSON.
    out = tmp_path / "fit.json"
    cli = ["--topology", "v5e:2x2", "--fit", "--cache-dir", str(cache), "--json", str(out)]
    assert aot.main([*cli, "--", script, *argv]) == 0
    printed = capsys.readouterr().out
    assert "as given: fits" in printed and "(cached)" in printed
    saved = json.loads(out.read_text())
    assert [t["name"] for t in saved["tried"]] == ["as given"]
    assert saved["best"]["name"] == "as given" and saved["best"]["peak_bytes_per_device"] > 0
    assert saved["command"] in printed


def test_a_fitting_rung_without_a_floor_never_wins_by_counting_zero():
    # A chip the hardware table lacks gives no floor: such a rung ranks after every rung
    # with one (a floor of 0 would make it win), and among floor-less rungs the first
    # tried (the least costly) wins.
    tried = [
        {"name": "as given", "fits": False, "step_time_floor_seconds": 0.001},
        {"name": "bf16", "fits": True, "step_time_floor_seconds": None},
        {"name": "bf16 + remat", "fits": True, "step_time_floor_seconds": 0.030},
        {"name": "bf16 + remat (dots_saveable)", "fits": True, "step_time_floor_seconds": 0.020},
    ]
    assert choose(tried)["name"] == "bf16 + remat (dots_saveable)"
    assert choose(tried[:2])["name"] == "bf16"  # the only one that fits
    unknown = [{**t, "step_time_floor_seconds": None} for t in tried]
    assert choose(unknown)["name"] == "bf16"
    assert choose([tried[0]]) is None
