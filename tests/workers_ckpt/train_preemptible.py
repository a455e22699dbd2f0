"""A tiny Flax NNX + optax loop under PreemptionCheckpointHandler, run as a real process.

Usage: train_preemptible.py CKPT_DIR OUT.npz TOTAL_STEPS

With PAUSE_AT_STEP=k the step that starts with total_run_calls == k waits
(up to 30 s) before it finishes, so a test can send SIGTERM while a step is
running: for the preemption notice in one process, for the file GO_FILE when
started by ``python -m dtensor.launch`` (the notice then travels through JAX's
coordination service, invisible here). Prints "START n", "PAUSED k pid=PID",
"STEP n loss" lines. With START_NPZ=path, the restored state is written there
before training.

Under dtensor.launch the model and optimizer are replicated over a mesh of all
processes' devices and each batch is split over it (gloo all-reduces); process
0 writes OUT.npz.
"""

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

LAUNCHED = "DTENSOR_NUM_PROCESSES" in os.environ
if not LAUNCHED:
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("NUM_DEVICES", "1")))

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import dtensor  # noqa: E402
from strategies.failure_handling import PreemptionCheckpointHandler  # noqa: E402

dtensor.initialize()  # joins the job under dtensor.launch; a no-op otherwise


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


def replicate(obj: nnx.Module | nnx.Optimizer, mesh: dtensor.Mesh) -> None:
    """Make every array of ``obj`` a global array replicated over ``mesh`` (in place)."""

    def one(v: jax.Array) -> jax.Array:
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            return jax.random.wrap_key_data(
                one(jax.random.key_data(v)), impl=jax.random.key_impl(v)
            )
        return dtensor.copy_to_mesh(np.asarray(v), dtensor.Layout.replicated(mesh, v.ndim))

    state = nnx.state(obj)
    nnx.replace_by_pure_dict(state, jax.tree.map(one, state.to_pure_dict()))
    nnx.update(obj, state)


def dump(model: MLP, optimizer: nnx.Optimizer, path: str) -> None:
    """Write the model's and optimizer's values (keys as raw data) to ``path`` (process 0)."""
    pure = nnx.state((model, optimizer)).to_pure_dict()
    flat = {}
    for p, v in jax.tree_util.tree_leaves_with_path(pure):
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        flat[jax.tree_util.keystr(p)] = np.asarray(v.addressable_data(0))
    if jax.process_index() == 0:
        np.savez(path, **flat)


def main() -> None:
    ckpt_dir, out_path, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    pause_at = int(os.environ.get("PAUSE_AT_STEP", "-1"))
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(total, 8, 4)).astype(np.float32)
    ys = rng.normal(size=(total, 8, 2)).astype(np.float32)

    model = MLP(nnx.Rngs(0))
    mesh = dtensor.create_mesh([("data", -1)]) if LAUNCHED else None
    if mesh is not None:
        replicate(model, mesh)
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    if mesh is not None:
        replicate(optimizer, mesh)

    def batch(a: np.ndarray) -> jax.Array | np.ndarray:
        return a if mesh is None else dtensor.copy_to_mesh(a, dtensor.Layout(["data", None], mesh))

    handler = PreemptionCheckpointHandler(ckpt_dir, {"model": model, "optimizer": optimizer})
    if os.environ.get("START_NPZ"):
        dump(model, optimizer, os.environ["START_NPZ"])
    print(f"START {handler.total_run_calls}", flush=True)

    def step() -> jax.Array:
        i = handler.total_run_calls
        loss = train_step(model, optimizer, batch(xs[i]), batch(ys[i]))
        if i == pause_at:
            print(f"PAUSED {i} pid={os.getpid()}", flush=True)
            deadline = time.monotonic() + 30
            go_file = os.environ.get("GO_FILE", "")
            while time.monotonic() < deadline:
                if os.path.exists(go_file) if LAUNCHED else handler.preemption_noticed:
                    break
                time.sleep(0.01)
        return loss

    while handler.total_run_calls < total:
        loss = handler.run(step)
        print(f"STEP {handler.total_run_calls} {float(loss):.6f}", flush=True)
    handler.close()
    dump(model, optimizer, out_path)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
