"""Worker: a Grain pipeline and an NNX model under PreemptionCheckpointHandler(data=...).

Usage: grain_resume.py CKPT_DIR TOTAL_STEPS [STOP_AT]

Each process reads its share of every global batch of 8 examples (a shuffled
Grain MapDataset, ``[index::count]``, batched by the share) through
``strategy.distribute_datasets_from_function``. With STOP_AT=k, rank 0 sends
itself SIGTERM during step k; the handler saves model, optimizer and data
position at the step boundary and exits 143. Run again, it resumes. Prints one
RESULT line per rank: the steps run here with the example ids of each global
batch, the step it started from, and (at the end) a hash of the parameters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time

GLOBAL_BATCH = 8


def main() -> None:
    logging.getLogger("gcsfs").setLevel(logging.ERROR)  # a credentials warning per call
    import dtensor

    dtensor.initialize(timeout_s=60)

    import grain
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from strategies.failure_handling import PreemptionCheckpointHandler, TerminationConfig
    from tests.models import MLPModel, make_train_step, mlp_loss

    ckpt_dir, total = sys.argv[1], int(sys.argv[2])
    stop_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    rank = jax.process_index()

    def example(i):
        rng = np.random.default_rng(int(i))
        return {
            "id": np.int32(i),
            "x": rng.normal(size=(16,)).astype(np.float32),
            "y": rng.normal(size=(8,)).astype(np.float32),
        }

    def dataset_fn(ctx):
        rows = ctx.get_per_pipeline_batch_size(GLOBAL_BATCH)
        ds = grain.MapDataset.range(GLOBAL_BATCH * total).shuffle(seed=7).map(example)
        return ds[ctx.input_pipeline_id :: ctx.num_input_pipelines].batch(rows)

    s = strategies.MultiWorkerMirroredStrategy()
    data = iter(s.distribute_datasets_from_function(dataset_fn))
    with s.scope():
        model = MLPModel(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = make_train_step(mlp_loss)
    seen: list = []
    out = {"rank": rank, "processes": jax.process_count(), "seen": seen}

    def report_and_exit() -> None:
        print("RESULT " + json.dumps(out), flush=True)
        sys.exit(143)

    handler = PreemptionCheckpointHandler(
        ckpt_dir,
        {"model": model, "opt": opt},
        s,
        data=data,
        termination_config=TerminationConfig(exit_fn=report_and_exit),
    )
    out["start"] = handler.total_run_calls
    while handler.total_run_calls < total:
        batch = next(data)
        ids = multihost_utils.process_allgather(batch["id"], tiled=True)
        seen.append([handler.total_run_calls + 1, np.asarray(ids).tolist()])
        if stop_at == handler.total_run_calls + 1 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(
                2
            )  # the notice reaches the other processes through JAX's coordination service
        handler.run(s.run, step, args=(model, opt, batch))
    leaves = jax.tree.leaves(nnx.state((model, opt)).to_pure_dict())
    digest = hashlib.sha256()
    for leaf in leaves:
        digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
    out["params"] = digest.hexdigest()
    handler.close()
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
