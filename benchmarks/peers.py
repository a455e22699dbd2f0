"""The same MLP, Adam step and global batch under peers, step times in the same run.

Ours: ``MirroredStrategy.run`` and raw ``jax.jit`` (data parallel, 8 simulated
CPU devices). Peers, each in its own process (their frameworks claim the
devices their own way): Keras 3's ``DataParallel`` on the JAX backend
(``keras.distribution``), and TensorFlow's ``MirroredStrategy`` over 8
logical CPU devices. A peer that is not installed is recorded as
``"not installed"`` (``pip install '.[bench]'`` brings them). Rounds
interleave the in-process variants; each peer process runs its own rounds.

    python -m benchmarks.peers [--rounds 5] [--steps 10] [--hidden 1024] [--batch 128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import common


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# -------------------------------------------------------------- peer bodies
def _keras_data_parallel(args: argparse.Namespace) -> list[float]:
    os.environ["KERAS_BACKEND"] = "jax"
    common.ensure_devices()
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=keras.distribution.list_devices())
    )
    model = keras.Sequential(
        [
            keras.Input((args.features,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(args.features),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    b = common.mlp_batch(args.batch, args.features, args.features)
    model.train_on_batch(b["x"], b["y"])  # compile
    return [
        common.time_steps(lambda: model.train_on_batch(b["x"], b["y"]), args.steps)
        for _ in range(args.rounds)
    ]


def _tf_mirrored(args: argparse.Namespace) -> list[float]:
    import time

    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * common.N_DEVICES
    )
    strategy = tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")]
    )
    b = common.mlp_batch(args.batch, args.features, args.features)
    # Adam written out in TF ops: Keras 3's optimizer inside tf.function +
    # MirroredStrategy fails on its internal cond (TF 2.21 / Keras 3.15).
    first = tf.VariableAggregation.ONLY_FIRST_REPLICA

    def var(value: Any) -> Any:
        return tf.Variable(value, aggregation=first)

    with strategy.scope():
        w1 = var(tf.random.normal((args.features, args.hidden), stddev=0.02))
        b1 = var(tf.zeros((args.hidden,)))
        w2 = var(tf.random.normal((args.hidden, args.features), stddev=0.02))
        b2 = var(tf.zeros((args.features,)))
        variables = [w1, b1, w2, b2]
        mu = [var(tf.zeros_like(v)) for v in variables]
        nu = [var(tf.zeros_like(v)) for v in variables]
        count = var(tf.constant(0.0))
    dataset = tf.data.Dataset.from_tensors((b["x"], b["y"])).repeat()
    it = iter(strategy.experimental_distribute_dataset(dataset))

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                pred = tf.nn.relu(x @ w1 + b1) @ w2 + b2
                loss = tf.reduce_sum(tf.reduce_mean((pred - y) ** 2, axis=-1)) / args.batch
            ctx = tf.distribute.get_replica_context()
            grads = ctx.all_reduce("SUM", tape.gradient(loss, variables))
            t = count.assign_add(1.0)
            for v, g, m, n in zip(variables, grads, mu, nu, strict=True):
                m.assign(0.9 * m + 0.1 * g)
                n.assign(0.999 * n + 0.001 * g * g)
                mhat = m / (1.0 - 0.9**t)
                nhat = n / (1.0 - 0.999**t)
                v.assign_sub(1e-3 * mhat / (tf.sqrt(nhat) + 1e-8))
            return loss

        return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)

    x, y = next(it)
    step(x, y).numpy()  # trace
    times = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        for _ in range(args.steps):
            out = step(x, y)
        out.numpy()
        times.append((time.perf_counter() - start) / args.steps)
    return times


PEERS = {
    "keras_data_parallel_jax": ("keras", _keras_data_parallel),
    "tf_mirrored_strategy": ("tensorflow", _tf_mirrored),
}


def _run_peer(name: str, args: argparse.Namespace) -> dict[str, Any]:
    module, _ = PEERS[name]
    if not _installed(module) or (name.startswith("keras") and not _installed("jax")):
        return {"peer": name, "status": "not installed", "requires": module}
    cmd = [sys.executable, "-m", "benchmarks.peers", "--peer", name, *_forward(args)]
    env = {**os.environ, "KERAS_BACKEND": "jax"} if name.startswith("keras") else dict(os.environ)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        return {"peer": name, "status": "failed", "stderr": proc.stderr[-800:]}
    times = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"peer": name, "status": "ok", "ms_per_step": common.summary([t * 1e3 for t in times])}


def _forward(args: argparse.Namespace) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("features", "hidden", "batch", "rounds", "steps")]


# -------------------------------------------------------------------- ours
def _ours(args: argparse.Namespace) -> dict[str, list[float]]:
    import dtensor
    import strategies

    from .overhead import handwritten

    step = common.train_step("mlp")
    factory = common.mlp_model(args.features, args.hidden, args.features)
    host = common.mlp_batch(args.batch, args.features, args.features)
    s1, s2 = strategies.MirroredStrategy(), strategies.MirroredStrategy()
    m1, o1 = common.build(s1, factory)
    m2, o2 = common.build(s2, factory)
    batch = {k: dtensor.copy_to_mesh(v, s1.batch_layout(v.ndim)) for k, v in host.items()}
    s1.run(step, args=(m1, o1, batch))
    s2.run(step, args=(m2, o2, batch))
    jitted = handwritten(s2, m2, o2, step, batch)
    jitted()

    def run() -> Any:
        return s1.run(step, args=(m1, o1, batch))

    times: dict[str, list[float]] = {"mirrored_strategy_run": [], "raw_jax_jit": []}
    for r in range(args.rounds):
        pair = [("mirrored_strategy_run", run), ("raw_jax_jit", jitted)]
        for name, fn in pair if r % 2 == 0 else pair[::-1]:
            times[name].append(common.time_steps(fn, args.steps))
    return times


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per peer process")
    parser.add_argument("--peer", choices=sorted(PEERS), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.peer:  # inside a peer's own process: print its times as one JSON line
        print(json.dumps(PEERS[args.peer][1](args)))
        return {}
    common.ensure_devices()
    ours = _ours(args)
    base = common.summary([t * 1e3 for t in ours["raw_jax_jit"]])["median"]
    rows = [
        {"peer": k, "status": "ok", "ms_per_step": common.summary([t * 1e3 for t in v])}
        for k, v in ours.items()
    ]
    rows += [_run_peer(name, args) for name in PEERS]
    for r in rows:
        if r["status"] == "ok":
            r["ratio_to_raw_jit"] = r["ms_per_step"]["median"] / base
    payload = {
        "settings": {
            k: getattr(args, k) for k in ("features", "hidden", "batch", "rounds", "steps")
        },
        "results": rows,
    }
    path = common.write_json("peers", payload, args.out)
    common.print_table(
        f"the same MLP step under peers ({path.name})",
        ["variant", "status", "median ms/step", "min", "max", "/ raw jit"],
        [
            (
                r["peer"],
                r["status"],
                *(
                    (
                        r["ms_per_step"]["median"],
                        r["ms_per_step"]["min"],
                        r["ms_per_step"]["max"],
                        r["ratio_to_raw_jit"],
                    )
                    if r["status"] == "ok"
                    else ("-", "-", "-", "-")
                ),
            )
            for r in rows
        ],
    )
    return payload


if __name__ == "__main__":
    main()
