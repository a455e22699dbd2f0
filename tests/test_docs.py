"""The documentation site builds with warnings as errors, and documents every public name.

One build (Sphinx, `-W --keep-going`, no network) into a temporary directory,
shared by the checks below. The docs tools come with the ``dev`` extra, so
``make test`` has them; a missing tool is a failure, not a skip.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dtensor
import dtensor.checkpoint
import strategies
import strategies.failure_handling
from tests.once import once

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GUIDES = [
    "layouts",
    "presets",
    "migrating_tf_distribute",
    "migrating_tf_dtensor",
    "migrating_keras",
    "migrating_pytorch",
    "multi_process",
    "checkpoints",
    "pretrained",
    "failure_handling",
    "explain",
]
# Attributes tf.distribute's objects have that ours set per instance.
INSTANCE_ATTRIBUTES = {"total_run_calls", "num_replicas_in_sync", "strategy"}
NOTEBOOKS = ["01_layouts", "02_strategies", "03_checkpoint_preemption", "04_multi_process"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once a run (the workers share it)."""
    return once(tmp_path_factory, "docs-site", _build_site)


def _build_site(out: Path) -> Path:
    html = out / "html"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    cmd += ["-d", str(out / "doctrees"), str(DOCS), str(html)]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"sphinx-build failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    )
    assert "WARNING" not in result.stderr, result.stderr[-5000:]
    return html


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def test_key_pages_exist(site):
    pages = [
        "index",
        "getting_started",
        "api/index",
        "api/dtensor",
        "api/strategies",
        "api/checkpoint",
        "api/failure_handling",
    ]
    pages += [f"guides/{g}" for g in GUIDES] + [f"notebooks/{n}" for n in NOTEBOOKS]
    missing = [p for p in pages if not (site / f"{p}.html").is_file()]
    assert missing == []
    index = _text(site / "index.html")
    for page in ("getting_started", "guides/presets", "notebooks/01_layouts", "api/index"):
        assert f'href="{page}.html"' in index, page


def _documented(page: str, qualified: str) -> bool:
    return f'id="{qualified}"' in page


@pytest.mark.parametrize(
    "package, page, skip",
    [
        (dtensor, "api/dtensor", {"checkpoint"}),
        (strategies, "api/strategies", {"failure_handling"}),
    ],
    ids=["dtensor", "strategies"],
)
def test_every_public_name_is_documented_at_its_public_path(site, package, page, skip):
    html = _text(site / f"{page}.html")
    missing = [
        n
        for n in package.__all__
        if n not in skip and not _documented(html, f"{package.__name__}.{n}")
    ]
    assert missing == []


@pytest.mark.parametrize(
    "module, page",
    [(dtensor.checkpoint, "api/checkpoint"), (strategies.failure_handling, "api/failure_handling")],
    ids=["dtensor.checkpoint", "strategies.failure_handling"],
)
def test_public_modules_are_documented(site, module, page):
    html = _text(site / f"{page}.html")
    missing = [n for n in module.__all__ if not _documented(html, f"{module.__name__}.{n}")]
    assert missing == []


def test_type_hints_link_to_public_paths(site):
    html = _text(site / "api/dtensor.html")
    assert 'href="#dtensor.Mesh"' in html and 'href="#dtensor.Layout"' in html
    assert "dtensor.core.layout.Layout" not in re.sub(r"<[^>]+>", "", html)


def test_notebooks_render_with_their_outputs(site):
    for name in NOTEBOOKS:
        html = _text(site / f"notebooks/{name}.html")
        assert html.count("cell_output") >= 3, name
    assert "<img" in _text(site / "notebooks/02_strategies.html")  # the plot


