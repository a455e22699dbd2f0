"""Save and restore time by checkpoint tier (2 real processes), and the goodput they buy.

Runs ``benchmarks/checkpoint_tiers_job.py`` as a 2-process job through
``dtensor.launch`` (``--gib`` GiB of arrays per process), which times a
persistent save and a local-tier save (the time training is blocked, and until
the files are complete) and restores from the local, peer and persistent tiers.
Then the goodput arithmetic: for a mean time between failures ``M``
(``--mtbf-hours``), Young/Daly's checkpoint interval ``tau = sqrt(2 C M)``
from the blocking save time ``C``, and the fraction of time lost,
``C / tau + (tau / 2 + R) / M`` with ``R`` the restore time (the persistent
tier's, or the peer tier's for a replaced host). The persistent tier is a
``gs://`` bucket in ``gcp-storage-emulator`` started here (a single Python
thread on the same disk: the cost of the HTTP path, not a real bucket's
bandwidth), or with ``--persistent disk`` a directory; the peer copy crosses
gloo on loopback. These figures say what the tiers cost on this machine, not on
a TPU slice.

    python -m benchmarks.checkpoint_tiers [--gib 1.0] [--rounds 1] [--mtbf-hours 6] [--persistent bucket|disk] [--out DIR]
    python -m benchmarks.checkpoint_tiers --markdown    # the guide's table, from the results
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from . import common

REPO = Path(__file__).resolve().parents[1]


def goodput(save_s: float, restore_s: float, mtbf_s: float) -> dict[str, float]:
    """Young/Daly's interval and the fraction of time lost to saves, lost work and restores.

    Examples:
        >>> g = goodput(2.0, 30.0, 3600.0)
        >>> round(g["interval_s"], 1), round(g["lost_fraction"], 4)
        (120.0, 0.0417)
    """
    tau = math.sqrt(2 * save_s * mtbf_s)
    lost = save_s / tau + (tau / 2 + restore_s) / mtbf_s
    return {"interval_s": tau, "lost_fraction": lost, "goodput": 1 - lost}


def markdown(payload: dict[str, Any]) -> list[str]:
    """The guide's table (docs/guides/checkpoints.md) from a results payload."""
    t, g = payload["median_s"], payload["goodput"]
    gib = payload["bytes_per_process"] / 2**30
    head = [
        f"| {gib:.2f} GiB a process, {payload['config']['processes']} processes | save: training "
        "blocked | save: complete | restore | Young/Daly interval | time lost |",
        "|---|---|---|---|---|---|",
    ]
    plans = {"persistent": "persistent only", "local": "local tier (peer restore)"}
    where = "a bucket" if payload["config"]["persistent"].startswith("gcp") else "a directory"

    def lost(name: str) -> str:
        row = g[plans[name]]
        return f"{row['interval_s']:.0f} s | {100 * row['lost_fraction']:.2f}%"

    return head + [
        f"| persistent ({where}) | {t['persistent_save_blocking']:.2f} s | "
        f"{t['persistent_save']:.2f} s | {t['persistent']:.2f} s | {lost('persistent')} |",
        f"| local | {t['local_save_blocking']:.2f} s | {t['local_save']:.2f} s | "
        f"{t['local']:.2f} s | {lost('local')} |",
        f"| peer (a replaced host) | | | {t['peer']:.2f} s | | |",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").strip().splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of arrays per process")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--mtbf-hours", type=float, default=6.0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--persistent",
        choices=("bucket", "disk"),
        default="bucket",
        help="the persistent tier: a gs:// bucket in gcp-storage-emulator started here on "
        "127.0.0.1 (the default; needs the gcs extra), or a directory on the local disk",
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the guide's table from the committed results (no run)",
    )
    args = parser.parse_args(argv)
    if args.markdown:
        payload = json.loads((common.RESULTS / "checkpoint_tiers.json").read_text())
        print("\n".join(markdown(payload)))
        return payload
    with tempfile.TemporaryDirectory(prefix="ckpt_tiers_") as work, contextlib.ExitStack() as st:
        cmd = [sys.executable, "-m", "dtensor.launch", "-n", "2", "--", sys.executable]
        cmd += ["-m", "benchmarks.checkpoint_tiers_job", "--gib", str(args.gib)]
        cmd += ["--rounds", str(args.rounds), "--work", work]
        env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
        if args.persistent == "bucket":
            from tests.gcs import emulator, fresh_url

            (Path(work) / "gcs").mkdir()
            env.update(st.enter_context(emulator(Path(work) / "gcs" / "data")).env)
            cmd += ["--persistent", fresh_url("tiers")]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    lines = [ln for ln in done.stdout.splitlines() if "RESULT " in ln]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the job failed ({done.returncode}):\n{done.stdout[-3000:]}")
    job = json.loads(lines[0].split("RESULT ", 1)[1])
    t = job["median_s"]
    mtbf = args.mtbf_hours * 3600
    plans = {
        "persistent only": goodput(t["persistent_save_blocking"], t["persistent"], mtbf),
        "local tier (peer restore)": goodput(t["local_save_blocking"], t["peer"], mtbf),
    }
    payload = {
        "config": {
            "gib_per_process": args.gib,
            "rounds": args.rounds,
            "processes": job["processes"],
            "devices": job["devices"],
            "mtbf_hours": args.mtbf_hours,
            "persistent": (
                "gcp-storage-emulator on 127.0.0.1 (single-threaded, same disk)"
                if args.persistent == "bucket"
                else "a directory on the same local disk"
            ),
            "peer copy": "gloo collectives on loopback",
        },
        "bytes_per_process": job["bytes_per_process"],
        "median_s": t,
        "runs_s": job["runs_s"],
        "goodput": plans,
        "load_average_1min": os.getloadavg()[0],
    }
    path = common.write_json("checkpoint_tiers", payload, args.out)
    gib = job["bytes_per_process"] / 2**30
    common.print_table(
        f"checkpoint tiers: {gib:.2f} GiB a process, {job['processes']} processes, median seconds "
        f"of {args.rounds} round(s)",
        ["tier", "save (blocking)", "save (complete)", "restore"],
        [
            [
                "persistent",
                t["persistent_save_blocking"],
                t["persistent_save"],
                t["persistent"],
            ],
            ["local", t["local_save_blocking"], t["local_save"], t["local"]],
            ["peer (a replaced host)", "", "", t["peer"]],
        ],
    )
    common.print_table(
        f"Young/Daly at a mean time between failures of {args.mtbf_hours:g} h",
        ["plan", "interval s", "time lost", "goodput"],
        [
            [
                name,
                f"{g['interval_s']:.0f}",
                f"{100 * g['lost_fraction']:.3f}%",
                f"{g['goodput']:.5f}",
            ]
            for name, g in plans.items()
        ],
    )
    print(f"written to {path}")
    return payload


if __name__ == "__main__":
    main()
