"""The README's Python blocks run as written and print what the README says they print
(and the partial-values block the README's layouts section links to, in the layouts guide)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dtensor

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
LAYOUTS = re.findall(
    r"```python\n(.*?)```", (ROOT / "docs/guides/layouts.md").read_text(), flags=re.S
)


def _run(block: str, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], list[str]]:
    namespace: dict[str, Any] = {"__name__": "readme_block"}
    exec(compile(block, "README.md[python block]", "exec"), namespace)
    return namespace, capsys.readouterr().out.splitlines()


def _quickstart(ns: dict[str, Any], out: list[str]) -> None:
    # The compiled step's communication over the minimum for its layouts, a lower bound (per
    # matmul, the cheaper of gathering the weight or moving its activations: for this tiny
    # batch, the activations), so at least 1 (measured 14.9). Against the ZeRO reference
    # (every weight gathered), FSDP's gathers at reads move about that much (measured 0.79).
    ratio = float(out[-1])
    assert math.isfinite(ratio) and ratio >= 1, out
    s, step = ns["strategy"], ns["train_step"]
    report = s.explain(step, args=(ns["model"], ns["optimizer"], ns["batch"]))
    zero = report.min_comm_references["weights gathered (ZeRO)"]
    assert 0.5 <= report.comm_bytes_per_device / zero <= 1.05
    assert math.isfinite(float(ns["loss"]))
    kernel = ns["model"].layers[0].kernel[...]
    assert (
        dtensor.fetch_layout(kernel).num_shards(0) * dtensor.fetch_layout(kernel).num_shards(1)
        == ns["strategy"].num_replicas_in_sync
    )  # FSDP: every device holds its own part


def _layouts(ns: dict[str, Any], out: list[str]) -> None:
    mesh = ns["mesh"]
    # The comment beside the print is its output, verbatim.
    assert out[0] == "Layout([UNSHARDED, 'model'], mesh=Mesh(batch=4, model=2))"
    assert dtensor.fetch_layout(ns["x"]).local_shape((8, 16)) == (2, 16)
    dense = ns["params"]["dense"]
    assert dtensor.fetch_layout(dense["kernel"]) == dtensor.Layout([None, "model"], mesh)
    assert dtensor.fetch_layout(dense["bias"]).is_fully_replicated()
    picture = "\n".join(out[1:])
    assert "dev 0,2,4,6" in picture and "dev 1,3,5,7" in picture  # the kernel's two column blocks


def _partial(ns: dict[str, Any], out: list[str]) -> None:
    assert out == [f"{np.full((8,), 28.0)} Layout(['x'], mesh=Mesh(x=8))"]  # 0+1+...+7
    np.testing.assert_array_equal(np.asarray(ns["scattered"]), np.full((8,), 28.0))


# Each README block, recognised by a line of it, and what it must do.
CHECKS: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
    "strategy = strategies.FullyShardedStrategy(min_shard_bytes=0)": _quickstart,
    'layout = dtensor.Layout(["batch", dtensor.UNSHARDED], mesh)': _layouts,
}
# The layouts guide's block (moved there from the README).
GUIDE_CHECKS: dict[str, Callable[[dict[str, Any], list[str]], None]] = {
    "partial = dtensor.pack(": _partial,
}


def _check_for(block: str) -> Callable[[dict[str, Any], list[str]], None] | None:
    return next((check for marker, check in CHECKS.items() if marker in block), None)


@pytest.mark.parametrize("marker", sorted(CHECKS) + sorted(GUIDE_CHECKS))
def test_readme_block_prints_what_the_readme_says(marker, capsys):
    (block,) = [b for b in (BLOCKS if marker in CHECKS else LAYOUTS) if marker in b]
    namespace, out = _run(block, capsys)
    {**CHECKS, **GUIDE_CHECKS}[marker](namespace, out)


def test_every_readme_python_block_is_checked():
    # A new README block needs its entry in CHECKS: what it must print and do.
    unchecked = [b.splitlines()[0] for b in BLOCKS if _check_for(b) is None]
    assert len(BLOCKS) >= len(CHECKS) and not unchecked, unchecked
