"""The multi-process side of ``benchmarks/coordinator.py``: one script for chief, ps and workers.

    python -m dtensor.launch --ps 1 --workers K -- python -m benchmarks.coordinator_job --closures 120

The same MLP regression as the single-process rows, Adam, 48 rows a closure;
the chief prints ``RESULT {json}`` with closures per second (after a warm-up
that compiles every worker's step), bytes moved per closure, and staleness.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import dtensor.runtime

parser = argparse.ArgumentParser()
parser.add_argument("--closures", type=int, default=120)
flags = parser.parse_args()
role = dtensor.runtime.join_cluster(local_device_count=1)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import strategies  # noqa: E402
from benchmarks.coordinator import BATCH, MLP, _data, _loss  # noqa: E402


@strategies.remote_function
def build():
    model = MLP()
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


@strategies.remote_function
def dataset_fn(ctx):
    x, y = _data(flags.closures)
    for i in itertools.count(ctx.input_pipeline_id, ctx.num_input_pipelines):
        i %= flags.closures
        yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


@strategies.remote_function
def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(_loss)(model, *batch)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    strategy = strategies.ParameterServerStrategy(strategies.FixedShardsPartitioner(2))
    with strategy.scope():
        model, optimizer = build()
    coordinator = strategies.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))
    for _ in range(4 * coordinator.num_workers):  # warm-up: every worker compiles its step
        coordinator.schedule(train_step, args=(model, optimizer, iterator))
    coordinator.join()
    warm, warm_bytes = coordinator.stats().completed, coordinator.stats().bytes_moved
    start = time.perf_counter()
    for _ in range(flags.closures):
        coordinator.schedule(train_step, args=(model, optimizer, iterator))
    coordinator.join()
    elapsed = time.perf_counter() - start
    stats = coordinator.stats()
    coordinator._remote.fetch_variables(model)
    x, y = _data(flags.closures)
    staleness = stats.staleness[warm:]
    coordinator.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "closures_per_s": flags.closures / elapsed,
                "bytes_per_closure": (stats.bytes_moved - warm_bytes) / flags.closures,
                "staleness_mean": float(np.mean(staleness)),
                "staleness_max": int(np.max(staleness)),
                "final_loss": float(_loss(model, jnp.asarray(x), jnp.asarray(y))),
            }
        ),
        flush=True,
    )


if role.is_chief:
    main()
else:
    dtensor.runtime.serve()
