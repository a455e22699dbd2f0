"""Worker: train tests/models.py's MLP for 5 steps under a preset across processes.

argv[1]: the preset name (strategies.from_name); argv[2]: "global" (every process
passes the global batch) or "per_process" (distribute_datasets_from_function).
Prints one RESULT line with the losses and the final parameters.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    preset, feed = sys.argv[1], sys.argv[2]
    import dtensor

    dtensor.initialize(timeout_s=60)

    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from tests.models import MLPModel, make_train_step, mlp_batches, mlp_loss

    strategy = strategies.from_name(preset)
    with strategy.scope():
        model = MLPModel(rngs=nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(mlp_loss)
    batches = mlp_batches()
    if feed == "per_process":

        def dataset_fn(ctx: strategies.InputContext):
            rows = ctx.get_per_pipeline_batch_size(16)
            lo = ctx.input_pipeline_id * rows
            return [{k: v[lo : lo + rows] for k, v in b.items()} for b in batches]

        data = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        data = strategy.experimental_distribute_dataset(batches)
    losses = [float(strategy.run(step, args=(model, opt, b))) for b in data]
    params = {
        jax.tree_util.keystr(p): np.asarray(
            multihost_utils.process_allgather(v, tiled=True)
        ).tolist()
        for p, v in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))
    }
    refused = None
    if preset == "one_device":  # a device of another process: every process runs the step
        other = next(d for d in jax.devices() if d.process_index != jax.process_index())
        try:
            strategies.OneDeviceStrategy(other)
        except ValueError as e:
            refused = str(e)
    print(
        "RESULT "
        + json.dumps(
            {
                "rank": dtensor.client_id(),
                "mesh": repr(strategy.mesh),
                "replicas": strategy.num_replicas_in_sync,
                "losses": losses,
                "params": params,
                "refused": refused,
            }
        ),
        flush=True,
    )
    dtensor.barrier("done")


if __name__ == "__main__":
    main()
