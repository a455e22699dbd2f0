"""Shared pieces of the benchmarks: devices, models, steps, timing, JSON and tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
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
