"""Worker: join the job, sum a global array, pass barriers, print one RESULT line.

argv[1]: "launcher" (read dtensor.launch's variables) or "tf_config" (turn
them into a TF_CONFIG first, so the cluster comes from TF_CONFIG).
"""

from __future__ import annotations

import json
import os
import sys


def to_tf_config() -> int:
    """Replace the launcher variables by an equivalent TF_CONFIG; returns devices/process."""
    coordinator = os.environ.pop("DTENSOR_COORDINATOR")
    n = int(os.environ.pop("DTENSOR_NUM_PROCESSES"))
    me = int(os.environ.pop("DTENSOR_PROCESS_ID"))
    devices = int(os.environ.pop("DTENSOR_DEVICES_PER_PROCESS"))
    # Process 0 is the chief (its address is the coordinator); the rest are workers.
    workers = [f"127.0.0.1:{10000 + i}" for i in range(1, n)]
    task = {"type": "chief", "index": 0} if me == 0 else {"type": "worker", "index": me - 1}
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"chief": [coordinator], "worker": workers}, "task": task}
    )
    return devices


def main() -> None:
    mode = sys.argv[1]
    import dtensor

    local_count = to_tf_config() if mode == "tf_config" else None
    spec = dtensor.initialize(local_device_count=local_count, timeout_s=60)

    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    me, n = dtensor.client_id(), dtensor.num_clients()
    local = len(jax.local_devices())
    total = len(jax.devices())

    # A global (total, 3) array: each process contributes `local` rows.
    mesh = dtensor.create_distributed_mesh([("batch", local)], [("batch", n)])
    sharding = NamedSharding(mesh.jax_mesh, P("batch"))
    rows = np.arange(local * 3, dtype=np.float32).reshape(local, 3) + 100.0 * me
    x = jax.make_array_from_process_local_data(sharding, rows)
    replicated = NamedSharding(mesh.jax_mesh, P())
    total_sum = jax.jit(lambda a: a.sum(), out_shardings=replicated)(x)
    col_sums = jax.jit(lambda a: a.sum(axis=0), out_shardings=replicated)(x)

    # Barrier: after it, every process must see every other's arrival mark.
    client = distributed.global_state.client
    client.key_value_set(f"test/arrived/{me}", "1")
    dtensor.barrier("arrived")
    seen = sorted(int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get("test/arrived/"))
    dtensor.barrier("arrived")  # the same name again

    # A barrier only process 0 reaches times out there, and the job goes on.
    lone_barrier = None
    if me == 0:
        try:
            dtensor.barrier("only-process-0", timeout_s=1)
        except dtensor.DistributedRuntimeError as e:
            lone_barrier = str(e)
    dtensor.barrier("after-lone")

    # initialize() again: the same job is fine, another one is an error.
    again = dtensor.initialize() == spec
    try:
        dtensor.initialize("127.0.0.1:1", 5, 0)
        second_job = None
    except dtensor.DistributedRuntimeError as e:
        second_job = str(e)

    print(
        "RESULT "
        + json.dumps(
            {
                "client_id": me,
                "num_clients": n,
                "process_index": jax.process_index(),
                "source": spec.source if spec else None,
                "num_processes": spec.num_processes if spec else None,
                "process_id": spec.process_id if spec else None,
                "local_devices": local,
                "devices": total,
                "mesh_process_order": [d.process_index for d in mesh.device_list],
                "global_shape": list(x.shape),
                "sum": float(total_sum),
                "col_sums": np.asarray(col_sums).tolist(),
                "seen_after_barrier": seen,
                "lone_barrier": lone_barrier,
                "initialize_again_same": again,
                "initialize_other_job": second_job,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
