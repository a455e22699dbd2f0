"""The MultiWorkerMirrored side of ``benchmarks/hosts_link.py``: one process of a job, timed.

    TF_CONFIG=... python -m benchmarks.hosts_job --hidden 2048 --steps 10

An MLP (``--features`` -> ``--hidden`` -> ``--features``) trained with Adam under
``MultiWorkerMirroredStrategy`` on a global batch of ``--batch`` rows; process 0
prints ``RESULT {json}``: seconds per step (median of ``--rounds`` rounds of
``--steps``, after a compile step) and the collective bytes per device that
``strategy.explain`` reads from the compiled step.
"""

from __future__ import annotations

import argparse
import json
import statistics

import dtensor

parser = argparse.ArgumentParser()
parser.add_argument("--features", type=int, default=512)
parser.add_argument("--hidden", type=int, default=2048)
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--steps", type=int, default=5)
parser.add_argument("--rounds", type=int, default=3)
flags = parser.parse_args()
dtensor.initialize(timeout_s=60)

import strategies  # noqa: E402
from benchmarks import common  # noqa: E402


def main() -> None:
    strategy = strategies.MultiWorkerMirroredStrategy()
    model, opt = common.build(
        strategy, common.mlp_model(flags.features, flags.hidden, flags.features)
    )
    batch = common.mlp_batch(flags.batch, flags.features, flags.features)  # the global batch
    step = common.train_step("mlp")
    report = strategy.explain(step, args=(model, opt, batch))
    float(strategy.run(step, args=(model, opt, batch)))  # compile
    times = [
        common.time_steps(lambda: strategy.run(step, args=(model, opt, batch)), flags.steps)
        for _ in range(flags.rounds)
    ]
    if dtensor.client_id() == 0:
        out = {
            "step_s": statistics.median(times),
            "comm_bytes_per_device": report.comm_bytes_per_device,
            "collectives": [c.kind for c in report.collectives],
            "replicas": strategy.num_replicas_in_sync,
        }
        print("RESULT " + json.dumps(out), flush=True)
    dtensor.barrier("done")


if __name__ == "__main__":
    main()
