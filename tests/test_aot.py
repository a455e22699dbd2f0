"""``python -m dtensor.aot``: a training script's step compiled for a TPU topology."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dtensor.tpu import aot
from tests.once import once

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "examples" / "train.py")

BIG = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import strategies

    def step(model, optimizer, batch):
        def loss_fn(m):
            h = batch["x"]
            for layer in m.layers:
                h = jax.nn.relu(layer(h))
            return jnp.mean(h ** 2)
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    class Deep(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(16384, 16384, use_bias=False, rngs=rngs) for _ in range(5)])

    def aot_step(argv, *, devices):
        name = argv[argv.index("--strategy") + 1] if "--strategy" in argv else "mirrored"
        def build():
            m = Deep(nnx.Rngs(0))
            return m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param)
        model, opt = nnx.eval_shape(build)
        batch = {"x": jax.ShapeDtypeStruct((64, 16384), jnp.float32)}
        return strategies.from_name(name, devices=devices), step, (model, opt, batch)
    """
)


def test_cli_prints_the_demo_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = aot.main(
        ["--topology", "v5e:4x4", "--strategy", "fully_sharded", "--json", str(out), "--", DEMO]
    )
    text = capsys.readouterr().out
    assert rc == 0
    for needle in (
        "v5litepod-16 (v5e:4x4, 16 chips, no wraparound links) = 16 TPU v5 lite devices",
        "Mesh(fsdp=16)",
        "memory per chip",
        "HBM of a v5e chip",
        "OK fits:",
        "ICI",
    ):
        assert needle in text, needle
    got = json.loads(out.read_text())
    assert (
        got["topology"] == "v5e:4x4" and got["devices"] == 16 and got["strategy"] == "fully_sharded"
    )
    report = got["report"]
    assert report["memory_fit"]["fits"] is True and report["memory_fit"]["chip"] == "v5e"
    assert report["dcn_bytes_per_device"] == 0 and report["ici_bytes_per_device"] > 0
    assert report["ici_bytes_per_device"] == pytest.approx(report["comm_bytes_per_device"])


def test_will_not_fit_exits_1_with_the_numbers(tmp_path, capsys):
    script = tmp_path / "big.py"
    script.write_text(BIG)
    rc = aot.main(["--topology", "v5e:4x4", "--strategy", "mirrored", "--", str(script)])
    text = capsys.readouterr().out
    assert rc == 1
    assert "NO will not fit: the TPU compiler needs" in text and "GiB of HBM is available" in text
    rc = aot.main(["--topology", "v5e:4x4", "--strategy", "fully_sharded", str(script)])
    assert rc == 0 and "OK fits:" in capsys.readouterr().out


def test_errors(tmp_path, capsys):
    with pytest.raises(aot.AotError, match=r"script 'nope.py' does not exist .* examples/train.py"):
        aot.load_script("nope.py")
    plain = tmp_path / "plain.py"
    plain.write_text("x = 1\n")
    with pytest.raises(
        aot.AotError, match=r"defines no aot_step\(argv, \*, devices\) function; add one"
    ):
        aot.load_script(plain)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def aot_step(argv, *, devices):\n    return 3\n")
    with pytest.raises(
        aot.AotError,
        match=r"aot_step\(\) returned int '3'; it must return the tuple \(strategy, step, args\)",
    ):
        aot.compile_script(wrong, topology="v5e:4x4")

    assert aot.main(["--topology", "v5e:4x4", "--", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert aot.main(["--topology", "v8:1x1", "--", DEMO]) == 2
    assert "unknown TPU generation 'v8'" in capsys.readouterr().err
    assert aot.main(["--topology", "v5e:4x4"]) == 2
    assert "give the training script" in capsys.readouterr().err
    # The script's own checks come back as a usage error too.
    assert aot.main(["--topology", "v5e:4x4", "--", DEMO, "--batch-size", "24"]) == 2
    assert "--batch-size 24 does not divide over the 16 replicas" in capsys.readouterr().err


def two_slices_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``python -m dtensor.aot`` for two v5e:4x4 slices, as a user runs it (``JAX_PLATFORMS``
    unset: the CLI picks CPU itself), once a run: its return code, output and JSON report.

    test_module_entry_point_two_slices reads the report; tests/test_quiet.py reads the same
    run's stderr for libtpu's noise (one TPU compile of the demo's step for both).
    """

    def make(folder: Path) -> dict:
        out = folder / "r.json"
        env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        cli = ["--topology", "v5e:4x4", "--num-slices", "2", "--strategy", "multi_worker_mirrored"]
        proc = subprocess.run(
            [sys.executable, "-m", "dtensor.aot", *cli, "--json", str(out), "--", DEMO],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        report = json.loads(out.read_text()) if proc.returncode == 0 else None
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
                "json": report}  # fmt: skip

    return once(tmp_path_factory, "aot-two-slices", make)


@pytest.mark.slow
def test_module_entry_point_two_slices(tmp_path_factory):
    proc = two_slices_run(tmp_path_factory)
    assert proc["returncode"] == 0, proc["stderr"][-2000:]
    assert "2 slices over DCN = 32 TPU v5 lite devices" in proc["stdout"]
    assert "DCN" in proc["stdout"] and "all-reduce" in proc["stdout"]
    report = proc["json"]["report"]
    dcn = [c for c in report["collectives"] if c["network"] == "dcn"]
    assert dcn and {c["kind"] for c in dcn} == {"all-reduce"} and {c["count"] for c in dcn} == {1}
    assert report["dcn_bytes_per_device"] > 0
