"""Shared pieces of the benchmarks: devices, models, steps, timing, JSON and tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
N_DEVICES = 8


def ensure_devices(n: int = N_DEVICES) -> None:
    """Ask for ``n`` simulated CPU devices (before JAX initialises its backends)."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already up (e.g. under pytest's conftest)
        pass
    if len(jax.devices()) < n:
        raise SystemExit(
            f"the benchmarks need {n} devices, found {len(jax.devices())}; run them in a fresh process."
        )


def environment() -> dict[str, Any]:
    """Versions and machine facts recorded with every result."""
    import flax
    import jax
    import optax

    return {
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
    }


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``payload`` (with the environment) to ``<out_dir>/<name>.json``, keys sorted."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(
        json.dumps(
            {"benchmark": name, "environment": environment(), **payload}, indent=2, sort_keys=True
        )
        + "\n"
    )
    return path


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for r in rows:
        table.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    Console(width=140).print(table)


# ------------------------------------------------------------------ models
def mlp_model(din: int, hidden: int, dout: int) -> Callable[[], Any]:
    from flax import nnx

    from tests.models import MLPModel

    return lambda: MLPModel(nnx.Rngs(0), din=din, dh=hidden, dout=dout)


def mlp_batch(batch: int, din: int, dout: int, seed: int = 0) -> dict[str, Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(batch, din)).astype(np.float32),
        "y": rng.normal(size=(batch, dout)).astype(np.float32),
    }


def transformer_model() -> Callable[[], Any]:
    from flax import nnx

    from tests.models import Block

    return lambda: Block(nnx.Rngs(0))


def transformer_batch(batch: int, seed: int = 0) -> dict[str, Any]:
    from tests.models import lm_batches

    return lm_batches(1, batch=batch, seed=seed)[0]


def train_step(kind: str) -> Callable[..., Any]:
    """The user's NNX train step (value_and_grad + optimizer update), as in the tests."""
    from tests.models import lm_loss, make_train_step, mlp_loss

    return make_train_step(mlp_loss if kind == "mlp" else lm_loss)


def build(strategy: Any, factory: Callable[[], Any]) -> tuple[Any, Any]:
    """A model and Adam optimizer built inside ``strategy.scope()``."""
    import optax
    from flax import nnx

    with strategy.scope():
        model = factory()
        opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return model, opt


# ------------------------------------------------------------------ timing
def time_steps(fn: Callable[[], Any], steps: int) -> float:
    """Seconds per call of ``fn`` over ``steps`` calls, waiting on the last result.

    At most 10 steps are queued before waiting (XLA's CPU collectives abort
    when many steps with all-reduces are in flight).
    """
    import jax

    start = time.perf_counter()
    out = None
    for i in range(steps):
        out = fn()
        if (i + 1) % 10 == 0:
            jax.block_until_ready(out)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / steps


def summary(values: Sequence[float]) -> dict[str, float]:
    """min / median / max of ``values``."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


GIB = float(1 << 30)
REPO = Path(__file__).resolve().parents[1]

#: The decoder's attention as XLA einsums, as the FSDP, MoE and pipeline rows were measured
#: (its default is the platform's kernel; benchmarks/long_context.py has the kernels' rows).
XLA_ATTENTION = ("--attention", "xla")


def aot_train(
    topology: str, strategy: str, train_args: Sequence[str], *, num_slices: int = 1
) -> tuple[dict[str, Any], float, list[str]]:
    """Compile ``examples/train.py`` ahead of time with ``python -m dtensor.aot`` in its own
    process (libtpu or XLA:GPU, no accelerator): its JSON report, the seconds it took, and the
    command line (as a user would type it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        head = ["-m", "dtensor.aot", "--topology", topology]
        if num_slices > 1:
            head += ["--num-slices", str(num_slices)]
        head += ["--strategy", strategy]
        cmd = [sys.executable, *head, "--json", str(out), "--", "examples/train.py", *train_args]
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        if done.returncode:
            raise RuntimeError(f"{' '.join(cmd[1:])} failed:\n{done.stderr[-3000:]}")
        data = json.loads(out.read_text())
    shown = ["python", *head, "--", "examples/train.py", *train_args]
    return data, seconds, shown


def memory_figures(report: dict[str, Any]) -> dict[str, Any]:
    """Peak per chip (as MaxText counts it: arguments + outputs - aliased + temporaries +
    code), its parts, whether it fits, and the step-time floor, from an aot JSON report."""
    fit = report.get("memory_fit") or {}
    floor = report.get("step_floor") or {}

    def gib(v: float | None) -> float | None:
        return None if v is None else round(v / GIB, 2)

    seconds = report.get("step_time_floor_seconds")
    return {
        "mesh": report["mesh"],
        "peak_gib": gib(fit.get("bytes_per_chip", report["peak_bytes_per_device"])),
        "hbm_gib": gib(fit.get("hbm_bytes_per_chip")),
        "arguments_gib": gib(report["argument_bytes_per_device"]),
        "temporaries_gib": gib(report["temp_bytes_per_device"]),
        "fits": fit.get("fits"),
        "floor_ms": None if seconds is None else round(seconds * 1e3, 1),
        "floor_bound": floor.get("bound"),
        "mfu_ceiling": report.get("mfu_ceiling"),
        "comm_gib": gib(report["comm_bytes_per_device"]),
        "dcn_gib": gib(report.get("dcn_bytes_per_device")),
        "ib_gib": gib(report.get("ib_bytes_per_device")),
    }


def measure_rows(
    name: str,
    specs: Sequence[Any],
    picked: Sequence[Any],
    measure: Callable[[Any], dict[str, Any]],
    key: Callable[[dict[str, Any]], Any],
    key_of_spec: Callable[[Any], Any],
    out_dir: Path | None,
    *,
    merge: bool,
) -> list[dict[str, Any]]:
    """Measure ``picked`` (some of ``specs``) one by one, writing ``results/NAME.json`` after
    each; with ``merge`` the file's other rows are kept. Rows stay in ``specs``' order."""
    path = (out_dir or RESULTS) / f"{name}.json"
    kept = json.loads(path.read_text())["rows"] if merge and path.exists() else []
    order = [key_of_spec(spec) for spec in specs]
    rows = [r for r in kept if key(r) in order]
    for spec in picked:
        rows = [r for r in rows if key(r) != key_of_spec(spec)] + [measure(spec)]
        rows.sort(key=lambda r: order.index(key(r)))
        write_json(name, {"benchmark": name, "rows": rows, "environment": environment()}, out_dir)
    return rows
