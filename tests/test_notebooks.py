"""The tutorial notebooks run end to end (nbclient), and match their MyST sources.

Each notebook executes in a fresh IPython kernel on this interpreter (a
kernelspec written for the test, so a user's own Jupyter set-up cannot pick
another Python); the notebooks ask for 8 simulated CPU devices in their first
cell, and their own ``assert`` cells check the values they show.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import jupytext
import nbclient
import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 240
KERNEL = "dtensor-test-python"
# Seconds on 2 busy CPU cores: 01 ~10, 02 ~35, 03 ~25 (three training processes), 04 ~20
# (a two-process dtensor.launch job).
MARKS = {
    "02_strategies": [pytest.mark.slow],
    "03_checkpoint_preemption": [pytest.mark.slow],
    "04_multi_process": [pytest.mark.slow, pytest.mark.multiprocess],
}


def test_every_notebook_is_found():
    assert [p.stem for p in NOTEBOOKS] == [
        "01_layouts",
        "02_strategies",
        "03_checkpoint_preemption",
        "04_multi_process",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_paired_with_its_myst_source_and_stored_without_outputs(path):
    """The MyST markdown beside each notebook is its source (jupytext pairs them)."""
    source = path.with_suffix(".md")
    assert source.exists(), f"{path.name} has no MyST source {source.name}"
    stored = nbformat.read(path, as_version=4)
    for cell in stored.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:80]
    paired = jupytext.read(source)
    assert [(c.cell_type, c.source) for c in stored.cells] == [
        (c.cell_type, c.source) for c in paired.cells
    ], (
        f"{path.name} differs from its source {source.name}; after editing the .md, run "
        f".venv/bin/jupytext --sync notebooks/{source.name}"
    )
    assert stored.metadata.get("jupytext", {}).get("formats") == "ipynb,md:myst"


def _kernel_manager(tmp_path: Path) -> AsyncKernelManager:
    """A kernel on this very interpreter (the project's .venv under `make test`)."""
    spec_dir = tmp_path / "kernels" / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dtensor tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(tmp_path / "kernels")])
    return AsyncKernelManager(kernel_name=KERNEL, kernel_spec_manager=specs)


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=MARKS.get(p.stem, []), id=p.stem) for p in NOTEBOOKS]
)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.prefix)"))
    before = sorted(p.name for p in NOTEBOOK_DIR.iterdir())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        resources={"metadata": {"path": str(run_dir)}},
    )
    # The notebooks' temporary directories (checkpoints, scripts) land under tmp_path.
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=str(tmp_path / "tmp"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        client.execute(env=env)
    except nbclient.exceptions.CellExecutionError as e:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # IPython's colours
        pytest.fail(f"{path.name} failed:\n{text[-4000:]}", pytrace=False)
    last = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    assert last == sys.prefix, "the kernel ran on another Python environment"
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert errors == []
    # Nothing was written next to the notebooks: they use temporary directories.
    assert sorted(p.name for p in NOTEBOOK_DIR.iterdir()) == before
