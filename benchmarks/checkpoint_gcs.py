"""Save + restore of a ~1 GiB checkpoint in a GCS bucket (the emulator on loopback) beside local disk.

Saves the same tree (a few large float32 arrays sharded over 8 simulated CPU
devices) with :func:`dtensor.checkpoint.save` to a local directory and to
``gs://`` in a ``gcp-storage-emulator`` started here on 127.0.0.1 (the same
test helper the suite uses), then restores each into the saved layout, with
checksum verification, for ``--runs`` rounds (the order alternates). Ratios are
bucket / local, measured in the same run. The emulator is a single-threaded
Python server writing to the same disk, so the bucket figures say what the
storage path costs through a real GCS JSON API (HTTP, TensorStore's GCS driver,
gcsfs, orbax's commit protocol), not what a real bucket's bandwidth would be.

    python -m benchmarks.checkpoint_gcs [--gib 1.0] [--arrays 4] [--runs 1] [--out DIR] [--bucket gs://B/P]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from . import common
from .checkpoint_verify import _tree


def _timed(fn: Any) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--arrays", type=int, default=4)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--bucket",
        default=None,
        help="save under this gs:// URL, through the emulator or bucket the environment names "
        "(STORAGE_EMULATOR_HOST, TENSORSTORE_GCS_HTTP_URL), instead of an emulator started here",
    )
    args = parser.parse_args(argv)
    if args.bucket is not None and not args.bucket.startswith("gs://"):
        parser.error(f"--bucket {args.bucket!r} is not a gs:// URL; give gs://BUCKET/PREFIX")
    common.ensure_devices()
    import jax

    from dtensor import checkpoint
    from tests.gcs import emulator, fresh_url

    tree = _tree(args.gib, args.arrays)
    jax.block_until_ready(tree)
    nbytes = sum(x.nbytes for x in tree.values())
    work = Path(tempfile.mkdtemp(prefix="ckpt_gcs_"))
    saved_env = {
        k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
    }
    times: dict[str, dict[str, list[float]]] = {
        w: {"save": [], "restore": []} for w in ("local", "bucket")
    }
    try:
        (work / "gcs").mkdir()
        with contextlib.ExitStack() as stack:
            if args.bucket is None:
                os.environ.update(stack.enter_context(emulator(work / "gcs")).env)
            logging.getLogger("gcsfs").setLevel(logging.ERROR)
            for i in range(args.runs):
                url = fresh_url(f"bench{i}") if args.bucket is None else f"{args.bucket}/bench{i}"
                places = {"local": str(work / f"local{i}"), "bucket": url}
                order = ("local", "bucket") if i % 2 == 0 else ("bucket", "local")
                for where in order:
                    d = places[where]
                    times[where]["save"].append(
                        _timed(lambda d=d: checkpoint.save(d, tree, step=0))
                    )
                    times[where]["restore"].append(
                        _timed(lambda d=d: checkpoint.restore(d, step=0))
                    )
                shutil.rmtree(places["local"], ignore_errors=True)
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)
    s = {w: {op: common.summary(v) for op, v in ops.items()} for w, ops in times.items()}
    total = {w: s[w]["save"]["median"] + s[w]["restore"]["median"] for w in s}
    mib = nbytes / 2**20
    payload = {
        "config": {
            "gib": args.gib,
            "arrays": args.arrays,
            "runs": args.runs,
            "array_bytes": nbytes,
            "devices": common.N_DEVICES,
            "bucket": "gcp-storage-emulator on 127.0.0.1 (single-threaded, same disk)",
            "restore": "verify=True (checksums checked)",
        },
        "local": s["local"],
        "bucket": s["bucket"],
        "runs_s": times,
        "save_plus_restore_s": total,
        "ratio_bucket_to_local": {
            "save": s["bucket"]["save"]["median"] / s["local"]["save"]["median"],
            "restore": s["bucket"]["restore"]["median"] / s["local"]["restore"]["median"],
            "save_plus_restore": total["bucket"] / total["local"],
        },
        "mib_per_s": {w: {op: mib / s[w][op]["median"] for op in ("save", "restore")} for w in s},
        "load_average_1min": os.getloadavg()[0],
    }
    path = common.write_json("checkpoint_gcs", payload, args.out)
    ratio = payload["ratio_bucket_to_local"]
    common.print_table(
        f"save + restore of a {nbytes / 2**30:.2f} GiB checkpoint ({args.arrays} arrays over "
        f"{common.N_DEVICES} CPU devices), median seconds of {args.runs} run(s)",
        ["where", "save", "restore", "save + restore", "save MiB/s", "restore MiB/s"],
        [
            [
                w,
                s[w]["save"]["median"],
                s[w]["restore"]["median"],
                total[w],
                f"{payload['mib_per_s'][w]['save']:.0f}",
                f"{payload['mib_per_s'][w]['restore']:.0f}",
            ]
            for w in ("local", "bucket")
        ]
        + [
            [
                "bucket / local",
                f"{ratio['save']:.2f}x",
                f"{ratio['restore']:.2f}x",
                f"{ratio['save_plus_restore']:.2f}x",
                "",
                "",
            ]
        ],
    )
    print(
        f"load average {payload['load_average_1min']:.1f} on {os.cpu_count()} CPUs; written to {path}"
    )
    return payload


if __name__ == "__main__":
    main()
