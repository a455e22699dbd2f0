"""ClusterCoordinator throughput and staleness for 1, 2 and 6 workers, and across processes.

The same ``ParameterServerStrategy`` over the 8 simulated CPU devices keeps
the variables on 2 parameter devices; its 6 other devices form ``k`` worker
groups (``ClusterCoordinator(strategy, num_workers=k)``: 1 group of 6 devices,
2 of 3, or 6 of 1). An MLP regression model is trained with Adam by
``--closures`` scheduled closures of 48 rows each (split over a group's
devices), after a warm-up that compiles every worker's step.
Reported: closures per second (wall clock, median of ``--repeats``), the
staleness of each committed update (how many other updates landed between its
read of the parameters and its own), and the final loss.

The multi-process rows run the same training as a job of processes
(``dtensor.launch --ps 1 --workers K``, :mod:`benchmarks.coordinator_job`):
closures per second and the bytes each closure moves between tasks (the
snapshot it reads, the changes and gradients it commits, its output).

Run: ``JAX_PLATFORMS=cpu python -m benchmarks.coordinator`` (writes
``benchmarks/results/coordinator.json`` and prints a table). On the shared
2-core CPU machine the workers compete for the same cores, so more workers
mainly raise staleness; on real multi-device hosts they add throughput.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

if __name__ == "__main__":  # imported by benchmarks.coordinator_job: its devices are set already
    jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import strategies  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "coordinator.json"
DIN, HIDDEN, BATCH = 64, 256, 48


class MLP(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.up = nnx.Linear(DIN, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


def _loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def train_step(
    model: MLP, optimizer: nnx.Optimizer, batch: tuple[jax.Array, jax.Array]
) -> jax.Array:
    loss, grads = nnx.value_and_grad(_loss)(model, *batch)
    optimizer.update(model, grads)
    return loss


def _data(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n * BATCH, DIN)).astype(np.float32)
    w = rng.normal(size=(DIN, 1)).astype(np.float32) / np.sqrt(DIN)
    return x, np.tanh(x @ w).astype(np.float32)


def run(num_workers: int, closures: int, repeats: int) -> dict[str, object]:
    strategy = strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2))
    x, y = _data(closures)

    def dataset_fn(ctx: strategies.InputContext):
        for i in itertools.count(ctx.input_pipeline_id, ctx.num_input_pipelines):
            i %= closures
            yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    rates, staleness, losses = [], [], []
    for _ in range(repeats):
        model = MLP()
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        with strategies.ClusterCoordinator(strategy, num_workers=num_workers) as coordinator:
            iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
            for _ in range(4 * num_workers):  # warm-up: every worker compiles its step
                coordinator.schedule(train_step, args=(model, optimizer, iterator))
            coordinator.join()
            warm = len(coordinator.stats().staleness)
            start = time.perf_counter()
            for _ in range(closures):
                coordinator.schedule(train_step, args=(model, optimizer, iterator))
            coordinator.join()
            elapsed = time.perf_counter() - start
            rates.append(closures / elapsed)
            staleness.extend(coordinator.stats().staleness[warm:])
        losses.append(float(_loss(model, x, y)))
    return {
        "workers": num_workers,
        "devices_per_worker": 6 // num_workers,
        "closures": closures,
        "closures_per_s": statistics.median(rates),
        "closures_per_s_all": rates,
        "staleness_mean": float(np.mean(staleness)),
        "staleness_p50": float(np.median(staleness)),
        "staleness_max": int(np.max(staleness)),
        "final_loss": statistics.median(losses),
    }


def run_processes(num_workers: int, closures: int) -> dict[str, object]:
    """The same training as a job of processes: chief + 1 ps + ``num_workers`` workers."""
    import sys

    from dtensor.runtime.launch import launch

    root = pathlib.Path(__file__).resolve().parents[1]
    out = open(os.devnull, "w")  # noqa: SIM115 - the launcher keeps the outputs
    result = launch(
        [sys.executable, "-m", "benchmarks.coordinator_job", "--closures", str(closures)],
        2 + num_workers,
        num_ps=1,
        timeout_s=600,
        env={"PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"},
        out=out,
    )
    line = next(ln for ln in result.outputs[0].splitlines() if ln.startswith("RESULT "))
    row = json.loads(line[len("RESULT ") :])
    row.update(workers=num_workers, processes=2 + num_workers)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--closures", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 6])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS)
    parser.add_argument(
        "--process-workers",
        type=int,
        nargs="*",
        default=[1, 2, 4],
        help="worker counts of the multi-process rows (chief + 1 ps + K worker processes)",
    )
    args = parser.parse_args(argv)
    rows = [run(k, args.closures, args.repeats) for k in args.workers]
    process_rows = [run_processes(k, args.closures) for k in args.process_workers]
    result = {
        "benchmark": "coordinator",
        "devices": f"{len(jax.devices())} x {jax.devices()[0].platform}",
        "cpu_count": os.cpu_count(),
        "model": f"MLP {DIN}-{HIDDEN}-1, Adam, batch {BATCH} per closure, 2 parameter devices",
        "jax": jax.__version__,
        "rows": rows,
        "process_rows": process_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ClusterCoordinator ({result['devices']}, {result['model']})")
    for col in (
        "workers",
        "devices each",
        "closures/s",
        "staleness mean",
        "p50",
        "max",
        "final loss",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["workers"]),
            str(r["devices_per_worker"]),
            f"{r['closures_per_s']:.1f}",
            f"{r['staleness_mean']:.2f}",
            f"{r['staleness_p50']:.0f}",
            str(r["staleness_max"]),
            f"{r['final_loss']:.4f}",
        )
    Console().print(table)
    base = rows[0]["closures_per_s"] if rows else float("nan")
    procs = Table(title="Across processes (chief + 1 ps + K workers, 1 CPU device each)")
    for col in (
        "workers",
        "closures/s",
        "vs 1-process 1 worker",
        "bytes/closure",
        "staleness mean",
        "max",
        "final loss",
    ):
        procs.add_column(col, justify="right")
    for r in process_rows:
        procs.add_row(
            str(r["workers"]),
            f"{r['closures_per_s']:.1f}",
            f"{r['closures_per_s'] / base:.2f}x",
            f"{r['bytes_per_closure']:.0f}",
            f"{r['staleness_mean']:.2f}",
            str(r["staleness_max"]),
            f"{r['final_loss']:.4f}",
        )
    Console().print(procs)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
