"""A tiny Flax NNX + optax loop under PreemptionCheckpointHandler, run as a real process.

Usage: train_preemptible.py CKPT_DIR OUT.npz TOTAL_STEPS

With PAUSE_AT_STEP=k the step that starts with total_run_calls == k waits
(up to 30 s) for a preemption notice before it finishes, so a test can send
SIGTERM while a step is running. Prints "START n", "PAUSED k", "STEP n" lines.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ.get("NUM_DEVICES", "1")))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from strategies.failure_handling import PreemptionCheckpointHandler  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.l1 = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.l2 = nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(self.drop(nnx.relu(self.l1(x))))


@nnx.jit
def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
    def loss_fn(m: MLP) -> jax.Array:
        return ((m(x) - y) ** 2).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    ckpt_dir, out_path, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause_at = int(os.environ.get("PAUSE_AT_STEP", "-1"))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(total, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(total, 8, 2)).astype(np.float32)

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    handler = PreemptionCheckpointHandler(ckpt_dir, {"model": model, "optimizer": optimizer})
    print(f"START {handler.total_run_calls}", flush=True)

    def step() -> jax.Array:
        i = handler.total_run_calls
        loss = train_step(model, optimizer, xs[i], ys[i])
        if i == pause_at:
            print(f"PAUSED {i}", flush=True)
            deadline = time.monotonic() + 30
            while not handler.preemption_noticed and time.monotonic() < deadline:
                time.sleep(0.01)
        return loss

    while handler.total_run_calls < total:
        loss = handler.run(step)
        print(f"STEP {handler.total_run_calls} {float(loss):.6f}", flush=True)
    handler.close()
    pure = nnx.state((model, optimizer)).to_pure_dict()
    flat = {}
    for path, v in jax.tree_util.tree_leaves_with_path(pure):
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        flat[jax.tree_util.keystr(path)] = np.asarray(v)
    np.savez(out_path, **flat)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
