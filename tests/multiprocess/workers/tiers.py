"""Worker: training with a local checkpoint tier beside the persistent one, killed and resumed.

Usage: tiers.py CKPT_DIR LOCAL_DIR TOTAL_STEPS [KILL_STEP KILL_RANKS [WHERE]]

An NNX MLP under ``HybridStrategy(data=processes // 2, fsdp=2)`` (every array
sharded: each process holds its own quarter or half, replicated across the
"slices" of the data axis) reads a Grain pipeline of global batches of 8
through ``strategy.distribute_datasets_from_function``. The handler saves the
local tier every step and the persistent tier (CKPT_DIR: a directory or a
``gs://`` URL) every 4 steps. With KILL_STEP=k, the ranks in KILL_RANKS (comma
separated) SIGKILL themselves at the start of step k, as a host lost mid-step;
with WHERE=``copy``, inside the local save after step k instead, while the peer
copy crosses the network (the step's own shards half written). Each killing rank
prints ``KILL <unix time>`` first.
Each rank prints one RESULT line: the step and tier it started from, the global
batch ids of each step run, and the parameters (float32 hex) at the end.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

GLOBAL_BATCH = 8


def main() -> None:
    logging.getLogger("gcsfs").setLevel(logging.ERROR)
    import dtensor

    dtensor.initialize(timeout_s=60)

    import grain
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import multihost_utils

    import strategies
    from strategies.failure_handling import PreemptionCheckpointHandler
    from tests.models import MLPModel, make_train_step, mlp_loss

    ckpt, local, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    kill_step = int(sys.argv[4]) if len(sys.argv) > 4 else None
    kill_ranks = {int(r) for r in sys.argv[5].split(",")} if len(sys.argv) > 5 else set()
    kill_where = sys.argv[6] if len(sys.argv) > 6 else "step"
    rank, count = jax.process_index(), jax.process_count()

    def example(i: Any) -> dict:
        rng = np.random.default_rng(int(i))
        return {
            "id": np.int32(i),
            "x": rng.normal(size=(16,)).astype(np.float32),
            "y": rng.normal(size=(8,)).astype(np.float32),
        }

    def dataset_fn(ctx: Any) -> Any:
        rows = ctx.get_per_pipeline_batch_size(GLOBAL_BATCH)
        ds = grain.MapDataset.range(GLOBAL_BATCH * 64).shuffle(seed=7).map(example)
        return ds[ctx.input_pipeline_id :: ctx.num_input_pipelines].batch(rows)

    s = strategies.HybridStrategy(data=max(1, count // 2), fsdp=min(2, count), min_shard_bytes=0)
    data = iter(s.distribute_datasets_from_function(dataset_fn))
    with s.scope():
        model = MLPModel(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.05), wrt=nnx.Param)
    step_fn = make_train_step(mlp_loss)

    running: list = []  # the handler, once built

    def die() -> None:
        print(f"KILL {time.time()}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if kill_where == "copy" and rank in kill_ranks:
        from dtensor.checkpoint import exchange

        send = exchange.send_bytes

        def send_then_die(payload: Any, pairs: Any, **kw: Any) -> Any:
            if running and running[0].total_run_calls == kill_step:
                die()
            return send(payload, pairs, **kw)

        exchange.send_bytes = send_then_die
    t0 = time.monotonic()
    handler = PreemptionCheckpointHandler(
        ckpt,
        {"model": model, "opt": opt},
        s,
        data=data,
        save_interval_steps=4,
        local_directory=local,
        local_interval_steps=1,
        async_save=False,
    )
    running.append(handler)
    out: dict = {
        "rank": rank,
        "processes": count,
        "start": handler.total_run_calls,
        "tier": handler.restored_from_tier,
        "restore_seconds": round(time.monotonic() - t0, 3),
        "seen": [],
    }
    while handler.total_run_calls < total:
        batch = next(data)
        ids = multihost_utils.process_allgather(batch["id"], tiled=True)
        out["seen"].append([handler.total_run_calls + 1, np.asarray(ids).tolist()])
        if handler.total_run_calls + 1 == kill_step and rank in kill_ranks and kill_where == "step":
            die()
        handler.run(s.run, step_fn, args=(model, opt, batch))
    handler.close()
    params = nnx.state(model, nnx.Param).to_pure_dict()
    full = multihost_utils.process_allgather(params, tiled=True)
    flat = jax.tree_util.tree_leaves_with_path(full)
    out["params"] = {
        jax.tree_util.keystr(p): np.asarray(v, np.float32).tobytes().hex() for p, v in flat
    }
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
