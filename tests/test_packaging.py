"""The distribution builds (sdist + wheel), passes `twine check`, and works installed.

The wheel is built without isolation (no network: setuptools comes with the
``dev`` extra), installed with ``--no-deps`` into a fresh virtual environment
whose only view of jax, flax and the rest is this interpreter's site-packages
(a ``.pth`` line), and exercised from outside the source tree: both packages
import from the venv, carry ``py.typed`` and ``__version__``, and a preset runs
a training step.
"""

from __future__ import annotations

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from tests.once import once

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

pytestmark = pytest.mark.slow


def _source_files() -> list[Path]:
    """What a checkout holds for the build: git's tracked and unignored files.

    Never the virtual environments (``.venv``, ``.venv-latest``: gigabytes each with the
    CUDA plugin), build outputs or caches, whatever they are named: git's ignore rules
    decide, as they do for a fresh clone.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    files = [ROOT / name for name in listed.split("\0") if name]
    return [f for f in files if f.is_file()]


STEP = """
import jax
jax.config.update("jax_num_cpu_devices", 8)
import numpy as np, optax
from flax import nnx
import dtensor, strategies

strategy = strategies.FullyShardedStrategy(min_shard_bytes=0)
with strategy.scope():
    model = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

def step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(lambda m: ((m(batch) - 1.0) ** 2).mean())(model)
    optimizer.update(model, grads)
    return loss

loss = strategy.run(step, args=(model, optimizer, np.ones((16, 16), "f4")))
print("files", dtensor.__file__, strategies.__file__)
print("versions", dtensor.__version__, strategies.__version__)
print("loss", float(loss), dtensor.fetch_layout(model.kernel.get_value()).sharding_specs)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, built once a run (the workers share them)."""
    return once(tmp_path_factory, "packaging-dist", _build)


def _build(work: Path) -> Path:
    # Build from a copy, so the build's egg-info and build/ never land in the checkout.
    src = work / "src" / "jax-dtensor"
    files = _source_files()
    size = sum(f.stat().st_size for f in files)
    assert size < 200 * 2**20, f"the source tree to build is {size / 2**20:.0f} MiB"
    for f in files:
        target = src / f.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, target)
    out = work / "dist"
    out.mkdir()
    cmd = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(src)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_sdist_and_wheel_pass_twine_check(dist):
    files = sorted(dist.iterdir())
    assert sorted(f.suffix for f in files) == [".gz", ".whl"], files
    result = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("PASSED") == 2, result.stdout


def test_wheel_holds_every_subpackage_and_the_typed_markers(dist):
    wheel = next(dist.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("dtensor", "strategies"):
        assert f"{package}/py.typed" in names
        on_disk = {
            p.relative_to(ROOT).as_posix()
            for p in (ROOT / package).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert on_disk <= names, sorted(on_disk - names)
    # The GPU target configs are package data (dtensor.gpu_topology reads them).
    configs = {
        p.relative_to(ROOT).as_posix() for p in (ROOT / "dtensor/gpu/configs").glob("*.txtpb")
    }
    assert len(configs) == 4 and configs <= names, sorted(configs - names)
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)


def test_installed_wheel_imports_and_trains_outside_the_source_tree(dist, tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    wheel = next(dist.glob("*.whl"))
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    result = subprocess.run(install, capture_output=True, text=True, timeout=300, env=_env())
    assert result.returncode == 0, result.stdout + result.stderr
    # jax, flax, optax... from this interpreter's site-packages, after the venv's own.
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shared = [*site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    (Path(purelib) / "shared_site_packages.pth").write_text("\n".join(dict.fromkeys(shared)) + "\n")

    run = subprocess.run(
        [str(python), "-c", STEP],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    files = re.search(r"^files (\S+) (\S+)$", run.stdout, re.M)
    assert files and all(f.startswith(str(env_dir)) for f in files.groups()), run.stdout
    assert f"versions {VERSION} {VERSION}" in run.stdout
    assert "('fsdp', 'unsharded')" in run.stdout
    for package in ("dtensor", "strategies"):
        assert (Path(purelib) / package / "py.typed").is_file()
