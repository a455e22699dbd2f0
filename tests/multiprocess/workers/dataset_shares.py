"""Worker: DTensorDataset shares and MultiWorkerMirrored communication options across processes.

Prints one RESULT line with what it saw; the test compares ranks.
"""

from __future__ import annotations

import json


def main() -> None:
    import dtensor

    dtensor.initialize(timeout_s=60)

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import strategies
    from tests.models import MLPModel, make_train_step, mlp_batches, mlp_loss

    me, n = jax.process_index(), jax.process_count()
    mesh = dtensor.create_mesh([("batch", jax.device_count())])
    data = {"x": np.arange(64.0, dtype=np.float32).reshape(16, 4)}
    out: dict = {"rank": me}

    # Global elements: every process passes the whole batch, keeps only its rows.
    ds = dtensor.DTensorDataset(data, mesh, global_batch_size=8, batch_dim="batch")
    sums, local_rows = [], []
    for batch in ds:
        sums.append(float(jax.jit(lambda b: b.sum())(batch["x"])))
        local_rows.append(sorted(int(s.index[0].start) for s in batch["x"].addressable_shards))
    out["global_sums"], out["local_rows"] = sums, local_rows

    # Process-local elements: each process yields its share; global arrays are stitched.
    share = [{"x": data["x"][i * 8 + me * 4 : i * 8 + me * 4 + 4]} for i in range(2)]
    ds = dtensor.DTensorDataset(
        share, mesh, global_batch_size=8, batch_dim="batch", process_local=True
    )
    out["local_sums"] = [float(jax.jit(lambda b: b.sum())(b["x"])) for b in ds]

    # Shares that disagree with the global batch: a clear error on the process that is off.
    bad = [{"x": np.ones((4 if me == 0 else 2, 4), np.float32)}]
    try:
        list(
            dtensor.DTensorDataset(
                bad, mesh, global_batch_size=8, batch_dim="batch", process_local=True, prefetch=0
            )
        )
        out["share_error"] = None
    except ValueError as e:
        out["share_error"] = str(e)

    # MultiWorkerMirrored with each communication choice: the same losses as the default.
    def train(**kw):
        s = strategies.MultiWorkerMirroredStrategy(**kw)
        with s.scope():
            model = MLPModel(rngs=nnx.Rngs(0))
            opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        step = make_train_step(mlp_loss)
        kinds = sorted(
            {
                c.kind
                for c in s.explain(step, args=(model, opt, mlp_batches(steps=1)[0])).collectives
            }
        )
        return [float(s.run(step, args=(model, opt, b))) for b in mlp_batches(steps=2)], kinds

    opts = strategies.CommunicationOptions
    out["losses"] = {
        "default": train(),
        "ring": train(communication_options=opts(implementation="ring", timeout_seconds=60)),
        "packs": train(communication_options=opts(bytes_per_pack=2048)),
        "hierarchical": train(cross_device_ops=strategies.HierarchicalCopyAllReduce(num_groups=n)),
    }
    dtensor.barrier("done")
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
