"""Restore time of a ~1 GiB checkpoint with and without checksum verification.

Saves a few large float32 arrays sharded over 8 simulated CPU devices (one
step), then restores it into the saved layout, alternating
``restore(..., verify=True)`` and ``verify=False`` (which goes first alternates
too) for ``--runs`` rounds. Verification on restore is the cheap quick check
(checksum records, file sizes, small files' bytes) plus one CRC-32 per restored
shard, hashed on a thread pool; the data is read once, by orbax. Wall-clock
and CPU seconds (all threads) are both recorded: on a shared machine the CPU
ratio is the steadier figure, and the verification step is also timed alone
(the quick check and the per-shard checksums, on the tree an unverified
restore returned), as a share of the unverified restore. Also timed: the
save, and
``dtensor.checkpoint.verify`` (every byte of every file).

    python -m benchmarks.checkpoint_verify [--gib 1.0] [--arrays 4] [--runs 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common


def _tree(gib: float, arrays: int) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import dtensor

    mesh = dtensor.create_mesh([("x", common.N_DEVICES)])
    cols = 4096
    rows = int(gib * 2**30 / 4 / arrays / cols) // common.N_DEVICES * common.N_DEVICES
    layout = dtensor.Layout(["x", None], mesh)
    make = jax.jit(
        lambda key: jax.random.normal(key, (rows, cols), jnp.float32), out_shardings=layout.sharding
    )
    return {f"layer{i}": make(jax.random.key(i)) for i in range(arrays)}


def _timed(fn: Any) -> tuple[float, float]:
    """Wall-clock and CPU seconds (all of this process's threads) of ``fn()``."""
    import jax

    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    return time.perf_counter() - wall, time.process_time() - cpu


def _restore(ckpt: Any, verify: bool, box: list[Any]) -> Any:
    box.append(ckpt.restore(0, verify=verify))
    return box[0]


def _verification(ckpt: Any, restored: Any) -> None:
    """What ``restore(verify=True)`` adds: the quick check and the per-shard checksums."""
    from dtensor.checkpoint import integrity

    _, records, _ = ckpt.quick_check(0)
    bad, _ = integrity.check_arrays(restored, records)
    if bad:
        raise SystemExit(f"the benchmark checkpoint is damaged: {bad[:1]}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--arrays", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    common.ensure_devices()
    import jax

    from dtensor import checkpoint

    tree = _tree(args.gib, args.arrays)
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())
    work = Path(tempfile.mkdtemp(prefix="ckpt_verify_"))
    try:
        start = time.perf_counter()
        checkpoint.save(work, tree, step=0)
        save_s = time.perf_counter() - start
        del tree
        disk = sum(p.stat().st_size for p in work.rglob("*") if p.is_file())
        verify_s = _timed(lambda: checkpoint.verify(work))[0]
        checkpoint.restore(work, verify=False)  # warm the page cache for both variants alike
        times: dict[bool, list[float]] = {True: [], False: []}
        cpus: dict[bool, list[float]] = {True: [], False: []}
        alone: list[tuple[float, float]] = []
        with checkpoint.Checkpointer(work, create=False) as ckpt:
            for i in range(args.runs):
                for verify in (True, False) if i % 2 == 0 else (False, True):
                    box: list[Any] = []
                    wall, cpu = _timed(lambda v=verify, box=box: _restore(ckpt, v, box))
                    times[verify].append(wall)
                    cpus[verify].append(cpu)
                    if not verify:  # the verification step alone, on what was just restored
                        alone.append(_timed(lambda box=box: _verification(ckpt, box[0])))
                    box.clear()  # the next restore starts with this one's arrays freed
    finally:
        shutil.rmtree(work, ignore_errors=True)
    on, off = common.summary(times[True]), common.summary(times[False])
    cpu_on, cpu_off = common.summary(cpus[True]), common.summary(cpus[False])
    ratio = on["median"] / off["median"]
    cpu_ratio = cpu_on["median"] / cpu_off["median"]
    step_wall = common.summary([w for w, _ in alone])
    step_cpu = common.summary([c for _, c in alone])
    added = step_wall["median"] / off["median"]
    added_cpu = step_cpu["median"] / cpu_off["median"]
    load = os.getloadavg()[0]
    payload = {
        "config": {
            "gib": args.gib,
            "arrays": args.arrays,
            "runs": args.runs,
            "array_bytes": nbytes,
            "disk_bytes": disk,
            "devices": common.N_DEVICES,
            "checksum": "crc32 per shard (zlib), restored shards hashed on a thread pool",
        },
        "save_s": save_s,
        "verify_all_files_s": verify_s,
        "restore_verified_s": on,
        "restore_unverified_s": off,
        "restore_verified_runs_s": times[True],
        "restore_unverified_runs_s": times[False],
        "restore_verified_cpu_s": cpu_on,
        "restore_unverified_cpu_s": cpu_off,
        "ratio_median": ratio,
        "overhead_pct": 100 * (ratio - 1),
        "cpu_ratio_median": cpu_ratio,
        "cpu_overhead_pct": 100 * (cpu_ratio - 1),
        "verification_step_s": step_wall,
        "verification_step_cpu_s": step_cpu,
        "verification_step_pct_of_restore": 100 * added,
        "verification_step_cpu_pct_of_restore": 100 * added_cpu,
        "load_average_1min": load,
        "target_overhead_pct": 10,
    }
    path = common.write_json("checkpoint_verify", payload, args.out)
    common.print_table(
        f"restore of a {nbytes / 2**30:.2f} GiB checkpoint ({args.arrays} arrays over "
        f"{common.N_DEVICES} CPU devices, {disk / 2**30:.2f} GiB on disk), seconds",
        ["restore", "min", "median", "max", "CPU s (median)"],
        [
            ["verify=False", off["min"], off["median"], off["max"], cpu_off["median"]],
            ["verify=True", on["min"], on["median"], on["max"], cpu_on["median"]],
            ["ratio (median)", "", f"{ratio:.3f}", "", f"{cpu_ratio:.3f}"],
            [
                "verification step alone",
                step_wall["min"],
                step_wall["median"],
                step_wall["max"],
                step_cpu["median"],
            ],
            ["  as % of restore", "", f"{100 * added:.1f}%", "", f"{100 * added_cpu:.1f}%"],
        ],
    )
    print(
        f"save {save_s:.2f} s; verify() of every file {verify_s:.2f} s; load average {load:.1f} "
        f"on {os.cpu_count()} CPUs; written to {path}"
    )
    return payload


if __name__ == "__main__":
    main()
