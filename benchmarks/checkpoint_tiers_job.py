"""One process of ``benchmarks/checkpoint_tiers.py``'s job: save and restore by tier, timed.

    python -m dtensor.launch -n 2 -- python -m benchmarks.checkpoint_tiers_job --gib 1 --work DIR

Every process holds ``--gib`` GiB of float32 arrays (sharded over all devices of
the job: each process's own quarter/half, as FSDP holds parameters and optimizer
state). Timed, each between barriers, for ``--rounds`` rounds: a persistent save
(``Checkpointer.save`` to a directory, local tier off) and a local-tier save
(``save_local``: each process's own shards written, and a peer's received over
the job's collectives and written), each as the time training is blocked (the
call) and until the files are complete (``wait()``); a restore from the local tier, a restore
from the peer tier (process 1's folder deleted first, as a replaced host's), and
a restore from the persistent tier. Process 0 prints ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import dtensor

parser = argparse.ArgumentParser()
parser.add_argument("--gib", type=float, default=1.0, help="GiB of arrays per process")
parser.add_argument("--arrays", type=int, default=4)
parser.add_argument("--rounds", type=int, default=1)
parser.add_argument("--work", type=Path, required=True)
parser.add_argument(
    "--persistent",
    default=None,
    help="the persistent tier's directory or gs:// URL (default: WORK)",
)
flags = parser.parse_args()
dtensor.initialize(timeout_s=120)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from dtensor.checkpoint import Checkpointer  # noqa: E402


def _tree() -> dict[str, jax.Array]:
    n = jax.device_count()
    mesh = dtensor.create_mesh([("x", n)])
    cols = 4096
    total = flags.gib * 2**30 * jax.process_count()
    rows = int(total / 4 / flags.arrays / cols) // n * n
    layout = dtensor.Layout(["x", None], mesh)
    return {
        f"a{i}": dtensor.call_with_layout(
            lambda i=i: jnp.full((rows, cols), float(i), jnp.float32), layout
        )
        for i in range(flags.arrays)
    }


def _timed(label: str, fn) -> float:
    dtensor.barrier(f"before-{label}")
    start = time.perf_counter()
    jax.block_until_ready(fn())
    dtensor.barrier(f"after-{label}")
    return time.perf_counter() - start


def _since(start: float, label: str) -> float:
    dtensor.barrier(label)
    return time.perf_counter() - start


def main() -> None:
    tree = _tree()
    jax.block_until_ready(tree)
    per_process = sum(x.nbytes for x in tree.values()) / jax.process_count()
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "persistent_save_blocking",
            "persistent_save",
            "local_save_blocking",
            "local_save",
            "local",
            "peer",
            "persistent",
        )
    }
    me = jax.process_index()
    for r in range(flags.rounds):
        base = flags.persistent or str(flags.work)
        persistent, local = f"{base}/p{r}", flags.work / f"l{r}"
        with Checkpointer(persistent) as ck:
            start = time.perf_counter()
            times["persistent_save_blocking"].append(_timed(f"ps{r}", lambda: ck.save(1, tree)))
            ck.wait()
            times["persistent_save"].append(_since(start, f"psw{r}"))
        with Checkpointer(persistent, local_directory=local) as ck:
            start = time.perf_counter()
            times["local_save_blocking"].append(_timed(f"ls{r}", lambda: ck.save_local(1, tree)))
            ck.wait()
            times["local_save"].append(_since(start, f"lsw{r}"))
        for tier in ("local", "peer", "persistent"):
            if tier == "peer" and me == 1:
                shutil.rmtree(local / "process_1")
            dtensor.barrier(f"ready-{tier}-{r}")
            use = None if tier == "persistent" else local
            with Checkpointer(persistent, local_directory=use) as ck:
                times[tier].append(_timed(f"{tier}{r}", lambda ck=ck: ck.restore(None, tree)))
                assert ck.restored_tier == tier, (tier, ck.restored_tier)
        dtensor.barrier(f"clean-{r}")
        if me == 0:
            shutil.rmtree(local, ignore_errors=True)  # the persistent steps: with the run's dir
    if me == 0:
        out = {
            "bytes_per_process": per_process,
            "processes": jax.process_count(),
            "devices": jax.device_count(),
            "median_s": {k: statistics.median(v) for k, v in times.items()},
            "runs_s": times,
        }
        print("RESULT " + json.dumps(out), flush=True)
    dtensor.barrier("done")


if __name__ == "__main__":
    main()
