"""Worker: a Grain pipeline and an NNX model under PreemptionCheckpointHandler(data=...).

Usage: grain_resume.py CKPT_DIR TOTAL_STEPS [STOP_AT]

Each process reads its share of every global batch of 8 examples (a shuffled
Grain MapDataset, ``[index::count]``, batched by the share) through
``strategy.distribute_datasets_from_function``. With STOP_AT=k, rank 0 sends
itself SIGTERM during step k; the handler saves model, optimizer and data
position at the step boundary and exits 143. Run again, it resumes. Prints one
RESULT line per rank: the steps run here with the example ids of each global
batch, the step it started from, and (at the end) a hash of the parameters.
:func:`train` is also called in-process by the tests (one process).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

GLOBAL_BATCH = 8


def train(ckpt_dir: str, total: int, stop_at: int | None, on_stop: Callable[[dict], None]) -> dict:
    """Train ``total`` steps (resuming from ``ckpt_dir``); ``on_stop(out)`` at the preemption save."""
    import grain
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from strategies.failure_handling import PreemptionCheckpointHandler, TerminationConfig
    from tests.models import MLPModel, make_train_step, mlp_loss

    rank = jax.process_index()

    def example(i: Any) -> dict:
        rng = np.random.default_rng(int(i))
        return {
            "id": np.int32(i),
            "x": rng.normal(size=(16,)).astype(np.float32),
            "y": rng.normal(size=(8,)).astype(np.float32),
        }

    def dataset_fn(ctx: Any) -> Any:
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
    out: dict = {"rank": rank, "processes": jax.process_count(), "seen": seen}
    handler = PreemptionCheckpointHandler(
        ckpt_dir,
        {"model": model, "opt": opt},
        s,
        data=data,
        termination_config=TerminationConfig(exit_fn=lambda: on_stop(out)),
    )
    out["start"] = handler.total_run_calls
    while handler.total_run_calls < total:
        batch = next(data)
        ids = multihost_utils.process_allgather(batch["id"], tiled=True)
        seen.append([handler.total_run_calls + 1, np.asarray(ids).tolist()])
        if stop_at == handler.total_run_calls + 1 and rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
            if jax.process_count() > 1:
                time.sleep(2)  # the notice reaches the others through JAX's coordination service
        handler.run(s.run, step, args=(model, opt, batch))
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(nnx.state((model, opt)).to_pure_dict()):
        digest.update(np.asarray(leaf.addressable_data(0)).tobytes())
    out["params"] = digest.hexdigest()
    handler.close()
    return out


def main() -> None:
    logging.getLogger("gcsfs").setLevel(logging.ERROR)  # a credentials warning per call
    import dtensor

    dtensor.initialize(timeout_s=60)

    def report_and_exit(out: dict) -> None:
        print("RESULT " + json.dumps(out), flush=True)
        sys.exit(143)

    stop_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
    out = train(sys.argv[1], int(sys.argv[2]), stop_at, report_and_exit)
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