def test_guides_quote_the_measured_figures(site):
    presets = re.sub(r"<[^>]+>", "", _text(site / "guides/presets.html"))
    measured = json.loads((ROOT / "benchmarks/results/comm_memory.json").read_text())
    (fsdp,) = [
        r for r in measured["results"] if r["preset"] == "fully_sharded" and r["model"] == "mlp"
    ]
    tpu = json.loads((ROOT / "benchmarks/results/tpu_presets.json").read_text())
    (mirrored,) = [r for r in tpu["rows"] if r["strategy"] == "mirrored"]
    peak = f"{mirrored['peak_bytes_per_chip'] / 2**20:.2f} MiB"  # the table's precision
    for figure in ("8.02", f"{fsdp['comm_ratio']:.2f}", "v5e:4x4", peak, "1.10"):
        assert figure in presets, figure
    explain = re.sub(r"<[^>]+>", "", _text(site / "guides/explain.html"))
    assert "will not fit" in explain.lower() or "fits" in explain


def test_tf_distribute_table_names_exist_here():
    """Every `strategy.x`, `ctx.x`, `strategies.X` or `dtensor.X` in the right column resolves."""
    text = (DOCS / "guides/migrating_tf_distribute.md").read_text()
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| `")]
    ours = " ".join(r[2] for r in rows if len(r) > 3)
    strategy = strategies.MirroredStrategy()
    roots = {
        "strategy": strategy,
        "strategies": strategies,
        "dtensor": dtensor,
        "input_context": strategy.input_context(),
        "handler": strategies.failure_handling.PreemptionCheckpointHandler,
        "coordinator": strategies.ClusterCoordinator,
        "RemoteValue": strategies.RemoteValue,
        "ctx": strategies.ReplicaContext(strategy, strategy.batch_axes, 8),
    }
    checked = 0
    for root, path in re.findall(r"\b(" + "|".join(roots) + r")((?:\.[A-Za-z_]\w*)+)", ours):
        obj = roots[root]
        for attr in path.strip(".").split("."):
            if attr in INSTANCE_ATTRIBUTES:  # set in __init__, so not on the class
                break
            try:  # statically: properties such as replica_id_in_sync_group only work traced
                found = inspect.getattr_static(obj, attr)
            except AttributeError:
                pytest.fail(f"{root}{path}: {type(obj).__name__} has no {attr!r}")
            if isinstance(found, property | functools.cached_property):
                try:
                    found = getattr(obj, attr)
                except Exception:  # noqa: BLE001 - needs a traced context: its existence is enough
                    break
            if found is None:
                break
            obj = found
        checked += 1
    assert checked > 60


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_executed_notebooks_match_the_tutorials(name):
    """docs/notebooks/ are executed copies of notebooks/: regenerate after an edit there."""
    import nbformat

    source = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4)
    executed = nbformat.read(DOCS / "notebooks" / f"{name}.ipynb", as_version=4)
    assert [c.source for c in executed.cells] == [c.source for c in source.cells], (
        f"docs/notebooks/{name}.ipynb is stale; rerun `make docs-notebooks` "
        "(python docs/execute_notebooks.py)"
    )
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert errors == []
    # Executed without JAX_PLATFORMS (docs/execute_notebooks.py): no libtpu probe noise.
    text = str([c.outputs for c in code])
    assert "TPU_WORKER_HOSTNAMES" not in text and "INVALID_ARGUMENT" not in text


def test_large_models_guide_example_runs_scaled_down():
    """The guide's fit check, on the tiny decoder and v5e:2x2 (the 7b on v5e:4x4 takes minutes).

    Run here with ``exec``, not in a new interpreter: the code is the guide's, its imports
    and its TPU compile the same; a process of its own would add only JAX's start-up.
    """
    guide = (
        Path(__file__).resolve().parents[1] / "docs" / "guides" / "large_models.md"
    ).read_text()
    code = re.findall(r"```python\n(.*?)```", guide, re.S)[0]
    assert 'CONFIGS["7b"]' in code and '"v5e:4x4"' in code and "(16, 1024)" in code
    code = code.replace('CONFIGS["7b"]', 'CONFIGS["tiny"]').replace('"v5e:4x4"', '"v5e:2x2"')
    code = code.replace("(16, 1024)", "(8, 128)")
    names: dict = {"__name__": "large_models_guide"}
    exec(compile(code, "docs/guides/large_models.md", "exec"), names)
    report = names["report"]
    assert report.memory_fit.fits and report.peak_bytes_per_device > 0
