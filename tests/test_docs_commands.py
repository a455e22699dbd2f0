"""The commands the README and guides show do what their comments say.

`python -m dtensor.launch -n 2 -- python examples/train.py ...  # 2 processes x 4 devices`
(README, the multi-process guide, examples/train.py) and which platform the entry
points select without `JAX_PLATFORMS` (the multi-process and ahead-of-time guides).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dtensor.runtime.platform as platform
from dtensor.runtime.launch import launch
from dtensor.runtime.platform import accelerator_device_files, default_platforms

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "docs" / "guides" / "multi_process.md"]
DOCUMENTED = (
    "python -m dtensor.launch -n 2 -- python examples/train.py --strategy multi_worker_mirrored"
)


def test_the_documented_launch_command_is_the_one_tested():
    for doc in DOCS:
        lines = [line for line in doc.read_text().splitlines() if DOCUMENTED in line]
        assert len(lines) == 1 and lines[0].rstrip().endswith("# 2 processes x 4 devices"), doc


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.xdist_group("multiprocess")
@pytest.mark.timeout(420)
def test_launch_without_devices_per_process_gives_2_processes_x_4_devices(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    env.pop("DTENSOR_DEVICES_PER_PROCESS", None)
    extra = ["--steps", "1", "--json", "--save-every", "0", "--sample-chars", "1"]
    cmd = [*DOCUMENTED.split()[:6], sys.executable, *DOCUMENTED.split()[7:]]
    cmd = [sys.executable, *cmd[1:], "--out", str(tmp_path), "--fresh", *extra]
    proc = subprocess.run(
        ["timeout", "-k", "10", "400", *cmd],
        capture_output=True,
        text=True,
        env=env,
        timeout=410,
        cwd=ROOT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if line.startswith("[rank")]
    summary = json.loads(next(row for row in rows if row.startswith("{")))
    assert summary["strategy"] == "multi_worker_mirrored"
    assert (summary["processes"], summary["local_devices"], summary["devices"]) == (2, 4, 8)


def test_train_refuses_devices_that_do_not_split_over_the_processes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("DTENSOR_DEVICES_PER_PROCESS", None)
    env.update(DTENSOR_COORDINATOR="127.0.0.1:1", DTENSOR_NUM_PROCESSES="3", DTENSOR_PROCESS_ID="0")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert "--devices 8 does not divide over the 3 processes" in proc.stderr
    assert "--devices-per-process" in proc.stderr


def test_default_platforms_is_cpu_only_without_accelerator_device_files(tmp_path):
    assert accelerator_device_files(tmp_path) == []
    assert default_platforms({}, dev=tmp_path) == "cpu"
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # the control file every Linux machine may have
    assert default_platforms({}, dev=tmp_path) == "cpu"
    for name in ("vfio/0", "accel0", "nvidia0"):
        dev = tmp_path / name.replace("/", "_")
        (dev / name).parent.mkdir(parents=True, exist_ok=True)
        (dev / name).touch()
        assert accelerator_device_files(dev) == [str(dev / name)]
        assert default_platforms({}, dev=dev) is None, name  # JAX picks the TPU/GPU
        assert default_platforms({"JAX_PLATFORMS": "cpu"}, dev=dev) == "cpu"  # the user's wins


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("files", [[], ["/dev/accel0"]], ids=["no-accelerator", "tpu-vm"])
def test_launch_selects_cpu_only_without_accelerator_device_files(monkeypatch, files):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(platform, "accelerator_device_files", lambda dev="/dev": files)
    code = "import os; print(os.environ.get('JAX_PLATFORMS'))"
    result = launch([sys.executable, "-c", code], 2, timeout_s=30, out=io.StringIO())
    assert result.returncode == 0, result.outputs
    assert [out.strip() for out in result.outputs] == (["None"] * 2 if files else ["cpu"] * 2)


def _check_newest():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_newest", ROOT / ".ci" / "check_newest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_test_latest_fails_loudly_when_a_release_is_not_the_newest(monkeypatch, capsys):
    check = _check_newest()
    listing = {"jax": "0.12.0.1, 0.12.0, 0.11.0", "optax": "0.2.9, 0.2.8"}
    installed = {"jax": "0.12.0.1", "optax": "0.2.8"}

    def version(name):
        if name not in installed:
            raise check.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(check, "version", version)

    def pip_index(cmd, **kw):
        name = cmd[-1]
        out = f"{name} (x)\nAvailable versions: {listing[name]}\n" if name in listing else ""
        return subprocess.CompletedProcess(cmd, 0 if out else 1, out, "")

    monkeypatch.setattr(check.subprocess, "run", pip_index)
    assert check.main(["jax", "optax"]) == 1
    err = capsys.readouterr().err
    assert "NOT the newest releases" in err
    assert "optax 0.2.8 is installed, but the newest release is 0.2.9" in err
    assert "jax" not in err.split("NOT the newest releases:")[1].split("Rebuild")[0]
    listing["optax"] = "0.2.8, 0.2.7"
    assert check.main(["jax", "optax"]) == 0
    assert "the newest releases: jax 0.12.0.1, optax 0.2.8" in capsys.readouterr().out
    assert check.main(["jax", "nothing-on-the-index"]) == 1  # a name the index lacks fails too
    assert "nothing-on-the-index: the index lists no release" in capsys.readouterr().err


def test_makefile_runs_the_newest_check_before_the_latest_suite():
    recipe = (ROOT / "Makefile").read_text().split("\ntest-latest:")[1].split("\n\n")[0]
    check = recipe.index(".ci/check_newest.py $(NEWEST)")
    assert check < recipe.index("-m pytest")


def _requirements(extra: str | None = None) -> list[str]:
    """The distribution's requirements (an extra's with its own extras expanded), by name."""
    import re
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found, todo = [], list(project["dependencies"] if extra is None else [f"jax-dtensor[{extra}]"])
    while todo:
        req = todo.pop()
        name, extras = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", req).groups()
        if name == "jax-dtensor":
            for e in extras.split(","):
                todo += project["optional-dependencies"][e.strip()]
        else:
            found.append(req)
    return found


def test_make_demo_installs_the_package_and_its_demo_extra_only(tmp_path):
    """``make demo`` from a fresh clone: no libtpu, no CUDA wheels, no test tools."""
    venv = tmp_path / "venv"
    plan = subprocess.run(
        ["make", "-n", "-B", "demo", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True
    )
    assert plan.returncode == 0, plan.stderr
    installs = [line for line in plan.stdout.splitlines() if "pip install" in line]
    assert any("-e '.[demo]'" in line for line in installs), plan.stdout
    assert not any("[dev]" in line or "[test]" in line for line in installs), plan.stdout
    demo = _requirements("demo") + _requirements()
    heavy = ("libtpu", "jax[tpu]", "jax[cuda", "nvidia", "pytest", "sphinx", "tensorflow", "keras")
    assert not [r for r in demo if r.lower().startswith(heavy)], demo
    # The demo's needs are in make test's install too (one .venv serves both).
    dev = _requirements("dev")
    assert {r.split(">")[0] for r in _requirements("demo")} <= {r.split(">")[0] for r in dev}


def test_the_base_package_has_no_platform_only_requirement():
    """``pip install jax-dtensor`` works on Linux, macOS and Windows alike: each base
    requirement is a name with wheels for all three (checked by hand with ``pip download
    --platform``), without extras or environment markers that pick a platform."""
    base = _requirements()
    names = {r.split(">")[0].split("=")[0].split("<")[0] for r in base}
    assert names == {"jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "rich"}
    assert not [r for r in base if "[" in r or ";" in r], base
