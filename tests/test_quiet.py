"""Entry points stay quiet on a machine without a TPU when JAX_PLATFORMS is unset.

With libtpu installed (the ``tpu-aot`` extra), a JAX that probes every platform
makes libtpu print a ``TPU_WORKER_HOSTNAMES`` / ``INVALID_ARGUMENT`` block to
stderr on a machine with no TPU. ``examples/train.py``, ``python -m dtensor.aot``
and ``python -m dtensor.launch`` select the CPU platform themselves there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("TPU_WORKER_HOSTNAMES", "INVALID_ARGUMENT")


def _has_tpu() -> bool:
    return any(Path("/dev").glob("accel[0-9]*")) or any(Path("/dev/vfio").glob("[0-9]*"))


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


COMMANDS = {
    "train_list_strategies": ["examples/train.py", "--list-strategies"],
    "launch": [
        "-m",
        "dtensor.launch",
        "-n",
        "1",
        "--",
        sys.executable,
        "-c",
        "import jax; print(jax.devices()[0].platform)",
    ],
    # python -m dtensor.aot: tests/test_aot.py's run for two slices (two_slices_run), made
    # once a run with JAX_PLATFORMS unset, read here too
    "aot": None,
}


@pytest.mark.slow
@pytest.mark.skipif(_has_tpu(), reason="a TPU machine is meant to initialise libtpu")
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_entry_point_prints_no_libtpu_noise_without_jax_platforms(name, tmp_path_factory):
    if COMMANDS[name] is None:
        from tests.test_aot import two_slices_run

        got = two_slices_run(tmp_path_factory)
        returncode, stderr = got["returncode"], got["stderr"]
    else:
        result = _run(COMMANDS[name])
        returncode, stderr = result.returncode, result.stderr
    assert returncode == 0, stderr[-3000:]
    for noise in NOISE:
        assert noise not in stderr, stderr[-3000:]
