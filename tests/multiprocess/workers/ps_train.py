"""TF's parameter-server tutorial in NNX: one script, run by the chief, the ps and the workers.

    python -m dtensor.launch --ps 1 --workers 2 -- python ps_train.py --steps 40

The chief prints ``RESULT {json}``: the losses, the final loss on the whole
data set, and the coordinator's statistics. ``--kill-worker K`` makes worker
0 SIGKILL itself while reading its K-th batch, inside a closure (once: see
``--marker``), and worker 1 then waits for the restarted worker 0 to read a batch;
``--die ps`` makes the ps task SIGKILL itself 3 s after it starts serving.
``--hold DIR`` forces a stale commit, by event and not by timing: worker 0,
having read the variables, holds its first batch until worker 1 has read 3
batches since, so at least 2 of worker 1's commits land between worker 0's
read and its commit. ``--shards`` makes the chief print ``SHARDS {json}``:
each ps task's own variables (shapes, values) and the closures it applied,
in order, beside the chief's fetched kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time

import dtensor.runtime

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--kill-worker", type=int, default=0, help="worker 0 dies at its K-th batch")
parser.add_argument("--marker", default="", help="a file: worker 0 dies only if it does not exist")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds each batch takes to read")
parser.add_argument("--die", default="", help="'ps' or 'chief': SIGKILL it 3 s into the run")
parser.add_argument("--save", default="", help="checkpoint the ps variables here at the end")
parser.add_argument("--restore", default="", help="restore the ps variables from here first")
parser.add_argument("--max-staleness", type=int, default=-1)
parser.add_argument("--partition", action="store_true", help="split the kernel in 2 shards")
parser.add_argument("--adam", action="store_true", help="Adam (state split with the kernel)")
parser.add_argument("--local", action="store_true", help="the single-process coordinator instead")
parser.add_argument(
    "--hold",
    default="",
    help="a folder: worker 0 holds its first batch until worker 1 has read 3 more (a stale read)",
)
parser.add_argument("--shards", action="store_true", help="print each ps task's own variables")
flags = parser.parse_args()

if not flags.local:
    role = dtensor.runtime.join_cluster(local_device_count=1)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import strategies  # noqa: E402

FEATURES = 4
TRUE_W = np.arange(1, FEATURES + 1, dtype=np.float32) / FEATURES


class Regression(nnx.Module):
    """The tutorial's Keras model: Dense(1) over the features, here an NNX module."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.dense = nnx.Linear(FEATURES, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dense(x)[:, 0]


@strategies.remote_function
def build():
    model = Regression(nnx.Rngs(0))
    tx = optax.adam(0.05) if flags.adam else optax.sgd(0.1)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


def data(seed: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    return x, (x @ TRUE_W + 0.5).astype(np.float32)


@strategies.remote_function
def dataset_fn(ctx):
    x, y = data(100 + ctx.input_pipeline_id)  # each worker its own shard of data

    def batches():
        n = 0
        while True:
            for i in range(0, len(x), 16):
                n += 1
                if flags.hold:
                    hold(ctx.input_pipeline_id, n)
                if flags.kill_worker and flags.marker:
                    rejoin(ctx.input_pipeline_id)
                if (
                    flags.kill_worker == n
                    and ctx.input_pipeline_id == 0
                    and not os.path.exists(flags.marker)
                ):
                    open(flags.marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)  # mid-closure: read, not committed
                time.sleep(flags.sleep)
                yield x[i : i + 16], y[i : i + 16]

    return batches()


def rejoin(worker: int) -> None:
    """``--kill-worker``: once worker 0 was killed, worker 1 waits for its restarted self to
    read a batch (by event, not by timing: the restart may take seconds on a loaded machine)."""
    back = flags.marker + ".back"
    if worker == 0 and os.path.exists(flags.marker):
        open(back, "w").close()
    elif worker == 1 and os.path.exists(flags.marker):
        deadline = time.monotonic() + 60  # a restart that never comes fails the test, later
        while not os.path.exists(back) and time.monotonic() < deadline:
            time.sleep(0.01)


def hold(worker: int, n: int) -> None:
    """``--hold``: worker 0 waits at its first batch until worker 1 has read 3 more."""
    held, go = os.path.join(flags.hold, "held"), os.path.join(flags.hold, "go")
    if worker == 0 and n == 1:
        open(held, "w").close()
        deadline = time.monotonic() + 60  # a hang fails the closure, it does not wait forever
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"--hold: worker 1 never wrote {go}")
            time.sleep(0.01)
    elif worker == 1 and os.path.exists(held) and not os.path.exists(go):
        since = os.path.join(flags.hold, "since")
        count = int(open(since).read()) + 1 if os.path.exists(since) else 1
        with open(since, "w") as f:
            f.write(str(count))
        if count == 3:  # its 2 closures before this one have committed since worker 0 read
            open(go, "w").close()


@strategies.remote_function
def train_step(model, optimizer, batch):
    x, y = batch

    def loss_fn(m):
        return ((m(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def shards(coordinator, model) -> dict:
    """Each ps task's own variables (shape and values) and commit order; the chief's kernel."""
    (per_ps,) = coordinator.parameter_shards().values()
    return {
        "ps": [
            {
                "variables": {
                    path: {"shape": list(v.shape), "value": np.asarray(v).tolist()}
                    for path, v in ps["variables"].items()
                },
                "applied": ps["applied"],
            }
            for ps in per_ps
        ],
        "kernel": np.asarray(model.dense.kernel[...]).tolist(),
    }


def main() -> None:
    partitioner = strategies.FixedShardsPartitioner(2) if flags.partition else None
    strategy = strategies.ParameterServerStrategy(partitioner)
    with strategy.scope():
        model, optimizer = build()
    bound = None if flags.max_staleness < 0 else flags.max_staleness
    coordinator = strategies.ClusterCoordinator(strategy, max_staleness=bound)
    if flags.die == "chief":
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    if flags.local:
        ds = coordinator.create_per_worker_dataset(dataset_fn.fn)
    else:
        ds = coordinator.create_per_worker_dataset(dataset_fn)
    iterator = iter(ds)
    if flags.restore:
        coordinator.restore(flags.restore, model, optimizer)
    losses = [
        coordinator.schedule(train_step, args=(model, optimizer, iterator))
        for _ in range(flags.steps)
    ]
    coordinator.join()
    assert coordinator.done()
    values = [float(v) for v in coordinator.fetch(losses)]
    if not flags.local:
        coordinator.fetch_variables()
    if flags.shards:
        print("SHARDS " + json.dumps(shards(coordinator, model)), flush=True)
    if flags.save:
        coordinator.save(flags.save, step=int(optimizer.step[...]))
    x, y = data(7, 256)
    final = float(((model(x) - y) ** 2).mean())
    stats = coordinator.stats()
    coordinator.close()
    print(
        "RESULT "
        + json.dumps(
            {
                "losses": values,
                "final": final,
                "completed": stats.completed,
                "per_worker": stats.per_worker,
                "staleness": stats.staleness,
                "retries": stats.retries,
                "bytes": stats.bytes_moved,
                "step": int(optimizer.step[...]),
            }
        ),
        flush=True,
    )


if flags.local:
    main()
elif role.is_chief:
    main()
else:
    if flags.die == "ps" and role.task_type == "ps":
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    print(f"{role.task_type} {role.task_index} serving at {time.time():.1f}", flush=True)
    dtensor.runtime.serve()
