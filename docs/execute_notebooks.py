"""Execute the tutorial notebooks once and store the copies, with outputs, under docs/notebooks/.

    .venv/bin/python docs/execute_notebooks.py          # or: make docs-notebooks

The site renders these stored outputs (myst-nb ``nb_execution_mode = "off"``),
so ``make docs`` runs no notebook. notebooks/*.ipynb stay without outputs
(tests/test_notebooks.py checks that); rerun this after changing them. Each
notebook runs in a fresh kernel on this interpreter, in a temporary directory,
with 8 simulated CPU devices, as tests/test_notebooks.py runs them, but
without ``JAX_PLATFORMS`` in the environment.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import nbclient
import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "notebooks"
TARGET = ROOT / "docs" / "notebooks"
KERNEL = "dtensor-docs-python"
TMP_PATH = re.compile(r"/tmp/[^\s'\"]*")


def _kernel_manager(kernels: Path) -> AsyncKernelManager:
    spec_dir = kernels / KERNEL
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "dtensor docs",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return AsyncKernelManager(
        kernel_name=KERNEL, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)])
    )


def _scrub(nb: nbformat.NotebookNode) -> None:
    """Stable stored outputs: no kernel metadata or timings, temporary paths shortened."""
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = TMP_PATH.sub("/tmp/...", out["text"])


def execute(path: Path, work: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    run_dir = work / "run"
    run_dir.mkdir()
    client = nbclient.NotebookClient(
        nb,
        km=_kernel_manager(work / "kernels"),
        timeout=300,
        allow_errors=False,
        resources={"metadata": {"path": str(run_dir)}},
    )
    # JAX_PLATFORMS left unset, as on a reader's machine: the notebooks select the CPU
    # themselves, so libtpu (the tpu-aot extra) prints nothing into the stored outputs.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    client.execute(env=env)
    _scrub(nb)
    return nb


def main(argv: list[str]) -> int:
    names = argv or sorted(p.name for p in SOURCE.glob("[0-9][0-9]_*.ipynb"))
    TARGET.mkdir(parents=True, exist_ok=True)
    for name in names:
        with tempfile.TemporaryDirectory() as work:
            print(f"executing {name}", flush=True)
            nb = execute(SOURCE / name, Path(work))
        nbformat.write(nb, TARGET / name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
