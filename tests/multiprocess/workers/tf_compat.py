"""Worker: tf.distribute's view of a multi-process job, printed as one RESULT line.

argv[1]: "launcher" or "tf_config" (the launcher's variables turned into a
TF_CONFIG first, process 0 the chief).
"""

from __future__ import annotations

import json
import sys

# The same TF_CONFIG as the collective worker (this script's folder is on sys.path).
from collective import to_tf_config


def main() -> None:
    import dtensor

    local_count = to_tf_config() if sys.argv[1] == "tf_config" else None
    dtensor.initialize(local_device_count=local_count, timeout_s=60, summary=False)

    import jax
    import numpy as np

    import strategies

    strategy = strategies.MultiWorkerMirroredStrategy()
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group)
    )
    local = strategy.experimental_local_results(values)
    resolver = strategy.cluster_resolver
    ext = strategy.extended
    print(
        "RESULT "
        + json.dumps(
            {
                "local_results": [float(np.asarray(v)) for v in local],
                "task": [resolver.task_type, resolver.task_id],
                "cluster_spec": resolver.cluster_spec(),
                "worker_devices": [d.id for d in ext.worker_devices],
                "local_device_ids": [d.id for d in jax.local_devices()],
                "parameter_devices": len(ext.parameter_devices),
                "should_checkpoint": ext.should_checkpoint,
                "should_save_summary": ext.should_save_summary,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
